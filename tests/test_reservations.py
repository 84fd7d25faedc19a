"""Admission arithmetic in one place (`reservations.Reservations`), read on the scheduler's live state.

A multi-rank restore (`RankRuntime._restore`) replaces the scheduler's allocator, owners and regions with saved
copies: whatever counts held blocks must read the live ones, never an object it captured before.
"""

from __future__ import annotations

import copy

import pytest
import torch

from paged_kv_compile import ConfigError, PagedKVConfig
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
from paged_kv_compile.models.dreamzero import DreamZeroConfig
from paged_kv_compile.reservations import Reservations
from paged_kv_compile.runtime import PagedKVRuntime

B = 4
DZ = DreamZeroSpec(frame_seqlen=8, chunk_frames=1, window_frames=4, sink_frames=0, action_tokens=3)


def restore_a_saved_state(rt: PagedKVRuntime) -> None:
    """What a RankRuntime does when another rank refuses a call: the scheduler's vars replaced by a saved copy."""
    sched = rt.scheduler
    saved = copy.deepcopy(vars(sched), memo={id(sched.pool): sched.pool})
    vars(sched).clear()
    vars(sched).update(saved)


def test_the_fp8_scale_guard_reads_the_allocator_a_restore_put_in_place():
    """Before: the scheduler patched `pool.blocks_held` with a closure over the allocator of its construction;
    after a restore replaced that allocator, the closure read the dead one (0 held) and new scales were accepted
    while a session's history was held."""
    cfg = DreamZeroConfig(num_layers=2, frame_seqlen=4, num_frame_per_block=1, local_attn_size=3, text_len=6)
    rt = PagedKVRuntime(dreamzero_runtime_config(cfg, kernel="reference", kv_dtype=torch.float8_e4m3fn))
    original = rt.scheduler.allocator
    restore_a_saved_state(rt)
    assert rt.scheduler.allocator is not original  # the restore put a copy in place
    rt.admit("s", DreamZeroSpec.from_model_config(cfg))
    rt.scheduler.finish_forward(rt.scheduler.plan("s", "commit"))  # history held, quantized with these scales
    held = rt.scheduler.held_blocks()
    assert held > 0 and original.num_free == original.num_blocks  # the dead allocator holds nothing
    scales = rt.pool.scales.clone()
    with pytest.raises(ConfigError, match=f"set_scales while {held} blocks per layer are held"):
        rt.pool.set_scales(0.5, 0.25)
    assert torch.equal(rt.pool.scales, scales)
    rt.release("s")
    rt.pool.set_scales(0.5, 0.25)  # nothing held: accepted


def test_the_pool_is_not_patched_from_outside():
    rt = PagedKVRuntime(PagedKVConfig(num_layers=2, num_kv_heads=1, head_dim=4, block_size=B, blocks_per_layer=32,
                                      max_rows=2, scratch_tokens_per_row=32))
    from paged_kv_compile.scheduler import Scheduler

    assert "blocks_held" not in Scheduler.__init__.__code__.co_names  # the scheduler no longer sets it on the pool
    assert rt.pool.blocks_held() == 0
    rt.admit("s", DZ, rows=2)
    rt.scheduler.finish_forward(rt.scheduler.plan("s", "commit"))
    held = sum(len(row) for row in rt.scheduler.owners["s"].rows)
    assert held > 0 and rt.pool.blocks_held() == rt.scheduler.held_blocks() == held


def test_what_reservations_say_a_release_frees_is_what_it_frees():
    """One reference-count loop serves 'held alone' and 'freed by a release': checked against a real release of a
    parent whose blocks a fork shares, of the fork, and of an owner that holds blocks alone."""
    rt = PagedKVRuntime(PagedKVConfig(num_layers=2, num_kv_heads=1, head_dim=4, block_size=B, blocks_per_layer=64,
                                      max_rows=2, scratch_tokens_per_row=32))
    sched = rt.scheduler
    rt.admit("a", DZ, rows=2)
    for _ in range(2):
        sched.finish_forward(sched.plan("a", "commit"))
    rt.fork("a", "b")
    sched.finish_forward(sched.plan("b", "commit"))  # b's own blocks beside the shared history
    rt.admit("c", DZ, rows=1)
    sched.finish_forward(sched.plan("c", "commit"))
    for oid in ("a", "b", "c"):
        res = sched.reservations
        assert isinstance(res, Reservations)
        predicted = res.freed_by(sched.owners[oid])
        alone = res.alone_held(sched.owners[oid])
        free = sched.allocator.num_free
        rt.release(oid)
        assert sched.allocator.num_free - free == predicted, oid
        assert alone == predicted, oid  # no regions here: rows alone are what a release frees
    assert sched.held_blocks() == 0
