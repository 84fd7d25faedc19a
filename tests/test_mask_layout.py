"""The prefill mask read from O(S) counts (`layout.layout_from_prefill_mask`) decides exactly as the full
(S, S) comparison it replaced: same layouts, same refusals, same first offending query and key.

The oracle is the previous implementation (`_oracle_allowed`, `_oracle_layout`), with the three-way value rule:
an additive entry attends iff it is 0 (or -0.0), is masked iff it is at most `layout.MASKED_AT` (-inf, every
finfo.min, -1e4, -1e9), and is refused otherwise (a bias, +inf, NaN of either sign; it used to read as attended,
so a -1e4 causal mask paged as bidirectional). Masks are drawn from a seeded generator: pageable layouts (left,
middle, right padding, pads seeing themselves or nothing, causal pads, bidirectional spans) and the same with a
few entries flipped (windows, gaps, padding that real tokens see), in boolean and additive form (bf16, fp16, fp32;
finfo.min or another masked value; now and then a -0.0 or a refused value), per row or broadcast (1, ...). The
block size is shrunk so that one mask spans many blocks, some on the integer path and some on the exact
classification (`layout._attends`).
"""

from __future__ import annotations

import random

import pytest
import torch

from paged_kv_compile import RequestError, layout
from paged_kv_compile.layout import RowLayout, layout_from_prefill_mask, mask_disagreement, mask_rows


def _oracle_allowed(mask: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(allowed, ambiguous, values) per row: an additive entry attends iff it is 0, is masked iff it is at most
    MASKED_AT (-inf included), and is ambiguous otherwise (a bias, +inf, NaN): refused wherever it is read."""
    if mask.dim() == 4:
        if mask.shape[1] != 1:
            raise RequestError(f"the attention mask has {mask.shape[1]} head rows; one (broadcast over heads) is needed")
        mask = mask[:, 0]
    if mask.dim() != 3:
        raise RequestError(f"the attention mask must be (rows, 1, queries, keys), got shape {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        allowed, ambiguous = mask, torch.zeros_like(mask)
    else:
        allowed = mask == 0
        ambiguous = ~allowed & ~(mask <= layout.MASKED_AT)
    if allowed.shape[0] not in (1, rows):
        raise RequestError(f"the attention mask has {allowed.shape[0]} rows but the request has {rows} CFG rows")
    expand = lambda t: t.expand(rows, *t.shape[1:]).to("cpu")  # noqa: E731
    return expand(allowed), expand(ambiguous), expand(mask.float() if mask.dtype != torch.bool else mask)


def _first_ambiguous(ambiguous: torch.Tensor, values: torch.Tensor, row: int | None = None):
    """The error the readers raise for the first (row-major) ambiguous entry, or None."""
    bad = ambiguous.nonzero()
    if not len(bad):
        return None
    q, k = (int(i) for i in bad[0])
    return layout.AmbiguousMaskValue(q, k, float(values[q, k]), row)


def _oracle_layout(allowed: torch.Tensor, row: int = 0, ambiguous: torch.Tensor | None = None,
                   values: torch.Tensor | None = None):
    S = allowed.shape[-1]
    if allowed.shape != (S, S):
        raise RequestError(f"a prefill mask must be square (queries = keys), got {tuple(allowed.shape)}")
    if ambiguous is not None and (err := _first_ambiguous(ambiguous, values, row)) is not None:
        raise err
    diag = torch.arange(S)
    on_diag = allowed[diag, diag].to(torch.int32)
    sees = allowed.view(torch.uint8).sum(1, dtype=torch.int32)
    seen_by_others = allowed.view(torch.uint8).sum(0, dtype=torch.int32) - on_diag
    pad = (seen_by_others == 0) & (sees - on_diag == 0)
    a = allowed
    if bool(pad.any()):
        a = allowed.clone()
        a[pad] = False
        a[:, pad] = False
        sees = a.view(torch.uint8).sum(1, dtype=torch.int32)
    kept = a.any(0)
    positions = torch.where(kept, torch.cumsum(kept, 0) - 1, torch.full((S,), -1))
    ends = sees.to(torch.int64)
    expect = kept[None, :] & (positions[None, :] < ends[:, None])
    if not torch.equal(a, expect):
        q, c = (int(i) for i in (a != expect).nonzero()[0])
        raise RequestError(
            f"row {row}: dense query {q} {'sees' if bool(a[q, c]) else 'does not see'} key {c}, but the paged op "
            f"gives each query the first n kept tokens of its row, in order (query {q} sees {int(ends[q])}): this "
            "mask (a window, a gap, or padding that real tokens see) cannot be paged; run this request densely"
        )
    ends_by_position = ends[kept]
    return positions, ends.to(torch.int64), ends_by_position.to(torch.int32)


def _pageable(rng: random.Random, S: int) -> torch.Tensor:
    """A boolean (S, S) mask the paged op can express: kept tokens causal with bidirectional spans, pads
    (seeing themselves or nothing) at the left, in the middle or at the right, or causal pads at the end."""
    style = rng.choice(["left", "middle", "right", "causal-right", "none", "scattered"])
    n_pad = rng.randrange(0, S // 2 + 1) if style != "none" else 0
    cut = rng.randrange(0, S - n_pad + 1)
    pads = {"left": range(n_pad), "middle": range(cut, cut + n_pad), "right": range(S - n_pad, S),
            "causal-right": range(0), "none": range(0), "scattered": rng.sample(range(S), n_pad)}[style]
    pad = torch.zeros(S, dtype=torch.bool)
    pad[list(pads)] = True
    kept = (~pad).nonzero().flatten().tolist()
    ends = list(range(1, len(kept) + 1))
    i = 0
    while i < len(kept):  # bidirectional spans
        if rng.random() < 0.2:
            j = min(len(kept), i + rng.randrange(2, 6))
            ends[i:j] = [j] * (j - i)
            i = j
        else:
            i += 1
    m = torch.zeros(S, S, dtype=torch.bool)
    for q, e in zip(kept, ends):
        m[q, kept[:e]] = True
    self_seeing = rng.random() < 0.5
    for p in pads:
        m[p, p] = self_seeing if rng.random() < 0.9 else not self_seeing
    return m


def _perturbed(rng: random.Random, m: torch.Tensor) -> torch.Tensor:
    m = m.clone()
    S = m.shape[0]
    kind = rng.choice(["flip", "flip", "window", "gap", "pad-seen", "random"])
    if kind == "flip":
        for _ in range(rng.randrange(1, 4)):
            q, c = rng.randrange(S), rng.randrange(S)
            m[q, c] = ~m[q, c]
    elif kind == "window":  # sliding window: a query stops seeing the first keys
        q = rng.randrange(S)
        m[q, : rng.randrange(1, S + 1)] = False
    elif kind == "gap":
        c = rng.randrange(S)
        m[rng.randrange(S) :, c] = False
    elif kind == "pad-seen":
        m[rng.randrange(S), rng.randrange(S)] = True
    else:
        m = torch.rand(S, S, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) < rng.random()
    return m


#: Additive values that read as masked (every conventional "lowest value", in any float dtype) and as attended.
_MASKED_VALUES = [float("-inf"), layout.MASKED_AT, -1e4, -1e9, torch.finfo(torch.bfloat16).min]
_ODD_VALUES = [-0.0, -1.0, -8000.0, 3.0, float("inf"), float("nan"), "negative-nan"]  # -0.0 attends; the rest refused


def _encoded(rng: random.Random, allowed: torch.Tensor) -> torch.Tensor:
    """`allowed` as the model would pass it: boolean, or additive in a random float dtype with finfo.min or
    another masked value, sometimes with values that are neither 0 nor masked (a bias, +inf, NaN of either sign:
    refused wherever a reader reads them) or a -0.0 (attends)."""
    dtype = rng.choice([torch.bool, torch.bfloat16, torch.bfloat16, torch.float16, torch.float32])
    if dtype == torch.bool:
        return allowed
    low = torch.finfo(dtype).min if rng.random() < 0.6 else rng.choice(_MASKED_VALUES)
    low = max(low, float("-inf") if low == float("-inf") else torch.finfo(dtype).min)  # fp16 holds no -1e9
    m = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, low)
    if rng.random() < 0.3:
        odd = torch.rand(allowed.shape, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) < 0.05
        value = rng.choice(_ODD_VALUES)
        where = odd & (allowed if rng.random() < 0.5 else ~allowed)
        if rng.random() < 0.2:
            where = odd  # anywhere
        if value == "negative-nan":
            m[where] = _negative_nan(dtype)
        else:
            m = m.masked_fill(where, value)
    return m


def _negative_nan(dtype: torch.dtype) -> torch.Tensor:
    """A NaN with the sign bit set (its integer view lies between view(-inf) and 0)."""
    itype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty((), dtype=dtype).element_size()]
    nan = torch.tensor(float("nan"), dtype=dtype).view(itype) | torch.tensor(1, dtype=itype) << (torch.iinfo(itype).bits - 1)
    out = nan.view(dtype)
    assert out.isnan() and out.view(itype) < 0
    return out


def _outcome(fn):
    try:
        return fn()
    except RequestError as e:
        return f"RequestError: {e}"


def _compare(mask: torch.Tensor, rows: int) -> tuple[int, int]:
    """Both readers of every row of `mask` agree; returns (accepted, refused) rows."""
    expected = _outcome(lambda: _oracle_allowed(mask, rows))
    got = _outcome(lambda: mask_rows(mask, rows))
    if isinstance(expected, str):
        assert got == expected
        return 0, 1
    accepted = refused = 0
    allowed, ambiguous, values = expected
    for r in range(rows):
        want = _outcome(lambda: _oracle_layout(allowed[r], r, ambiguous[r], values[r]))
        have = _outcome(lambda: layout_from_prefill_mask(got[r], r))
        if isinstance(want, str):
            assert have == want, (r, mask)
            refused += 1
            continue
        assert not isinstance(have, str), (have, mask)
        for w, h in zip(want, (have.positions, have.visible_end, have.ends_by_position)):
            assert h.dtype == w.dtype and torch.equal(h, w), (r, w, h, mask)
        assert have.kept == len(want[2])
        accepted += 1
    return accepted, refused


def _prefill_masks(rng: random.Random, n: int):
    """`n` random (mask, rows): per row or broadcast, pageable or perturbed, boolean or additive."""
    for _ in range(n):
        S = rng.randrange(1, 20)
        rows = rng.choice([1, 2])
        broadcast = rows == 2 and rng.random() < 0.3
        per_row = []
        for _ in range(1 if broadcast else rows):
            m = _pageable(rng, S)
            per_row.append(_perturbed(rng, m) if rng.random() < 0.4 else m)
        mask = _encoded(rng, torch.stack(per_row))
        yield (mask[:, None] if rng.random() < 0.7 else mask), rows  # (rows, 1, S, S): as the model passes it


@pytest.mark.parametrize("block", [1 << 19, 7, 1])
def test_mask_read_matches_full_comparison(monkeypatch, block):
    """Random masks, per row and broadcast, boolean and additive: identical layouts and refusals (message
    included) to the full comparison, with the mask read in one block or in blocks of one query row."""
    monkeypatch.setattr(layout, "_BLOCK_ELEMENTS", block)
    accepted = refused = 0
    for mask, rows in _prefill_masks(random.Random(1234 + block), 300):
        a, r = _compare(mask, rows)
        accepted, refused = accepted + a, refused + r
    assert accepted > 150 and refused > 80  # both paths exercised


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_mask_read_matches_full_comparison():
    """A mask on the device is reduced there (`layout._attend_counts`): the same layouts and refusals."""
    for mask, rows in _prefill_masks(random.Random(7), 100):
        _compare(mask.to("cuda"), rows)


def test_mask_read_shape_errors_match():
    """Shape errors come first and read the same (head rows, rank, row count, non-square)."""
    for mask, rows in [(torch.ones(2, 2, 4, 4, dtype=torch.bool), 2), (torch.ones(4, 4, dtype=torch.bool), 2),
                       (torch.ones(3, 4, 4, dtype=torch.bool), 2), (torch.zeros(2, 1, 3, 4), 2)]:
        _compare(mask, rows)


def test_empty_and_single_token_masks():
    for S in (0, 1):
        for fill in (True, False):
            _compare(torch.full((1, 1, S, S), fill, dtype=torch.bool), 1)
            _compare(torch.full((2, 1, S, S), 0.0 if fill else float("-inf")), 2)


def _oracle_disagreement(mask: torch.Tensor, row: RowLayout, key_positions: torch.Tensor) -> str:
    allowed, ambiguous, values = (t[0] for t in _oracle_allowed(mask, 1))
    if allowed.shape[-1] != len(key_positions) or allowed.shape[-2] < row.num_tokens:
        return (f"mask shape {tuple(allowed.shape)} vs {row.num_tokens} queries over {len(key_positions)} "
                "dense key columns")
    T = row.num_tokens
    if (err := _first_ambiguous(ambiguous[:T], values[:T])) is not None:
        return err.where()
    expect = (key_positions[None, :] >= 0) & (key_positions[None, :] < row.visible_end[:, None])
    valid = row.visible_end > 0
    got = allowed[: row.num_tokens]
    bad = ((got != expect) & valid[:, None]).nonzero()
    if not len(bad):
        return ""
    t, c = (int(i) for i in bad[0])
    return f"query {t}, key column {c}: mask {bool(got[t, c])}, layout {bool(expect[t, c])}"


def _step_cases(rng: random.Random, n: int):
    """`n` random (mask, row, key_positions): key columns in order or shuffled, padding columns, repeated
    positions, padded queries (visible end 0), extra mask rows, a few entries flipped, a misfit shape."""
    for _ in range(n):
        T, K = rng.randrange(1, 12), rng.randrange(1, 20)
        keys = list(range(K))
        if rng.random() < 0.5:
            rng.shuffle(keys)
        keys = [k if rng.random() > 0.2 else -1 for k in keys]
        if rng.random() < 0.2:
            keys[rng.randrange(K)] = keys[rng.randrange(K)]  # a repeated position
        keys = torch.tensor(keys, dtype=torch.int64)
        ends = torch.tensor([rng.randrange(0, K + 3) if rng.random() > 0.2 else 0 for _ in range(T)])
        row = RowLayout.build([], [0], torch.arange(T), ends, K)
        allowed = (keys[None, :] >= 0) & (keys[None, :] < row.visible_end[:, None])
        extra = rng.choice([0, 0, 2])
        allowed = torch.cat([allowed, torch.rand(extra, K) < 0.5])
        if rng.random() < 0.5:
            allowed = _perturbed(rng, allowed) if T + extra == K else allowed.clone()
            for _ in range(rng.randrange(0, 3)):
                q, c = rng.randrange(T + extra), rng.randrange(K)
                allowed[q, c] = ~allowed[q, c]
        mask = _encoded(rng, allowed[None])
        yield (mask[..., : K - 1] if rng.random() < 0.05 else mask), row, keys


@pytest.mark.parametrize("block", [1 << 19, 5])
def test_step_mask_check_matches_full_comparison(monkeypatch, block):
    """`mask_disagreement` (the step mask check, `ForwardContext.check_dense_mask`) from counts names the same first
    disagreeing (query, key) as the full comparison, or none."""
    monkeypatch.setattr(layout, "_BLOCK_ELEMENTS", block)
    agree = differ = 0
    for mask, row, keys in _step_cases(random.Random(99 + block), 400):
        want = _oracle_disagreement(mask, row, keys)
        assert mask_disagreement(mask_rows(mask, 1)[0], row, keys) == want, (mask, row, keys)
        agree, differ = agree + (want == ""), differ + (want != "")
    assert agree > 100 and differ > 100


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_step_mask_check_matches_full_comparison():
    for mask, row, keys in _step_cases(random.Random(5), 100):
        want = _oracle_disagreement(mask, row, keys)
        assert mask_disagreement(mask_rows(mask.to("cuda"), 1)[0], row, keys) == want


# ---- an additive mask entry is "attend", "masked" or refused -------------------------------


def _prefill_vs_dense(mask: torch.Tensor, prefix: int, target: int) -> tuple[object, float]:
    """The spec read from `mask` (one row, `HunyuanSpec.from_prefill_mask`, Tencent's documented path) and the
    max |paged - dense| of one prefill attention over it (reference kernel; dense: SDPA with the same mask)."""
    import torch.nn.functional as F

    from paged_kv_compile.config import PagedKVConfig
    from paged_kv_compile.families.hunyuan_image3 import HunyuanSpec
    from paged_kv_compile.runtime import PagedKVRuntime

    S, H, D = mask.shape[-1], 2, 8
    spec = HunyuanSpec.from_prefill_mask(mask, [prefix], target)
    rt = PagedKVRuntime(PagedKVConfig(num_layers=1, num_kv_heads=H, head_dim=D, block_size=4, blocks_per_layer=8,
                                      max_rows=1, scratch_tokens_per_row=target + 4))
    rt.admit("r", spec)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, S, H, D, generator=gen) for _ in range(3))
    with rt.forward("r", "prefill", prefix_capacity=prefix, attention_mask=mask) as active:
        views = active.meta.layers[0]
        got = torch.ops.paged_kv.write_attend(q, k, v, rt.pool.tensor, views.slot_mapping, views.block_table,
                                              active.meta.seq_lens, active.meta.kv_visible_end, D ** -0.5, "reference")
    dense = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                           attn_mask=mask.to(q.dtype)).transpose(1, 2)
    return spec, (got - dense).abs().max().item()


@pytest.mark.parametrize("low", [-1e4, torch.finfo(torch.bfloat16).min, layout.MASKED_AT, -1e9])
def test_causal_additive_mask_with_any_masked_value_reads_causal(low):
    """Issue 23's case: a one-row causal fp32 additive mask that masks with -1e4 (or bf16's lowest value) read as
    full visibility (full_spans=((0, T),)), and the paged prefill attended bidirectionally: 1.35 off dense."""
    p, T = 5, 6
    causal = torch.ones(p + T, p + T, dtype=torch.bool).tril()
    mask = torch.zeros(1, 1, p + T, p + T).masked_fill(~causal, low)
    spec, diff = _prefill_vs_dense(mask, p, T)
    assert spec.full_spans == ()
    assert diff <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("numpy_path", [True, False])
@pytest.mark.parametrize("value", [-1.0, -8000.0, 0.5, float("inf"), float("nan"), "negative-nan"])
def test_ambiguous_mask_value_refused(monkeypatch, dtype, numpy_path, value):
    """A value that is neither 0 nor at most MASKED_AT is refused by every reader (prefill layout, spec, step check),
    naming the row, the entry, the value and the fix; on the host integer path and on the torch comparison (a
    device mask's). A request refused at its prefill leaves the runtime as it was (test_reliability_bad_input)."""
    if not numpy_path:
        monkeypatch.setattr(layout, "_INT_VIEWS", {})
    S = 6
    mask = torch.zeros(S, S, dtype=dtype).masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), torch.finfo(dtype).min)
    mask[4, 2] = _negative_nan(dtype) if value == "negative-nan" else value  # on an attended entry
    mask[5, 5] = -0.0  # attends, before and after
    with pytest.raises(RequestError, match=r"row 1: the attention mask holds .* at \(query 4, key 2\).*a bias.*"
                                           r"masked_fill\(~allowed, torch.finfo\(dtype\).min\)"):
        layout_from_prefill_mask(mask_rows(mask[None, None], 1)[0], 1)
    row = RowLayout.build([], [0], torch.arange(S), torch.arange(1, S + 1), S)
    why = mask_disagreement(mask_rows(mask[None], 1)[0], row, torch.arange(S))
    assert why.startswith("query 4, key column 2: mask value") and "neither 0 (attend)" in why


@pytest.mark.parametrize("numpy_path", [True, False])
def test_masked_values_and_negative_zero_read_exactly(monkeypatch, numpy_path):
    """-0.0 attends; -inf, finfo.min, MASKED_AT, -1e4 mask, in every dtype: the same layout as the boolean mask."""
    if not numpy_path:
        monkeypatch.setattr(layout, "_INT_VIEWS", {})
    S = 7
    allowed = torch.ones(S, S, dtype=torch.bool).tril()
    allowed[:, 5] = allowed[5, :] = False
    allowed[5, 5] = True  # a pad seeing itself
    want = layout_from_prefill_mask(allowed, 0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for low in (float("-inf"), torch.finfo(dtype).min, layout.MASKED_AT, -1e4):
            m = torch.full((S, S), -0.0, dtype=dtype).masked_fill(~allowed, low)
            got = layout_from_prefill_mask(m, 0)
            assert all(torch.equal(a, b) for a, b in zip((got.positions, got.visible_end, got.ends_by_position),
                                                         (want.positions, want.visible_end, want.ends_by_position)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_masked_value_weight(dtype):
    """Why MASKED_AT (layout.py): SDPA gives a key masked with it exactly no weight (the output is bit-identical
    to dropping the key) while the masked key's logit is up to 8,000 above the visible one, and -1e3 does not
    (it is a bias that the op cannot express: refused)."""
    import torch.nn.functional as F

    def output_without_key(v: float, gap: float) -> bool:
        D = 8
        q = torch.zeros(1, 1, 1, D)
        q[..., 0] = 1.0
        k = torch.zeros(1, 1, 2, D)
        k[..., 1, 0] = gap * D ** 0.5  # logits: 0 (visible) and `gap` (masked)
        val = torch.randn(1, 1, 2, D, generator=torch.Generator().manual_seed(0))
        mask = torch.tensor([0.0, v]).view(1, 1, 1, 2)
        out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), val.to(dtype), attn_mask=mask.to(dtype))
        alone = F.scaled_dot_product_attention(q.to(dtype), k[..., :1, :].to(dtype), val[..., :1, :].to(dtype))
        return torch.equal(out, alone)

    for gap in (0.0, 10.0, 100.0, 1000.0, 8000.0):
        assert output_without_key(layout.MASKED_AT, gap), gap
    assert not output_without_key(-1e3, 1000.0)
