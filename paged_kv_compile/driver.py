"""Drive the unmodified reference loops on a runtime: stand-ins instead of caches, a plan per forward.

`PagedHooks` is what a serving pipeline does around a dense model: it hands the model fixed-shape
stand-ins for its dense caches (from the model's family, `families/`) and brackets each model
forward with the runtime's plan for it. `paged_run` runs one session/request of a model's loop that way,
whatever its family; the CLI and the benchmarks call it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from . import families
from .models.hooks import DenseHooks, drive

__all__ = ["PagedHooks", "admit_loop", "paged_run"]

#: make_hooks(runtime, owner_id) -> the hooks one session/request runs with (PagedHooks or a subclass)
HooksFactory = Callable[[Any, str], "PagedHooks"]


class PagedHooks(DenseHooks):
    """Hooks for one session or request `owner_id` on `runtime`, of any family."""

    def __init__(self, runtime: Any, owner_id: str) -> None:
        self.runtime = runtime
        self.owner_id = owner_id
        self.geometry: dict[str, Any] = {}  # the caches' geometry (e.g. prefix_capacity): every plan gets it
        #: `runtime.admit` arguments (spec, rows, cache_salt, content_keys) of an owner admitted only when the loop
        #: hands over its write-once K/V (`write_once_kv`), which then live in shared regions (regions.py)
        self.admit_with: dict[str, Any] | None = None

    def caches(self, model: torch.nn.Module, batch: int, **geometry: Any) -> list:
        self.geometry = dict(geometry)
        return families.for_model(model).standin_caches(self.runtime, model, batch, **geometry)

    def write_once_kv(self, model: torch.nn.Module, kvs: list) -> list:
        if self.admit_with is not None:
            self.runtime.admit(self.owner_id, cross_kv=kvs, **self.admit_with)
            self.admit_with = None
        if self.runtime.owner(self.owner_id) is None or not self.runtime.regions_of(self.owner_id):
            return kvs
        return families.for_model(model).region_standins(self.runtime, model, kvs[0].shape[1])

    def forward(self, kind: str, **info: Any) -> contextlib.AbstractContextManager:
        return self.runtime.forward(self.owner_id, kind, **{**self.geometry, **info})

    def reset_history(self) -> None:
        self.runtime.reset(self.owner_id)


def admit_loop(model: torch.nn.Module, runtime: Any, owner_id: str, *, admit: bool = True, rows: int | None = None,
               family_model: torch.nn.Module | None = None, **loop: Any) -> tuple[Any, Any, dict[str, Any]]:
    """(family, spec, loop arguments) of one session/request of `model`'s loop on `runtime`, admitted unless
    `admit=False`. The loop arguments are the family's for this runtime (`Family.loop_arguments`), derived before
    admission: a request the runtime's buckets cannot serve is refused while it holds nothing.

    rows: the rows this runtime admits (default: the spec's; a CFG-parallel rank holds fewer). family_model: the
    reference model the family and spec are read from, when `model` wraps it (a rank's `CfgBranch`)."""
    family_model = model if family_model is None else family_model
    family = families.for_model(family_model)
    spec = family.spec_for(family_model, **loop)
    loop = family.loop_arguments(runtime, spec, loop)
    if admit:
        runtime.admit(owner_id, spec, rows)
    return family, spec, loop


@torch.no_grad()
def paged_run(model: torch.nn.Module, runtime: Any, *, owner_id: str = "owner", make_hooks: HooksFactory = PagedHooks,
              shared_kv: bool = False, cache_salt: str | bytes | None = None, rows: int | None = None,
              family_model: torch.nn.Module | None = None, **loop: Any) -> Any:
    """One session/request of `model`'s own loop (`Family.steps`) on `runtime`: admitted first, released after,
    aborted if the loop raises. `loop`: the loop's keyword arguments (e.g. num_chunks=, num_inference_steps=;
    prompts=, num_steps=); the family derives the spec from them (`Family.spec_for`).

    shared_kv: the loop's write-once K/V (e.g. cross-attention) live in shared regions of the pool (keyed by
    `cache_salt`, regions.py) and the compiled model reads them with `paged_kv::attend`; the owner is admitted
    when the loop has computed them. rows, family_model: as `admit_loop`."""
    family, spec, loop = admit_loop(model, runtime, owner_id, admit=not shared_kv, rows=rows,
                                    family_model=family_model, **loop)
    hooks = make_hooks(runtime, owner_id)
    if shared_kv:
        hooks.admit_with = {"spec": spec, "cache_salt": cache_salt}
    try:
        out = drive(family.steps(model, hooks, **loop), hooks)
    except BaseException:
        if runtime.owner(owner_id) is not None and runtime.active is None:
            runtime.abort(owner_id)
        raise
    if runtime.owner(owner_id) is not None:
        runtime.release(owner_id)
    return out
