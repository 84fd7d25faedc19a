"""The paged compiled calls a captured region makes, recorded so that the captured path can check them.

A compiled paged function (`backend.py: paged_kv_compiled_forward`) is two parts: its host checks (which
layer is calling, the bucket, the session against the compiled site, regions, pool geometry, masks and write
positions when those are checked) and one call of the inner compiled graph. A CUDA-graph replay runs only the
second. So while a region is captured, every paged call it makes is recorded here (`record_calls`) with the
exact arguments it received: static buffers, parameters, stand-ins, all at fixed addresses. Before each replay
`PagedCall.check` runs the host checks again on those arguments, which by then hold the call's values; a
replay that runs no Python at all (`graphs.CompiledOnlyGraphs`) calls the recorded inner graphs directly.

The backend reports calls (`report`) and never imports the capture package's other modules.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..errors import RequestError

_RECORDERS: list[list["PagedCall"]] = []  # the open `record_calls()` blocks, innermost last


@dataclass(eq=False)
class PagedCall:
    """One call of a compiled paged function, as it was made while a region was captured."""

    fn: Callable  # the compiled paged function: `.host_checks(args)`, `.compiled`
    args: tuple  # what dynamo passed it (every tensor at a fixed address while the capture lives)
    runtime: Any  # the runtime its host checks resolved
    layers: tuple[int, ...]  # the layers its sites served
    extras: tuple  # pool and metadata appended to the inner graph's inputs
    outputs: Any  # what the inner graph returned at capture

    def check(self, runtime) -> tuple[int, ...]:
        """The call's host checks on its recorded arguments; the layers it serves.

        Raises what the uncaptured call would raise. Binding the blocks to another runtime, or their weights to
        other layers, after capture is refused: the captured graph keeps the pool and layer bases it was captured
        with."""
        got, layers = self.fn.host_checks(self.args)
        if got is not runtime or tuple(layers) != self.layers:
            raise RequestError(
                f"a captured block's weights are now bound to {'another runtime' if got is not runtime else 'layers'} "
                f"{'' if got is not runtime else tuple(layers)} but it was captured for layers {self.layers} of this "
                "runtime: the graph would read the old layers' KV. Warm up (and capture) again after rebinding")
        return self.layers


def recording() -> bool:
    """Whether a region is being recorded (the backend reports its calls only then)."""
    return bool(_RECORDERS)


def report(call: PagedCall) -> None:
    for recorder in _RECORDERS:
        recorder.append(call)


@contextlib.contextmanager
def record_calls() -> Iterator[list[PagedCall]]:
    """Collect every compiled paged call made inside the block, in call order."""
    got: list[PagedCall] = []
    _RECORDERS.append(got)
    try:
        yield got
    finally:  # by identity: nested recorders may hold equal lists
        del _RECORDERS[next(i for i, r in enumerate(_RECORDERS) if r is got)]
