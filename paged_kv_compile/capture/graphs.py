"""How graphs are captured: real CUDA graphs, or on a CPU an emulation with the same bookkeeping.

A graph backend captures a region: `capture(region, targets, inputs)` runs `region()` (it returns a flat list
of leaves), and the graph ends by copying leaf k into `targets[k]` where one is given. After `graph.replay()`
the captured leaves and the targets hold that replay's values, at the addresses they had at capture.
`inputs` are the static input buffers the region reads (the other tensors it reads are parameters, cache
stand-ins and the runtime's pool and metadata).

`CudaGraphs` captures CUDA graphs. On a CPU, `EmulatedGraphs` replays by calling the region again (its Python,
dynamo's guards and the compiled functions' host checks included), and `CompiledOnlyGraphs` replays what a CUDA
graph replays and nothing more: the inner compiled graphs the region called, on the arguments recorded at
capture. Tests of the captured path use the latter: a check that runs only in Python it skips.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from .. import binding
from ..errors import CaptureError
from .calls import PagedCall, record_calls

Region = Callable[[], list]


def _copy_into_targets(targets: Sequence[torch.Tensor | None], leaves: list) -> None:
    for target, leaf in zip(targets, leaves):
        if target is not None:
            target.copy_(leaf)


def _is_real(value: Any) -> bool:
    """A tensor a replay must refresh: not a stand-in (stand-ins hold nothing)."""
    return isinstance(value, torch.Tensor) and not binding.is_standin(value)


class CudaGraphs:
    """CUDA graphs, all captured into one shared memory pool (`torch.cuda.graph_pool_handle()`)."""

    def __init__(self, pool=None) -> None:
        self.pool = pool

    def warm(self, run: Callable[[], Any], iters: int) -> None:
        """Run on a side stream first, as capture requires (lazy inits, allocator warm-up)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(iters):
                run()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def capture(self, region: Region, targets: Sequence[torch.Tensor | None],
                inputs: Sequence[torch.Tensor] = ()) -> tuple[Any, list]:
        """(graph, the region's leaves while captured); graph.replay() runs its kernels again."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            leaves = region()
            _copy_into_targets(targets, leaves)  # the graph's last kernels: results into static outputs
        return graph, leaves

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class _Rerun:
    """EmulatedGraphs' replay: the region again, its results written where the captured ones live."""

    def __init__(self, region: Region, leaves: list, targets: Sequence[torch.Tensor | None]) -> None:
        self.region, self.leaves, self.targets = region, leaves, targets

    def replay(self) -> None:
        got = self.region()
        for old, new in zip(self.leaves, got):
            if _is_real(old) and new is not old:
                old.copy_(new)
        _copy_into_targets(self.targets, got)


class EmulatedGraphs:
    """Stands in for CUDA graphs on machines without a GPU: "replay" calls the captured region again.

    It reads the same static buffers a CUDA graph would, so the capture bookkeeping (static inputs and
    outputs, copy in and out) is exercised end to end; `CapturedBlocks(..., graphs=EmulatedGraphs())`.
    Its replay runs the region's Python (dynamo's guards, the compiled functions' host checks): use
    `CompiledOnlyGraphs` to test what a replay that runs no Python does.
    """

    def warm(self, run: Callable[[], Any], iters: int) -> None:
        for _ in range(iters):
            run()

    def capture(self, region: Region, targets: Sequence[torch.Tensor | None],
                inputs: Sequence[torch.Tensor] = ()) -> tuple[Any, list]:
        leaves = region()
        _copy_into_targets(targets, leaves)
        return _Rerun(region, leaves, targets), leaves

    def synchronize(self) -> None:
        pass


class _CompiledOnlyReplay:
    """The inner compiled graphs of a region, in call order, on their recorded arguments.

    Each output a later call reads, or the region returned, is copied back to where it was at capture, so
    later calls and the caller read this replay's values at fixed addresses, as they would from a CUDA graph.
    """

    def __init__(self, calls: list[PagedCall], refresh: list[list[int]], leaves: list,
                 targets: Sequence[torch.Tensor | None]) -> None:
        self.calls, self.refresh, self.leaves, self.targets = calls, refresh, leaves, targets
        self.launches = 0

    def replay(self) -> None:
        self.launches += 1
        for call, keep in zip(self.calls, self.refresh):
            got = pytree.tree_leaves(call.fn.compiled(*call.args, *call.extras))
            was = pytree.tree_leaves(call.outputs)
            for k in keep:
                was[k].copy_(got[k])
        _copy_into_targets(self.targets, self.leaves)


class CompiledOnlyGraphs:
    """A graph backend for CPU tests whose replay runs no Python of ours: what a CUDA graph does.

    At capture it runs the region once, recording every compiled paged call it makes (`capture/calls.py`):
    the inner compiled graph and its exact arguments (static buffers, parameters, stand-ins, the pool and
    metadata). A replay calls only those inner graphs, in order, and copies their outputs where the captured
    ones live and into the static outputs: no dynamo guards, no `paged_kv_compiled_forward`, no host checks,
    none of the model's Python. A region that cannot be replayed that way raises CaptureError: a tensor that
    the region returns or a compiled call reads which is neither produced by an earlier compiled call nor one
    of the fixed tensors (static inputs, parameters, stand-ins) was made by Python between the graphs, which a
    replay would not run. It is a test tool: a CUDA graph would capture such Python's kernels too.
    """

    def warm(self, run: Callable[[], Any], iters: int) -> None:
        for _ in range(iters):
            run()

    def capture(self, region: Region, targets: Sequence[torch.Tensor | None],
                inputs: Sequence[torch.Tensor] = ()) -> tuple[Any, list]:
        with record_calls() as made:
            leaves = region()
        _copy_into_targets(targets, leaves)
        if not made:
            raise CaptureError("the captured region made no compiled paged call: nothing a replay could run")
        produced: dict[int, tuple[int, int]] = {}  # id(tensor) -> (call, output leaf)
        refresh: list[set[int]] = [set() for _ in made]
        fixed = {id(t) for t in inputs}

        def source(value, where: str) -> None:
            if not _is_real(value):
                return
            if id(value) in produced:
                call, out = produced[id(value)]
                refresh[call].add(out)
            elif id(value) not in fixed and not isinstance(value, torch.nn.Parameter):
                raise CaptureError(
                    f"{where} is a tensor made outside the compiled graphs (by Python between them, or before the "
                    "region without being a static input): a replay that runs only the compiled graphs would read "
                    "its value from capture time. CompiledOnlyGraphs cannot replay this region")

        for n, call in enumerate(made):
            for k, arg in enumerate(call.args):
                source(arg, f"argument {k} of compiled call {n}")
            for k, out in enumerate(pytree.tree_leaves(call.outputs)):
                if _is_real(out) and id(out) not in {id(a) for a in call.args}:
                    produced.setdefault(id(out), (n, k))
        for k, leaf in enumerate(leaves):
            source(leaf, f"returned leaf {k}")
        return _CompiledOnlyReplay(made, [sorted(r) for r in refresh], leaves, targets), leaves

    def synchronize(self) -> None:
        pass
