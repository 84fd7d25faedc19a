"""The fuzzer's runtimes and serving paths (`fuzz/differential.py`): tiny models of both families compiled once per
process, the runtime each path serves from, how a path calls a block, and what a call may not change.

Both paths' models hold the same weights (the binding ties a weight to one live runtime, so each path has its own
model); their blocks are `FuzzBlock`s, which route a call the path's way and raise an injected fault after the block
ran when the path armed one.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from fuzz.world import DreamZeroOracle, HunyuanOracle
from paged_kv_compile.backend import paged_kv_backend
from paged_kv_compile.config import Bucket
from paged_kv_compile.families.dreamzero import dreamzero_block_inputs, dreamzero_buckets, dreamzero_runtime_config
from paged_kv_compile.families.hunyuan_image3 import hunyuan_buckets, hunyuan_layer_inputs, hunyuan_runtime_config
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel
from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config, HunyuanImage3Model
from paged_kv_compile.runtime import PagedKVRuntime

FAMILIES = ("dreamzero", "hunyuan_image3")
#: finished ids remembered by the fuzzed runtimes (the library's default is 4096): reuse past it happens in short runs
FINISHED_MEMORY = 3
FP8 = torch.float8_e4m3fn
WEIGHT_SEED = 7
#: the LRU cap on live DreamZero sessions: above what the pool's reservations admit of 2-row sessions (two), at
#: what they admit of 1-row ones (four), so admissions are refused for capacity and the least recently used session
#: is evicted, both
MAX_SESSIONS = 4

#: DreamZero: 2 layers, 2 heads x 8, frames of 4 tokens in blocks of 2, chunk 1 frame, window 3 frames with a 1-frame
#: sink, 2 action registers, 3 cross-attention tokens (2 blocks, the last one half used).
DZ_CFG = DreamZeroConfig(num_layers=2, dim=16, num_heads=2, head_dim=8, ffn_dim=32, frame_seqlen=4,
                         num_frame_per_block=1, local_attn_size=3, sink_size=1, window_reset_frames=4,
                         action_register_length=2, text_len=3, text_dim=8, in_channels=4, action_dim=4, freq_dim=8)
DZ_BLOCK = 2
#: (frame tokens, chunk frames, block size) a run may draw (`draw_geometry`): blocks that divide neither the frame
#: nor the chunk, chunks of 1 and 2 frames; the first is DZ_CFG with DZ_BLOCK, every run's default
DZ_GEOMETRIES = ((4, 1, 2), (4, 1, 3), (5, 1, 2), (5, 2, 3), (3, 2, 4), (5, 1, 8), (4, 2, 5), (3, 1, 2))


def dz_config(frame_seqlen: int, chunk_frames: int) -> DreamZeroConfig:
    """DZ_CFG with another frame length and chunk (window 3 frames, 1-frame sink, reset at frame 4 as DZ_CFG)."""
    return dataclasses.replace(DZ_CFG, frame_seqlen=frame_seqlen, num_frame_per_block=chunk_frames)


def draw_geometry(seed: int) -> tuple[int, int, int]:
    """A (frame tokens, chunk frames, block size) drawn from the seed: `random.Random(seed)` over DZ_GEOMETRIES."""
    return random.Random(seed).choice(DZ_GEOMETRIES)


DZ_ROWS = (1, 2, 4)  # bucket row counts: a batch of 3 rows is refused (no bucket)
DZ_CONTENTS = 3  # distinct cross-attention contexts (prompts)
#: HunyuanImage-3: 2 layers, 2 query heads over 1 kv head x 8, image 2x2 (target 6 tokens), prompts padded to 6.
HY_CFG = HunyuanImage3Config(num_layers=2, hidden=16, num_heads=2, num_kv_heads=1, head_dim=8, intermediate=32,
                             vocab=32, latent_channels=4, image_h=2, image_w=2, freq_dim=8)
HY_CAPACITY = 6
HY_BLOCK = 4


class InjectedFault(RuntimeError):
    """Raised by a fuzzed block after it ran (the fault inside a forward)."""


# ---- the fuzzed models: compiled blocks behind a wrapper that routes and injects faults ----------------------


class CountingBackend:
    """The paged_kv backend, counting the graphs it compiles."""

    def __init__(self) -> None:
        self.frames = 0

    def __call__(self, gm, example_inputs):
        self.frames += 1
        return paged_kv_backend(gm, example_inputs)


class FuzzBlock(torch.nn.Module):
    """`model.blocks[i]` of a fuzzed model: runs the compiled block the way its path serves it, then raises
    `InjectedFault` when the path armed a fault at this block (after it ran: its K/V are in the pool)."""

    def __init__(self, index: int, inner: torch.nn.Module) -> None:
        super().__init__()
        self.index = index
        self.inner = inner
        self.path: "ServingPath | None" = None

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # the model and its family read a block's submodules (block.self_attn)
            if name.startswith("__") or "_modules" not in self.__dict__:
                raise
            return getattr(self._modules["inner"], name)

    def forward(self, *args, **kwargs):
        out = self.path.call_block(self.index, args, kwargs)
        if self.path.fault == self.index:
            self.path.fault = None
            raise InjectedFault(f"injected inside block {self.index}")
        return out


@dataclass
class Harness:
    """Per family and pool dtype, built once per process: the dense model and the compiled models of both paths
    (same weights). Fuzz runs bind fresh runtimes to them, so graphs compile once and are reused across runs."""

    family: str
    fp8: bool
    cfg: Any  # the model config (DreamZero: DZ_CFG or `dz_config(...)`)
    dense: torch.nn.Module
    models: dict  # path name -> model whose blocks are FuzzBlocks
    backend: CountingBackend
    oracle: Any = None  # the dense side (`fuzz.world`), over `dense`

    @staticmethod
    def build(family: str, fp8: bool, cfg: Any = None) -> "Harness":
        backend = CountingBackend()
        cfg = cfg if cfg is not None else DZ_CFG if family == "dreamzero" else HY_CFG
        make = (lambda: DreamZeroModel(cfg, seed=WEIGHT_SEED)) if family == "dreamzero" else \
            (lambda: HunyuanImage3Model(cfg, seed=WEIGHT_SEED))
        models = {}
        for name in ("compiled", "captured"):
            model = make().eval()
            blocks = model.blocks if family == "dreamzero" else model.layers
            for i, block in enumerate(blocks):
                block.compile(backend=backend, fullgraph=True, dynamic=False)
                blocks[i] = FuzzBlock(i, block)
            models[name] = model
        dense = make().eval()
        oracle = (DreamZeroOracle if family == "dreamzero" else HunyuanOracle)(dense, FP8 if fp8 else None)
        return Harness(family, fp8, cfg, dense, models, backend, oracle)

    def inner_blocks(self, path: str) -> list[torch.nn.Module]:
        model = self.models[path]
        return [b.inner for b in (model.blocks if self.family == "dreamzero" else model.layers)]

    def outer_blocks(self, path: str) -> list[FuzzBlock]:
        model = self.models[path]
        return list(model.blocks if self.family == "dreamzero" else model.layers)


_HARNESSES: dict[tuple, Harness] = {}


def harness(family: str, fp8: bool, cfg: Any = None) -> Harness:
    key = (family, fp8, cfg)
    if key not in _HARNESSES:
        _HARNESSES[key] = Harness.build(family, fp8, cfg)
    return _HARNESSES[key]


def runtime_config(family: str, fp8: bool, cfg: Any = None, block_size: int | None = None):
    common = dict(kernel="reference", inner_compiler="aot_eager", kv_dtype=FP8 if fp8 else None)
    if family == "dreamzero":
        # pool for two 2-row sessions (or four 1-row ones) and three distinct cross-attention regions; forwards of up
        # to 4 rows. The LRU cap (MAX_SESSIONS) evicts the least recently used session past four.
        cfg = cfg or DZ_CFG
        return dreamzero_runtime_config(cfg, block_size=block_size or DZ_BLOCK, sessions=2, rows=2,
                                        cross_regions=DZ_CONTENTS, max_rows=max(DZ_ROWS),
                                        buckets=dreamzero_buckets(cfg, rows=DZ_ROWS),
                                        **common)
    # room for three 2-row requests with full prompts; right padding keeps causal pads after the target, so a
    # prefill's scratch covers the whole dense row
    return hunyuan_runtime_config(HY_CFG, max_prefix=HY_CAPACITY, block_size=HY_BLOCK, requests=3, rows=2,
                                  scratch_tokens_per_row=HY_CAPACITY + HY_CFG.target_len,
                                  buckets=hunyuan_buckets(HY_CFG, [HY_CAPACITY], rows=(1, 2)), **common)


# ---- the serving paths ----------------------------------------------------------------------------------------


class ServingPath:
    """One serving path: a runtime, the fuzzed model bound to it, how its blocks are called."""

    name = "compiled"

    def __init__(self, h: Harness, block_size: int | None = None) -> None:
        self.h = h
        self.model = h.models[self.name]
        self.runtime = PagedKVRuntime(runtime_config(h.family, h.fp8, h.cfg, block_size), max_sessions=MAX_SESSIONS)
        self.runtime.scheduler.FINISHED_MEMORY = FINISHED_MEMORY
        self.runtime.bind(h.inner_blocks(self.name))
        for block in h.outer_blocks(self.name):
            block.path = self
        self.fault: int | None = None
        self.variant: str | None = None  # the forward's argument kind (DreamZero cross K/V, HunyuanImage-3 mask)

    def call_block(self, index: int, args: tuple, kwargs: dict):
        return self.h.inner_blocks(self.name)[index](*args, **kwargs)

    def warmed(self) -> list[tuple]:
        """(path, bucket, argument kind) of what was compiled before the run (nothing: compiled on first use)."""
        return []

    def close(self) -> None:
        self.runtime.close()


class CapturedPath(ServingPath):
    """The blocks warmed up and captured per bucket (`capture.CapturedBlocks`) with `CompiledOnlyGraphs`, whose
    replay calls only the inner compiled graphs on the static buffers: no dynamo guards, no compiled function's
    Python, no model code, as a CUDA graph. Only the captured path's own host checks (recorded at capture, run
    before every replay) guard it. A captured call must match what was warmed up, so each argument kind (DreamZero:
    cross-attention K/V from shared regions or dense; HunyuanImage-3: a boolean or an additive mask) has its own
    `CapturedBlocks` over the same blocks, every configured bucket warmed up."""

    name = "captured"
    VARIANTS = {"dreamzero": ("region", "dense"), "hunyuan_image3": ("bool", "float")}

    def __init__(self, h: Harness, block_size: int | None = None) -> None:
        super().__init__(h, block_size)
        from paged_kv_compile.capture import CapturedBlocks, CompiledOnlyGraphs

        self.captured = {}
        for variant in self.VARIANTS[h.family]:
            captured = CapturedBlocks(h.inner_blocks(self.name), self.runtime,
                                      lambda bucket, variant=variant: self._example_inputs(variant, bucket),
                                      graphs=CompiledOnlyGraphs(), capture=True)
            captured.warmup(progress=False)
            self.captured[variant] = captured

    def warmed(self) -> list[tuple]:
        return [(self.name, bucket, variant) for variant, c in self.captured.items() for bucket in c.warmed_buckets]

    def _example_inputs(self, variant: str, bucket: Bucket) -> tuple[tuple, dict]:
        if self.h.family == "dreamzero":
            args, kwargs = dreamzero_block_inputs(self.model, self.runtime, bucket)  # a region stand-in (config)
            if variant == "dense":
                args = (*args[:-1], torch.zeros(args[-1].shape))
            return args, kwargs
        args, kwargs = hunyuan_layer_inputs(self.model, self.runtime, bucket)  # a boolean mask
        if variant == "float":
            args = (*args[:3], torch.where(args[3], 0.0, float("-inf")), *args[4:])
        return args, kwargs

    def call_block(self, index: int, args: tuple, kwargs: dict):
        return self.captured[self.variant].call(index, *args, **kwargs)


PATHS: dict[str, type[ServingPath]] = {"compiled": ServingPath, "captured": CapturedPath}


# ---- snapshots and invariants ---------------------------------------------------------------------------------


def held_blocks(rt: PagedKVRuntime) -> Counter:
    """Per local block, how many holders it has: owner rows and shared-region rows."""
    sched = rt.scheduler
    held: Counter = Counter()
    for oid, owner in sched.owners.items():
        for row in owner.rows:
            held.update(row)
        for region in sched.regions.of(oid):
            held.update(region.blocks)
    return held


def pool_bytes(rt: PagedKVRuntime, blocks: list[int]) -> torch.Tensor:
    """The bytes of local `blocks` in every layer: (2, layers, blocks, block_size, bytes per slot)."""
    pool = rt.pool
    ids = torch.tensor([base + b for base in pool.layer_bases.tolist() for b in blocks], dtype=torch.long)
    data = pool.tensor[:, ids].contiguous().view(torch.uint8)
    slot = pool.num_kv_heads * pool.head_dim * pool.tensor.element_size()
    return data.reshape(2, pool.num_layers, len(blocks), pool.block_size, slot).clone()


@dataclass
class Snapshot:
    state: dict
    blocks: list[int]
    data: torch.Tensor
    compared: torch.Tensor  # (blocks, block_size) bool: the slots whose bytes must not change
    scales: torch.Tensor | None

    @staticmethod
    def of(rt: PagedKVRuntime, rewritten: dict[int, int] | None = None) -> "Snapshot":
        """`rewritten[b] = k`: the call may write block b in place from slot k on (a HunyuanImage-3 request's own
        prompt blocks: a prefill rewrites the prompt, a step the target positions after it); not compared."""
        blocks = sorted(held_blocks(rt))
        compared = torch.ones(len(blocks), rt.pool.block_size, dtype=torch.bool)
        for i, b in enumerate(blocks):
            if rewritten and b in rewritten:
                compared[i, rewritten[b]:] = False
        scales = None if rt.pool.scales is None else rt.pool.scales.clone()
        return Snapshot(rt.state(), blocks, pool_bytes(rt, blocks), compared, scales)

    def changed(self, rt: PagedKVRuntime) -> str:
        """What differs now ("" when nothing): state, the held blocks' bytes, the FP8 scales."""
        now = rt.state()
        if now != self.state:
            diff = {k: (self.state[k], now[k]) for k in now if now[k] != self.state.get(k)}
            return f"runtime.state() changed: {diff}"
        differs = (pool_bytes(rt, self.blocks) != self.data).any(-1).any(0).any(0) & self.compared
        if bool(differs.any()):
            where = [(self.blocks[int(i)], int(j)) for i, j in differs.nonzero()[:6]]
            return f"pool bytes of live owners' blocks changed at (block, slot) {where}"
        if self.scales is not None and not torch.equal(rt.pool.scales, self.scales):
            return "the FP8 scales changed"
        return ""


