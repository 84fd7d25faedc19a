"""The seam between the generation loops and whoever owns the KV memory.

Each reference loop is written once, as a step generator (`dreamzero_steps`, `hunyuan_steps`): it
asks a hooks object for the caches, and instead of calling the model it yields a `Forward` (its kind,
what the plan needs to know, and the model call) and receives the call's result back. `drive` runs
every `Forward` inside `hooks.forward(...)`; `dreamzero_rollout` / `hunyuan_generate` are exactly
that. Other drivers (interleaving sessions, retrying a failed forward, timing each one) drive the same
generators. `DenseHooks` is the default: the model's own dense caches (`model.dense_caches`) and
no-op contexts; a paged driver (`driver.PagedHooks`) hands out stand-ins and plans each forward.
This module knows no model: the models import it, never the other way round.
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


def drive(steps: Steps, hooks: "DenseHooks") -> Any:
    """Run a step generator to its end, every forward inside `hooks.forward`; returns the loop's result."""
    result = None
    while True:
        try:
            forward = steps.send(result)
        except StopIteration as stop:
            return stop.value
        with hooks.forward(forward.kind, **forward.info):
            result = forward.call()


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
