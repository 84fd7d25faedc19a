"""Drive the unmodified reference loops on a runtime: stand-ins instead of caches, a plan per forward.

`PagedHooks` is what a serving pipeline does around a dense model: it hands the model fixed-shape
stand-ins for its dense caches and brackets each model forward with the runtime's plan for it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .models.hooks import DenseHooks
from .config import PagedKVConfig
from .runtime import PagedKVRuntime
from .scheduler import DreamZeroSpec, HunyuanSpec


class PagedHooks(DenseHooks):
    """Hooks for one DreamZero session or one HunyuanImage-3 request on `runtime`."""

    def __init__(self, runtime: PagedKVRuntime, owner_id: str) -> None:
        self.runtime = runtime
        self.owner_id = owner_id
        self.prefix_capacity: int | None = None

    def dreamzero_caches(self, model, batch: int) -> list[torch.Tensor]:
        cfg = model.cfg
        standin = self.runtime.standin(2, batch, cfg.max_attention_size, cfg.num_heads, cfg.head_dim)
        return [standin] * cfg.num_layers

    def hunyuan_caches(self, model, batch: int, prefix_capacity: int) -> list:
        from .models.hunyuan_image3 import HunyuanKVCache

        cfg = model.cfg
        self.prefix_capacity = prefix_capacity
        standin = self.runtime.standin(batch, prefix_capacity, cfg.num_kv_heads, cfg.head_dim, writable=True)
        return [HunyuanKVCache(standin, standin) for _ in range(cfg.num_layers)]

    def forward(self, kind: str, **info: Any) -> contextlib.AbstractContextManager:
        if kind in ("commit", "denoise"):
            return self.runtime.dreamzero_forward(self.owner_id, commit=kind == "commit")
        if kind in ("prefill", "step"):
            if self.prefix_capacity is None:
                raise RuntimeError("hunyuan_caches must be requested before the first forward")
            return self.runtime.hunyuan_forward(self.owner_id, phase=kind, prefix_capacity=self.prefix_capacity)
        raise ValueError(f"unknown forward kind {kind!r}")

    def window_reset(self) -> None:
        self.runtime.reset_window(self.owner_id)


def dreamzero_runtime_config(model_cfg, *, block_size: int | None = None, sessions: int = 1, rows: int = 2,
                             **overrides) -> PagedKVConfig:
    """A pool for `sessions` DreamZero sessions of `rows` CFG rows each (one window per row)."""
    block_size = block_size or model_cfg.frame_seqlen
    per_row = -(-model_cfg.max_attention_size // block_size)
    fields = dict(
        num_layers=model_cfg.num_layers, num_kv_heads=model_cfg.num_heads, head_dim=model_cfg.head_dim,
        block_size=block_size, blocks_per_layer=sessions * rows * per_row, max_rows=rows,
        scratch_tokens_per_row=model_cfg.tokens_per_forward,
    )
    fields.update(overrides)
    return PagedKVConfig(**fields)


def hunyuan_runtime_config(model_cfg, *, max_prefix: int, block_size: int = 16, requests: int = 1, rows: int = 2,
                           **overrides) -> PagedKVConfig:
    """A pool for `requests` HunyuanImage-3 requests whose prompts are at most `max_prefix` tokens."""
    per_row = -(-max_prefix // block_size)
    fields = dict(
        num_layers=model_cfg.num_layers, num_kv_heads=model_cfg.num_kv_heads, head_dim=model_cfg.head_dim,
        block_size=block_size, blocks_per_layer=requests * rows * per_row, max_rows=rows,
        scratch_tokens_per_row=model_cfg.target_len,
    )
    fields.update(overrides)
    return PagedKVConfig(**fields)


def hunyuan_spec(model_cfg, prompts: list[torch.Tensor]) -> HunyuanSpec:
    """The request layout of `prompts` (1 or 2 CFG rows): image tokens attend bidirectionally."""
    image = model_cfg.image_tokens
    return HunyuanSpec(tuple(int(p.numel()) for p in prompts), model_cfg.target_len, ((1, 1 + image),))


def paged_dreamzero_rollout(model, runtime: PagedKVRuntime, *, session_id: str = "session", **kwargs) -> dict:
    """`dreamzero_rollout` as one session on `runtime`; the session is closed afterwards."""
    from .models.dreamzero import dreamzero_rollout

    runtime.open_session(session_id, DreamZeroSpec.from_model_config(model.cfg), rows=2)
    try:
        return dreamzero_rollout(model, hooks=PagedHooks(runtime, session_id), **kwargs)
    finally:
        runtime.close_session(session_id)


def paged_hunyuan_generate(model, runtime: PagedKVRuntime, prompts: list[torch.Tensor], *,
                           request_id: str = "request", **kwargs) -> torch.Tensor:
    """`hunyuan_generate` as one request on `runtime`; finished (or aborted on error) afterwards."""
    from .models.hunyuan_image3 import hunyuan_generate

    spec = hunyuan_spec(model.cfg, prompts)
    # The capacity first: a request no bucket can serve must be refused before it holds any block.
    capacity = kwargs.pop("prefix_capacity", None) or runtime.hunyuan_prefix_capacity(spec.prefix_lens, spec.target_len)
    runtime.admit_request(request_id, spec)
    try:
        out = hunyuan_generate(model, prompts, prefix_capacity=capacity, hooks=PagedHooks(runtime, request_id), **kwargs)
    except BaseException:
        runtime.abort(request_id)
        raise
    runtime.finish_request(request_id)
    return out
