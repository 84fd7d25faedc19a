"""The reference kernel (pure torch, every device) and the helpers the vendor adapters share.

It is the oracle the other kernels are tested against. Attention gathers whole blocks of the row's
table (`index_select` on the block axis), measured faster than per-token gathers during the design, and
runs SDPA under a boolean mask built from `kv_visible_end` and `seq_lens`. On a device nothing here
reads a value on the host, so the same code is safe under CUDA graphs; on CPU tensors it reads lengths
and valid slots on the host to skip padding work (`HOST_LENGTHS_ON_CPU`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import dequantize, quantize


#: On CPU tensors, read the lengths on the host and attend over the used span only (see
#: `_attend_used_span`). Tests turn it off to exercise the device path (full table, mask) on the CPU.
HOST_LENGTHS_ON_CPU = True


def write_kv(kv_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
             row_scales: torch.Tensor | None = None) -> None:
    """Copy key/value ``[R, T, Hkv, D]`` into the pool's flat slots; tokens with slot -1 write nothing.

    FP8 pools: each token is quantized with its row's scales ``row_scales [2, R, Hkv]`` (ops/fp8.py).

    On a device, without a host sync: a -1 token is redirected to the first valid token of the call and
    writes that token's own row again (duplicates of identical values are harmless). If no token is
    valid, every token writes slot 0's current content back onto itself. On CPU tensors (as in `attend`,
    `HOST_LENGTHS_ON_CPU`) nothing is captured, so the valid tokens are read on the host and copied
    directly: no redirect, no blend with the old content (that blend was most of the op's CPU cost).
    """
    _, N, B, H, D = kv_pool.shape
    # FP8 pools are moved as their bytes: index_copy_/where have no float8 kernels.
    flat = (kv_pool if row_scales is None else kv_pool.view(torch.uint8)).view(2, N * B, H, D)
    slots = slot_mapping.reshape(-1)
    valid = slots >= 0
    keep = None  # device path: which tokens really write (the others write back what is there)
    if HOST_LENGTHS_ON_CPU and slots.device.type == "cpu":
        src = None if bool(valid.all()) else valid.nonzero().squeeze(1)  # None: every token writes
        target = slots if src is None else slots.index_select(0, src)
    else:
        first = torch.argmax(valid.to(torch.int32))  # first valid token, 0 when there is none
        src = torch.where(valid, torch.arange(slots.numel(), device=slots.device), first)
        target = slots.index_select(0, src)
        keep = (target >= 0).view(-1, 1, 1)
        target = target.clamp(min=0)
    for i, (half, new) in enumerate(((flat[0], key), (flat[1], value))):
        rows = new.reshape(-1, H, D)
        if src is not None:
            rows = rows.index_select(0, src)
        if row_scales is not None:
            token_row = (torch.arange(slots.numel(), device=slots.device) if src is None else src) // key.shape[1]
            rows = quantize(rows, row_scales[i].index_select(0, token_row).unsqueeze(-1), kv_pool.dtype)
            rows = rows.view(torch.uint8)
        if keep is not None:
            rows = torch.where(keep, rows, half.index_select(0, target))
        half.index_copy_(0, target, rows)


def visible_mask(seq_lens: torch.Tensor, kv_visible_end: torch.Tensor, length: int) -> torch.Tensor:
    """Boolean ``[R, T, length]``: query (r, t) sees logical key p iff p < min(visible_end, seq_len)."""
    end = torch.minimum(kv_visible_end, seq_lens.view(-1, 1))
    return torch.arange(length, device=end.device) < end.unsqueeze(-1)


def zero_padded_queries(attn: torch.Tensor, seq_lens: torch.Tensor, kv_visible_end: torch.Tensor) -> torch.Tensor:
    """Contiguous ``[R, T, Hq, D]`` copy of `attn` with exact zeros where a query sees no key.

    Uses masked_fill, not a multiply, so NaN a vendor kernel may give a fully masked row never leaks.
    """
    empty = torch.minimum(kv_visible_end, seq_lens.view(-1, 1)) <= 0
    out = attn.new_empty(attn.shape)  # contiguous: the fake kernel promises these strides
    return out.copy_(attn).masked_fill_(empty[:, :, None, None], 0)


def _gather(kv_pool: torch.Tensor, block_ids: torch.Tensor, row_scales: torch.Tensor | None) -> torch.Tensor:
    """The blocks ``block_ids`` of both halves; FP8 pools gathered as bytes (index_select has no float8 kernel)."""
    if row_scales is None:
        return kv_pool.index_select(1, block_ids)
    return kv_pool.view(torch.uint8).index_select(1, block_ids).view(kv_pool.dtype)


def _dequantized(kv: torch.Tensor, row_scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Gathered K/V ``[2, R, L, Hkv, D]`` as `dtype`: FP8 blocks times their row's scales, others as they are."""
    if row_scales is None:
        return kv
    return dequantize(kv, row_scales[:, :, None, :, None], dtype)


def attend(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_visible_end: torch.Tensor,
    scale: float,
    visibility: str = "general",
    row_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query [R, T, Hq, D]`` over each row's blocks; zeros for queries that see nothing.

    `visibility` is the vendor kernels' hint; this kernel computes any layout and ignores it. FP8
    pools are dequantized to the query's dtype with ``row_scales [2, R, Hkv]``.
    """
    R, T, Hq, D = query.shape
    _, _, B, Hkv, _ = kv_pool.shape
    if HOST_LENGTHS_ON_CPU and query.device.type == "cpu" and R:
        return _attend_used_span(query, kv_pool, block_table, seq_lens, kv_visible_end, scale, row_scales)
    M = block_table.shape[1]
    kv = _gather(kv_pool, block_table.reshape(-1), row_scales).view(2, R, M * B, Hkv, D)
    kv = _dequantized(kv, row_scales, query.dtype).transpose(2, 3)
    mask = visible_mask(seq_lens, kv_visible_end, M * B)
    # A query that sees nothing gets key 0 as a dummy (softmax stays finite); its output is zeroed below.
    mask[:, :, 0] |= ~mask.any(-1)
    attn = F.scaled_dot_product_attention(
        query.transpose(1, 2), kv[0], kv[1], attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=Hq != Hkv
    )
    return zero_padded_queries(attn.transpose(1, 2), seq_lens, kv_visible_end)


def _attend_used_span(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_visible_end: torch.Tensor,
    scale: float,
    row_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """CPU path: lengths are host values here, so gather only the blocks in use, and drop the mask
    when every query sees its whole row (DreamZero's window) so SDPA can take its fused kernel.

    The padded table width and the all-rows mask are what fixed shapes cost on a device that must not
    read lengths; on the CPU nothing is captured and reading them is free.
    """
    R, T, Hq, D = query.shape
    _, _, B, Hkv, _ = kv_pool.shape
    length = int(seq_lens.max())
    if length == 0:
        return query.new_zeros(query.shape)
    blocks = -(-length // B)
    kv = _gather(kv_pool, block_table[:, :blocks].reshape(-1), row_scales).view(2, R, blocks * B, Hkv, D)
    kv = _dequantized(kv[:, :, :length], row_scales, query.dtype).transpose(2, 3)
    full = bool((seq_lens == length).all()) and bool((kv_visible_end == length).all())
    mask = None
    if not full:
        mask = visible_mask(seq_lens, kv_visible_end, length)
        mask[:, :, 0] |= ~mask.any(-1)  # a query that sees nothing: dummy key 0, zeroed below
        mask = mask.unsqueeze(1)
    attn = F.scaled_dot_product_attention(
        query.transpose(1, 2), kv[0], kv[1], attn_mask=mask, scale=scale, enable_gqa=Hq != Hkv
    ).transpose(1, 2)
    return attn.contiguous() if full else zero_padded_queries(attn, seq_lens, kv_visible_end)
