"""The fused Triton kernels: a slot store for the new K/V, and paged attention with online softmax.

Attention runs one program per (row, query tile, kv head). A program holds the tile's queries of all
query heads that share the kv head (GQA: head h reads kv head h // (Hq // Hkv)), so each K/V tile is
loaded once per group. It walks the row's logical keys in tiles of BLOCK_N positions, each position
resolved through the block table (any block size works), up to the largest visible end in the tile.
A row's gap (``kv_gap``) is masked out, and the tiles that lie wholly in it are never loaded: the walk
runs in two loops, up to the gap's start and from the tile holding its end.
Queries that see nothing keep a zero accumulator and store exact zeros. No value is read on the host.
Dots use input_precision="ieee": fp32 pools then match the reference to 1e-5 instead of TF32's 1e-3;
it changes nothing for fp16/bf16 operands. FP8 pools (HAS_SCALES): the store quantizes with the row's
scales exactly as ops/fp8.py does (float32 division, saturation, cast); attention dequantizes each
loaded tile to the query's dtype (float32 product) before the dots.

Imported only when kernel="triton" is selected. On CPU it needs TRITON_INTERPRET=1 before this
module is first imported (the interpreter is chosen when the kernels are decorated).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..errors import KernelUnavailableError


@triton.jit
def _to_fp8_grid(x, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """float32 `x` (already saturated) rounded to nearest-even on the FP8 grid (MBITS mantissa bits, EMIN
    the smallest normal exponent), so the cast that follows is exact. The cast alone is not enough:
    Triton's interpreter rounds 31.49 to 16 in float8_e4m3fn (a lost mantissa carry)."""
    e = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
    quantum = ((e - MBITS + 127) << 23).to(tl.float32, bitcast=True)  # 2 ** (e - MBITS), exact
    y = x / quantum  # exact: a power of two; |y| < 2 ** (MBITS + 1)
    return ((y + 12582912.0) - 12582912.0) * quantum  # 1.5 * 2**23: float32 addition rounds y to an integer


@triton.jit
def _store_kv_kernel(
    K, V, Pool, Slots, Scales,
    T, half_stride, slot_stride, pool_h_stride,
    s_kr, s_kt, s_kh, s_kd,
    s_vr, s_vt, s_vh, s_vd,
    s_sr, s_st, s_c2, s_cr,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SCALES: tl.constexpr, FP8_MAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
):
    token = tl.program_id(0)
    r = (token // T).to(tl.int64)
    t = (token % T).to(tl.int64)
    slot = tl.load(Slots + r * s_sr + t * s_st)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # The slot test is broadcast to the tile before it joins the mask: triton >= 3.9's interpreter
    # rejects a mask that combines a block of booleans with a loaded scalar's comparison.
    keep = (h * 0 + slot) >= 0
    mask = (h < H) & (d < D) & keep
    dst = Pool + slot * slot_stride + h * pool_h_stride + d
    k = tl.load(K + r * s_kr + t * s_kt + h * s_kh + d * s_kd, mask=mask)
    v = tl.load(V + r * s_vr + t * s_vt + h * s_vh + d * s_vd, mask=mask)
    if HAS_SCALES:  # Scales: the rows' scales [2, R, Hkv], unit stride over heads
        ks = tl.load(Scales + r * s_cr + h, mask=h < H, other=1.0)
        vs = tl.load(Scales + s_c2 + r * s_cr + h, mask=h < H, other=1.0)
        k = _to_fp8_grid(tl.clamp(tl.div_rn(k.to(tl.float32), ks), -FP8_MAX, FP8_MAX), MBITS, EMIN)
        v = _to_fp8_grid(tl.clamp(tl.div_rn(v.to(tl.float32), vs), -FP8_MAX, FP8_MAX), MBITS, EMIN)
    tl.store(dst, k.to(Pool.dtype.element_ty), mask=mask)
    tl.store(dst + half_stride, v.to(Pool.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, start, kv_end, end, gap_lo, gap_hi, r, kvh, d, d_ok, k_scale, v_scale, scale,
    Pool, Table, half_stride, slot_stride, pool_h_stride, s_tr, s_tm,
    B: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SCALES: tl.constexpr,
):
    """One online-softmax step over the logical keys [start, start + BLOCK_N) of row r."""
    p = start + tl.arange(0, BLOCK_N)
    p_ok = p < kv_end
    block = tl.load(Table + r * s_tr + (p // B) * s_tm, mask=p_ok, other=0).to(tl.int64)
    addr = (block * B + p % B)[:, None] * slot_stride + kvh * pool_h_stride + d[None, :]
    kv_mask = p_ok[:, None] & d_ok[None, :]
    k = tl.load(Pool + addr, mask=kv_mask, other=0.0)
    if HAS_SCALES:
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    seen = (p[None, :] < end[:, None]) & ((p[None, :] < gap_lo) | (p[None, :] >= gap_hi))
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
    alpha = tl.exp(m_i - m_safe)
    probs = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(probs, 1)
    v = tl.load(Pool + half_stride + addr, mask=kv_mask, other=0.0)
    if HAS_SCALES:
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _attend_kernel(
    Q, Pool, Out, Table, SeqLens, VisEnd, Scales, Gap, scale,
    T, M, half_stride, slot_stride, pool_h_stride,
    s_qr, s_qt, s_qh, s_qd,
    s_or, s_ot, s_oh,
    s_tr, s_tm, s_seq, s_vr, s_vt, s_c2, s_cr, s_gr, s_gc,
    B: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SCALES: tl.constexpr,
    HAS_GAP: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_T * G_PAD
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    tiles = tl.cdiv(T, BLOCK_T)
    r = (pid // tiles).to(tl.int64)
    i = tl.arange(0, BLOCK_M)
    t = (pid % tiles) * BLOCK_T + i // G_PAD
    g = i % G_PAD
    h = kvh * G + g
    row_ok = (t < T) & (g < G)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    q = tl.load(Q + r * s_qr + t[:, None] * s_qt + h[:, None] * s_qh + d[None, :] * s_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    seq = tl.load(SeqLens + r * s_seq)
    end = tl.load(VisEnd + r * s_vr + t * s_vt, mask=row_ok, other=0)
    end = tl.minimum(end, seq)
    kv_end = tl.minimum(tl.max(end, 0), M * B)
    k_scale = 1.0
    v_scale = 1.0
    if HAS_SCALES:
        k_scale = tl.load(Scales + r * s_cr + kvh)
        v_scale = tl.load(Scales + s_c2 + r * s_cr + kvh)
    gap_lo = 0
    gap_hi = 0
    if HAS_GAP:
        gap_lo = tl.load(Gap + r * s_gr)
        gap_hi = tl.load(Gap + r * s_gr + s_gc)
    # Two walks: the tiles up to the gap's start, then from the tile holding its end; the tiles between lie
    # wholly in the gap (or past every visible end) and are skipped. Without a gap the first walk is empty.
    stop_1 = tl.minimum(gap_lo, kv_end)
    start_2 = tl.maximum((gap_hi // BLOCK_N) * BLOCK_N, tl.cdiv(stop_1, BLOCK_N) * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, stop_1, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, start, kv_end, end, gap_lo, gap_hi, r, kvh, d, d_ok,
                                     k_scale, v_scale, scale, Pool, Table, half_stride, slot_stride, pool_h_stride,
                                     s_tr, s_tm, B, BLOCK_N, HAS_SCALES)
    for start in range(start_2, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, start, kv_end, end, gap_lo, gap_hi, r, kvh, d, d_ok,
                                     k_scale, v_scale, scale, Pool, Table, half_stride, slot_stride, pool_h_stride,
                                     s_tr, s_tm, B, BLOCK_N, HAS_SCALES)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + r * s_or + t[:, None] * s_ot + h[:, None] * s_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not isinstance(_attend_kernel, InterpretedFunction):
        raise KernelUnavailableError(
            "kernel='triton' on CPU tensors needs TRITON_INTERPRET=1 set before paged_kv_compile.ops.triton_kernel "
            "is first imported; set it at process start or use kernel='reference'"
        )


#: (mantissa bits, smallest normal exponent) of the FP8 formats, for _to_fp8_grid.
_FP8_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


def _scales_args(kv_pool: torch.Tensor, row_scales: torch.Tensor | None) -> tuple:
    """(scales tensor, its half and row strides, HAS_SCALES, FP8_MAX, MBITS, EMIN); a dummy pointer when unscaled."""
    if row_scales is None:
        return kv_pool, 0, 0, False, 0.0, 0, 0
    row_scales = row_scales.contiguous()
    return (row_scales, row_scales.stride(0), row_scales.stride(1), True, torch.finfo(kv_pool.dtype).max,
            *_FP8_GRID[kv_pool.dtype])


def write_kv(kv_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
             row_scales: torch.Tensor | None = None) -> None:
    """Store key/value ``[R, T, Hkv, D]`` at their slots (any strides); slot -1 stores nothing.

    FP8 pools: quantized with the rows' scales ``row_scales [2, R, Hkv]``.
    """
    _check_device(kv_pool)
    R, T, H, D = key.shape
    if R * T == 0:
        return
    s = kv_pool.stride()
    scales, c2, cr, has_scales, fp8_max, mbits, emin = _scales_args(kv_pool, row_scales)
    _store_kv_kernel[(R * T,)](
        key, value, kv_pool, slot_mapping, scales,
        T, s[0], s[2], s[3],
        *key.stride(), *value.stride(), *slot_mapping.stride(), c2, cr,
        H=H, D=D, BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D),
        HAS_SCALES=has_scales, FP8_MAX=fp8_max, MBITS=mbits, EMIN=emin,
    )


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
    """Paged attention of ``query [R, T, Hq, D]``; returns a contiguous ``[R, T, Hq, D]`` tensor.

    Any visibility layout is computed from ``kv_visible_end``; the `visibility` hint is ignored.
    FP8 pools are dequantized with ``row_scales [2, R, Hkv]``; keys in a row's ``kv_gap`` are hidden.
    """
    _check_device(query)
    R, T, Hq, D = query.shape
    _, _, B, Hkv, _ = kv_pool.shape
    out = query.new_empty(query.shape)
    if out.numel() == 0:
        return out
    G = Hq // Hkv
    G_PAD = triton.next_power_of_2(G)
    # tl.dot wants tiles of at least 16 rows/cols on GPUs; a tile holds BLOCK_T tokens x G_PAD heads.
    BLOCK_T = max(min(triton.next_power_of_2(T), 64 // G_PAD), 16 // G_PAD, 1)
    s = kv_pool.stride()
    grid = (R * triton.cdiv(T, BLOCK_T), Hkv)
    scales, c2, cr, has_scales, *_ = _scales_args(kv_pool, row_scales)
    gap = block_table if kv_gap is None else kv_gap  # a dummy pointer when there is no gap
    _attend_kernel[grid](
        query, kv_pool, out, block_table, seq_lens, kv_visible_end, scales, gap, scale,
        T, block_table.shape[1], s[0], s[2], s[3],
        *query.stride(), *out.stride()[:3],
        *block_table.stride(), *seq_lens.stride(), *kv_visible_end.stride(), c2, cr,
        *((0, 0) if kv_gap is None else kv_gap.stride()),
        B=B, G=G, G_PAD=G_PAD, D=D, BLOCK_T=BLOCK_T, BLOCK_N=32,
        BLOCK_D=max(16, triton.next_power_of_2(D)), HAS_SCALES=has_scales, HAS_GAP=kv_gap is not None,
    )
    return out
