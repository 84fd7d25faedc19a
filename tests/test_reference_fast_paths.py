"""The reference kernel's CPU fast paths against its general path and the dense oracle.

Where a row's blocks (or the slots it writes) form one ascending run, the CPU path reads the pool
through a view (`reference._span_view`) and writes each row with a slice copy
(`reference._write_row_runs`) instead of `index_select` / `index_copy_`. Each test checks that the fast
path is really taken (the general one is made to fail), that it gives the general path's result bit for
bit, and that a fragmented table or scattered slots fall back.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import paged_kv_compile  # noqa: F401  (registers torch.ops.paged_kv)
from paged_kv_compile.ops import reference
from paged_kv_compile.ops.fp8 import row_scales

from _opcases import dense_oracle, expected_pool, fp8_case, make_case

# Equal rows, every token new and written (DreamZero's shape): blocks handed out in order.
RUNS = {
    "two rows, history crosses a block": dict(seed=3, hkv=2, ratio=2, block_size=4, tokens=5, prefixes=[6, 6],
                                              new_counts=[5, 5], modes=["full", "full"]),
    "three rows, causal, gqa4": dict(seed=4, hkv=1, ratio=4, block_size=3, tokens=4, prefixes=[2, 2, 2],
                                     new_counts=[4, 4, 4], modes=["causal", "causal", "causal"]),
    "one row, transposed inputs": dict(seed=5, hkv=2, ratio=1, block_size=2, tokens=3, prefixes=[5],
                                       new_counts=[3], modes=["random"], layout="transposed"),
}


def _pool_and_scales(case, dtype):
    """(pool, kv_scales, row_scales, oracle case): the case's own pool, or its FP8 twin (tests/_opcases.py)."""
    if dtype is None:
        return case.pool, None, None, case
    pool, scales, oracle = fp8_case(case, dtype, seed=7)
    return pool, scales, row_scales(scales, case.block_table), oracle


def _attend(case, pool, row_scales):
    return reference.attend(case.query, pool, case.block_table, case.seq_lens, case.kv_visible_end, case.scale,
                            "general", row_scales)


def _refuse(*_args, **_kwargs):
    raise AssertionError("the general path ran where the fast path applies")


@pytest.mark.parametrize("dtype", [None, torch.float8_e4m3fn], ids=["fp32", "fp8-e4m3"])
@pytest.mark.parametrize("geometry", list(RUNS))
def test_span_view_gives_the_gather_result_bit_for_bit(geometry, dtype, monkeypatch):
    case = make_case(**RUNS[geometry], ascending_blocks=True)
    pool, _, row_scales, oracle = _pool_and_scales(case, dtype)
    reference.write_kv(pool, case.key, case.value, case.slot_mapping, row_scales)
    with monkeypatch.context() as m:
        m.setattr(reference, "_gather", _refuse)  # the view must serve this table
        fast = _attend(case, pool, row_scales)
    with monkeypatch.context() as m:
        m.setattr(reference, "_span_view", lambda *a: None)
        general = _attend(case, pool, row_scales)
    assert torch.equal(fast, general)
    torch.testing.assert_close(fast, dense_oracle(oracle), atol=1e-5, rtol=0)


def _ids(rows):
    return np.array(rows, dtype=np.int32)


@pytest.mark.parametrize("rows", [[[2, 3, 4]], [[0, 1], [0, 1]], [[1, 2], [5, 6]], [[0, 1], [3, 4], [6, 7]], [[9]]],
                         ids=["one row", "same blocks", "spaced rows", "three evenly spaced", "last block"])
def test_span_view_holds_the_tables_blocks(rows):
    pool = torch.randn(2, 10, 3, 2, 4)
    ids = _ids(rows)
    view = reference._span_view(pool, ids)
    assert view is not None
    gathered = pool.index_select(1, torch.from_numpy(ids.reshape(-1)).long()).view(view.shape)
    assert torch.equal(view, gathered)


@pytest.mark.parametrize("rows", [[[2, 4]], [[3, 2]], [[4, 5], [0, 1]], [[0, 1], [2, 3], [7, 8]], [[9, 10]],
                                  [[-1, 0]]],
                         ids=["gap", "descending", "rows descending", "uneven spacing", "past the pool", "negative"])
def test_span_view_declines_other_tables(rows):
    assert reference._span_view(torch.randn(2, 10, 3, 2, 4), _ids(rows)) is None


def test_fragmented_table_takes_the_gather(monkeypatch):
    case = make_case(**RUNS["two rows, history crosses a block"])  # shuffled blocks, as in a busy pool
    ids = case.block_table[:, : -(-int(case.seq_lens.max()) // case.pool.shape[2])].numpy()
    assert reference._span_view(case.pool, ids) is None
    calls = []
    gather = reference._gather
    monkeypatch.setattr(reference, "_gather", lambda *a: calls.append(1) or gather(*a))
    out = _attend(case, _write(case, case.pool), None)
    assert calls, "a fragmented table must be gathered"
    torch.testing.assert_close(out, dense_oracle(case), atol=1e-5, rtol=0)


def _write(case, pool):
    reference.write_kv(pool, case.key, case.value, case.slot_mapping)
    return pool


@pytest.mark.parametrize("geometry", list(RUNS))
def test_row_runs_write_what_index_copy_writes(geometry, monkeypatch):
    case = make_case(**RUNS[geometry], ascending_blocks=True)
    before = case.pool.clone()
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "index_copy_", _refuse)  # every row is one run: no scatter
        fast = _write(case, case.pool.clone())
    with monkeypatch.context() as m:
        m.setattr(reference, "_write_row_runs", lambda *a: False)
        general = _write(case, case.pool.clone())
    assert torch.equal(fast, general)
    assert torch.equal(fast, expected_pool(case, before))


@pytest.mark.parametrize("change", ["a token that does not write", "scattered blocks", "slot past the pool"])
def test_row_runs_decline_and_leave_the_pool(change):
    case = make_case(**RUNS["two rows, history crosses a block"], ascending_blocks=change != "scattered blocks")
    slots = case.slot_mapping.clone()
    if change == "a token that does not write":
        slots[1, 2] = -1
    elif change == "slot past the pool":
        slots[0] = slots[0] - slots[0, 0] + case.pool.shape[1] * case.pool.shape[2] - 2
    flat = case.pool.clone().view(2, -1, *case.pool.shape[3:])
    assert not reference._write_row_runs(flat, case.key, case.value, slots.numpy())
    assert torch.equal(flat.view(case.pool.shape), case.pool)
