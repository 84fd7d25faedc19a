"""Adapter to Ascend's ``torch_npu.npu_fused_infer_attention_score`` in paged (block_table) mode.

Query goes in BSND layout; the pool's halves are viewed as ``[num_blocks, block_size, Hkv * D]``.
Visibility other than "full", or a row's ``kv_gap``, is passed as ``atten_mask`` ``[R, 1, T, M * B]``
(True = masked out), built on the device: one call covers visible keys that start and end inside blocks.
New K/V are written first by the shared torch helper; padded queries are zeroed afterwards (with
masked_fill, so a NaN from a fully masked row cannot leak).

Caveat: ``actual_seq_lengths_kv`` is a host int list, so this adapter reads
``seq_lens`` on the host every call, and a captured NPU graph bakes those ints in: refresh them after
capture (graph task update) or make them part of the capture key.
"""

from __future__ import annotations

import functools
import importlib
import inspect
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


def _argument_names(fn) -> set[str]:
    """Keyword names `fn` accepts: its Python signature, else its torch op schema, else its docstring's."""
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        pass
    try:
        return {a.name for a in torch.ops.npu.npu_fused_infer_attention_score.default._schema.arguments}
    except (AttributeError, RuntimeError):
        pass
    doc = getattr(fn, "__doc__", None) or ""
    return {"scale_value"} if "scale_value" in doc else set()


def scale_keyword(torch_npu: ModuleType) -> str:
    """The softmax-scale keyword of this torch_npu: ``scale_value`` up to 6.0.x, ``scale`` from 7.0.

    Prototypes: "float scale_value=1.0" in the 6.0.0 / 6.0.RC3 API reference (hiascend.com,
    Pytorch/600 ptaoplist_000837, Pytorch/60RC3 ptaoplist_000768), "float scale=1.0" in 7.0.0's
    (Pytorch/700 ptaoplist_001232) and in Ascend/op-plugin docs/context/torch_npu-npu_fused_infer_attention_score.md.
    The torch_npu package version does not carry that release number, so the signature decides.
    """
    names = _argument_names(torch_npu.npu_fused_infer_attention_score)
    return "scale_value" if "scale_value" in names and "scale" not in names else "scale"


def page_size_rule(block_size: int, tokens: int, head_dim: int) -> str | None:
    """Why Ascend's paged attention refuses `block_size` for float16/bfloat16 caches, or None.

    From the block_size constraints of npu_fused_infer_attention_score (Ascend/op-plugin
    docs/context/torch_npu-npu_fused_infer_attention_score.md: with page attention, float16/bfloat16 key/value
    need block_size 16-aligned, at most 512) and of aclnnFusedInferAttentionScore (CANN ops docs: for GQA with
    head_dim other than 64/128 and Q_S > 1, block_size 128-aligned and at most 512).
    """
    if block_size <= 0 or block_size > 512 or block_size % 16:
        return f"needs block_size % 16 == 0 and 0 < block_size <= 512 for float16/bfloat16, got {block_size}"
    if tokens > 1 and head_dim not in (64, 128) and block_size % 128:
        return (f"with head_dim={head_dim} (not 64/128) and {tokens} query tokens needs block_size % 128 == 0, "
                f"got {block_size}")
    return None


def unavailable_reason(query: torch.Tensor, kv_pool: torch.Tensor, visibility: str) -> str | None:
    """Why the NPU kernel cannot serve these inputs, or None."""
    if query.device.type not in DEVICE_TYPES:
        return f"kernel='npu' (torch_npu) runs on Ascend NPU tensors, got {query.device.type}; use kernel='reference'"
    if load_module() is None:
        return "kernel='npu' needs torch_npu, which is not importable: install torch-npu matching torch (with CANN)"
    if kv_pool.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return (
            f"npu_fused_infer_attention_score has no {kv_pool.dtype} key/value: its quantized caches are int8 "
            "with key_antiquant_scale/value_antiquant_scale (Ascend/op-plugin docs/context/"
            "torch_npu-npu_fused_infer_attention_score.md); use kv_dtype=None or kernel='reference'"
        )
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"npu_fused_infer_attention_score takes float16/bfloat16, got {query.dtype}; use kernel='reference'"
    rule = page_size_rule(kv_pool.shape[2], query.shape[1], query.shape[3])
    if rule is not None:
        return f"npu_fused_infer_attention_score's paged mode {rule}: change the pool's block_size, or use kernel='reference'"
    return None


def attend(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_visible_end: torch.Tensor,
    scale: float,
    visibility: str,
    row_scales: torch.Tensor | None = None,
    kv_gap: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend with the fused NPU kernel (the dispatcher wrote the new K/V), zero the padded queries.

    FP8 pools are refused in `unavailable_reason`, so `row_scales` is always None here."""
    torch_npu = load_module()
    R, T, Hq, D = query.shape
    _, N, B, Hkv, _ = kv_pool.shape
    caches = kv_pool.view(2, N, B, Hkv * D)
    mask = None
    if visibility != "full" or kv_gap is not None:
        mask = ~visible_mask(seq_lens, kv_visible_end, block_table.shape[1] * B, kv_gap).unsqueeze(1)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        query.contiguous(), caches[0], caches[1],
        atten_mask=mask, block_table=block_table.contiguous(),
        actual_seq_lengths_kv=seq_lens.tolist(),  # host sync, see above
        num_heads=Hq, num_key_value_heads=Hkv, input_layout="BSND", block_size=B, **{scale_keyword(torch_npu): scale},
    )
    return zero_padded_queries(out, seq_lens, kv_visible_end, kv_gap)
