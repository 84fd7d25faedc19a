"""Admission by real need: a DreamZero session is sized by what its loop can hold, and never holds more.

`families/dreamzero.py: session_blocks_per_row` is what admission checks against the pool. The oracle here is
the real scheduler driven through the loop (`models/dreamzero.py: dreamzero_steps`: commit the previous chunk,
denoise the current one, reset the window when the start frame reaches the reset frame), with the blocks it
holds read from the allocator.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv_compile import CapacityError, RequestError
from paged_kv_compile.allocator import BuiltinAllocator
from paged_kv_compile.families.dreamzero import DreamZeroSpec, session_blocks_per_row
from paged_kv_compile.models.dreamzero import DREAMZERO_14B
from paged_kv_compile.pool import KVPool
from paged_kv_compile.scheduler import Scheduler


def meta_scheduler(spec: DreamZeroSpec, block: int, blocks_per_layer: int, rows: int = 2) -> Scheduler:
    scratch = -(-spec.tokens_per_forward // block) + 1
    pool = KVPool(2, blocks_per_layer, block, 1, 4, scratch_rows=rows, scratch_blocks_per_row=scratch, device="meta")
    return Scheduler(pool, BuiltinAllocator(blocks_per_layer), max_rows=rows)


def drive_loop(sched: Scheduler, sid: str, spec: DreamZeroSpec, chunks: int) -> int:
    """Run `chunks` chunks of the loop, every phase; the most blocks per layer the session held at once."""
    used = lambda: sched.num_blocks - sched.allocator.num_free  # noqa: E731
    peak, start, previous = 0, 0, None
    for _ in range(chunks):
        if previous is not None:
            plan = sched.plan(sid, "commit")
            peak = max(peak, used())
            sched.finish_forward(plan)
        frames = spec.first_commit_frames if start == 0 and spec.first_commit_frames else spec.chunk_frames
        sched.finish_forward(sched.plan(sid, "denoise"))
        peak = max(peak, used())
        previous, start = frames, start + frames
        if spec.reset_frames is not None and start >= spec.reset_frames:
            sched.reset(sid)
            start, previous = 0, None
    return peak


def loop_chunks(spec: DreamZeroSpec) -> int:
    """Two whole window cycles, or (no reset) long enough for the window to slide."""
    per_cycle = spec.reset_frames if spec.reset_frames is not None else spec.window_frames + 3
    return 2 * per_cycle // min(spec.chunk_frames, spec.first_commit_frames or spec.chunk_frames) + 2


def test_dreamzero_14b_needs_its_reset_frame_not_a_full_window():
    """The loop resets at frame 20 with 2-frame chunks: 9 commits, 18 frames per row; a sliding loop: 21."""
    spec = DreamZeroSpec.from_model_config(DREAMZERO_14B)
    per_frame = DREAMZERO_14B.frame_seqlen // 16
    assert spec.reset_frames == 20
    assert session_blocks_per_row(spec, 16) == 18 * per_frame
    sliding = DreamZeroSpec(**{**spec.__dict__, "reset_frames": None})
    assert session_blocks_per_row(sliding, 16) == 21 * per_frame


SPECS = {
    "reset before the window fills": DreamZeroSpec(4, 2, 8, action_tokens=3, reset_frames=6),
    "reset after the window slides": DreamZeroSpec(4, 2, 6, action_tokens=3, reset_frames=16),
    "sink, sliding": DreamZeroSpec(4, 1, 5, sink_frames=1, action_tokens=2),
    "vllm-omni: 1-frame first commit, no registers": DreamZeroSpec(4, 2, 7, action_tokens=3, first_commit_frames=1,
                                                                   commit_action_tokens=0, reset_frames=7),
}


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
@pytest.mark.parametrize("block", [2, 4])
def test_session_runs_every_phase_in_a_pool_of_exactly_its_need(spec, block):
    """Admission's figure is the loop's real peak: reached, never exceeded, and one block less is refused."""
    need = 2 * session_blocks_per_row(spec, block)
    sched = meta_scheduler(spec, block, need)
    sched.admit("s", spec, rows=2)
    assert drive_loop(sched, "s", spec, loop_chunks(spec)) == need
    with pytest.raises(CapacityError, match=f"needs {need} blocks per layer .* whole pool has {need - 1}: it can never"):
        meta_scheduler(spec, block, need - 1).admit("s", spec, rows=2)


@settings(max_examples=60, deadline=None)
@given(frame_blocks=st.integers(1, 3), block=st.sampled_from([1, 2, 4]), chunk=st.integers(1, 3),
       extra=st.integers(0, 6), sink=st.integers(0, 2), first=st.sampled_from([None, 1]),
       reset=st.one_of(st.none(), st.integers(1, 14)), rows=st.integers(1, 2))
def test_admission_need_is_the_loop_peak_for_any_geometry(frame_blocks, block, chunk, extra, sink, first, reset, rows):
    window = chunk + sink + extra
    spec = DreamZeroSpec(frame_blocks * block, chunk, window, sink_frames=sink, action_tokens=1,
                         first_commit_frames=first, reset_frames=reset)
    need = rows * session_blocks_per_row(spec, block)
    sched = meta_scheduler(spec, block, max(need, 1), rows)
    sched.admit("s", spec, rows=rows)
    assert drive_loop(sched, "s", spec, loop_chunks(spec)) == need


def test_a_commit_past_the_reset_frame_is_refused_without_change():
    """A loop that does not reset where its spec says would hold more than admission sized it for."""
    spec = SPECS["reset before the window fills"]  # commits frames [0, 2), [2, 4); the chunk at 4 ends at the reset
    sched = meta_scheduler(spec, 4, 64)
    sched.admit("s", spec, rows=2)
    for _ in range(2):
        sched.finish_forward(sched.plan("s", "commit"))
    before = (sched.owned_blocks(), sched.allocator.num_free, sched.in_flight)
    with pytest.raises(RequestError, match="beyond the 4 its admission sized it for: .* resets the window at frame 6"):
        sched.plan("s", "commit")
    assert (sched.owned_blocks(), sched.allocator.num_free, sched.in_flight) == before
    sched.reset("s")
    sched.finish_forward(sched.plan("s", "commit"))  # after the reset it commits again


# ---- admission reserves what a session holds up to its reset --------------------------------
from paged_kv_compile.families.dreamzero import dreamzero_runtime_config  # noqa: E402
from paged_kv_compile.models.dreamzero import DreamZeroConfig  # noqa: E402
from paged_kv_compile.runtime import PagedKVRuntime  # noqa: E402

# Default-size blocks (one frame), a 4-frame window with a sink, reset at frame 6: 2 commits of 2 frames per cycle.
LOOP_CFG = DreamZeroConfig(num_layers=1, frame_seqlen=4, num_frame_per_block=2, local_attn_size=4, sink_size=1,
                           window_reset_frames=6, action_register_length=2)
LOOP_SPEC = DreamZeroSpec.from_model_config(LOOP_CFG)


def loop_steps(sched: Scheduler, sid: str, spec: DreamZeroSpec, start: int = 0, previous: bool = False):
    """One session's loop, one forward per `next` (as `dreamzero_steps` drives it): commit the previous chunk,
    denoise the current one (starting at frame `start`), reset the window when the start frame reaches the
    reset frame."""
    while True:
        if previous:
            sched.finish_forward(sched.plan(sid, "commit"))
            yield
        sched.finish_forward(sched.plan(sid, "denoise"))
        yield
        previous, start = True, start + spec.chunk_frames
        if spec.reset_frames is not None and start >= spec.reset_frames:
            sched.reset(sid)
            start, previous = 0, False


def interleave(sched: Scheduler, sids: list[str], forwards: int) -> None:
    """Every session's loop, one forward each in turn: none may ever wait for a block (CapacityError)."""
    loops = [loop_steps(sched, sid, LOOP_SPEC) for sid in sids]
    for _ in range(forwards):
        for loop in loops:
            next(loop)


def test_three_sessions_in_a_pool_for_one_deadlocked_now_the_second_is_refused():
    """Issue 23's case: a pool from dreamzero_runtime_config(cfg, sessions=1) admitted three sessions (admission
    took nothing); each committed once, then every commit of all three raised CapacityError, forever. Now the
    second admission is refused (what the first reserved is counted) and the first runs its loop to the end."""
    rt = PagedKVRuntime(dreamzero_runtime_config(LOOP_CFG, sessions=1))
    rt.admit("a", LOOP_SPEC)
    before = rt.state()
    with pytest.raises(CapacityError, match=r"admitting 'b' reserves 8 blocks per layer .* only 0 of the pool's 8 are "
                                            r"free to reserve .*the family's runtime config reserves room for exactly N owners"):
        rt.admit("b", LOOP_SPEC)
    assert rt.state() == before
    interleave(rt.scheduler, ["a"], 20)


@pytest.mark.parametrize("sessions", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 2])
def test_a_pool_built_for_n_sessions_admits_exactly_n_and_none_ever_waits(sessions, rows):
    """dreamzero_runtime_config's promise: N sessions are admitted, the N+1th is refused (state unchanged), and
    the N run their loops interleaved through window resets without any commit waiting for a block."""
    rt = PagedKVRuntime(dreamzero_runtime_config(LOOP_CFG, sessions=sessions, rows=rows))
    sids = [f"s{i}" for i in range(sessions)]
    for sid in sids:
        rt.admit(sid, LOOP_SPEC, rows=rows)
    before = rt.state()
    with pytest.raises(CapacityError, match="free to reserve"):
        rt.admit("extra", LOOP_SPEC, rows=rows)
    assert rt.state() == before
    interleave(rt.scheduler, sids, 16)  # two reset cycles each
    rt.reset(sids[0])  # a reset keeps the reservation: still no room
    with pytest.raises(CapacityError, match="free to reserve"):
        rt.admit("extra", LOOP_SPEC, rows=rows)


def test_forks_reserve_their_future_commits_and_evictions_free_reservations():
    """A fork shares its parent's history but commits into blocks of its own: it reserves a session's need. In
    a pool for two sessions, one fork fits and a second is refused (state unchanged) until the first ends; parent
    and fork then run their loops interleaved without waiting. An LRU eviction frees the victim's reservation."""
    rt = PagedKVRuntime(dreamzero_runtime_config(LOOP_CFG, sessions=2))
    rt.admit("a", LOOP_SPEC)
    loop = loop_steps(rt.scheduler, "a", LOOP_SPEC)
    for _ in range(3):  # denoise, commit, denoise: history shared from here
        next(loop)
    rt.fork("a", "b")
    before = rt.state()
    with pytest.raises(CapacityError, match=r"forking 'a' into 'c' reserves 8 blocks per layer .* only 0 of the "
                                            r"pool's 16 are free to reserve"):
        rt.fork("a", "c")
    assert rt.state() == before
    with pytest.raises(CapacityError, match="free to reserve"):
        rt.admit("c", LOOP_SPEC)
    rt.release("b")
    rt.fork("a", "c")
    fork_loop = loop_steps(rt.scheduler, "c", LOOP_SPEC, start=4, previous=True)  # where its parent is: commit next
    for _ in range(16):
        next(loop)
        next(fork_loop)

    lru = PagedKVRuntime(dreamzero_runtime_config(LOOP_CFG, sessions=1), max_sessions=1)
    lru.admit("old", LOOP_SPEC)
    lru.admit("new", LOOP_SPEC)  # evicts "old": its reservation is freed, so "new" fits
    assert lru.scheduler.finished["old"].startswith("evicted")
    interleave(lru.scheduler, ["new"], 10)


# ---- forks with a budget: a candidate that commits once reserves one commit, not a session ----------------------
def _parent_with_history(rt: PagedKVRuntime) -> None:
    rt.admit("a", LOOP_SPEC)
    loop = loop_steps(rt.scheduler, "a", LOOP_SPEC)
    for _ in range(3):  # denoise, commit, denoise: "a" holds one chunk (2 blocks per row)
        next(loop)


def test_forks_with_a_commit_budget_reserve_their_commits_and_a_commit_beyond_is_refused():
    """In a pool for three sessions, two full forks fit beside the parent (each reserves a session: 8 blocks);
    forks with commits=1 reserve the 4 blocks one commit of both rows takes, so three fit, counted as: what is held
    (the parent's 4, shared) + what the parent may still add once all its blocks are shared (8) + each budget (4).
    Each commits once; a second commit is refused with the runtime unchanged. Released, their budgets free."""
    rt = PagedKVRuntime(dreamzero_runtime_config(LOOP_CFG, sessions=3))
    _parent_with_history(rt)
    for k in range(3):
        rt.fork("a", f"c{k}", commits=1)
    before = rt.state()
    with pytest.raises(CapacityError, match=r"forking 'a' into 'c3' reserves 4 blocks per layer .* only 0 of the "
                                            r"pool's 24 are free to reserve"):
        rt.fork("a", "c3", commits=1)
    assert rt.state() == before
    for k in range(3):
        rt.scheduler.finish_forward(rt.scheduler.plan(f"c{k}", "commit"))
    before = rt.state()
    with pytest.raises(RequestError, match=r"would take 4 blocks per layer for 'c0', a fork with a budget of 0 more"):
        rt.scheduler.plan("c0", "commit")
    assert rt.state() == before
    rt.scheduler.finish_forward(rt.scheduler.plan("c0", "denoise"))  # denoising takes nothing: still allowed
    with pytest.raises(RequestError, match="commits=-1: a fork's commit budget is a count of chunks"):
        rt.fork("a", "bad", commits=-1)
    for k in range(3):
        rt.release(f"c{k}")
    rt.fork("a", "full")  # no budget: a session's reservation, which fits again
    rt.admit("x", LOOP_SPEC)  # 8 + 8 + 8 of 24
    with pytest.raises(CapacityError, match="free to reserve"):
        rt.admit("y", LOOP_SPEC)


WIDE = DreamZeroSpec(frame_seqlen=4, chunk_frames=2, window_frames=8, action_tokens=2, reset_frames=8)


def test_a_fork_is_checked_as_if_its_parent_shared_every_block(monkeypatch):
    """After a fork the parent's blocks are shared: it may drop them all (its fork keeps them) and take its whole
    reservation anew. A window of 8 frames resetting at frame 8 holds at most 6 frames per row (12 blocks for 2
    rows). After two commits the parent holds 8, all of which a fork would share; in a pool of 16, its 12 to come
    and a commits=1 fork's 4 do not fit beside them, and the fork is refused. Checked as if the parent still held
    its blocks alone, the fork was admitted, and after a window reset the parent's second commit waited for a
    block its fork held: what the refusal prevents."""
    def parent(sched):
        sched.admit("a", WIDE, rows=2)
        for _ in range(2):
            sched.finish_forward(sched.plan("a", "commit"))

    sched = meta_scheduler(WIDE, 4, 16)
    parent(sched)
    with pytest.raises(CapacityError, match=r"forking 'a' into 'c' reserves 4 blocks per layer .* only 0 of the "
                                            r"pool's 16 are free to reserve"):
        sched.fork("a", "c", commits=1)

    check = Scheduler._check_reserved
    monkeypatch.setattr(Scheduler, "_check_reserved",
                        lambda self, what, need, victim, **kw: check(self, what, need, victim, budget=kw.get("budget")))
    blind = meta_scheduler(WIDE, 4, 16)
    parent(blind)
    blind.fork("a", "c", commits=1)
    blind.finish_forward(blind.plan("c", "commit"))
    blind.reset("a")
    blind.finish_forward(blind.plan("a", "commit"))
    with pytest.raises(CapacityError, match="free blocks per layer"):
        blind.plan("a", "commit")
