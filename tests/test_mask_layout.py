"""The prefill mask read from O(S) counts (`layout.layout_from_prefill_mask`) decides exactly as the full
(S, S) comparison it replaced: same layouts, same refusals, same first offending query and key.

The oracle is the previous implementation, kept verbatim below (`_oracle_allowed`, `_oracle_layout`). Masks are
drawn from a seeded generator: pageable layouts (left, middle, right padding, pads seeing themselves or nothing,
causal pads, bidirectional spans) and the same with a few entries flipped (windows, gaps, padding that real
tokens see), in boolean and additive form (bf16, fp16, fp32; finfo.min or -inf; now and then a -0.0, a
negative bias, a NaN), per row or broadcast (1, ...). The block size is shrunk so that one mask spans many
blocks, some on the integer path and some on the comparison (`layout._attends`).
"""

from __future__ import annotations

import random

import pytest
import torch

from paged_kv_compile import RequestError, layout
from paged_kv_compile.layout import RowLayout, layout_from_prefill_mask, mask_disagreement, mask_rows


def _oracle_allowed(mask: torch.Tensor, rows: int) -> torch.Tensor:
    if mask.dim() == 4:
        if mask.shape[1] != 1:
            raise RequestError(f"the attention mask has {mask.shape[1]} head rows; one (broadcast over heads) is needed")
        mask = mask[:, 0]
    if mask.dim() != 3:
        raise RequestError(f"the attention mask must be (rows, 1, queries, keys), got shape {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask > torch.finfo(mask.dtype).min
    if allowed.shape[0] not in (1, rows):
        raise RequestError(f"the attention mask has {allowed.shape[0]} rows but the request has {rows} CFG rows")
    return allowed.expand(rows, *allowed.shape[1:]).to("cpu")


def _oracle_layout(allowed: torch.Tensor, row: int = 0):
    S = allowed.shape[-1]
    if allowed.shape != (S, S):
        raise RequestError(f"a prefill mask must be square (queries = keys), got {tuple(allowed.shape)}")
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


def _encoded(rng: random.Random, allowed: torch.Tensor) -> torch.Tensor:
    """`allowed` as the model would pass it: boolean, or additive in a random float dtype, sometimes with values
    that are neither 0 nor masked (a negative bias, -0.0, +inf: attended; NaN: masked)."""
    dtype = rng.choice([torch.bool, torch.bfloat16, torch.bfloat16, torch.float16, torch.float32])
    if dtype == torch.bool:
        return allowed
    low = torch.finfo(dtype).min if rng.random() < 0.7 else float("-inf")
    m = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, low)
    if rng.random() < 0.3:
        odd = torch.rand(allowed.shape, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) < 0.05
        value = rng.choice([-1.0, -0.0, float("inf"), 3.0, float("nan")])
        where = odd & (allowed if value == value else ~allowed)  # NaN reads as masked: put it on masked entries
        if rng.random() < 0.2:
            where = odd  # anywhere: attended keys turn masked (NaN) or masked keys attended (a bias)
        m = m.masked_fill(where, value)
    return m


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
    for r in range(rows):
        want = _outcome(lambda: _oracle_layout(expected[r], r))
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


def _oracle_disagreement(allowed: torch.Tensor, row: RowLayout, key_positions: torch.Tensor) -> str:
    if allowed.shape[-1] != len(key_positions) or allowed.shape[-2] < row.num_tokens:
        return (f"mask shape {tuple(allowed.shape)} vs {row.num_tokens} queries over {len(key_positions)} "
                "dense key columns")
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
    """`mask_disagreement` (the step mask check, `runtime.check_dense_mask`) from counts names the same first
    disagreeing (query, key) as the full comparison, or none."""
    monkeypatch.setattr(layout, "_BLOCK_ELEMENTS", block)
    agree = differ = 0
    for mask, row, keys in _step_cases(random.Random(99 + block), 400):
        want = _oracle_disagreement(_oracle_allowed(mask, 1)[0], row, keys)
        assert mask_disagreement(mask_rows(mask, 1)[0], row, keys) == want, (mask, row, keys)
        agree, differ = agree + (want == ""), differ + (want != "")
    assert agree > 100 and differ > 100


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_step_mask_check_matches_full_comparison():
    for mask, row, keys in _step_cases(random.Random(5), 100):
        want = _oracle_disagreement(_oracle_allowed(mask, 1)[0], row, keys)
        assert mask_disagreement(mask_rows(mask.to("cuda"), 1)[0], row, keys) == want
