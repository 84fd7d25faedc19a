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
