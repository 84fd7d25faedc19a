"""The reference kernel (pure torch, every device) and the helpers the vendor adapters share.

It is the oracle the other kernels are tested against. Attention gathers whole blocks of the row's
table (`index_select` on the block axis), measured faster than per-token gathers during the design, and
runs SDPA under a boolean mask built from `kv_visible_end` and `seq_lens`. On a device nothing here
reads a value on the host, so the same code is safe under CUDA graphs; on CPU tensors it reads lengths,
slots and block ids on the host (as numpy views, no torch op) to skip padding work and, where the
blocks or slots form ascending runs, to read and write the pool through views instead of gathers and
scatters (`HOST_LENGTHS_ON_CPU`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .fp8 import dequantize, quantize


#: On CPU tensors, read the lengths on the host and attend over the used span only (see
#: `_attend_used_span`). Tests turn it off to exercise the device path (full table, mask) on the CPU.
HOST_LENGTHS_ON_CPU = True

#: With host lengths, read and write ascending runs of blocks/slots through views of the pool
#: (`_span_view`, `_write_row_runs`). Benchmarks turn it off to time what a fragmented table costs.
VIEW_RUNS = True


def write_kv(kv_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
             row_scales: torch.Tensor | None = None) -> None:
    """Copy key/value ``[R, T, Hkv, D]`` into the pool's flat slots; tokens with slot -1 write nothing.

    FP8 pools: each token is quantized with its row's scales ``row_scales [2, R, Hkv]`` (ops/fp8.py).

    On a device, without a host sync: a -1 token is redirected to the first valid token of the call and
    writes that token's own row again (duplicates of identical values are harmless). If no token is
    valid, every token writes slot 0's current content back onto itself. On CPU tensors (as in `attend`,
    `HOST_LENGTHS_ON_CPU`) nothing is captured, so the slots are read on the host: when every token
    writes and each row's slots count up by one (a chunk written into consecutive blocks), each row is
    one slice copy (`_write_row_runs`, about 3x faster than `index_copy_` at DreamZero's sizes);
    otherwise the valid tokens are copied with `index_copy_`. No redirect, no blend with the old content.
    """
    _, N, B, H, D = kv_pool.shape
    # FP8 pools are moved as their bytes: index_copy_/where have no float8 kernels.
    flat = (kv_pool if row_scales is None else kv_pool.view(torch.uint8)).view(2, N * B, H, D)
    slots = slot_mapping.reshape(-1)
    keep = None  # device path: which tokens really write (the others write back what is there)
    if HOST_LENGTHS_ON_CPU and slots.device.type == "cpu":
        host = slot_mapping.numpy()
        if VIEW_RUNS and row_scales is None and _write_row_runs(flat, key, value, host):
            return
        valid = host.reshape(-1) >= 0
        src = None if bool(valid.all()) else torch.from_numpy(np.flatnonzero(valid))  # None: every token writes
        target = slots if src is None else slots.index_select(0, src)
    else:
        valid = slots >= 0
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


def _ascending_runs(ids: np.ndarray) -> bool:
    """Whether each row of ``ids [R, n]`` counts up by one: one ascending run of slots or blocks per row."""
    return ids.shape[1] < 2 or bool((np.diff(ids, axis=1) == 1).all())


def _write_row_runs(flat: torch.Tensor, key: torch.Tensor, value: torch.Tensor, host_slots: np.ndarray) -> bool:
    """CPU fast path of `write_kv`: if every token writes and each row's slots are one ascending run,
    copy each row into its slice of the flat pool ``[2, N*B, Hkv, D]`` and return True; else write nothing
    and return False (the caller scatters). Out-of-range slots also go to the caller, whose `index_copy_`
    raises on them."""
    R, T = host_slots.shape
    if not host_slots.size or host_slots.min() < 0 or host_slots.max() >= flat.shape[1] or not _ascending_runs(host_slots):
        return False
    for r in range(R):
        start = int(host_slots[r, 0])
        flat[0].narrow(0, start, T).copy_(key[r])
        flat[1].narrow(0, start, T).copy_(value[r])
    return True


def visible_mask(seq_lens: torch.Tensor, kv_visible_end: torch.Tensor, length: int,
                 kv_gap: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean ``[R, T, length]``: query (r, t) sees logical key p iff p < min(visible_end, seq_len) and p is
    not in the row's gap ``[kv_gap[r, 0], kv_gap[r, 1])``. `positions` (``[length]``) are the logical keys the
    columns stand for, ``arange(length)`` by default."""
    end = torch.minimum(kv_visible_end, seq_lens.view(-1, 1))
    p = torch.arange(length, device=end.device) if positions is None else positions
    mask = p < end.unsqueeze(-1)
    if kv_gap is not None:
        start, stop = kv_gap[:, 0].view(-1, 1, 1), kv_gap[:, 1].view(-1, 1, 1)
        mask &= (p < start) | (p >= stop)
    return mask


def visible_counts(seq_lens: torch.Tensor, kv_visible_end: torch.Tensor,
                   kv_gap: torch.Tensor | None = None) -> torch.Tensor:
    """``[R, T]``: how many keys each query sees (its visible prefix less the part of the gap inside it)."""
    end = torch.minimum(kv_visible_end, seq_lens.view(-1, 1)).clamp(min=0)
    if kv_gap is None:
        return end
    start, stop = kv_gap[:, :1], kv_gap[:, 1:]
    return end - (torch.minimum(stop, end) - torch.minimum(start, end)).clamp(min=0)


def zero_padded_queries(attn: torch.Tensor, seq_lens: torch.Tensor, kv_visible_end: torch.Tensor,
                        kv_gap: torch.Tensor | None = None) -> torch.Tensor:
    """Contiguous ``[R, T, Hq, D]`` copy of `attn` with exact zeros where a query sees no key (a query whose
    visible keys all lie in the row's gap included).

    Uses masked_fill, not a multiply, so NaN a vendor kernel may give a fully masked row never leaks.
    """
    empty = visible_counts(seq_lens, kv_visible_end, kv_gap) <= 0
    out = attn.new_empty(attn.shape)  # contiguous: the fake kernel promises these strides
    return out.copy_(attn).masked_fill_(empty[:, :, None, None], 0)


def _gather(kv_pool: torch.Tensor, block_ids: torch.Tensor, row_scales: torch.Tensor | None) -> torch.Tensor:
    """The blocks ``block_ids`` of both halves; FP8 pools gathered as bytes (index_select has no float8 kernel)."""
    if row_scales is None:
        return kv_pool.index_select(1, block_ids)
    return kv_pool.view(torch.uint8).index_select(1, block_ids).view(kv_pool.dtype)


def _span_view(kv_pool: torch.Tensor, ids: np.ndarray) -> torch.Tensor | None:
    """``[2, R, n*B, Hkv, D]``: the blocks ``ids [R, n]`` (host values) of both halves as a view of the pool,
    when each row's blocks are one ascending run and the rows' first blocks are evenly spaced (any step
    >= 0: DreamZero's scratch rows, a fresh pool's rows); None otherwise (the caller gathers).

    Why: `index_select` copies every used block out of the pool, on top of the write that put the new
    tokens there; dense attention copies its new K/V once. The view lets SDPA read the pool in place
    (same values in the same order, so the same result bit for bit). A busy pool hands out scattered
    blocks, and any row that is not one run takes the gather.
    """
    R, n = ids.shape
    _, N, B, H, D = kv_pool.shape
    if not kv_pool.is_contiguous() or ids.min() < 0 or ids.max() >= N or not _ascending_runs(ids):
        return None
    starts = ids[:, 0].astype(np.int64)
    step = int(starts[1] - starts[0]) if R > 1 else 0
    if step < 0 or not bool((np.diff(starts) == step).all()):
        return None
    block = B * H * D
    return kv_pool.as_strided((2, R, n * B, H, D), (N * block, step * block, H * D, D, 1),
                              kv_pool.storage_offset() + int(starts[0]) * block)


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
    kv_gap: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query [R, T, Hq, D]`` over each row's blocks; zeros for queries that see nothing.

    `visibility` is the vendor kernels' hint; this kernel computes any layout and ignores it. FP8
    pools are dequantized to the query's dtype with ``row_scales [2, R, Hkv]``. Keys in a row's
    ``kv_gap`` span are masked out.
    """
    R, T, Hq, D = query.shape
    _, _, B, Hkv, _ = kv_pool.shape
    if HOST_LENGTHS_ON_CPU and query.device.type == "cpu" and R:
        return _attend_used_span(query, kv_pool, block_table, seq_lens, kv_visible_end, scale, row_scales, kv_gap)
    M = block_table.shape[1]
    kv = _gather(kv_pool, block_table.reshape(-1), row_scales).view(2, R, M * B, Hkv, D)
    kv = _dequantized(kv, row_scales, query.dtype).transpose(2, 3)
    mask = visible_mask(seq_lens, kv_visible_end, M * B, kv_gap)
    # A query that sees nothing gets key 0 as a dummy (softmax stays finite); its output is zeroed below.
    mask[:, :, 0] |= ~mask.any(-1)
    attn = F.scaled_dot_product_attention(
        query.transpose(1, 2), kv[0], kv[1], attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=Hq != Hkv
    )
    return zero_padded_queries(attn.transpose(1, 2), seq_lens, kv_visible_end, kv_gap)


def skipped_blocks(gap: np.ndarray, seq: np.ndarray, block_size: int) -> tuple[int, int]:
    """``(lo, hi)``: the logical blocks ``[lo, hi)`` that lie wholly inside the gap of every row that holds
    keys (host values ``gap [R, 2]``, ``seq [R]``); ``(0, 0)`` when there is no such block. Rows of length 0
    see nothing and do not count."""
    used = seq > 0
    if not bool(used.any()):
        return 0, 0
    lo = int((-(-gap[used, 0] // block_size)).max())
    hi = int((gap[used, 1] // block_size).min())
    return (lo, hi) if hi > lo else (0, 0)


def _attend_used_span(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_visible_end: torch.Tensor,
    scale: float,
    row_scales: torch.Tensor | None = None,
    kv_gap: torch.Tensor | None = None,
) -> torch.Tensor:
    """CPU path: lengths are host values here, so gather only the blocks in use (or view them in place,
    `_span_view`), skip the blocks that lie wholly inside every row's gap (`skipped_blocks`: a window's
    evicted head, the blocks between a sink and its window), and drop the mask when every query sees its
    whole row less one gap shared by every row (DreamZero's window, `_attend_one_gap`) so SDPA can take its
    fused kernel.

    The padded table width and the all-rows mask are what fixed shapes cost on a device that must not
    read lengths; on the CPU nothing is captured and reading them is free.
    """
    R, T, Hq, D = query.shape
    _, _, B, Hkv, _ = kv_pool.shape
    seq = seq_lens.numpy()  # host values without a torch op: a few us instead of tens per read
    length = int(seq.max())
    if length == 0:
        return query.new_zeros(query.shape)
    blocks = -(-length // B)
    gap = None if kv_gap is None else kv_gap.numpy()
    full = bool((seq == length).all()) and bool((kv_visible_end.numpy() == length).all())
    if full and gap is not None and bool((gap == gap[:1]).all()):
        return _attend_one_gap(query, kv_pool, block_table, length, int(gap[0, 0]), int(gap[0, 1]), scale, row_scales)
    lo, hi = (0, 0) if gap is None else skipped_blocks(gap, seq, B)
    if hi > lo:  # the kept columns: logical blocks [0, lo) and [hi, blocks)
        table = torch.cat([block_table[:, :lo], block_table[:, hi:blocks]], 1)
        positions = torch.cat([torch.arange(lo * B), torch.arange(hi * B, length)])
    else:
        table, positions = block_table[:, :blocks], None
    kept = length - (hi - lo) * B
    if kept == 0:  # every row's keys lie in its gap
        return query.new_zeros(query.shape)
    kv = _dequantized(_blocks(kv_pool, table, row_scales)[:, :, :kept], row_scales, query.dtype).transpose(2, 3)
    full = full and gap is None
    mask = None
    if not full:
        mask = visible_mask(seq_lens, kv_visible_end, kept, kv_gap, positions)
        mask[:, :, 0] |= ~mask.any(-1)  # a query that sees nothing: dummy key 0, zeroed below
        mask = mask.unsqueeze(1)
    attn = F.scaled_dot_product_attention(
        query.transpose(1, 2), kv[0], kv[1], attn_mask=mask, scale=scale, enable_gqa=Hq != Hkv
    ).transpose(1, 2)
    return attn.contiguous() if full else zero_padded_queries(attn, seq_lens, kv_visible_end, kv_gap)


def _blocks(kv_pool: torch.Tensor, table: torch.Tensor, row_scales: torch.Tensor | None) -> torch.Tensor:
    """``[2, R, n*B, Hkv, D]``: the blocks ``table [R, n]`` of both halves, a view of the pool where `_span_view`
    finds one, else gathered."""
    _, _, B, Hkv, D = kv_pool.shape
    kv = _span_view(kv_pool, table.numpy()) if VIEW_RUNS else None
    if kv is None:
        kv = _gather(kv_pool, table.reshape(-1), row_scales).view(2, table.shape[0], table.shape[1] * B, Hkv, D)
    return kv


def _attend_one_gap(query: torch.Tensor, kv_pool: torch.Tensor, block_table: torch.Tensor, length: int,
                    start: int, stop: int, scale: float, row_scales: torch.Tensor | None) -> torch.Tensor:
    """Every row holds `length` keys, every query sees them all but one gap ``[start, stop)`` shared by all rows
    (DreamZero's window that starts inside a block, with or without a sink): read the keys before the gap and
    from its end on as slices of the blocks (a view where `_span_view` finds one: a window alone is then read
    in place, from inside its first block), without a mask, so SDPA takes its fused kernel."""
    B = kv_pool.shape[2]
    if start == stop:
        start = stop = 0
    pieces = []
    if start > 0:
        pieces.append(_blocks(kv_pool, block_table[:, : -(-start // B)], row_scales)[:, :, :start])
    if stop < length:
        first = stop // B
        kv = _blocks(kv_pool, block_table[:, first : -(-length // B)], row_scales)
        pieces.append(kv[:, :, stop - first * B : length - first * B])
    if not pieces:
        return query.new_zeros(query.shape)
    kv = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 2)
    kv = _dequantized(kv, row_scales, query.dtype).transpose(2, 3)
    return F.scaled_dot_product_attention(
        query.transpose(1, 2), kv[0], kv[1], scale=scale, enable_gqa=query.shape[2] != kv_pool.shape[3]
    ).transpose(1, 2).contiguous()
