"""Attention around a row's ``kv_gap`` for vendor kernels that see one prefix ``[0, seqused_k)`` of a table.

A row's visible keys are ``[0, g0)`` and ``[g1, seq)`` (each query's end aside). A paged vendor kernel reads a
prefix of a block table, so the row is cut into three spans, none of which needs a host value:

- before: ``[0, g0)``, the row's own table with length ``g0`` (its last block may be partial: kernels take that);
- head: ``[g1, c)`` with ``c = min(ceil(g1 / B) * B, seq)``, the rest of the block the gap ends in (at most B - 1
  keys), computed here in torch from that one block with each query's own end, so it is exact for any layout;
- after: ``[c, seq)``, through the table shifted left by ``ceil(g1 / B)`` blocks (a gather on the device), with
  length ``seq - c``; its blocks are whole pages, so a page-size rule (FA2's 256) is met as for the plain table.

The parts are merged by their log-sum-exp (`merge_by_lse`). A part's LSE counts only where this module knows the
query sees one of its keys: vendor kernels give +inf (flash-attn 2/3 on an empty row) or anything there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import _dequantized, _gather


@dataclass(frozen=True)
class GapSplit:
    """The three spans of each row (device tensors; ``[R]`` unless said)."""

    before_len: torch.Tensor  # int32: length of [0, g0) in the row's own table
    head_block: torch.Tensor  # int64: the block id holding key g1 (any valid id where the head is empty)
    head_first: torch.Tensor  # int64: logical position of that block's first key
    head_start: torch.Tensor  # int64: g1
    head_stop: torch.Tensor  # int64: c
    after_table: torch.Tensor  # int32 [R, M], contiguous: the table from block ceil(g1 / B) on (padded with its last)
    after_start: torch.Tensor  # int64: c's block boundary, ceil(g1 / B) * B
    after_len: torch.Tensor  # int32: max(seq - after_start, 0)


def split_around_gap(block_table: torch.Tensor, seq_lens: torch.Tensor, kv_gap: torch.Tensor,
                     block_size: int) -> GapSplit:
    R, M = block_table.shape
    B = block_size
    seq = seq_lens.to(torch.int64)
    start = torch.minimum(kv_gap[:, 0].to(torch.int64), seq)
    stop = torch.minimum(kv_gap[:, 1].to(torch.int64), seq)
    first_after = -(-stop // B)
    after_start = first_after * B
    columns = (first_after.view(-1, 1) + torch.arange(M, device=block_table.device)).clamp(max=M - 1)
    head_column = (stop // B).clamp(max=M - 1)
    return GapSplit(
        before_len=start.to(torch.int32),
        head_block=block_table.gather(1, head_column.view(-1, 1)).view(-1).to(torch.int64),
        head_first=(stop // B) * B,
        head_start=stop,
        head_stop=torch.minimum(after_start, seq),
        after_table=block_table.gather(1, columns).to(torch.int32).contiguous(),
        after_start=after_start,
        after_len=(seq - after_start).clamp(min=0).to(torch.int32),
    )


def query_ends(seq_lens: torch.Tensor, kv_visible_end: torch.Tensor) -> torch.Tensor:
    """``[R, T]`` int64: where each query's visible prefix ends, ``min(kv_visible_end, seq_len)`` (at least 0)."""
    return torch.minimum(kv_visible_end, seq_lens.view(-1, 1)).clamp(min=0).to(torch.int64)


def sees_before(split: GapSplit, ends: torch.Tensor) -> torch.Tensor:
    """``[R, T]``: the query sees a key of the before span."""
    return (split.before_len.view(-1, 1) > 0) & (ends > 0)


def sees_after(split: GapSplit, ends: torch.Tensor) -> torch.Tensor:
    """``[R, T]``: the query sees a key of the after span."""
    return ends > split.after_start.view(-1, 1)


def attend_head(query: torch.Tensor, kv_pool: torch.Tensor, split: GapSplit, ends: torch.Tensor, scale: float,
                row_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of every query over its row's head span in float32: ``(out [R, T, Hq, D], lse [R, T, Hq],
    seen [R, T])``; a query that sees none of the span has lse -inf and out 0."""
    R, T, Hq, D = query.shape
    _, _, B, Hkv, _ = kv_pool.shape
    kv = _dequantized(_gather(kv_pool, split.head_block, row_scales), row_scales, torch.float32).float()
    position = split.head_first.view(-1, 1) + torch.arange(B, device=query.device)  # [R, B]
    in_span = (position >= split.head_start.view(-1, 1)) & (position < split.head_stop.view(-1, 1))
    ok = in_span[:, None, :] & (position[:, None, :] < ends[:, :, None])  # [R, T, B]
    k, v = (half.repeat_interleave(Hq // Hkv, dim=2) for half in kv)  # [R, B, Hq, D]
    scores = torch.einsum("rthd,rbhd->rthb", query.float(), k) * scale
    scores = scores.masked_fill(~ok[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return torch.einsum("rthb,rbhd->rthd", probs, v), lse, ok.any(-1)


def merge_by_lse(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Merge attention parts ``(out [R, T, Hq, D], lse [R, T, Hq] natural log, seen [R, T])`` over disjoint key
    sets into the attention over their union, float32; zeros where no part is seen."""
    lses = [torch.where(seen[:, :, None], lse.float(), float("-inf")) for _, lse, seen in parts]
    top = torch.stack(lses).amax(0)
    top = torch.where(torch.isfinite(top), top, 0.0)
    total, weight = None, None
    for (out, _, seen), lse in zip(parts, lses):
        w = torch.exp(lse - top)  # 0 where the part is not seen
        term = w[..., None] * torch.where(seen[:, :, None, None], out.float(), 0.0)
        total = term if total is None else total + term
        weight = w if weight is None else weight + w
    return total / torch.where(weight > 0, weight, 1.0)[..., None]
