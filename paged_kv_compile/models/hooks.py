"""The seam between the generation loops and whoever owns the KV memory.

The loops (`dreamzero_rollout`, `hunyuan_generate`) never allocate caches themselves nor know about
paging: they ask a hooks object for the caches and wrap every model forward in `hooks.forward(...)`.
`DenseHooks` is the default: real dense caches and no-op contexts. A paged driver subclasses it,
hands out fixed-shape stand-ins instead and builds its per-forward metadata inside `forward`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .dreamzero import DreamZeroModel
    from .hunyuan_image3 import HunyuanImage3Model, HunyuanKVCache


def _param_like(model: torch.nn.Module) -> torch.Tensor:
    return next(model.parameters())


class DenseHooks:
    """Default: real dense caches, no-op forward contexts."""

    def dreamzero_caches(self, model: "DreamZeroModel", batch: int) -> list[torch.Tensor]:
        """Per layer an empty cache (2, batch, 0, H, D): K at [0], V at [1]; it grows by concat."""
        cfg, p = model.cfg, _param_like(model)
        return [
            torch.zeros(2, batch, 0, cfg.num_heads, cfg.head_dim, dtype=p.dtype, device=p.device)
            for _ in range(cfg.num_layers)
        ]

    def hunyuan_caches(
        self, model: "HunyuanImage3Model", batch: int, prefix_capacity: int
    ) -> list["HunyuanKVCache"]:
        """Per layer a preallocated prefix cache of zeros (batch, prefix_capacity, Hkv, D)."""
        from .hunyuan_image3 import HunyuanKVCache

        cfg, p = model.cfg, _param_like(model)
        shape = (batch, prefix_capacity, cfg.num_kv_heads, cfg.head_dim)
        return [
            HunyuanKVCache(
                torch.zeros(shape, dtype=p.dtype, device=p.device),
                torch.zeros(shape, dtype=p.dtype, device=p.device),
            )
            for _ in range(cfg.num_layers)
        ]

    def forward(self, kind: str, **info: Any) -> contextlib.AbstractContextManager:
        """Context around one model forward; kind in {"commit", "denoise", "prefill", "step"}."""
        return contextlib.nullcontext()

    def window_reset(self) -> None:
        """Called when a DreamZero window resets (history dropped); dense caches are simply replaced."""
