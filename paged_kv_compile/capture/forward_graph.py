"""One graph per forward: every block of a bucket's forward captured as one graph, copied into once, launched once.

`CapturedBlocks(..., granularity="forward")`. The model keeps its own loop (`x = block(x, ...)`); the installed
wrappers serve it from one graph per bucket:

* Capture runs the blocks in order, each on the previous block's first output (the chain: block i's first
  returned tensor is block i+1's first argument; every other argument is block 0's), and keeps every block's
  outputs where the graph computed them.
* Block 0's call copies its inputs into the static buffers (the forward's one copy-in), runs the host checks of
  every block's recorded compiled calls (`capture/calls.py`), all before anything runs, then launches the graph
  once. It returns block 0's outputs as the graph left them.
* Block i > 0's call launches nothing. It is checked to be the call the graph already ran: the next block in
  order, in the same runtime forward, its first argument the very tensor block i-1's call returned (unmodified:
  same object, same version), every other tensor argument the tensor block 0 received (same object, same
  version), every other argument equal to the warm-up's. It then returns its outputs from the graph; the last
  block's are copies (the next launch overwrites the graph's).

What that costs in binding flexibility: blocks run in the model's order, each exactly once per launch, on the
previous block's output. Skipping a block, reordering blocks, changing the hidden states between blocks or
passing a block a per-layer tensor of its own (dense per-layer cross-attention K/V: keep them in shared
regions) is detected by those identity checks and handled as any call that does not fit a capture: an error, or
with `fallback="eager"` the rest of that forward runs uncaptured. A forward that keeps its K/V and stops before
the last block is refused by the runtime's every-layer check (layers are recorded as each block's call is
verified, not at the launch). Intermediate outputs are the graph's own tensors, valid until the next launch of
any bucket; every block's outputs stay allocated per bucket (the per-block mode copies them into shared static
buffers instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from .. import binding
from ..errors import CaptureError
from .calls import PagedCall, record_calls
from .static import TENSOR, BucketState, copy_out, signature, tensor_version

GRANULARITIES = ("block", "forward")


@dataclass
class _Launch:
    """What the last launch ran: for which runtime forward, which block comes next, what it must receive."""

    generation: int
    next: int
    chained: tuple[torch.Tensor, int | None] | None  # the tensor the last served block returned, its version
    first: list  # block 0's leaves as received
    versions: list  # their versions then
    layers: list[list[int]] = field(default_factory=list)  # per block, what its host checks resolved


class ForwardGraph:
    """One bucket's blocks as one captured graph (see the module docstring)."""

    def __init__(self, state: BucketState, blocks: Sequence[torch.nn.Module]) -> None:
        self.state, self.blocks = state, list(blocks)
        self.graph: Any = None
        self.calls: list[list[PagedCall]] = []  # per block, the compiled paged calls its capture made
        self.outputs: list[Any] = []  # per block, its output tree over the graph's tensors
        self.launch_state: _Launch | None = None
        self._recording: list | None = None
        self._specs: list = []

    # ---- capture ----------------------------------------------------------------------------------------
    def _run(self) -> list:
        """Every block in order, each on the previous block's first output; all their output leaves, flat."""
        static = self.state.static_leaves()
        leaves, flat = static, []
        for block in self.blocks:
            args, kwargs = pytree.tree_unflatten(leaves, self.state.spec)
            if self._recording is None:
                out = block(*args, **kwargs)
            else:
                with record_calls() as made:
                    out = block(*args, **kwargs)
                self._recording.append(made)
            out_leaves, out_spec = pytree.tree_flatten(out)
            if self._recording is not None:
                self._specs.append((out_spec, len(out_leaves)))
            flat += out_leaves
            leaves = [out_leaves[0], *static[1:]]
        return flat

    def _check_chain(self) -> None:
        """Each block's first output must be able to stand where block 0's first argument stood."""
        kind, sig = self.state.slots[0].kind, self.state.slots[0].sig
        static = self.state.static_leaves()
        leaves = static
        for i, block in enumerate(self.blocks):
            args, kwargs = pytree.tree_unflatten(leaves, self.state.spec)
            out = pytree.tree_leaves(block(*args, **kwargs))
            got = signature(out[0], f"block {i}'s first output") if out else (None, None)
            if kind != TENSOR or got != (kind, sig):
                raise CaptureError(
                    f"granularity='forward' chains the blocks (x = block(x, ...)): block {i}'s first output must be "
                    f"a tensor like block 0's first argument ({sig}), got {got[1]}; capture this model per block")
            leaves = [out[0], *static[1:]]

    def capture(self, graphs, warmup_iters: int) -> None:
        """Capture the chain as one graph; keep each block's recorded calls and outputs."""
        self._check_chain()
        graphs.warm(self._run, warmup_iters)
        self._recording, self._specs = [], []
        try:
            inputs = [s.buffer for s in self.state.slots if s.buffer is not None]
            self.graph, flat = graphs.capture(self._run, (), inputs)
            self.calls = self._recording
        finally:
            self._recording = None
        self.outputs, start = [], 0
        for spec, count in self._specs:
            self.outputs.append(pytree.tree_unflatten(flat[start:start + count], spec))
            start += count

    def kept(self) -> list[torch.Tensor]:
        """The graph's output tensors that stay allocated (every block's, per bucket)."""
        return [t for out in self.outputs for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and not binding.is_standin(t)]

    # ---- serving ----------------------------------------------------------------------------------------
    def launch(self, leaves: list, generation: int, check: Callable[[list[PagedCall]], list[int]]) -> None:
        """Block 0's call, its inputs already copied in: every block's host checks, then one launch."""
        self.launch_state = None
        layers = [check(made) for made in self.calls]  # a refusal raises here, before anything ran
        self.graph.replay()
        self.launch_state = _Launch(generation, 0, None, list(leaves), [_version(x) for x in leaves], layers)

    def follows(self, index: int, leaves: list, spec, generation: int) -> str:
        """Why block `index`'s call is not the one the last launch ran ("" when it is)."""
        run = self.launch_state
        if run is None or run.generation != generation:
            return ("granularity='forward': no launch in this forward; block 0 launches the whole forward, so the "
                    "blocks must be called in order from block 0")
        if index != run.next:
            return (f"granularity='forward': block {run.next} comes next in the captured order (blocks cannot be "
                    "skipped or reordered in a forward graph)")
        if spec != self.state.spec:
            return "its arguments are structured differently from the warm-up's"
        tensor, version = run.chained
        if leaves[0] is not tensor or _version(leaves[0]) != version:
            return (f"granularity='forward': its first argument is not block {index - 1}'s output as the graph "
                    "computed it (the blocks must be chained directly: x = block(x, ...))")
        for n, (slot, leaf) in enumerate(zip(self.state.slots, leaves)):
            if n == 0:
                continue
            if slot.kind == TENSOR:
                if leaf is not run.first[n] or _version(leaf) != run.versions[n]:
                    return (f"granularity='forward': argument {n} is not the tensor block 0 received, and a forward "
                            "graph copies its inputs in once, at block 0 (per-layer tensors such as dense "
                            "cross-attention K/V belong in shared regions, or capture per block)")
            elif signature(leaf, f"argument {n}") != (slot.kind, slot.sig):
                return f"argument {n} differs from the warm-up's"
        return ""

    def serve(self, index: int) -> tuple[Any, list[int]]:
        """Block `index`'s outputs from the last launch (copies for the last block) and the layers it served."""
        run = self.launch_state
        last = index == len(self.blocks) - 1
        out = self.outputs[index]
        first = pytree.tree_leaves(out)[0]
        run.next, run.chained = index + 1, (first, _version(first))
        return (pytree.tree_map(copy_out, out) if last else out), run.layers[index]


def _version(value: Any) -> int | None:
    return tensor_version(value) if isinstance(value, torch.Tensor) else None
