"""A forward never runs on metadata built for another plan.

The metadata builder skips a build whose key repeats the bucket's last one (`MetadataBuilder.build`), so a key must
name everything the build depends on, for the runtime's whole life, and a build whose forward was aborted must not
be repeated. Each test drives the runtime to the issue's scenario and compares what the op would read (every
layer's slot mapping and block table, from the bucket's buffers) with the layout of the forward that runs
(`test_metadata.expected_layer_metadata`, token by token from the plan and the pool's addressing).
"""

from __future__ import annotations

import pytest
import torch
from helpers import left_padded_mask
from test_metadata import expected_layer_metadata

from paged_kv_compile import PagedKVConfig
from paged_kv_compile.families.dreamzero import DreamZeroSpec
from paged_kv_compile.families.hunyuan_image3 import HunyuanSpec
from paged_kv_compile.runtime import PagedKVRuntime
from paged_kv_compile.scheduler import Scheduler

B = 4
SPEC = DreamZeroSpec(frame_seqlen=8, chunk_frames=1, window_frames=4, sink_frames=0, action_tokens=3)


def runtime() -> PagedKVRuntime:
    cfg = PagedKVConfig(num_layers=2, num_kv_heads=1, head_dim=4, block_size=B, blocks_per_layer=48, max_rows=2,
                        scratch_tokens_per_row=32)
    return PagedKVRuntime(cfg)


def assert_reads_its_own_layout(rt: PagedKVRuntime, active) -> None:
    meta = active.meta
    for layer in range(rt.pool.num_layers):
        slots, table = expected_layer_metadata(rt.pool, active.plan.rows, layer, active.bucket.tokens, meta.width)
        assert torch.equal(meta.slot_mapping[layer], slots), f"layer {layer} would write at another plan's slots"
        assert torch.equal(meta.block_table[layer], table), f"layer {layer} would read another plan's blocks"


def test_a_reused_id_is_never_served_its_predecessors_build(monkeypatch):
    """Issue 23, defect 6: after FINISHED_MEMORY (4,096) finished ids an id is accepted again, and its owner's
    denoising step had the same repeat key (id, kind, version, branch) as its predecessor's last one: the bucket's
    build was skipped and the new session read the old one's history blocks, now another session's. Keys name
    the owner by an admission serial, never reused (the memory is shrunk to 2 ids here through the class)."""
    monkeypatch.setattr(Scheduler, "FINISHED_MEMORY", 2)
    rt = runtime()
    rt.admit("a", SPEC, rows=2)
    with rt.forward("a", "commit"):
        pass
    with rt.forward("a", "denoise") as active:  # version 1: reads its history
        old = {b for row in active.plan.rows for b in row.table[row.managed].tolist()}
    assert old
    rt.release("a")
    rt.admit("b", SPEC, rows=1)  # another tenant, another bucket (one row): it takes a's freed blocks
    for _ in range(2):
        with rt.forward("b", "commit"):
            pass
    assert old & {blk for row in rt.owner("b").rows for blk in row}
    for i in range(2):  # "a" leaves the finished-id memory
        rt.admit(f"x{i}", SPEC, rows=2)
        rt.release(f"x{i}")
    rt.admit("a", SPEC, rows=2)  # accepted again
    rt.reset("a")  # version 1 without a forward; no history
    with rt.forward("a", "denoise") as active:
        assert not any(bool(row.managed.any()) for row in active.plan.rows), "the new session has no history"
        assert_reads_its_own_layout(rt, active)


def test_a_retried_prefill_with_another_mask_is_built_for_that_mask():
    """Issue 23, defect 3: a HunyuanImage-3 prefill that failed after its metadata was built, retried with another
    valid mask for the same spec (the padding moved), reused the build: the prefill key (owner, kind, version,
    capacity) has no mask in it and the aborted forward left it as the bucket's last key. The op wrote with the
    first mask's positions while `finish` stored the second mask's layout."""
    rt = runtime()
    spec = HunyuanSpec((3, 5), 4, ((1, 3),))
    capacity = 6
    middle = spec.padded_mask(capacity)  # [prompt | pad | target]
    left = left_padded_mask(spec, capacity)  # [pad | prompt | target]
    rt.admit("r", spec)
    with pytest.raises(RuntimeError, match="injected"):
        with rt.forward("r", "prefill", prefix_capacity=capacity, attention_mask=middle):
            raise RuntimeError("injected: a layer failed after the metadata was built")
    with rt.forward("r", "prefill", prefix_capacity=capacity, attention_mask=left) as active:
        assert active.plan.rows[0].positions.tolist() != middle_positions(spec, capacity)
        assert_reads_its_own_layout(rt, active)


def middle_positions(spec: HunyuanSpec, capacity: int) -> list[int]:
    p = spec.prefix_lens[0]
    return list(range(p)) + [-1] * (capacity - p) + list(range(p, p + spec.target_len))


def test_an_aborted_forward_leaves_no_build_to_repeat():
    """The runtime half of defect 3's fix: whatever the key, a build whose forward was rolled back is forgotten."""
    rt = runtime()
    rt.admit("s", SPEC, rows=2)
    with pytest.raises(RuntimeError):
        with rt.forward("s", "denoise") as active:
            assert active.meta.last_key
            raise RuntimeError("injected")
    assert active.meta.last_key == ()


def test_a_prefill_has_no_repeat_key():
    """The family half of defect 3's fix: a prefill's layout comes from its mask, which its key cannot name."""
    rt = runtime()
    spec = HunyuanSpec((3,), 4)
    rt.admit("r", spec)
    plan = rt.scheduler.plan("r", "prefill", prefix_capacity=4, attention_mask=spec.padded_mask(4))
    assert plan.key == ()
    rt.scheduler.finish_forward(plan)
    step = rt.scheduler.plan("r", "step", prefix_capacity=4)
    assert step.key and step.key[0] == rt.owner("r").serial
