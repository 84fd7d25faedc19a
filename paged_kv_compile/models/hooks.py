"""The seam between the generation loops and whoever owns the KV memory.

The loops (`dreamzero_rollout`, `hunyuan_generate`) never allocate caches themselves nor know about
paging: they ask a hooks object for the caches and wrap every model forward in `hooks.forward(...)`.
`DenseHooks` is the default: the model's own dense caches (`model.dense_caches`) and no-op contexts.
A paged driver (`driver.PagedHooks`) hands out fixed-shape stand-ins instead and plans each forward
inside `forward`. This module knows no model: the models import it, never the other way round.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class DenseHooks:
    """Default: real dense caches, no-op forward contexts."""

    def caches(self, model: torch.nn.Module, batch: int, **geometry: Any) -> list:
        """Per layer the cache the model's attention reads (geometry: e.g. prefix_capacity)."""
        return model.dense_caches(batch, **geometry)

    def forward(self, kind: str, **info: Any) -> contextlib.AbstractContextManager:
        """Context around one model forward; kind in {"commit", "denoise", "prefill", "step"}."""
        return contextlib.nullcontext()

    def window_reset(self) -> None:
        """Called when a DreamZero window resets (history dropped); dense caches are simply replaced."""
