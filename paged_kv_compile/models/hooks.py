"""The seam between the generation loops and whoever owns the KV memory.

Each reference loop is written once, as a step generator (`dreamzero_steps`, `hunyuan_steps`): it
asks a hooks object for the caches, and instead of calling the model it yields a `Forward` (its kind,
what the plan needs to know, and the model call) and receives the call's result back. `Loop` runs
such a generator forward by forward, every `Forward` inside `hooks.forward(...)`; `drive` runs it to
its end, and `dreamzero_rollout` / `hunyuan_generate` are exactly that. Other drivers (interleaving
sessions, retrying a failed forward, timing one forward) use a `Loop` too. `DenseHooks` is the
default: the model's own dense caches (`model.dense_caches`) and no-op contexts; a paged driver
(`driver.PagedHooks`) hands out stand-ins and plans each forward. This module knows no model: the
models import it, never the other way round.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

import torch


@dataclass
class Forward:
    """One model forward a loop asks for: run `call()` inside `hooks.forward(kind, **info)`, send back its result."""

    kind: str  # the loop's forward kind: "commit" | "denoise" (DreamZero), "prefill" | "step" (HunyuanImage-3)
    index: int  # the chunk (DreamZero) or the denoising step (HunyuanImage-3) it belongs to
    call: Callable[[], Any]
    info: dict[str, Any] = field(default_factory=dict)


#: A reference loop: yields each Forward, receives its result, returns the loop's result.
Steps = Generator[Forward, Any, Any]


class Loop:
    """A step generator run forward by forward, each forward inside `hooks.forward(kind, **info)`.

    The generator starts here (the loop's setup runs: it asks `hooks` for its caches) and stops at its first
    forward, `pending`. `run_one` runs the pending forward and hands its result back, and the loop moves to its
    next one; a forward that raises leaves the loop where it was, so it can be run again (a retry). `done` once
    the loop has returned; `result` is what it returned.
    """

    def __init__(self, steps: Steps, hooks: "DenseHooks") -> None:
        self.steps, self.hooks = steps, hooks
        self.pending: Forward | None = None
        self.result: Any = None
        self.forwards = 0  # forwards run and handed back
        self._advance(None)

    @property
    def done(self) -> bool:
        return self.pending is None

    def _advance(self, value: Any) -> None:
        self.pending = None  # a loop that raises here has ended: its last forward must not run again
        try:
            self.pending = self.steps.send(value)
        except StopIteration as stop:
            self.result = stop.value

    def call_pending(self) -> Any:
        """Run the pending forward inside `hooks.forward` and return its result WITHOUT handing it to the loop:
        the loop stays at this forward. A forward that changes no state (a denoising step) can be repeated so,
        e.g. to time it at one fill level."""
        forward = self.pending
        if forward is None:
            raise RuntimeError("the loop has returned: it has no pending forward")
        with self.hooks.forward(forward.kind, **forward.info):
            return forward.call()

    def run_one(self, after: Callable[[Forward, Any], None] | None = None) -> Any:
        """Run the pending forward and hand its result to the loop, which moves to its next forward; `after(forward,
        result)` runs in between (the loop has not moved yet). Returns the result."""
        forward = self.pending
        result = self.call_pending()
        self.forwards += 1
        if after is not None:
            after(forward, result)
        self._advance(result)
        return result

    def run_while(self, condition: Callable[[Forward], bool],
                  after: Callable[[Forward, Any], None] | None = None) -> None:
        """Run forwards (`run_one`) while the loop has one and `condition(pending)` holds."""
        while self.pending is not None and condition(self.pending):
            self.run_one(after)

    def run_index(self, after: Callable[[Forward, Any], None] | None = None) -> None:
        """Run the forwards of the pending forward's loop index: one chunk (DreamZero), one step (HunyuanImage-3)."""
        if self.pending is not None:
            index = self.pending.index
            self.run_while(lambda forward: forward.index == index, after)

    def run(self) -> Any:
        """Run to the end; the loop's result."""
        self.run_while(lambda forward: True)
        return self.result


def drive(steps: Steps, hooks: "DenseHooks") -> Any:
    """Run a step generator to its end, every forward inside `hooks.forward`; returns the loop's result."""
    return Loop(steps, hooks).run()


class DenseHooks:
    """Default: real dense caches, no-op forward contexts."""

    def caches(self, model: torch.nn.Module, batch: int, **geometry: Any) -> list:
        """Per layer the cache the model's attention reads (geometry: e.g. prefix_capacity)."""
        return model.dense_caches(batch, **geometry)

    def write_once_kv(self, model: torch.nn.Module, kvs: list) -> list:
        """What the model reads for K/V computed once per session and never written again (e.g. cross-attention
        K/V): the dense K/V themselves; a paged driver may keep them in shared regions and hand out stand-ins."""
        return kvs

    def forward(self, kind: str, **info: Any) -> contextlib.AbstractContextManager:
        """Context around one model forward; `kind` is the loop's (e.g. "commit", "denoise", "prefill", "step")."""
        return contextlib.nullcontext()

    def reset_history(self) -> None:
        """Called when the loop drops its history (e.g. a window reset); dense caches are simply replaced."""
