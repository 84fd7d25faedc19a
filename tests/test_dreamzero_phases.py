"""DreamZero per-phase geometry and per-branch forwards (vllm-omni's pipeline, tests/upstream for the model).

vllm-omni's pipeline commits ONE frame into an empty window, later commits `num_frame_per_block` frames, and
neither carries the action/state registers that denoising forwards carry; each CFG branch is its own batch-1
forward over its own cache. Our reference model commits whole chunks with registers: one phase for all.
"""

from __future__ import annotations

import pytest

from paged_kv_compile import PagedKVConfig, RequestError
from paged_kv_compile.config import Bucket
from paged_kv_compile.models.dreamzero import DreamZeroConfig
from paged_kv_compile.runtime import PagedKVRuntime
from paged_kv_compile.families.dreamzero import DreamZeroSpec

FS = 8
OMNI = DreamZeroSpec(frame_seqlen=FS, chunk_frames=2, window_frames=5, action_tokens=4, first_commit_frames=1,
                     commit_action_tokens=0)


def _runtime() -> PagedKVRuntime:
    return PagedKVRuntime(PagedKVConfig(num_layers=2, num_kv_heads=1, head_dim=4, block_size=FS, blocks_per_layer=16,
                                        max_rows=2, scratch_tokens_per_row=OMNI.tokens_per_forward))


def test_phases_and_buckets():
    assert OMNI.phases() == [(FS, 0), (2 * FS, 0), (2 * FS, 4)]
    assert OMNI.buckets(rows=1) == (Bucket(1, 8, 40), Bucket(1, 16, 40), Bucket(1, 20, 40))
    assert OMNI.tokens_per_forward == 20
    ours = DreamZeroSpec.from_model_config(DreamZeroConfig())  # reference model: one phase
    assert len(ours.phases()) == 1 and ours.phase("commit") == ours.phase("denoise")


def test_branch_forwards_follow_the_phase_geometry():
    rt = _runtime()
    rt.admit("s", OMNI, rows=2)
    for branch in (0, 1):  # the first commit of each branch's empty window: one frame, no registers
        with rt.forward("s", "commit", branch=branch) as active:
            plan = active.plan
            assert (len(plan.rows), plan.tokens, plan.phase) == (1, FS, {"chunk_tokens": FS, "action_tokens": 0})
            assert [len(b) for b in plan.new_blocks] == ([1, 0] if branch == 0 else [0, 1])
    assert [len(r) for r in rt.scheduler.owners["s"].rows] == [1, 1]
    with rt.forward("s", "denoise", branch=1) as active:  # denoise: chunk + registers in scratch
        row = active.plan.rows[0]
        assert active.plan.tokens == 2 * FS + 4 and row.positions.tolist() == list(range(FS, 3 * FS + 4))
        assert active.plan.new_blocks == []
    with rt.forward("s", "commit", branch=0) as active:  # a later commit: the whole chunk
        assert active.plan.tokens == 2 * FS and active.plan.rows[0].positions.tolist() == list(range(FS, 3 * FS))
    assert [len(r) for r in rt.scheduler.owners["s"].rows] == [3, 1]
    for _ in range(2):  # fill branch 0's window: 3 -> 5 -> 7 frames committed, the window keeps what it needs
        with rt.forward("s", "commit", branch=0):
            pass
    with rt.forward("s", "denoise", branch=0) as active:
        assert active.plan.rows[0].positions[0].item() == (5 - 2) * FS  # window - chunk frames of history
    rt.reset("s")
    with rt.forward("s", "commit", branch=0) as active:  # an empty window again: a first commit
        assert active.plan.tokens == FS


def test_unknown_branch_is_refused():
    rt = _runtime()
    rt.admit("s", OMNI, rows=2)
    with pytest.raises(RequestError, match="branch 2 does not exist"):
        rt.forward("s", "commit", branch=2)
    assert rt.scheduler.in_flight is None
