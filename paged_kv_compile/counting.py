"""A torch.compile backend that counts what it compiles: the compile-hygiene checks of tests and benchmarks.

    backend = CountingBackend({"inner_compiler": "aot_eager"})
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=True, dynamic=False)
    ...                                   # run the model
    assert backend.frames == 1            # one graph serves every layer

`dense=True` compiles with the inner compiler alone (no paging), the dense model a benchmark compares with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .backend import inner_compile, paged_kv_backend, record_passes
from .passes.rewrite import PassResult

__all__ = ["CountingBackend"]


@dataclass
class CountingBackend:
    """The `paged_kv` backend with `options` (dense: the inner compiler `options["inner_compiler"]` alone, default
    inductor), counting the frames it compiles and the seconds spent in it, and keeping the passes' results."""

    options: dict = field(default_factory=dict)
    dense: bool = False
    frames: int = 0
    seconds: float = 0.0
    results: list[PassResult] = field(default_factory=list)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        t0 = time.perf_counter()
        try:
            if self.dense:
                return inner_compile(self.options.get("inner_compiler", "inductor"), gm, example_inputs)
            with record_passes() as got:
                fn = paged_kv_backend(gm, example_inputs, options=self.options)
            self.results.extend(got)
            return fn
        finally:
            self.frames += 1
            self.seconds += time.perf_counter() - t0
