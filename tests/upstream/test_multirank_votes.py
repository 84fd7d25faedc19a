"""Two gloo ranks driving `RankRuntime`s by hand (no model, no vllm-omni: a plain gloo world starts fast): a vote
covers what each rank is about to compute, every check that can refuse a forward runs before the end vote, and a
restore leaves nothing reading replaced state.

Each task returns every rank's outcome and its `runtime.state()` before and after, so the tests can require: every
rank raised (the same class), nothing was computed, and every rank is exactly where it started.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from paged_kv_compile import PagedKVRuntime
from paged_kv_compile.distributed import ParallelConfig, RankRuntime
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config, session_blocks_per_row
from paged_kv_compile.models.dreamzero import DreamZeroConfig

from .multirank import RankPool, outcome

CFG = DreamZeroConfig(num_layers=2, frame_seqlen=4, num_frame_per_block=1, local_attn_size=3, window_reset_frames=64,
                      action_register_length=2, text_len=6)
SPEC = DreamZeroSpec.from_model_config(CFG)
TIMEOUT_S = 600.0  # per call: a loaded 2-core machine (several 2-rank jobs at once) must never time one out


@pytest.fixture(scope="module")
def gloo_ranks():
    with RankPool(2, engine=False) as pool:
        yield pool


def _rank() -> int:
    return dist.get_rank()


def _runtime(parallel: ParallelConfig, *, sessions: int = 1, smaller_on: int | None = None,
             **overrides) -> RankRuntime:
    """This rank's runtime for `sessions` sessions of two CFG rows (rank `smaller_on`: room for one session only:
    less free memory on that GPU)."""
    cfg = parallel.rank_config(dreamzero_runtime_config(CFG, sessions=sessions, dtype=torch.float32, **overrides))
    if _rank() == smaller_on:
        cfg = dataclasses.replace(cfg, blocks_per_layer=session_blocks_per_row(SPEC, cfg.block_size) * cfg.max_rows)
    return RankRuntime(PagedKVRuntime(cfg), parallel, group=dist.group.WORLD, digest_every=1000)


def _tp() -> ParallelConfig:
    return ParallelConfig(tensor_parallel=2, tp_rank=_rank())


# ---- rank tasks ---------------------------------------------------------------------------------------------


def different_arguments_task() -> dict:
    """TP 2: the same forward with a different branch on each rank, then an admission with a different spec (same
    type, other values): each must raise DivergenceError on every rank before anything runs, changing nothing."""
    rt = _runtime(_tp(), sessions=2)
    rt.admit("s", SPEC, rows=2)
    with rt.forward("s", "commit", branch=0):
        pass
    out: dict = {"body_ran": False}
    before = rt.state()

    def differ():
        with rt.forward("s", "denoise", branch=_rank()):
            out["body_ran"] = True

    out["forward"] = outcome(differ)
    out["forward_unchanged"] = rt.state() == before
    other = SPEC if _rank() == 0 else dataclasses.replace(SPEC, commit_action_tokens=0)
    out["admit"] = outcome(lambda: rt.admit("t", other, rows=1))
    out["admit_unchanged"] = rt.state() == before
    with rt.forward("s", "denoise", branch=1):  # the ranks are still in step
        pass
    out["after"] = rt.state()
    return out


def refused_admission_then_scales_task() -> dict:
    """CFG-parallel 2, FP8 pools: rank 1's smaller pool refuses a second session's admission (rank 0 had applied
    it and restores), then the first session commits on both; setting the FP8 scales must then be refused on
    both ranks: directly on each rank's pool, and through the voted `RankRuntime.set_scales`."""
    rt = _runtime(ParallelConfig(cfg_parallel=2, cfg_rank=_rank()), sessions=2, smaller_on=1,
                  kv_dtype=torch.float8_e4m3fn)
    allocator = rt.runtime.scheduler.allocator
    rt.admit("small", SPEC, rows=1)
    out = {"admit": outcome(lambda: rt.admit("big", SPEC, rows=1))}
    out["same_allocator"] = rt.runtime.scheduler.allocator is allocator
    with rt.forward("small", "commit"):
        pass
    live = rt.runtime.scheduler.allocator
    out["held"] = live.num_blocks - live.num_free
    out["guard_sees"] = rt.pool.blocks_held()
    scales = rt.pool.scales.clone()
    out["pool_set_scales"] = outcome(lambda: rt.pool.set_scales(0.01, 0.01))
    out["voted_set_scales"] = outcome(lambda: rt.set_scales(0.01, 0.01))
    out["scales_unchanged"] = torch.equal(rt.pool.scales, scales)
    rt.release("small")
    out["free_set_scales"] = outcome(lambda: rt.set_scales(0.5, 0.25))  # nothing held on any rank: accepted
    out["scales_set"] = bool((rt.pool.scales[0] == 0.5).all() and (rt.pool.scales[1] == 0.25).all())
    out["state"] = rt.state()
    return out


def attention_check_before_vote_task() -> dict:
    """TP 2: the runtimes serve a bound model; in a commit, rank 0's compiled sites ran every layer, rank 1's ran
    none (its blocks ran eagerly: "no paged attention ran" refuses it). Both must roll back: the refusal is checked
    before the end vote."""
    rt = _runtime(_tp())
    rt.runtime.bound = True  # as runtime.bind(model.blocks) leaves it; the sites are simulated by active.record_layers
    rt.admit("s", SPEC, rows=2)
    before = rt.state()

    def commit():
        with rt.forward("s", "commit", branch=0):
            if _rank() == 0:
                rt.active.record_layers(range(CFG.num_layers))

    out = {"commit": outcome(commit), "unchanged": rt.state() == before}
    out["state"] = rt.state()
    return out


def tensor_parallel_regions_task() -> dict:
    """TP 2: a session brings shared cross-attention K/V, each rank its own heads' (keyed by the bytes it stores, so
    the registry keys differ between the ranks while the blocks agree); later calls must not see a divergence."""
    rt = _runtime(_tp(), sessions=2, cross_regions=2)
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(2, 2, CFG.cross_len, CFG.num_heads, CFG.head_dim, generator=gen) for _ in range(CFG.num_layers)]
    heads = slice(_rank() * CFG.num_heads // 2, (_rank() + 1) * CFG.num_heads // 2)
    mine = [t[..., heads, :].contiguous() for t in full]
    out = {"admit": outcome(lambda: rt.admit("s", SPEC, rows=2, cross_kv=mine, cache_salt="tenant"))}
    out["second"] = outcome(lambda: rt.admit("t", SPEC, rows=2, cross_kv=mine, cache_salt="tenant"))  # shares
    out["release"] = outcome(lambda: rt.release("s"))
    out["state"] = rt.state()
    return out


# ---- tests ----------------------------------------------------------------------------------------------------


def test_multirank_different_arguments_raise_divergence_before_computing(gloo_ranks):
    outs = gloo_ranks.run(different_arguments_task, timeout=TIMEOUT_S)
    for r, out in enumerate(outs):
        for what in ("forward", "admit"):
            assert out[what][0] == "DivergenceError", (r, what, out[what])
            assert out[f"{what}_unchanged"], f"rank {r}: the divergent {what} changed the runtime state"
        assert not out["body_ran"], f"rank {r} computed a forward the ranks disagreed on"
    assert outs[0]["after"] == outs[1]["after"]


def test_multirank_refused_admission_leaves_the_scale_guard_reading_live_state(gloo_ranks):
    outs = gloo_ranks.run(refused_admission_then_scales_task, timeout=TIMEOUT_S)
    for r, out in enumerate(outs):
        assert out["admit"][0] == "CapacityError", (r, out["admit"])
        assert out["held"] > 0 and out["guard_sees"] == out["held"], (r, out["held"], out["guard_sees"])
        for what in ("pool_set_scales", "voted_set_scales"):
            assert out[what][0] == "ConfigError" and "blocks per layer are held" in out[what][1], (r, what, out[what])
        assert out["same_allocator"], f"rank {r}: the restore replaced the allocator others hold"
        assert out["scales_unchanged"]
        assert out["free_set_scales"] == ("ok", "") and out["scales_set"], (r, out["free_set_scales"])
    assert outs[0]["state"]["owners"] == outs[1]["state"]["owners"] == {}


def test_multirank_a_check_refusing_one_ranks_forward_rolls_back_every_rank(gloo_ranks):
    outs = gloo_ranks.run(attention_check_before_vote_task, timeout=TIMEOUT_S)
    assert outs[1]["commit"][0] == "RequestError" and "no paged attention ran" in outs[1]["commit"][1]
    assert outs[0]["commit"][0] == "RequestError" and "rank 1 refused" in outs[0]["commit"][1], outs[0]["commit"]
    for r, out in enumerate(outs):
        assert out["unchanged"], f"rank {r}: the refused commit changed its state"
    assert outs[0]["state"] == outs[1]["state"], "the ranks' histories differ after the refused commit"


def test_multirank_tensor_parallel_ranks_with_shared_regions_stay_in_agreement(gloo_ranks):
    outs = gloo_ranks.run(tensor_parallel_regions_task, timeout=TIMEOUT_S)
    for r, out in enumerate(outs):
        for what in ("admit", "second", "release"):
            assert out[what] == ("ok", ""), (r, what, out[what])
    assert [out["state"]["owners"] for out in outs] == [{"t": [[], []]}] * 2
