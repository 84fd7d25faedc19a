"""Random inputs for the paged_kv ops, built from a logical (dense) layout, and the dense oracle.

A case starts from each row's logical K/V ``[seq_len, Hkv, D]``: the history part is scattered into a
pool full of garbage through a shuffled block table, the new part is passed as key/value at the row's
valid tokens (slot -1 elsewhere). The oracle never looks at the pool: it runs dense SDPA with an
explicit boolean mask over the logical K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Case:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    pool: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    kv_visible_end: torch.Tensor
    scale: float
    k_logical: list[torch.Tensor]
    v_logical: list[torch.Tensor]
    kv_gap: torch.Tensor | None = None  # int32 [R, 2]: the keys [start, end) each row hides

    def args(self, pool: torch.Tensor | None = None) -> tuple:
        """Positional args of write_attend (without scale/kernel), on `pool` or the case's own pool."""
        return (self.query, self.key, self.value, self.pool if pool is None else pool,
                self.slot_mapping, self.block_table, self.seq_lens, self.kv_visible_end)


def _layout_view(shape: tuple[int, ...], layout: str, dtype, gen) -> torch.Tensor:
    """A tensor of `shape` that is contiguous, a transpose of another layout, or a slice of a wider one."""
    R, T, H, D = shape
    if layout == "transposed":
        return torch.randn(R, H, T, D, generator=gen, dtype=dtype).transpose(1, 2)
    if layout == "sliced":
        return torch.randn(R, T, H + 1, D + 3, generator=gen, dtype=dtype)[:, :, 1:, 2 : 2 + D]
    return torch.randn(shape, generator=gen, dtype=dtype)


def strided_view(t: torch.Tensor, filler: int, transposed: bool = False) -> torch.Tensor:
    """Equal values in a non-contiguous view: every other element of the last dim of a wider tensor,
    whose gaps hold `filler` (a kernel that assumes unit strides reads the filler); for a 2-D tensor
    `transposed` also swaps the row/column strides (column-major storage)."""
    if transposed and t.dim() == 2:
        return strided_view(t.t().contiguous(), filler).t()
    wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), filler, dtype=t.dtype, device=t.device)
    view = wide[..., ::2]
    view.copy_(t)
    return view


def make_case(
    *,
    seed: int,
    hkv: int = 2,
    ratio: int = 2,
    head_dim: int = 8,
    block_size: int = 4,
    tokens: int = 4,
    prefixes: list[int],
    new_counts: list[int],
    modes: list[str],
    right_aligned: bool = False,
    extra_width: int = 1,
    pad_random: bool = True,
    layout: str = "contiguous",
    dtype: torch.dtype = torch.float32,
    meta_layout: str = "contiguous",
    ascending_blocks: bool = False,
    gaps: list[tuple[int, int]] | None = None,
) -> Case:
    """One geometry. Row r has prefixes[r] history tokens and new_counts[r] new ones (<= tokens).

    modes[r]: "full" (valid queries see the whole row), "causal" (query of position p sees [0, p+1)),
    "random" (any end in [0, seq_len]) or "padded" (a padded row: seq_len 0, no tokens).
    right_aligned puts the valid tokens last (padding first), as bottom-right causal kernels assume.
    meta_layout "strided" passes the four metadata tensors as non-contiguous views (see strided_view),
    "transposed" also stores the 2-D ones column-major.
    ascending_blocks hands out blocks in order (row 0 gets 0, 1, ..., row 1 the next ones), as a fresh
    pool does; by default they are shuffled, as in a busy pool.
    gaps[r] = (start, end) hides row r's keys [start, end) (the op's kv_gap), clipped to the row's length.
    """
    gen = torch.Generator().manual_seed(seed)
    R, T, B, D, Hq = len(prefixes), tokens, block_size, head_dim, hkv * ratio
    seq = [0 if m == "padded" else h + n for h, n, m in zip(prefixes, new_counts, modes)]
    needed = [-(-s // B) for s in seq]
    M = max(needed + [1]) + extra_width
    N = sum(needed) + 3  # two spare blocks and the pad block N-1
    perm = list(range(N - 1)) if ascending_blocks else torch.randperm(N - 1, generator=gen).tolist()
    table = torch.full((R, M), N - 1, dtype=torch.int32)
    if pad_random:  # pad entries may be any valid id, including other rows' blocks
        table = torch.randint(0, N, (R, M), generator=gen, dtype=torch.int32)
    for r, n in enumerate(needed):
        table[r, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]

    pool = torch.randn(2, N, B, hkv, D, generator=gen, dtype=dtype)
    flat = pool.view(2, N * B, hkv, D)
    key = _layout_view((R, T, hkv, D), layout, dtype, gen)
    value = _layout_view((R, T, hkv, D), layout, dtype, gen)
    slots = torch.full((R, T), -1, dtype=torch.int64)
    ends = torch.zeros((R, T), dtype=torch.int32)
    k_log, v_log = [], []
    for r in range(R):
        kl = torch.randn(seq[r], hkv, D, generator=gen, dtype=dtype)
        vl = torch.randn(seq[r], hkv, D, generator=gen, dtype=dtype)
        k_log.append(kl)
        v_log.append(vl)
        n = seq[r] - (0 if modes[r] == "padded" else prefixes[r])
        h = seq[r] - n
        slot_of = lambda p: int(table[r, p // B]) * B + p % B  # noqa: E731
        for p in range(h):
            flat[0, slot_of(p)] = kl[p]
            flat[1, slot_of(p)] = vl[p]
        picks = list(range(T - n, T)) if right_aligned else sorted(torch.randperm(T, generator=gen)[:n].tolist())
        for j, t in enumerate(picks):
            p = h + j
            slots[r, t] = slot_of(p)
            key[r, t] = kl[p]
            value[r, t] = vl[p]
            if modes[r] == "full":
                ends[r, t] = seq[r]
            elif modes[r] == "causal":
                ends[r, t] = p + 1
            else:
                ends[r, t] = int(torch.randint(0, seq[r] + 1, (), generator=gen))
    query = _layout_view((R, T, Hq, D), layout, dtype, gen)
    scale = float(torch.empty(()).uniform_(0.1, 1.0, generator=gen))
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    if meta_layout != "contiguous":
        # Fillers a stride-blind kernel would read: a spare block of garbage, "do not write", a length of 0
        # and an end that sees everything -- each changes the result or the pool.
        col_major = meta_layout == "transposed"
        other = int(perm[0])  # perm still holds the two spare blocks
        slots = strided_view(slots, -1, col_major)
        table = strided_view(table, other, col_major)
        seq_lens = strided_view(seq_lens, 0)
        ends = strided_view(ends, M * B, col_major)
    kv_gap = None
    if gaps is not None:
        clipped = [(min(a, b, s), min(b, s)) for (a, b), s in zip(gaps, seq)]
        kv_gap = torch.tensor(clipped, dtype=torch.int32).view(R, 2)
    return Case(query, key, value, pool, slots, table, seq_lens, ends, scale, k_log, v_log, kv_gap)


def dense_oracle(case: Case) -> torch.Tensor:
    """Dense SDPA over the logical K/V with an explicit mask, fp32; zeros where a query sees nothing."""
    R, T, Hq, D = case.query.shape
    hkv = case.k_logical[0].shape[1] if case.k_logical else case.key.shape[2]
    L = max([k.shape[0] for k in case.k_logical] + [1])
    k = torch.zeros(R, L, hkv, D)
    v = torch.zeros(R, L, hkv, D)
    for r, (kl, vl) in enumerate(zip(case.k_logical, case.v_logical)):
        k[r, : kl.shape[0]] = kl.float()
        v[r, : vl.shape[0]] = vl.float()
    rep = Hq // hkv
    k = k.repeat_interleave(rep, dim=2).transpose(1, 2)
    v = v.repeat_interleave(rep, dim=2).transpose(1, 2)
    end = torch.minimum(case.kv_visible_end, case.seq_lens.view(-1, 1))
    mask = torch.arange(L) < end.unsqueeze(-1)  # [R, T, L]
    if case.kv_gap is not None:
        for r, (start, stop) in enumerate(case.kv_gap.tolist()):
            mask[r, :, start:stop] = False
    seen = mask.any(-1)
    mask[:, :, 0] |= ~seen  # a dummy key for queries that see nothing (zeroed below): no NaN from SDPA
    out = F.scaled_dot_product_attention(
        case.query.float().transpose(1, 2), k, v, attn_mask=mask.unsqueeze(1), scale=case.scale
    ).transpose(1, 2)
    return torch.where(seen[:, :, None, None], out, torch.zeros(()))


def expected_pool(case: Case, before: torch.Tensor) -> torch.Tensor:
    """`before` with exactly the valid tokens' key/value written at their slots."""
    _, N, B, H, D = before.shape
    want = before.clone()
    flat = want.view(2, N * B, H, D)
    for r, t in (case.slot_mapping >= 0).nonzero().tolist():
        flat[0, case.slot_mapping[r, t]] = case.key[r, t]
        flat[1, case.slot_mapping[r, t]] = case.value[r, t]
    return want


def fp8_case(case: Case, dtype: torch.dtype, seed: int = 0, low: float = 0.004, high: float = 0.02) -> tuple:
    """The case on an FP8 pool: ``(pool, kv_scales, oracle_case)``.

    Every block gets a random scale per (K/V, kv head) in [low, high] (the defaults saturate the tails of
    randn values: |x| > 448 * scale); each row's blocks share its first block's scales, as a layer's
    blocks do (KVPool.set_scales). The pool holds the case's history quantized with those scales. The
    oracle case carries the quantize-dequantize round trip of every logical K/V: dense attention over
    it is the exact oracle of the FP8 path.
    """
    from paged_kv_compile.ops.fp8 import dequantize, quantize

    gen = torch.Generator().manual_seed(seed)
    _, N, B, H, D = case.pool.shape
    scales = torch.empty(2, N, H).uniform_(low, high, generator=gen)
    rows = []
    for r, kl in enumerate(case.k_logical):
        used = case.block_table[r, : max(-(-kl.shape[0] // B), 1)].long()
        scales[:, used] = scales[:, used[:1]]
        rows.append(scales[:, int(case.block_table[r, 0])])
    pool = quantize(case.pool, scales[:, :, None, :, None], dtype)

    def round_trip(x, s):
        return dequantize(quantize(x, s, dtype), s, torch.float32)

    oracle = Case(**{**case.__dict__})
    oracle.k_logical = [round_trip(k, s[0][:, None]) for k, s in zip(case.k_logical, rows)]
    oracle.v_logical = [round_trip(v, s[1][:, None]) for v, s in zip(case.v_logical, rows)]
    return pool, scales, oracle


def expected_fp8_pool(case: Case, before: torch.Tensor, kv_scales: torch.Tensor) -> torch.Tensor:
    """`before` with exactly the valid tokens' key/value written, quantized with their row's scales."""
    from paged_kv_compile.ops.fp8 import quantize

    _, N, B, H, D = before.shape
    want = before.clone()
    flat = want.view(2, N * B, H, D)
    for r, t in (case.slot_mapping >= 0).nonzero().tolist():
        s = kv_scales[:, int(case.block_table[r, 0])]
        flat[0, case.slot_mapping[r, t]] = quantize(case.key[r, t], s[0][:, None], before.dtype)
        flat[1, case.slot_mapping[r, t]] = quantize(case.value[r, t], s[1][:, None], before.dtype)
    return want
