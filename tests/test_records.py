"""The records the scheduler and the families share are typed: an owner holds its family and that family's own
record, and a forward plan is complete when made, never edited after."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paged_kv_compile import PagedKVConfig
from paged_kv_compile.families import DREAMZERO, HUNYUAN_IMAGE3
from paged_kv_compile.families.dreamzero import DreamZeroRecord, DreamZeroSpec, dreamzero_runtime_config
from paged_kv_compile.families.hunyuan_image3 import HunyuanRecord, HunyuanSpec
from paged_kv_compile.models.dreamzero import DreamZeroConfig
from paged_kv_compile.runtime import PagedKVRuntime

B = 4
DZ = DreamZeroSpec(frame_seqlen=8, chunk_frames=1, window_frames=4, sink_frames=0, action_tokens=3)


def small_runtime() -> PagedKVRuntime:
    return PagedKVRuntime(PagedKVConfig(num_layers=2, num_kv_heads=1, head_dim=4, block_size=B, blocks_per_layer=64,
                                        max_rows=2, scratch_tokens_per_row=64))


def test_an_owner_holds_its_family_and_that_familys_record():
    rt = small_runtime()
    sched = rt.scheduler
    rt.admit("s", DZ, rows=2)
    owner = rt.owner("s")
    assert owner.family is DREAMZERO and owner.state == DreamZeroRecord([0, 0])
    sched.finish_forward(sched.plan("s", "commit"))
    assert owner.state.commits == [1, 1]
    rt.fork("s", "c")
    child = rt.owner("c")
    assert child.family is DREAMZERO and child.state == DreamZeroRecord([1, 1])
    assert child.state is not owner.state and child.state.commits is not owner.state.commits  # its own record
    sched.finish_forward(sched.plan("c", "commit"))
    assert child.state.commits == [2, 2] and owner.state.commits == [1, 1]
    rt.reset("s")
    assert owner.state == DreamZeroRecord([0, 0])  # a window reset starts the count again

    rt.admit("r", HunyuanSpec((5, 3), 4), rows=2)
    request = rt.owner("r")
    assert request.family is HUNYUAN_IMAGE3 and request.state == HunyuanRecord()  # no layout before the prefill
    mask = HunyuanSpec((5, 3), 4).padded_mask(8)
    sched.finish_forward(sched.plan("r", "prefill", prefix_capacity=8, attention_mask=mask))
    assert len(request.state.layouts) == 2 and not request.state.step_mask_checked
    step = sched.plan("r", "step", prefix_capacity=8)
    assert step.state is None  # nothing new to record: the request's record stays as it is
    sched.finish_forward(step)
    assert len(request.state.layouts) == 2
    rt.reset("r")
    assert request.state == HunyuanRecord()


def test_a_plan_is_never_edited_after_it_is_made():
    """The scheduler used to write `plan.regions` into the plan its family returned; it now makes the plan with
    them (a new plan), and a plan refuses any edit."""
    cfg = DreamZeroConfig(num_layers=2, frame_seqlen=4, num_frame_per_block=1, local_attn_size=3, text_len=6)
    rt = PagedKVRuntime(dreamzero_runtime_config(cfg, cross_regions=2, kernel="reference"))
    kv = [torch.randn(2, 2, cfg.text_len, cfg.num_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    rt.admit("s", DreamZeroSpec.from_model_config(cfg), cross_kv=kv)
    plan = rt.plan("s", "commit")
    assert plan.regions == rt.regions_of("s")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.regions = None
    rt.scheduler.abort_forward(plan)
