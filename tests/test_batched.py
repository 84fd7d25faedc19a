"""Batched forwards: one forward carries the rows of several owners at the same phase.

Batch invariance is the oracle: an owner's output inside a batch equals its output alone (fp32, reference
kernel, <= 1e-6), for K forked DreamZero candidates run through the compiled model and for HunyuanImage-3
requests through the op. A batch is all or nothing: refusals and failures leave every owner as it was.
"""

from __future__ import annotations

import pytest
import torch
from test_fork import CFG, SPEC, assert_refcounts_exact, chunk_inputs, commit_empty, cross_kvs, make_model_rig
from test_fork import make_runtime as make_dz_runtime

from paged_kv_compile import PagedKVConfig, RequestError, families
from paged_kv_compile.config import Bucket
from paged_kv_compile.families.dreamzero import DreamZeroSpec
from paged_kv_compile.runtime import PagedKVRuntime
from paged_kv_compile.families.hunyuan_image3 import HunyuanSpec

INVARIANCE_TOL = 1e-6


pytestmark = pytest.mark.usefixtures("fresh_dynamo", "no_grad")


def batched_call(rt, model, sids, inputs, start, commit, t=0.0):
    """One model forward over the rows of `sids` (2 CFG rows each); per session (video, actions)."""
    x = torch.cat([i[0] for i in inputs])
    a = torch.cat([i[1] for i in inputs])
    rows = x.shape[0]
    caches = families.for_model(model).standin_caches(rt, model, rows)
    kind = "commit" if commit else "denoise"
    with rt.forward_batch([(sid, kind) for sid in sids]):
        video, act, _ = model(x, a, torch.full((rows,), t), start, caches, cross_kvs(model, rows),
                              update_kv_cache=commit)
    return [(video[2 * k : 2 * k + 2], act[2 * k : 2 * k + 2]) for k in range(len(sids))]


def alone_call(rt, model, sid, inp, start, commit, t=0.0):
    return batched_call(rt, model, [sid], [inp], start, commit, t)[0]


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_batched_forked_candidates_equal_their_forwards_alone():
    """K = 4 children of one parent: their commits and denoising steps as rows of ONE forward equal the
    same forwards run one child at a time (two sets of children from the same parent state)."""
    K = 4
    model, _, rt = make_model_rig(rows_per_forward=2 * K, sessions=2 * K + 1)
    rt.admit("p", SPEC)
    for chunk in range(3):
        alone_call(rt, model, "p", chunk_inputs(chunk), chunk, commit=True)
    for k in range(K):
        rt.fork("p", f"alone{k}")
        rt.fork("p", f"batch{k}")
    rt.metadata.buffers(Bucket(2 * K, CFG.tokens_per_forward, CFG.max_attention_size))  # its padding copy: not counted
    builds, copies = rt.metadata.builds, rt.metadata.copies
    worst = 0.0
    for step, (start, commit) in enumerate([(3, True), (4, False), (4, True), (5, False)]):
        inputs = [chunk_inputs(1000 * step + k) for k in range(K)]
        t = 0.0 if commit else 250.0
        alone = [alone_call(rt, model, f"alone{k}", inputs[k], start, commit, t) for k in range(K)]
        batch = batched_call(rt, model, [f"batch{k}" for k in range(K)], inputs, start, commit, t)
        worst = max(worst, *(max_diff(a, b) for a, b in zip(alone, batch)))
    print(f"\nbatched forked candidates (K={K}): max |batched - alone| = {worst:.3g}")
    assert worst <= INVARIANCE_TOL, worst
    # Each batched forward built its metadata once (one copy) for all of its owners; alone: one per owner.
    assert rt.metadata.builds - builds == 4 * K + 4 and rt.metadata.copies - copies == 4 * K + 4
    owned = rt.scheduler.owned_blocks()
    for k in range(K):  # the same history layout (fresh blocks of their own) as the children run alone
        assert [len(r) for r in owned[f"batch{k}"]] == [len(r) for r in owned[f"alone{k}"]]
    assert_refcounts_exact(rt)


def test_batched_forward_failure_rolls_back_every_owner():
    rt = make_dz_runtime(sessions=4, max_rows=6)
    for sid in ("a", "b"):
        rt.admit(sid, SPEC)
        commit_empty(rt, sid, 2)
    rt.fork("a", "a2")
    before = rt.state()
    with pytest.raises(RuntimeError, match="injected"):
        with rt.forward_batch([("a", "commit"), ("b", "commit"), ("a2", "commit")]) as active:
            assert len(active.plan.rows) == 6 and len(active.plan.parts) == 3
            raise RuntimeError("injected inside the batched forward")
    assert rt.state() == before
    assert_refcounts_exact(rt)
    with rt.forward_batch([("a", "commit"), ("b", "commit"), ("a2", "commit")]):
        pass
    assert all(rt.scheduler.owners[sid].state.commits == [3, 3] for sid in ("a", "b", "a2"))
    assert_refcounts_exact(rt)
    assert rt.scheduler.owners["a"].phases_done == {"commit"}


def test_batched_refusals_change_nothing():
    rt = make_dz_runtime(sessions=4, max_rows=4)
    for sid in ("a", "b", "c"):
        rt.admit(sid, SPEC)
    commit_empty(rt, "a", 1)
    rt.admit("h", HunyuanSpec((4,), 2))
    cases = [
        ([], "needs at least one"),
        ([("a", "commit"), ("a", "commit")], r"\['a'\] appear more than once"),
        ([("a", "commit"), ("b", "denoise")], "one family at one phase"),
        ([("a", "denoise"), ("h", "step")], "one family at one phase"),
        ([("a", "commit"), ("nope", "commit")], "unknown id 'nope'"),
        # the third owner's rows do not fit: the commits planned for a and b are given back
        ([("a", "commit"), ("b", "commit"), ("c", "commit")], "more than max_rows=4 rows"),
        (["a"], "batch items are"),
    ]
    for items, match in cases:
        before = rt.state()
        with pytest.raises(RequestError, match=match):
            rt.forward_batch(items)
        assert rt.state() == before, items
    assert_refcounts_exact(rt)


def test_batched_owners_must_share_the_phase_geometry():
    """vllm-omni's geometry: the first commit of an empty window is 1 frame, later ones a whole chunk."""
    omni = DreamZeroSpec(frame_seqlen=4, chunk_frames=2, window_frames=5, action_tokens=2, first_commit_frames=1,
                         commit_action_tokens=0)
    rt = PagedKVRuntime(PagedKVConfig(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, blocks_per_layer=32,
                                      max_rows=4, scratch_tokens_per_row=omni.tokens_per_forward))
    rt.admit("old", omni)
    commit_empty(rt, "old", 1)
    rt.admit("new", omni)
    before = rt.state()
    with pytest.raises(RequestError, match="'old': 8 tokens over 20, 'new': 4 tokens over 20"):
        rt.forward_batch([("old", "commit"), ("new", "commit")])
    assert rt.state() == before


# ---- HunyuanImage-3 requests at the same phase and target length, through the op ---------------------------
def _hunyuan_rt() -> PagedKVRuntime:
    return PagedKVRuntime(PagedKVConfig(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, blocks_per_layer=24,
                                        max_rows=4, scratch_tokens_per_row=12))


def _run_op(rt, active, qkv_by_row: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    """write_attend for every layer with each row's (q, k, v) [T, H, D]; per row the last layer's output."""
    q, k, v = (torch.stack([r[i] for r in qkv_by_row]) for i in range(3))
    for layer in range(rt.config.num_layers):
        views = active.meta.layers[layer]
        out = torch.ops.paged_kv.write_attend(q, k, v, rt.pool.tensor, views.slot_mapping, views.block_table,
                                              active.meta.seq_lens, active.meta.kv_visible_end, 8**-0.5, "reference")
    return list(out)


def test_batched_hunyuan_requests_equal_their_forwards_alone():
    specs = {"r1": HunyuanSpec((5, 3), 4, ((1, 3),)), "r2": HunyuanSpec((7, 2), 4, ((1, 3),))}
    capacity = 8
    g = torch.Generator().manual_seed(0)
    inputs = {(rid, phase, s): [tuple(torch.randn(n, 2, 8, generator=g) for _ in range(3)) for _ in range(2)]
              for rid in specs for s, (phase, n) in enumerate([("prefill", capacity + 4), ("step", 4), ("step", 4)])}
    alone_rt, batch_rt = _hunyuan_rt(), _hunyuan_rt()
    for rt in (alone_rt, batch_rt):
        for rid, spec in specs.items():
            rt.admit(rid, spec)
    worst = 0.0
    for s, phase in enumerate(["prefill", "step", "step"]):
        alone = {}
        for rid, spec in specs.items():
            mask = spec.padded_mask(capacity) if phase == "prefill" else None
            with alone_rt.forward(rid, phase, prefix_capacity=capacity, attention_mask=mask) as active:
                alone[rid] = _run_op(alone_rt, active, inputs[(rid, phase, s)])
        items = [(rid, phase, {"prefix_capacity": capacity,
                               "attention_mask": spec.padded_mask(capacity) if phase == "prefill" else None})
                 for rid, spec in specs.items()]
        with batch_rt.forward_batch(items) as active:
            batch = _run_op(batch_rt, active, inputs[("r1", phase, s)] + inputs[("r2", phase, s)])
        for got, want in zip(batch, alone["r1"] + alone["r2"]):
            worst = max(worst, (got - want).abs().max().item())
    print(f"\nbatched hunyuan requests: max |batched - alone| = {worst:.3g}")
    assert worst <= INVARIANCE_TOL, worst
    for rt in (alone_rt, batch_rt):
        for rid in specs:
            rt.release(rid)
        assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer


def test_batched_forward_checks_every_owner_against_the_compiled_site():
    rt = make_dz_runtime(sessions=2, max_rows=4)
    rt.admit("a", SPEC)
    rt.admit("b", DreamZeroSpec.from_model_config(CFG.__class__(**{**CFG.__dict__, "sink_size": 0})))
    from paged_kv_compile.passes.idioms import WINDOW, WindowExpect
    expect = WindowExpect(window_tokens=SPEC.window_tokens, sink_tokens=SPEC.sink_tokens,
                          chunk_tokens=SPEC.chunk_tokens, action_tokens=SPEC.action_tokens)
    with rt.forward_batch([("a", "denoise"), ("b", "denoise")]):
        with pytest.raises(RequestError, match="session 'b' disagree on sink_tokens"):
            rt.require_active().check_expectation(expect, WINDOW)
