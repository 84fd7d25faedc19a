"""The op's ``kv_gap``: a row's visible keys start and end inside blocks, with a gap between a sink and a window.

Every result is checked against dense SDPA over the logical K/V with an explicit mask (`_opcases.dense_oracle`),
fp32, 1e-5; the pages are sized for the kernel (64/128/256) at frame lengths they do not divide (880, 1560).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import paged_kv_compile  # noqa: F401  (registers torch.ops.paged_kv)
from paged_kv_compile.errors import OpInputError
from paged_kv_compile.ops import reference
from paged_kv_compile.ops import write_attend as wa

from _opcases import dense_oracle, expected_pool, make_case
from test_op_reference import geometries

write_attend = torch.ops.paged_kv.write_attend
attend = torch.ops.paged_kv.attend


def sink_window_gap(sink: int, offset: int, block_size: int) -> tuple[int, int]:
    """The interface's gap of a sink of `sink` tokens followed by a window whose first block starts `offset`
    tokens before the window: ``(S, ceil(S / B) * B + o)``."""
    return sink, -(-sink // block_size) * block_size + offset


@st.composite
def irregular_geometries(draw) -> dict:
    """test_op_reference's random geometries, with a gap per row (clipped to the row) and blocks in either order."""
    geometry = draw(geometries())
    rows = len(geometry["prefixes"])
    gaps = [tuple(sorted(draw(st.lists(st.integers(0, 17), min_size=2, max_size=2)))) for _ in range(rows)]
    return dict(geometry, gaps=gaps, ascending_blocks=draw(st.booleans()))


def _check_against_dense(case, kernel: str = "reference") -> torch.Tensor:
    before = case.pool.clone()
    out = write_attend(*case.args(), case.scale, kernel, kv_gap=case.kv_gap)
    assert out.shape == case.query.shape and out.is_contiguous()
    torch.testing.assert_close(out, dense_oracle(case), atol=1e-5, rtol=0)
    # written slots hold the new K/V, others untouched (NaN planted in skipped blocks stays NaN)
    torch.testing.assert_close(case.pool, expected_pool(case, before), atol=0, rtol=0, equal_nan=True)
    again = attend(case.query, case.pool, case.block_table, case.seq_lens, case.kv_visible_end, case.scale, kernel,
                   kv_gap=case.kv_gap)
    torch.testing.assert_close(again, out, atol=1e-6, rtol=0)
    return out


@pytest.mark.parametrize("host_lengths", [True, False], ids=["cpu-used-span", "device-path"])
@settings(max_examples=80, deadline=None)
@given(geometry=irregular_geometries())
def test_irregular_gaps_match_dense_on_both_reference_paths(host_lengths, geometry):
    """Any gap (empty, in one block, across blocks, at the row's start or end, the whole row) on any block size,
    partial last blocks, padded rows and queries whose visible keys all lie in the gap (exact zeros)."""
    previous, reference.HOST_LENGTHS_ON_CPU = reference.HOST_LENGTHS_ON_CPU, host_lengths
    try:
        case = make_case(**geometry)
        out = _check_against_dense(case)
    finally:
        reference.HOST_LENGTHS_ON_CPU = previous
    empty = reference.visible_counts(case.seq_lens, case.kv_visible_end, case.kv_gap) <= 0
    assert bool((out[empty] == 0).all()), "queries that see nothing give exact zeros"


FRAMES = {"dreamzero_880": 880, "832x480_1560": 1560}


@pytest.mark.parametrize("block_size", [64, 128, 256])
@pytest.mark.parametrize("frame", list(FRAMES), ids=list(FRAMES))
@pytest.mark.parametrize("host_lengths", [True, False], ids=["cpu-used-span", "device-path"])
def test_page_size_independent_of_the_frame_sink_and_sliding_window(frame, block_size, host_lengths, monkeypatch):
    """A one-frame sink, then a two-frame window that slid by a frame, so it starts inside a block: the row holds
    the sink's blocks, then the window's blocks from the one its first token lies in; the gap hides the sink's
    tail padding and the evicted head of that block. Row 1 has no sink: its window starts inside its first block
    (gap (0, o)). The chunk's queries (the window's last frame, a few of them) see the whole row less the gap."""
    F_ = FRAMES[frame]
    B = block_size
    offset = (3 * F_) % B  # the evicted head of the window's first block: frames 1-2 evicted, frame 3 first kept
    assert offset, "the geometry puts the window's start inside a block"
    sink_blocks = -(-F_ // B)
    seq_sink = sink_blocks * B + offset + 2 * F_
    seq_plain = offset + 2 * F_
    tokens = 4
    monkeypatch.setattr(reference, "HOST_LENGTHS_ON_CPU", host_lengths)
    case = make_case(seed=block_size + F_, hkv=1, ratio=2, head_dim=4, block_size=B, tokens=tokens,
                     prefixes=[seq_sink - tokens, seq_plain - tokens], new_counts=[tokens, tokens],
                     modes=["full", "full"], right_aligned=True, extra_width=0,
                     gaps=[sink_window_gap(F_, offset, B), (0, offset)])
    assert case.kv_gap.tolist() == [[F_, sink_blocks * B + offset], [0, offset]]
    _check_against_dense(case)


def test_page_size_skip_whole_gap_blocks_reads_no_gap_block(monkeypatch):
    """The CPU fast path reads none of the blocks that lie wholly in every row's gap: they hold NaN here, and
    the result is still the dense one (a read of them would poison the softmax)."""
    B = 8
    case = make_case(seed=5, hkv=1, ratio=1, head_dim=4, block_size=B, tokens=2, prefixes=[38, 38],
                     new_counts=[2, 2], modes=["full", "causal"], right_aligned=True, pad_random=False,
                     gaps=[(5, 27), (3, 30)])
    lo, hi = reference.skipped_blocks(case.kv_gap.numpy(), case.seq_lens.numpy(), B)
    assert (lo, hi) == (1, 3), "blocks 1 and 2 lie in both rows' gaps"
    for r in range(2):
        case.pool[:, case.block_table[r, lo:hi].long()] = float("nan")
    _check_against_dense(case)


def test_page_size_aligned_gap_takes_the_unmasked_path_and_matches_dense(monkeypatch):
    """A gap of whole blocks seen by queries that see the whole row: the fast path drops both the blocks and
    the mask (SDPA gets attn_mask=None), and the result is the dense one."""
    import torch.nn.functional as F

    masks = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(reference.F, "scaled_dot_product_attention",
                        lambda *a, **kw: masks.append(kw.get("attn_mask")) or real(*a, **kw))
    case = make_case(seed=6, hkv=1, ratio=2, head_dim=4, block_size=4, tokens=3, prefixes=[17, 17],
                     new_counts=[3, 3], modes=["full", "full"], right_aligned=True, gaps=[(4, 12), (4, 12)])
    _check_against_dense(case)
    assert masks[0] is None


def _base():
    return make_case(seed=3, hkv=2, ratio=2, head_dim=8, block_size=4, tokens=3, prefixes=[5, 2],
                     new_counts=[3, 2], modes=["causal", "full"], extra_width=1, pad_random=False,
                     gaps=[(1, 3), (0, 2)])


BAD_GAPS = [
    ("dtype", lambda g: g.long(), r"kv_gap must be torch.int32"),
    ("rank", lambda g: g[0], r"kv_gap must have rank 2 \[R, 2\]"),
    ("rows", lambda g: g[:1], r"kv_gap has shape \(1, 2\), expected \[R, 2\] = \(2, 2\)"),
    ("columns", lambda g: torch.zeros(2, 3, dtype=torch.int32), r"kv_gap has shape \(2, 3\)"),
    ("device", lambda g: g.to("meta"), r"kv_gap is on meta but query is on cpu"),
    ("negative start", lambda g: torch.tensor([[-1, 2], [0, 0]], dtype=torch.int32),
     r"kv_gap\[0\] = \(-1, 2\) .* negative start"),
    ("end below start", lambda g: torch.tensor([[0, 0], [2, 1]], dtype=torch.int32),
     r"kv_gap\[1\] = \(2, 1\) .* end below its start"),
    ("end past seq_len", lambda g: torch.tensor([[1, 9], [0, 0]], dtype=torch.int32),
     r"kv_gap\[0\] = \(1, 9\) \(seq_lens\[0\] = 8\) has an end past seq_lens"),
]


@pytest.mark.parametrize("change, pattern", [b[1:] for b in BAD_GAPS], ids=[b[0] for b in BAD_GAPS])
def test_irregular_bad_gap_names_the_problem_and_leaves_the_pool_unchanged(change, pattern):
    case = _base()
    before = case.pool.clone()
    with pytest.raises(OpInputError, match=pattern):
        write_attend(*case.args(), case.scale, "reference", kv_gap=change(case.kv_gap))
    assert torch.equal(case.pool, before)


def test_irregular_causal_hint_with_a_gap_promises_the_keys_before_it():
    """A causal hint with a gap says every query that sees anything sees all keys before the gap (the sink): the
    flash-attn adapter relies on it; a query that ends before the gap's start is refused on CPU values."""
    case = make_case(seed=4, hkv=1, ratio=1, head_dim=4, block_size=4, tokens=3, prefixes=[0], new_counts=[3],
                     modes=["causal"], right_aligned=True, gaps=[(2, 3)])
    before = case.pool.clone()
    with pytest.raises(OpInputError, match=r"kv_visible_end\[0, 0\] = 1 is below its row's kv_gap start"):
        write_attend(*case.args(), case.scale, "reference", visibility="causal", kv_gap=case.kv_gap)
    assert torch.equal(case.pool, before)
    ok = make_case(seed=4, hkv=1, ratio=1, head_dim=4, block_size=4, tokens=3, prefixes=[5], new_counts=[3],
                   modes=["causal"], right_aligned=True, gaps=[(2, 5)])
    out = write_attend(*ok.args(), ok.scale, "reference", visibility="causal", kv_gap=ok.kv_gap)
    torch.testing.assert_close(out, dense_oracle(ok), atol=1e-5, rtol=0)


def test_irregular_host_value_check_agrees_with_the_torch_checks_on_gaps(monkeypatch):
    """`_values_ok` (numpy, every CPU call) passes exactly the gaps the torch checks pass."""
    import numpy as np

    rng = np.random.default_rng(1)
    verdicts = set()
    for _ in range(200):
        R, T, N, B, M = int(rng.integers(1, 4)), 3, 6, 4, 3
        seq = rng.integers(0, M * B + 1, size=R)
        visibility = str(rng.choice(["general", "full", "causal"]))
        t = np.arange(T)
        vis = {"general": rng.integers(0, seq[:, None] + 1, size=(R, T)), "full": np.repeat(seq[:, None], T, 1),
               "causal": np.clip(seq[:, None] - T + t + 1, 0, None)}[visibility]
        gap = np.sort(rng.integers(-1, M * B + 2, size=(R, 2)), axis=1)
        if rng.random() < 0.3:
            gap = gap[:, ::-1].copy()
        args = (torch.zeros(R, T, 1, 2), torch.zeros(2, N, B, 1, 2), None,
                torch.from_numpy(rng.integers(0, N, size=(R, M)).astype(np.int32)),
                torch.from_numpy(seq.astype(np.int32)), torch.from_numpy(vis.astype(np.int32)), visibility,
                torch.from_numpy(gap.astype(np.int32)))
        with monkeypatch.context() as m:
            m.setattr(wa, "_values_ok", lambda *a: False)
            try:
                wa.check_values(*args)
                want = True
            except OpInputError:
                want = False
        assert wa._values_ok(*args) == want, (visibility, seq, vis, gap)
        verdicts.add(want)
    assert verdicts == {True, False}


def test_irregular_opcheck_with_a_gap():
    case = _base()
    torch.library.opcheck(write_attend.default, (*case.args(), case.scale),
                          {"kernel": "reference", "kv_gap": case.kv_gap})
    read_args = (case.query, case.pool, case.block_table, case.seq_lens, case.kv_visible_end, case.scale)
    torch.library.opcheck(attend.default, read_args, {"kernel": "reference", "kv_gap": case.kv_gap})


def test_irregular_gap_compiles_in_one_frame_and_matches_eager():
    """kv_gap as a graph input under torch.compile(fullgraph=True): one frame, no recompile when the gap's
    values change, and the eager result."""
    from torch._dynamo.testing import CompileCounter

    def step(q, k, v, pool, slot, table, seq, end, gap):
        return write_attend(q, k, v, pool, slot, table, seq, end, 0.5, "reference", kv_gap=gap) * 2

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for gaps in ([(1, 3), (0, 2)], [(2, 6), (1, 1)]):
        eager_case = make_case(seed=3, hkv=2, ratio=2, head_dim=8, block_size=4, tokens=3, prefixes=[5, 2],
                               new_counts=[3, 2], modes=["causal", "full"], gaps=gaps)
        case = make_case(seed=3, hkv=2, ratio=2, head_dim=8, block_size=4, tokens=3, prefixes=[5, 2],
                         new_counts=[3, 2], modes=["causal", "full"], gaps=gaps)
        want = step(*eager_case.args(), eager_case.kv_gap)
        with torch.no_grad():
            got = compiled(*case.args(), case.kv_gap)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        case.scale = 0.5  # the step's scale
        torch.testing.assert_close(want / 2, dense_oracle(case), atol=1e-5, rtol=0)
        assert torch.equal(case.pool, eager_case.pool)
    assert counter.frame_count == 1


TRITON_GEOMETRIES = {
    "gqa2, gaps inside and across blocks": dict(
        seed=30, hkv=2, ratio=2, block_size=3, tokens=3, prefixes=[9, 0, 13], new_counts=[2, 0, 3],
        modes=["random", "padded", "causal"], layout="transposed", gaps=[(2, 8), (0, 0), (0, 5)]),
    "gqa4, block 1, gap hides a query's whole view": dict(
        seed=31, hkv=1, ratio=4, block_size=1, tokens=4, prefixes=[3, 5], new_counts=[4, 1],
        modes=["causal", "full"], layout="sliced", gaps=[(0, 5), (6, 6)]),
    "mha, block 8, gap over several 32-key tiles": dict(
        seed=32, hkv=2, ratio=1, head_dim=4, block_size=8, tokens=5, prefixes=[120, 70], new_counts=[3, 5],
        modes=["full", "random"], right_aligned=True, extra_width=2, gaps=[(7, 101), (33, 64)]),
}


@pytest.mark.parametrize("meta_layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("name", list(TRITON_GEOMETRIES))
def test_irregular_triton_matches_dense(name, meta_layout):
    pytest.importorskip("triton")
    case = make_case(**TRITON_GEOMETRIES[name], meta_layout=meta_layout)
    if meta_layout == "transposed":  # the gap as a column-major view too
        case.kv_gap = case.kv_gap.t().contiguous().t()
    out = _check_against_dense(case, "triton")
    empty = reference.visible_counts(case.seq_lens, case.kv_visible_end, case.kv_gap) <= 0
    assert bool((out[empty] == 0).all()), "queries that see nothing give exact zeros"


@pytest.mark.parametrize("block_size", [128, 256])
def test_page_size_triton_sink_and_window_at_880(block_size):
    """DreamZero's 880-token frames on pages of 128/256 through the Triton kernel: the sink-window gap, and the
    tiles wholly in the gap are not read (they hold NaN, which a read would spread through the softmax)."""
    pytest.importorskip("triton")
    F_, B = 880, block_size
    offset = (3 * F_) % B
    sink_blocks = -(-F_ // B)
    seq = sink_blocks * B + offset + 2 * F_
    case = make_case(seed=B, hkv=1, ratio=2, head_dim=4, block_size=B, tokens=4, prefixes=[seq - 4],
                     new_counts=[4], modes=["full"], right_aligned=True, extra_width=0,
                     gaps=[sink_window_gap(F_, offset, B)])
    start, stop = case.kv_gap[0].tolist()
    planted = range(-(-start // 32) * 32, stop // 32 * 32)  # the 32-key tiles wholly in the gap
    assert len(planted) >= 32
    for p in planted:
        case.pool[:, int(case.block_table[0, p // B]), p % B] = float("nan")
    _check_against_dense(case, "triton")


FP8_GAP_GEOMETRY = dict(seed=40, hkv=2, ratio=2, block_size=4, tokens=3, prefixes=[17, 0, 10], new_counts=[3, 0, 2],
                        modes=["full", "padded", "causal"], right_aligned=True, gaps=[(5, 14), (0, 0), (0, 6)])


@pytest.mark.parametrize("kernel, host_lengths", [("reference", True), ("reference", False), ("triton", True)],
                         ids=["reference-cpu-used-span", "reference-device-path", "triton"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_irregular_gap_on_an_fp8_pool_matches_dense_over_the_round_trip(kernel, host_lengths, dtype, monkeypatch):
    """FP8 row scales are those of the row's first table block, gap or not: exact against dense attention over
    the quantize-dequantize round trip of every key."""
    from _opcases import expected_fp8_pool, fp8_case

    if kernel == "triton":
        pytest.importorskip("triton")
    monkeypatch.setattr(reference, "HOST_LENGTHS_ON_CPU", host_lengths)
    case = make_case(**FP8_GAP_GEOMETRY)
    pool, scales, oracle = fp8_case(case, dtype, seed=3)
    before = pool.clone()
    out = write_attend(*case.args(pool), case.scale, kernel, kv_scales=scales, kv_gap=case.kv_gap)
    torch.testing.assert_close(out, dense_oracle(oracle), atol=1e-5, rtol=0)
    assert torch.equal(pool.view(torch.uint8), expected_fp8_pool(case, before, scales).view(torch.uint8))


@st.composite
def frame_geometries(draw) -> dict:
    """DreamZero-14B's 880-token and 832x480's 1560-token frames on pages of 64/128/256: a sink of one frame (or
    none), a window of 1-2 frames slid by any number of frames (so it starts anywhere in a block), a chunk of
    queries at the window's end; tiny heads keep it cheap on the CPU."""
    frame = draw(st.sampled_from([880, 1560]))
    B = draw(st.sampled_from([64, 128, 256]))
    sink = draw(st.sampled_from([0, frame]))
    window = draw(st.integers(1, 2)) * frame
    offset = (draw(st.integers(1, 6)) * frame) % B  # where the window's first token lies in its block
    kept_sink = -(-sink // B) * B
    seq = kept_sink + offset + window
    tokens = draw(st.integers(1, 4))
    return dict(seed=draw(st.integers(0, 2**16)), hkv=1, ratio=draw(st.sampled_from([1, 2])), head_dim=4,
                block_size=B, tokens=tokens, prefixes=[seq - tokens], new_counts=[tokens],
                modes=[draw(st.sampled_from(["full", "causal"]))], right_aligned=True, extra_width=0,
                ascending_blocks=draw(st.booleans()), gaps=[(sink, kept_sink + offset)])


@pytest.mark.parametrize("host_lengths", [True, False], ids=["cpu-used-span", "device-path"])
@settings(max_examples=25, deadline=None)
@given(geometry=frame_geometries())
def test_page_size_property_at_dreamzero_and_832x480_frames(host_lengths, geometry):
    previous, reference.HOST_LENGTHS_ON_CPU = reference.HOST_LENGTHS_ON_CPU, host_lengths
    try:
        _check_against_dense(make_case(**geometry))
    finally:
        reference.HOST_LENGTHS_ON_CPU = previous


@pytest.mark.parametrize("sink", [0, 880], ids=["window", "sink-and-window"])
def test_page_size_shared_gap_reads_without_a_mask_and_a_window_in_place(sink, monkeypatch):
    """Rows that all hold the same keys less one shared gap, every query seeing them (DreamZero's window on pages
    of 128 at 880-token frames): SDPA gets no mask; a window alone is read in place from inside its first
    block (the keys SDPA reads are a view of the pool); the result is the dense one."""
    import torch.nn.functional as F

    seen = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(reference.F, "scaled_dot_product_attention",
                        lambda *a, **kw: seen.append((a[1], kw.get("attn_mask"))) or real(*a, **kw))
    F_, B = 880, 128
    offset = (3 * F_) % B
    gap = sink_window_gap(sink, offset, B) if sink else (0, offset)
    seq = gap[1] + 2 * F_
    case = make_case(seed=9, hkv=1, ratio=2, head_dim=4, block_size=B, tokens=3, prefixes=[seq - 3] * 2,
                     new_counts=[3, 3], modes=["full", "full"], right_aligned=True, extra_width=0, pad_random=False,
                     ascending_blocks=True, gaps=[gap, gap])
    _check_against_dense(case)
    key, mask = seen[0]
    assert mask is None
    in_pool = key.untyped_storage().data_ptr() == case.pool.untyped_storage().data_ptr()
    assert in_pool == (sink == 0), "a window alone is a view of the pool; a sink and a window are joined (a copy)"


def test_irregular_device_paths_read_no_gap_value_on_the_host():
    """What a captured forward runs with a gap reads no value on the host: on meta tensors (which have none to
    read, so any .item()/.tolist()/.numpy() raises) the reference kernel's device path and the flash-attn
    split (spans, the torch-attended head, the LSE merge) run and give the right shapes."""
    from paged_kv_compile.ops import gap_split

    case = _base()
    meta = {name: getattr(case, name).to("meta") for name in ("query", "pool", "block_table", "seq_lens",
                                                               "kv_visible_end", "kv_gap")}
    out = reference.attend(meta["query"], meta["pool"], meta["block_table"], meta["seq_lens"], meta["kv_visible_end"],
                           case.scale, kv_gap=meta["kv_gap"])
    assert out.device.type == "meta" and out.shape == case.query.shape
    split = gap_split.split_around_gap(meta["block_table"], meta["seq_lens"], meta["kv_gap"], case.pool.shape[2])
    ends = gap_split.query_ends(meta["seq_lens"], meta["kv_visible_end"])
    head = gap_split.attend_head(meta["query"], meta["pool"], split, ends, case.scale)
    R, T, Hq, _ = case.query.shape
    part = (meta["query"].float(), torch.zeros(R, T, Hq, device="meta"), gap_split.sees_after(split, ends))
    merged = gap_split.merge_by_lse([part, head])
    assert merged.device.type == "meta" and merged.shape == case.query.shape
