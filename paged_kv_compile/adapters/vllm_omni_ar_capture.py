"""Graph capture for the AR-Diffusion runner: warm up on the pipeline's own warm-up requests, capture, replay.

The runner knows the shapes it will serve only from the pipeline: DreamZero's `ar_diffusion_warmup_requests` runs
one request per window-fill shape, and those requests run every bucket (first commit, commit, denoise) at every
start frame a session reaches before its window resets. `record_block_calls` runs the blocks on copies of their
arguments while they run (ordinary tensors, as the capture's static buffers: the frames compiled then are the
ones the capture runs) and keeps one example call per (start frame, bucket); `FrameCaptures` then builds one `CapturedBlocks` per
start frame over those examples (compile, capture) and installs a wrapper per block that routes each call to the
capture of its start frame.

Why one capture per start frame: DreamZero's blocks take `current_start_frame` as a Python int and pick their
action/state RoPE rows with it (`action_state_index`). One compiled frame serves every start frame (the int is a
dynamic source), but a captured graph bakes the value it was captured with, and `CapturedBlocks` matches a call's
ints against its warm-up's. A session reaches only a few start frames per window (0, 1, 1 + nfpb, ... below
`local_attn_size`), so this costs a few static input sets, not a graph per request.

Replay: `CudaGraphs` on CUDA; on a CPU `CompiledOnlyGraphs`, whose replay runs only the recorded compiled graphs
(no Python of the model or the backend), the closest a CPU gets to a CUDA graph. Either way the recorded host
checks of every compiled call run before each replay (`CapturedBlocks._host_checks`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.utils import _pytree as pytree

from .. import binding
from ..capture import CapturedBlocks, CompiledOnlyGraphs, CudaGraphs
from ..capture.blocks import _CapturedBlock
from ..config import Bucket
from ..errors import ConfigError, RequestError

CUDA_GRAPHS = ("none", "block", "forward")
FRAME_KWARG = "current_start_frame"


def check_granularity(value: str) -> str:
    """The `cuda_graphs` option, refused where the model cannot be captured that way."""
    if value not in CUDA_GRAPHS:
        raise ConfigError(f"model_config['paged_kv']['cuda_graphs'] = {value!r}; choose one of {', '.join(CUDA_GRAPHS)}")
    if value == "forward":
        raise ConfigError(
            "cuda_graphs='forward' captures every block as one graph copied into once, at block 0, but DreamZero's "
            "CausalWanModel passes each block its own layer's cross-attention K/V (crossattn_cache[block_index]): "
            "one forward graph would read block 0's for every layer. Use cuda_graphs='block' (one graph per block "
            "and shape, the K/V copied in per block)")
    return value


def _keep(value: Any) -> Any:
    """A recorded argument that stays valid after the call: tensors cloned, stand-ins as they are."""
    if isinstance(value, torch.Tensor) and not binding.is_standin(value):
        return value.detach().clone()
    return value


@contextlib.contextmanager
def record_block_calls(blocks: torch.nn.ModuleList, runtime) -> Iterator[dict[tuple[Any, Bucket], tuple]]:
    """While open, every block runs on copies of its arguments made as the capture will make them (ordinary tensors,
    outside inference mode, without grad), and the first block's first call per (start frame, runtime bucket) is
    kept: (args, kwargs). So the frames the warm-up requests compile are the ones the capture then runs (the base
    runner serves under `inference_mode`, whose inference tensors dynamo would compile apart)."""
    seen: dict[tuple[Any, Bucket], tuple] = {}
    saved = [block.__dict__.get("forward") for block in blocks]

    def as_captured(index: int, forward):
        def call(*args, **kwargs):
            with torch.inference_mode(False), torch.no_grad():
                args, kwargs = pytree.tree_map(_keep, (tuple(args), dict(kwargs)))
                active = runtime.active
                if index == 0 and active is not None:
                    seen.setdefault((kwargs.get(FRAME_KWARG), active.bucket), (args, kwargs))
                return forward(*args, **kwargs)
        return call

    for index, block in enumerate(blocks):
        block.forward = as_captured(index, block.forward)
    try:
        yield seen
    finally:
        for block, forward in zip(blocks, saved):
            if forward is None:
                del block.forward
            else:
                block.forward = forward


class FrameCaptures:
    """One `CapturedBlocks` per start frame, installed in the model's block list (see the module docstring)."""

    def __init__(self, blocks: torch.nn.ModuleList, runtime, examples: dict[tuple[Any, Bucket], tuple]) -> None:
        if not examples:
            raise ConfigError("the pipeline's warm-up requests ran no paged forward: nothing to capture")
        self.module_list = blocks
        self.blocks = list(blocks)
        self.runtime = runtime
        on_cuda = runtime.pool.tensor.is_cuda
        frames = sorted({frame for frame, _ in examples})
        graphs = CudaGraphs() if on_cuda else CompiledOnlyGraphs()  # one backend: every graph in one memory pool
        self.by_frame: dict[Any, CapturedBlocks] = {}
        for frame in frames:
            mine = {bucket: call for (f, bucket), call in examples.items() if f == frame}
            self.by_frame[frame] = CapturedBlocks(
                self.blocks, runtime, lambda bucket, mine=mine: mine[bucket], buckets=sorted(mine),
                capture=True, graphs=graphs, fallback="error")
        self.compile_s = 0.0  # the first forward of each capture's buckets on its static buffers
        self.capture_s = 0.0  # recording or capturing the graphs

    def warmup(self) -> None:
        """Run every start frame's buckets on their static buffers, then capture them."""
        for captured in self.by_frame.values():
            report = captured.warmup(progress=False)
            self.compile_s += sum(t.compile_s for t in report.buckets)
            self.capture_s += sum(t.capture_s for t in report.buckets)

    def install(self) -> None:
        for i, block in enumerate(self.blocks):
            self.module_list[i] = _CapturedBlock(self, i, block)

    def _call(self, index: int, args: tuple, kwargs: dict):
        frame = kwargs.get(FRAME_KWARG)
        captured = self.by_frame.get(frame)
        if captured is None:
            raise RequestError(
                f"no graph was captured for {FRAME_KWARG}={frame} (captured at start frames "
                f"{sorted(self.by_frame)}): the pipeline's warm-up requests did not reach it. Serve with "
                "cuda_graphs='none', or make the warm-up requests cover every start frame a session reaches")
        return captured.call(index, *args, **kwargs)

    @property
    def stats(self) -> dict[str, int]:
        """The replays and host checks of every start frame's capture, summed."""
        total: dict[str, int] = {}
        for captured in self.by_frame.values():
            for key, value in captured.stats.items():
                total[key] = total.get(key, 0) + value
        return total

    @property
    def buckets(self) -> list[tuple[Any, Bucket]]:
        return [(frame, bucket) for frame, captured in self.by_frame.items() for bucket in captured.warmed_buckets]
