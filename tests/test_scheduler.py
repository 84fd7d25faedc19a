"""Scheduler: windows, sinks, prefixes, capacity, bad input, and random lifecycles (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_kv_compile import CapacityError, ConfigError, PagedKVConfig, RequestError
from paged_kv_compile.runtime import PagedKVRuntime
from paged_kv_compile.families.dreamzero import DreamZeroSpec
from paged_kv_compile.families.hunyuan_image3 import HunyuanSpec

B = 4
DZ = DreamZeroSpec(frame_seqlen=8, chunk_frames=1, window_frames=4, sink_frames=0, action_tokens=3)
DZ_SINK = DreamZeroSpec(frame_seqlen=8, chunk_frames=1, window_frames=4, sink_frames=1, action_tokens=3)


def make_runtime(blocks: int = 64, max_sessions: int | None = None) -> PagedKVRuntime:
    cfg = PagedKVConfig(num_layers=3, num_kv_heads=1, head_dim=4, block_size=B, blocks_per_layer=blocks,
                        max_rows=2, scratch_tokens_per_row=32)
    return PagedKVRuntime(cfg, max_sessions=max_sessions)


def run_forward(rt: PagedKVRuntime, plan, fail: bool = False) -> None:
    try:
        with rt.forward_plan(plan):
            if fail:
                raise RuntimeError("injected")
    except RuntimeError as e:
        if not fail or "injected" not in str(e):
            raise


def assert_ownership_consistent(rt: PagedKVRuntime) -> None:
    owned = [b for rows in rt.scheduler.owned_blocks().values() for row in rows for b in row]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert rt.scheduler.allocator.num_free + len(owned) == rt.pool.blocks_per_layer, "a block leaked"
    for b in owned:
        assert rt.scheduler.allocator.refcount(b) == 1


# ---- DreamZero windows ---------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [DZ, DZ_SINK], ids=["no-sink", "sink"])
def test_dreamzero_window_matches_dense_slicing(spec):
    """Visible history per forward equals what the dense cat/slice idiom keeps, chunk after chunk."""
    rt = make_runtime()
    rt.admit("s", spec, rows=2)
    committed: list[list[int]] = []  # logical chunks in commit order (as lists of block ids, row 0)
    n, s, m = spec.chunk_tokens, spec.sink_tokens, spec.window_tokens
    for chunk in range(8):
        plan = rt.scheduler.plan("s", "commit")
        row = plan.rows[0]
        hist_tokens = row.seq_len - n - spec.action_tokens
        total = chunk * n
        # dense: visible = H[:s] + H[s:][-(m - s - n):]
        expect = min(total, s) + max(0, min(total - s, m - s - n)) if total > s else total
        assert hist_tokens == expect
        assert torch.equal(row.positions, torch.arange(hist_tokens, hist_tokens + n + spec.action_tokens))
        assert torch.all(row.visible_end == row.seq_len)
        run_forward(rt, plan)
        committed.append(plan.new_blocks[0])
        assert_ownership_consistent(rt)
    kept = rt.scheduler.owned_blocks()["s"][0]
    if spec.sink_frames:
        assert kept[: s // B] == committed[0][: s // B], "the sink stays resident"
    assert kept[-(n // B):] == committed[-1], "the newest chunk is kept"
    rt.reset("s")
    assert rt.scheduler.owned_blocks()["s"] == [[], []]
    rt.release("s")
    assert rt.scheduler.allocator.num_free == 64


def test_denoise_writes_scratch_only_and_repeats_layout():
    rt = make_runtime()
    rt.admit("s", DZ, rows=2)
    run_forward(rt, rt.scheduler.plan("s", "commit"))
    free = rt.scheduler.allocator.num_free
    builds = rt.metadata.builds
    for _ in range(3):
        plan = rt.scheduler.plan("s", "denoise")
        assert not plan.rows[0].managed[-(DZ.chunk_tokens // B) :].any(), "denoise K/V must go to scratch"
        run_forward(rt, plan)
    assert rt.scheduler.allocator.num_free == free
    assert rt.metadata.builds == builds + 1, "identical denoise layouts are built once"


def _layout_arrays(plan) -> list[tuple]:
    return [tuple(a.tolist() for a in row.arrays) + (row.seq_len,) for row in plan.rows]


def _planned_twice(rt: PagedKVRuntime, plan_fn) -> tuple:
    """A forward's rows as planned (possibly from the owners' layout caches) and as planned with every cache
    cleared (the oracle); both forwards are run."""
    plan = plan_fn()
    got = (_layout_arrays(plan), plan.key_positions and [k.tolist() for k in plan.key_positions])
    run_forward(rt, plan)
    for owner in rt.scheduler.owners.values():
        owner.layout_cache = None
    fresh = plan_fn()
    want = (_layout_arrays(fresh), fresh.key_positions and [k.tolist() for k in fresh.key_positions])
    run_forward(rt, fresh)
    return plan, got, want


def test_repeated_plans_reuse_layouts_only_while_nothing_changed():
    """`families/base.py: reuse_layouts`: a denoising step reuses the last step's row layouts (the same objects),
    and every change a layout depends on (a commit, a window reset, a prefill run again with another mask, the
    branch, the forward's first scratch row in a batch, a fork) gives a plan equal to one made without any cache."""
    rt = make_runtime()
    sched = rt.scheduler
    rt.admit("s", DZ_SINK, rows=2)
    plans = [
        lambda: sched.plan("s", "denoise"),
        lambda: sched.plan("s", "denoise", branch=1),
        # s's branch 1 on the batch's scratch row 1 once the fork exists, else alone on row 0
        lambda: (sched.plan_batch([("t", "denoise", {"branch": 0}), ("s", "denoise", {"branch": 1})])
                 if "t" in sched.owners else sched.plan("s", "denoise", branch=1)),
        lambda: sched.plan("s", "denoise"),  # the next step's first plan has this key
    ]
    seen = set()
    for step in range(7):
        if step in (1, 2, 4, 5):
            run_forward(rt, sched.plan("s", "commit"))
        if step == 3:
            sched.fork("s", "t")
        if step == 6:
            rt.reset("s")
        for plan_fn in plans:
            _, got, want = _planned_twice(rt, plan_fn)
            assert got == want, f"step {step}: a reused layout differs from a fresh plan"
            seen.add(repr(got))
    assert len(seen) >= 8, "the steps must exercise different layouts"
    first = sched.plan("s", "denoise")
    run_forward(rt, first)
    again = sched.plan("s", "denoise")
    assert again.rows[0] is first.rows[0], "an unchanged denoising step reuses its layouts"
    run_forward(rt, again)

    spec = HunyuanSpec(prefix_lens=(5, 3), target_len=6, full_spans=((1, 5),))
    rt.admit("r", spec)
    middle = spec.padded_mask(8)  # row 1: [prompt 3 | pad 5 | target 6]
    perm = torch.tensor([3, 4, 5, 6, 7, 0, 1, 2, *range(8, 14)])
    left = middle.clone()
    left[1, 0] = middle[1, 0][perm][:, perm]  # row 1 left-padded: [pad 5 | prompt 3 | target 6]
    keys = []
    for mask in (middle, left):
        run_forward(rt, sched.plan("r", "prefill", prefix_capacity=8, attention_mask=mask))
        _, got, want = _planned_twice(rt, lambda: sched.plan("r", "step", prefix_capacity=8))
        assert got == want, "a step after a second prefill reused the first prefill's layout"
        keys.append(got[1])
    assert keys[0] != keys[1], "the two prefills must lay row 1's prompt out differently"


def test_failed_commit_rolls_back():
    rt = make_runtime()
    rt.admit("s", DZ, rows=2)
    before = rt.state()
    run_forward(rt, rt.scheduler.plan("s", "commit"), fail=True)
    after = rt.state()
    assert after == before


# ---- HunyuanImage-3 requests -------------------------------------------------------------------------
def test_hunyuan_layout_prefill_and_step():
    rt = make_runtime()
    spec = HunyuanSpec(prefix_lens=(5, 3), target_len=6, full_spans=((1, 5),))
    rt.admit("r", spec)
    assert [len(r) for r in rt.scheduler.owned_blocks()["r"]] == [2, 1]
    plan = rt.scheduler.plan("r", "prefill", prefix_capacity=8, attention_mask=spec.padded_mask(8))
    row1 = plan.rows[1]  # prefix 3, pad 5, target 6
    assert row1.positions.tolist() == [0, 1, 2, -1, -1, -1, -1, -1, 3, 4, 5, 6, 7, 8]
    assert row1.visible_end.tolist() == [1, 2, 3, 0, 0, 0, 0, 0, 4, 8, 8, 8, 8, 9]
    assert row1.seq_len == 9
    run_forward(rt, plan)
    plan = rt.scheduler.plan("r", "step", prefix_capacity=8)
    assert plan.rows[0].positions.tolist() == list(range(5, 11))
    assert plan.rows[0].visible_end.tolist() == [6, 10, 10, 10, 10, 11]
    run_forward(rt, plan)
    rt.release("r")
    assert rt.scheduler.allocator.num_free == 64


def test_hunyuan_step_before_prefill_is_refused():
    rt = make_runtime()
    rt.admit("r", HunyuanSpec(prefix_lens=(5,), target_len=6))
    before = rt.state()
    with pytest.raises(RequestError, match="not been prefilled"):
        rt.scheduler.plan("r", "step", prefix_capacity=8)
    assert rt.state() == before


# ---- bad input: clear errors, nothing changed ------------------------------------------------------
BAD_CASES = [
    ("unknown id", lambda rt: rt.scheduler.plan("nope", "denoise"), RequestError, "unknown id"),
    ("finished id", lambda rt: rt.scheduler.plan("done", "step", prefix_capacity=8), RequestError,
     "released"),
    ("reused id", lambda rt: rt.admit("done", HunyuanSpec((3,), 4)), RequestError, "already used"),
    ("live id reused", lambda rt: rt.admit("live", DZ), RequestError, "already live"),
    ("closed session", lambda rt: rt.scheduler.plan("closed", "commit"), RequestError, "'closed' is released"),
    ("too many rows", lambda rt: rt.admit("x", DZ, rows=3), RequestError, "max_rows"),
    ("window below chunk", lambda rt: rt.admit("x", DreamZeroSpec(8, 3, 2)), ConfigError,
     "smaller than a chunk"),
    ("larger than pool", lambda rt: rt.admit("x", HunyuanSpec((4 * 70,), 4)), CapacityError,
     "can never fit"),
    ("prefix capacity too small", lambda rt: rt.scheduler.plan("live_r", "prefill", prefix_capacity=2),
     RequestError, "below the longest prompt"),
    ("another family's kind", lambda rt: rt.scheduler.plan("live_r", "commit"), RequestError, "unknown phase 'commit'"),
    ("target span too long", lambda rt: rt.admit("x", HunyuanSpec((3,), 200)), ConfigError, "scratch"),
]


def test_page_size_block_not_dividing_frame_is_admitted():
    """Blocks that divide no frame (6-token frames in 4-token blocks) were refused ("DreamZero pages by frame");
    now a block holds tokens of any frames: the second commit continues the first one's partial block."""
    rt = make_runtime()
    rt.admit("x", DreamZeroSpec(6, 1, 4))
    first = rt.scheduler.plan("x", "commit")
    assert [len(b) for b in first.new_blocks] == [2, 2]  # 6 tokens: one full block and half of the next
    run_forward(rt, first)
    second = rt.scheduler.plan("x", "commit")
    assert [len(b) for b in second.new_blocks] == [1, 1]  # tokens 6..11: the rest of block 1, then block 2
    assert second.rows[0].positions.tolist() == list(range(6, 12))
    assert second.rows[0].table[:3].tolist() == rt.scheduler.owners["x"].rows[0] + second.new_blocks[0]
    run_forward(rt, second)
    assert [len(r) for r in rt.scheduler.owners["x"].rows] == [3, 3]


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_is_refused_without_change(case):
    _, call, exc, text = case
    rt = make_runtime()
    rt.admit("done", HunyuanSpec((3,), 4))
    rt.release("done")
    rt.admit("live", DZ)
    rt.admit("closed", DZ)
    rt.release("closed")
    rt.admit("live_r", HunyuanSpec((5,), 4))
    before = rt.state()
    with pytest.raises(exc, match=text):
        call(rt)
    assert rt.state() == before


def test_admission_refused_when_pool_full_leaves_state():
    rt = make_runtime(blocks=6)
    rt.admit("a", HunyuanSpec((12, 8), 4))  # 3 + 2 blocks
    before = rt.state()
    with pytest.raises(CapacityError, match="free"):
        rt.admit("b", HunyuanSpec((4, 4), 4))  # needs 2, 1 free: neither row is admitted
    assert rt.state() == before


def test_lru_cap_evicts_least_recently_used_session():
    rt = make_runtime(max_sessions=2)
    for sid in ("a", "b"):
        rt.admit(sid, DZ)
        run_forward(rt, rt.scheduler.plan(sid, "commit"))
    run_forward(rt, rt.scheduler.plan("a", "denoise"))  # "a" is now the most recent
    rt.admit("c", DZ)
    assert set(rt.scheduler.owners) == {"a", "c"}
    with pytest.raises(RequestError, match="evicted"):
        rt.scheduler.plan("b", "denoise")
    assert_ownership_consistent(rt)


# ---- random lifecycles ---------------------------------------------------------------------------
class Lifecycles(RuleBasedStateMachine):
    """Random admit/forward/commit/abort/fail/evict/reset/finish: ownership stays exact."""

    def __init__(self):
        super().__init__()
        self.rt = make_runtime(blocks=24, max_sessions=3)
        self.counter = 0

    def _new_id(self) -> str:
        self.counter += 1
        return f"id{self.counter}"

    def _refused(self, call) -> None:
        before = self.rt.state()
        try:
            call()
        except (CapacityError, RequestError, ConfigError):
            assert self.rt.state() == before, "a refused call changed the state"

    @rule(sink=st.booleans(), rows=st.integers(1, 2))
    def open_session(self, sink, rows):
        self._refused(lambda: self.rt.admit(self._new_id(), DZ_SINK if sink else DZ, rows=rows))

    @rule(prefixes=st.lists(st.integers(1, 40), min_size=1, max_size=2), target_len=st.integers(1, 12))
    def admit(self, prefixes, target_len):
        self._refused(lambda: self.rt.admit(self._new_id(), HunyuanSpec(tuple(prefixes), target_len)))

    def _live(self, family):
        return [o for o, v in self.rt.scheduler.owners.items() if v.family.name == family]

    @precondition(lambda self: self._live("dreamzero"))
    @rule(data=st.data(), commit=st.booleans(), fail=st.booleans())
    def dreamzero_forward(self, data, commit, fail):
        sid = data.draw(st.sampled_from(self._live("dreamzero")))
        before = self.rt.state()
        try:
            plan = self.rt.scheduler.plan(sid, "commit" if commit else "denoise")
        except CapacityError:
            assert self.rt.state() == before
            return
        run_forward(self.rt, plan, fail=fail)
        if fail:
            assert self.rt.state()["owners"] == before["owners"]

    @precondition(lambda self: self._live("hunyuan_image3"))
    @rule(data=st.data(), fail=st.booleans())
    def hunyuan_forward(self, data, fail):
        rid = data.draw(st.sampled_from(self._live("hunyuan_image3")))
        owner = self.rt.scheduler.owners[rid]
        phase = "step" if "prefill" in owner.phases_done else "prefill"
        capacity = max(owner.spec.prefix_lens)
        plan = self.rt.scheduler.plan(rid, phase, prefix_capacity=capacity,
                                      attention_mask=owner.spec.padded_mask(capacity) if phase == "prefill"
                                      else None)
        run_forward(self.rt, plan, fail=fail)

    @precondition(lambda self: self.rt.scheduler.owners)
    @rule(data=st.data(), how=st.sampled_from(["abort", "finish", "reset"]))
    def end(self, data, how):
        oid = data.draw(st.sampled_from(list(self.rt.scheduler.owners)))
        family = self.rt.scheduler.owners[oid].family.name
        if how == "abort":
            self.rt.abort(oid)
        elif family == "dreamzero":
            (self.rt.reset if how == "reset" else self.rt.release)(oid)
        else:
            self.rt.release(oid)

    @invariant()
    def ownership_is_exact(self):
        assert_ownership_consistent(self.rt)
        assert self.rt.scheduler.in_flight is None and self.rt.active is None

    def teardown(self):
        for oid in list(self.rt.scheduler.owners):
            self.rt.abort(oid)
        assert self.rt.scheduler.allocator.num_free == self.rt.pool.blocks_per_layer, "free count back to baseline"
        self.rt.close()


TestLifecycles = Lifecycles.TestCase
TestLifecycles.settings = settings(
    max_examples=500, stateful_step_count=15, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
