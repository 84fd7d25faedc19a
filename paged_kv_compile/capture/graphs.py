"""How graphs are captured: real CUDA graphs, or an emulation with the same bookkeeping on a CPU."""

from __future__ import annotations

from typing import Any, Callable

import torch


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

    def capture(self, region: Callable[[], Any]) -> tuple[Any, Any]:
        """(graph, what region returned while captured); graph.replay() runs its kernels again."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = region()
        return graph, out

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class _Replay:
    def __init__(self, region: Callable[[], Any]) -> None:
        self.region = region

    def replay(self) -> None:
        self.region()


class EmulatedGraphs:
    """Stands in for CUDA graphs on machines without a GPU: "replay" calls the captured region again.

    It reads the same static buffers a CUDA graph would, so the capture bookkeeping (static inputs and
    outputs, copy in and out) is exercised end to end; `CapturedBlocks(..., graphs=EmulatedGraphs())`.
    """

    def warm(self, run: Callable[[], Any], iters: int) -> None:
        for _ in range(iters):
            run()

    def capture(self, region: Callable[[], Any]) -> tuple[Any, Any]:
        return _Replay(region), region()

    def synchronize(self) -> None:
        pass
