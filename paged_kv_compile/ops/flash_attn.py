"""Adapter to flash-attn's paged attention: FA3, FA2 or vLLM's build (`vllm.vllm_flash_attn`).

The caches are the pool's halves ``kv_pool[0]``, ``kv_pool[1]`` ``[num_blocks, block_size, Hkv, D]``,
addressed by our int32 block table and ``seq_lens``. New K/V are written first by the shared torch
helper, not by flash-attn's ``k=``/``v=`` append (which appends at ``cache_seqlens``, not at our slots).

flash-attn expresses two visibility layouts: every query sees [0, seq_len) (non-causal) and
bottom-right causal. Checking ``kv_visible_end`` against them needs a host sync, so the caller states
the layout with the op's ``visibility`` hint ("full" or "causal"); "general" is refused here. The hint
is verified on CPU tensors only (see write_attend.check_values). Padded queries are zeroed afterwards.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from .reference import zero_padded_queries
from .reference import write_kv  # noqa: F401  the dispatcher writes new K/V with <kernel module>.write_kv

#: Device types whose tensors the vendor kernels take (tests add "cpu" to drive a fake module).
DEVICE_TYPES = ("cuda",)


def _kvcache_call(table_kw: str) -> Callable:
    def call(mod, q, k_cache, v_cache, block_table, seq_lens, scale, causal):
        return mod.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seq_lens, softmax_scale=scale, causal=causal, **{table_kw: block_table}
        )

    return call


def _vllm_call(mod, q, k_cache, v_cache, block_table, seq_lens, scale, causal):
    # vLLM's build only exposes the varlen entry point; every row has T queries.
    R, T, H, D = q.shape
    cu_seqlens_q = torch.arange(0, (R + 1) * T, T, dtype=torch.int32, device=q.device)
    out = mod.flash_attn_varlen_func(
        q.reshape(R * T, H, D), k_cache, v_cache, max_seqlen_q=T, cu_seqlens_q=cu_seqlens_q,
        max_seqlen_k=block_table.shape[1] * k_cache.shape[1], seqused_k=seq_lens, block_table=block_table,
        softmax_scale=scale, causal=causal,
    )
    return out.view(R, T, H, D)


@dataclass(frozen=True)
class Flavor:
    """One importable flash-attn build and the rule its paged mode puts on block_size."""

    module: str
    page_multiple: int
    call: Callable


FLAVORS = (
    Flavor("flash_attn_interface", 1, _kvcache_call("page_table")),  # FA3 (hopper build)
    Flavor("flash_attn", 256, _kvcache_call("block_table")),  # FA2: paged mode needs block_size % 256 == 0
    Flavor("vllm.vllm_flash_attn", 1, _vllm_call),  # vLLM's build: any block size
)


@functools.cache
def load_module(name: str) -> ModuleType | None:
    """The imported module or None; cached (tests that fake modules call ``load_module.cache_clear()``)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def select(block_size: int) -> tuple[Flavor, ModuleType] | str:
    """The first importable build whose page-size rule `block_size` meets, or why there is none."""
    loaded = [(f, m) for f in FLAVORS if (m := load_module(f.module)) is not None]
    if not loaded:
        return (
            "kernel='flash_attn' needs flash_attn (flash-attn 2), flash_attn_interface (flash-attn 3) or "
            "vllm.vllm_flash_attn; none is importable: pip install flash-attn on a CUDA machine, or use kernel='triton'"
        )
    for flavor, mod in loaded:
        if block_size % flavor.page_multiple == 0:
            return flavor, mod
    return (
        f"flash-attn 2's paged mode needs block_size % 256 == 0, got block_size={block_size}: use a multiple "
        "of 256, install flash-attn 3 or vLLM's vllm_flash_attn (any block size), or use kernel='triton'"
    )


def unavailable_reason(query: torch.Tensor, kv_pool: torch.Tensor, visibility: str) -> str | None:
    """Why flash-attn cannot serve these inputs, or None. Cheap; imports only on an accepted device."""
    if query.device.type not in DEVICE_TYPES:
        return (
            f"kernel='flash_attn' (flash_attn / vllm.vllm_flash_attn) runs on CUDA tensors, got {query.device.type}; "
            "use kernel='reference' or 'triton'"
        )
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"kernel='flash_attn' computes in float16/bfloat16, got {query.dtype}; use kernel='triton'"
    if visibility == "general":
        return (
            "this kv_visible_end layout is not expressible with flash-attn (it has only non-causal [0, seq_len) "
            "and bottom-right causal): pass visibility='full' or 'causal' if the layout is one of them, "
            "else use kernel='triton'"
        )
    picked = select(kv_pool.shape[2])
    return picked if isinstance(picked, str) else None


def attend(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_visible_end: torch.Tensor,
    scale: float,
    visibility: str,
) -> torch.Tensor:
    """Attend with flash-attn over the pool (the dispatcher wrote the new K/V), zero the padded queries."""
    flavor, mod = select(kv_pool.shape[2])
    causal = visibility == "causal"
    out = flavor.call(mod, query.contiguous(), kv_pool[0], kv_pool[1], block_table, seq_lens, scale, causal)
    return zero_padded_queries(out, seq_lens, kv_visible_end)
