"""Drive the unmodified reference loops on a runtime: stand-ins instead of caches, a plan per forward.

`PagedHooks` is what a serving pipeline does around a dense model: it hands the model fixed-shape
stand-ins for its dense caches (from the model's family, `families/`) and brackets each model
forward with the runtime's plan for it. `paged_dreamzero_rollout` / `paged_hunyuan_generate` run one
session / request of a reference loop that way; the CLI and the benchmarks call them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from . import families
from .families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
from .families.hunyuan_image3 import HunyuanSpec, hunyuan_runtime_config, hunyuan_spec
from .models.dreamzero import dreamzero_rollout
from .models.hooks import DenseHooks
from .models.hunyuan_image3 import hunyuan_generate
from .runtime import PagedKVRuntime

__all__ = [
    "PagedHooks",
    "DreamZeroSpec",
    "HunyuanSpec",
    "dreamzero_runtime_config",
    "hunyuan_runtime_config",
    "hunyuan_spec",
    "paged_dreamzero_rollout",
    "paged_hunyuan_generate",
]

#: make_hooks(runtime, owner_id) -> the hooks one session/request runs with (PagedHooks or a subclass)
HooksFactory = Callable[[PagedKVRuntime, str], "PagedHooks"]


class PagedHooks(DenseHooks):
    """Hooks for one session or request `owner_id` on `runtime`, of any family."""

    def __init__(self, runtime: PagedKVRuntime, owner_id: str) -> None:
        self.runtime = runtime
        self.owner_id = owner_id
        self.geometry: dict[str, Any] = {}  # the caches' geometry (e.g. prefix_capacity): every plan gets it
        #: open_session arguments (spec, rows, cache_salt, content_keys): the session opens in `cross_kvs`, when
        #: the loop hands over its cross-attention K/V, which then live in shared regions (regions.py)
        self.open_with: dict[str, Any] | None = None

    def caches(self, model: torch.nn.Module, batch: int, **geometry: Any) -> list:
        self.geometry = dict(geometry)
        return families.for_model(model).standin_caches(self.runtime, model, batch, **geometry)

    def cross_kvs(self, model: torch.nn.Module, cross_kvs: list) -> list:
        if self.open_with is not None:
            self.runtime.open_session(self.owner_id, cross_kv=cross_kvs, **self.open_with)
            self.open_with = None
        if self.runtime.owner(self.owner_id) is None or not self.runtime.regions_of(self.owner_id):
            return cross_kvs
        return families.for_model(model).region_standins(self.runtime, model, cross_kvs[0].shape[1])

    def forward(self, kind: str, **info: Any) -> contextlib.AbstractContextManager:
        return self.runtime.forward_for(self.owner_id, kind, **{**self.geometry, **info})

    def window_reset(self) -> None:
        self.runtime.reset_window(self.owner_id)


def paged_dreamzero_rollout(model, runtime: PagedKVRuntime, *, session_id: str = "session",
                            make_hooks: HooksFactory = PagedHooks, shared_cross: bool = False,
                            cache_salt: str | bytes | None = None, **kwargs) -> dict:
    """`dreamzero_rollout` as one session on `runtime`; the session is closed afterwards.

    shared_cross: the session's cross-attention K/V live in shared write-once regions of the pool (keyed by
    `cache_salt`, regions.py) and the compiled model reads them with `paged_kv::attend`; the session opens when
    the loop has computed them."""
    spec = DreamZeroSpec.from_model_config(model.cfg)
    hooks = make_hooks(runtime, session_id)
    if shared_cross:
        hooks.open_with = {"spec": spec, "rows": 2, "cache_salt": cache_salt}
    else:
        runtime.open_session(session_id, spec, rows=2)
    try:
        return dreamzero_rollout(model, hooks=hooks, **kwargs)
    finally:
        if runtime.owner(session_id) is not None:
            runtime.close_session(session_id)


def paged_hunyuan_generate(model, runtime: PagedKVRuntime, prompts: list[torch.Tensor], *,
                           request_id: str = "request", make_hooks: HooksFactory = PagedHooks,
                           **kwargs) -> torch.Tensor:
    """`hunyuan_generate` as one request on `runtime`; finished (or aborted on error) afterwards."""
    spec = hunyuan_spec(model.cfg, prompts)
    # The capacity first: a request no bucket can serve must be refused before it holds any block.
    capacity = kwargs.pop("prefix_capacity", None) or runtime.hunyuan_prefix_capacity(spec.prefix_lens, spec.target_len)
    runtime.admit_request(request_id, spec)
    try:
        out = hunyuan_generate(model, prompts, prefix_capacity=capacity, hooks=make_hooks(runtime, request_id),
                               **kwargs)
    except BaseException:
        runtime.abort(request_id)
        raise
    runtime.finish_request(request_id)
    return out
