"""Page vllm-omni's HunyuanImage-3 (`HunyuanImage3DecoderLayer` + `ImageKVCacheManager`) with one call.

As written (vllm_omni/diffusion/models/hunyuan_image3/hunyuan_image3_transformer.py, vllm-omni 0.30.0),
`ImageKVCacheManager._cache_prompt_kv` builds the prompt cache inside the forward: `new_zeros` sized by
`.item()`, a per-row `.item()` loop and a data-dependent assert. Dynamo cannot trace that with
`fullgraph=True`, and with graph breaks nothing is paged. `_reuse_prompt_kv` also calls
`logger.isEnabledFor` (a graph break). `install` replaces exactly those two methods, per instance, with the
same computation at a fixed shape: the prompt cache is a writable stand-in of `(rows, capacity, Hkv, D)`
written with `torch.where(column < prompt_len, key[:, :capacity], 0)` (the dense version's zero-padded
rows), and a step reads `cat([cache, key]).contiguous()`. Everything else (projections, RoPE, q/k norm,
repeat_kv, the mask's `.contiguous()`, vllm-omni's SDPA attention layer) runs unchanged and the paged_kv
passes rewrite it. The capacity is the dense code's own `max(prompt lens)` (its step masks have that many
prefix columns). Imports nothing from vllm-omni: the managers are found by their methods.

Strict Ulysses (`sp_size > 1`): vllm-omni's layer joins the text prefix (replicated on every rank) in front of
the all-to-all's image K/V (`joint_strategy="front"`, sliced to the rank's heads). The stand-in holds the rank's
KV heads, written from the prefix of `key` at the first step and tiled back to every KV head at a step so that
the layer's head slice reads exactly it; the layer keeps K/V at their KV heads (its `keep_kv_compressed`
branch), so the all-to-all carries KV heads and SDPA does the GQA. A step's image shard is padded by vllm-omni to
a multiple of the degree: `forward(..., step_padding=n)` plans those n trailing tokens (keys no target query sees).
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator, Sequence

import torch

from ..errors import RequestError
from ..runtime import PagedKVRuntime
from ..families.hunyuan_image3 import HunyuanSpec

_PATCHED = ("_cache_prompt_kv", "_reuse_prompt_kv")


def ulysses_heads(manager: torch.nn.Module) -> tuple[int, int]:
    """(first, count) of the KV heads this Ulysses rank attends and caches: with K/V kept at their KV heads (see
    `HunyuanAdapter`), vllm-omni's strict all-to-all gives rank r the KV heads [r*Hkv/U, (r+1)*Hkv/U)."""
    u = getattr(manager, "sp_size", 1)
    count = manager.num_kv_heads // u
    return getattr(manager, "sp_rank", 0) * count, count


def _rank_heads(self, x):
    first, count = ulysses_heads(self)
    return x[:, :, first:first + count]


def _as_all_heads(self, cached):
    """A rank's cached heads tiled to every local KV head: the layer's Ulysses joint split (the rank's slice of
    the joint K/V heads) reads back exactly this rank's cached heads."""
    return cached.repeat(1, 1, getattr(self, "sp_size", 1), 1)


def _cache_prompt_kv(self, key, value, seq_len, shard_image_size=None, gen_timestep_scatter_index=None):
    """`_cache_prompt_kv` at a fixed shape: rows keep key/value[:, :prompt_len], zeros after (as dense). Under
    Ulysses the cache holds this rank's heads (the layer's joint text prefix reads them from `key`)."""
    cached_key, cached_value = self._paged_kv_cache
    capacity = cached_key.shape[1]
    lens = gen_timestep_scatter_index[:, -1].to(torch.long)  # each row's prompt length (its timestep token)
    valid = (torch.arange(capacity, device=key.device)[None, :] < lens[:, None])[:, :, None, None]
    cached_key.copy_(torch.where(valid, _rank_heads(self, key[:, :capacity]), 0))
    cached_value.copy_(torch.where(valid, _rank_heads(self, value[:, :capacity]), 0))
    return key, value


def _reuse_prompt_kv(self, key, value, seq_len, bs, shard_image_size=None, position_ids=None):
    """`_reuse_prompt_kv` without the host-side debug assert: [cached prompt | new target] keys/values; under
    Ulysses the cached prompt alone (the layer joins it in front of the all-to-all's image K/V)."""
    cached_key, cached_value = self._paged_kv_cache
    if shard_image_size is not None and getattr(self, "sp_size", 1) > 1:
        return _as_all_heads(self, cached_key).contiguous(), _as_all_heads(self, cached_value).contiguous()
    return torch.cat([cached_key, key], dim=1).contiguous(), torch.cat([cached_value, value], dim=1).contiguous()


def _managers(layers: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    found = []
    for layer in layers:
        for module in layer.modules():
            if all(callable(getattr(module, name, None)) for name in _PATCHED) and hasattr(module, "image_kv_cache_map"):
                found.append(module)
    return found


def _check_parallel(manager: torch.nn.Module) -> None:
    u = getattr(manager, "sp_size", 1)
    if u <= 1:
        return
    if getattr(manager, "allgather_size", 1) > 1 and not getattr(manager, "_paged_kv_compressed", False):
        raise RequestError("AllGather-KV sequence parallel HunyuanImage-3 is not paged: use ulysses_degree")
    if manager.num_kv_heads % u:
        raise RequestError(f"{manager.num_kv_heads} KV heads per rank cannot be split across ulysses_degree={u}: "
                           "each Ulysses rank's pool holds its KV heads; choose a degree dividing them")


class HunyuanAdapter:
    """Installed on a model's decoder layers: brackets each forward with the runtime's plan and stand-ins."""

    def __init__(self, runtime: PagedKVRuntime, layers: Sequence[torch.nn.Module]) -> None:
        self.runtime = runtime
        self.managers = _managers(layers)
        if not self.managers:
            raise RequestError(
                "no vllm-omni ImageKVCacheManager found under these layers (modules with _cache_prompt_kv, "
                "_reuse_prompt_kv and image_kv_cache_map): pass the HunyuanImage3DecoderLayer list"
            )
        for manager in self.managers:
            _check_parallel(manager)
            if getattr(manager, "sp_size", 1) > 1:
                # The layer's compressed-K/V branch (`keep_kv_compressed`, taken for AllGather-KV): no `repeat_kv`
                # before the all-to-all, so each Ulysses rank receives its KV heads (not their repeats) and the
                # attention's SDPA does the GQA; the same numbers. Each rank's pool then holds Hkv/U heads.
                manager.allgather_size, manager._paged_kv_compressed = 2, True
            for name in _PATCHED:
                setattr(manager, name, types.MethodType(globals()[name], manager))
        runtime.bind(layers)

    @staticmethod
    def spec(attention_mask: torch.Tensor, gen_timestep_scatter_index: torch.Tensor, target_len: int) -> HunyuanSpec:
        """The request's spec from the pipeline's own prefill inputs (host side, once per request).

        Prompt lengths are the timestep token's index per row (what the dense cache keeps); the full spans
        are read from the first row's mask (`HunyuanSpec.from_prefill_mask`).
        """
        prefix_lens = tuple(int(i) for i in gen_timestep_scatter_index[:, -1].tolist())
        return HunyuanSpec.from_prefill_mask(attention_mask, prefix_lens, target_len)

    @contextlib.contextmanager
    def forward(self, request_id: str, *, phase: str, attention_mask: torch.Tensor | None = None,
                step_padding: int = 0) -> Iterator[None]:
        """One model forward of `request_id` ("prefill" = the pipeline's first_step, else "step")."""
        owner = self.runtime.owner(request_id)
        if owner is None:
            raise RequestError(f"unknown request {request_id!r}: admit it with runtime.admit(rid, spec) first")
        for manager in self.managers:
            if getattr(manager, "_injected_ar_kv", None) is not None:
                raise RequestError("imported AR prompt KV (_injected_ar_kv) is not supported by this adapter")
        rows, capacity = len(owner.spec.prefix_lens), max(owner.spec.prefix_lens)
        probe = self.managers[0]
        standin = self.runtime.standin(rows, capacity, ulysses_heads(probe)[1], probe.head_dim, writable=True)
        for manager in self.managers:
            manager._paged_kv_cache = (standin, standin)
        with self.runtime.forward(request_id, phase, prefix_capacity=capacity,
                                  attention_mask=attention_mask, step_padding=step_padding):
            yield


def install(layers: Sequence[torch.nn.Module], runtime: PagedKVRuntime) -> HunyuanAdapter:
    """Make vllm-omni's HunyuanImage-3 decoder layers pageable on `runtime` (binds them too)."""
    return HunyuanAdapter(runtime, layers)
