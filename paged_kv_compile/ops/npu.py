"""Adapter to Ascend's ``torch_npu.npu_fused_infer_attention_score`` in paged (block_table) mode.

Query goes in BSND layout; the pool's halves are viewed as ``[num_blocks, block_size, Hkv * D]``.
Visibility other than "full" is passed as ``atten_mask`` ``[R, 1, T, M * B]`` (True = masked out),
built on the device. New K/V are written first by the shared torch helper; padded queries are zeroed
afterwards (with masked_fill, so a NaN from a fully masked row cannot leak).

Caveat: ``actual_seq_lengths_kv`` is a host int list, so this adapter reads
``seq_lens`` on the host every call, and a captured NPU graph bakes those ints in: refresh them after
capture (graph task update) or make them part of the capture key.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from .reference import visible_mask, zero_padded_queries
from .reference import write_kv  # noqa: F401  the dispatcher writes new K/V with <kernel module>.write_kv

#: Device types whose tensors the NPU kernel takes (tests add "cpu" to drive a fake module).
DEVICE_TYPES = ("npu",)


@functools.cache
def load_module() -> ModuleType | None:
    """``torch_npu`` or None; cached (tests that fake it call ``load_module.cache_clear()``)."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError:
        return None


def unavailable_reason(query: torch.Tensor, kv_pool: torch.Tensor, visibility: str) -> str | None:
    """Why the NPU kernel cannot serve these inputs, or None."""
    if query.device.type not in DEVICE_TYPES:
        return f"kernel='npu' (torch_npu) runs on Ascend NPU tensors, got {query.device.type}; use kernel='reference'"
    if load_module() is None:
        return "kernel='npu' needs torch_npu, which is not importable: install torch-npu matching torch (with CANN)"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"npu_fused_infer_attention_score takes float16/bfloat16, got {query.dtype}; use kernel='reference'"
    return None


def attend(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_visible_end: torch.Tensor,
    scale: float,
    visibility: str,
) -> torch.Tensor:
    """Attend with the fused NPU kernel (the dispatcher wrote the new K/V), zero the padded queries."""
    torch_npu = load_module()
    R, T, Hq, D = query.shape
    _, N, B, Hkv, _ = kv_pool.shape
    caches = kv_pool.view(2, N, B, Hkv * D)
    mask = None
    if visibility != "full":
        mask = ~visible_mask(seq_lens, kv_visible_end, block_table.shape[1] * B).unsqueeze(1)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        query.contiguous(), caches[0], caches[1],
        atten_mask=mask, block_table=block_table, actual_seq_lengths_kv=seq_lens.tolist(),  # host sync, see above
        num_heads=Hq, num_key_value_heads=Hkv, input_layout="BSND", scale=scale, block_size=B,
    )
    return zero_padded_queries(out, seq_lens, kv_visible_end)
