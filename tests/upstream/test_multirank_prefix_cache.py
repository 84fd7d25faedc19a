"""Two gloo ranks (tensor parallel 2) sharing HunyuanImage-3 prompt prefixes (`prefix_cache.py`) through
`RankRuntime`s driven by hand (no model: a plain gloo world starts fast): each rank caches its own KV heads in the
same blocks, and the sharing decision is part of the admission's vote, so a rank that would decide otherwise makes
every rank refuse before anything changes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from paged_kv_compile import PagedKVRuntime
from paged_kv_compile.distributed import ParallelConfig, RankRuntime
from paged_kv_compile.families.hunyuan_image3 import hunyuan_runtime_config, hunyuan_spec
from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config

from .multirank import RankPool

CFG = HunyuanImage3Config(num_kv_heads=2, num_heads=4)
B, P = 4, 12
TIMEOUT_S = 600.0  # per call: a loaded 2-core machine must never time one out


@pytest.fixture(scope="module")
def gloo_ranks():
    with RankPool(2, engine=False) as pool:
        yield pool


def _prompts(tail_seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    system, negative = torch.randint(0, CFG.vocab, (8,), generator=g), torch.randint(0, CFG.vocab, (9,), generator=g)
    tail = torch.randint(0, CFG.vocab, (3,), generator=torch.Generator().manual_seed(tail_seed))
    return [torch.cat([system, tail]), negative]


def _runtime() -> RankRuntime:
    parallel = ParallelConfig(tensor_parallel=2, tp_rank=dist.get_rank())
    cfg = parallel.rank_config(hunyuan_runtime_config(CFG, max_prefix=P, block_size=B, requests=2, kernel="reference",
                                                      dtype=torch.float32))
    return RankRuntime(PagedKVRuntime(cfg), parallel, group=dist.group.WORLD, digest_every=1)


def _full_kv(seed: int, tokens: int) -> torch.Tensor:
    """(layers, 2, rows=2, tokens, all kv heads, D): the K/V every rank's prefill writes its own heads of."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(CFG.num_layers, 2, 2, tokens, CFG.num_kv_heads, CFG.head_dim, generator=g)


def _prefill(rt: RankRuntime, rid: str, prompts, kv: torch.Tensor) -> None:
    """The prefill, each layer writing this rank's heads of `kv` through the op (the suffix only, when cached)."""
    spec = hunyuan_spec(CFG, prompts)
    ready = rt.runtime.owner(rid).prefix_ready
    C = ready[0] if ready else 0
    heads = slice(dist.get_rank(), dist.get_rank() + 1)
    with rt.forward(rid, "prefill", prefix_capacity=P, attention_mask=spec.padded_mask(P),
                    **({"suffix_from": C} if C else {})) as active:
        for layer in range(CFG.num_layers):
            k, v = kv[layer, 0, :, C:, heads], kv[layer, 1, :, C:, heads]
            q = torch.randn(2, k.shape[1], CFG.num_heads // 2, CFG.head_dim)
            views = active.meta.layers[layer]
            torch.ops.paged_kv.write_attend(q, k.contiguous(), v.contiguous(), rt.runtime.pool.tensor,
                                            views.slot_mapping, views.block_table, active.meta.seq_lens,
                                            active.meta.kv_visible_end, CFG.head_dim**-0.5, "reference")


def shared_heads_task() -> dict:
    rt = _runtime()
    kv = _full_kv(1, P + CFG.target_len)
    a, b = _prompts(3), _prompts(4)
    rt.admit("a", hunyuan_spec(CFG, a), prompt_tokens=a)
    _prefill(rt, "a", a, kv)
    rt.release("a")
    rt.admit("b", hunyuan_spec(CFG, b), prompt_tokens=b)
    owner = rt.runtime.owner("b")
    out = {"ready": owner.prefix_ready, "rows": [list(r) for r in owner.rows]}
    mine = slice(dist.get_rank(), dist.get_rank() + 1)
    stored = [rt.runtime.pool.read_region(owner.rows[r][:2], 8) for r in range(2)]  # (L, 2, 8, 1, D) per row
    out["own_heads"] = all(torch.equal(stored[r], kv[:, :, r, :8, mine]) for r in range(2))
    _prefill(rt, "b", b, _full_kv(2, P + CFG.target_len))  # the suffix forward, voted like any other
    out["state"] = rt.runtime.state()
    return out


def divergent_decision_task() -> dict:
    """Rank 1's cache misses what rank 0's finds (as if it had evicted it): b's admission is refused on both ranks
    before either applies it."""
    rt = _runtime()
    a, b = _prompts(3), _prompts(4)
    rt.admit("a", hunyuan_spec(CFG, a), prompt_tokens=a)
    _prefill(rt, "a", a, _full_kv(1, P + CFG.target_len))
    rt.release("a")
    if dist.get_rank() == 1:
        rt.runtime.scheduler.prefix_cache.match = lambda chain, salt, keys: []
    before = rt.runtime.state()
    try:
        rt.admit("b", hunyuan_spec(CFG, b), prompt_tokens=b)
        outcome = "ok"
    except Exception as e:  # noqa: BLE001 - compared by the test
        outcome = type(e).__name__
    return {"outcome": outcome, "unchanged": rt.runtime.state() == before}


def cfg_parallel_task() -> dict:
    """CFG-parallel 2: each rank holds its own branch's row (the conditional prompt, the negative prompt), so each
    finds its own cached blocks; later calls must not see a divergence."""
    parallel = ParallelConfig(cfg_parallel=2, cfg_rank=dist.get_rank())
    cfg = parallel.rank_config(hunyuan_runtime_config(CFG, max_prefix=P, block_size=B, requests=2, kernel="reference",
                                                      dtype=torch.float32))
    rt = RankRuntime(PagedKVRuntime(cfg), parallel, group=dist.group.WORLD, digest_every=1)
    negative = torch.randint(0, CFG.vocab, (12,), generator=torch.Generator().manual_seed(5))  # 3 full blocks
    out = {}
    for rid, tail in (("a", 3), ("b", 4)):
        prompts = [[_prompts(tail)[0], negative][dist.get_rank()]]  # this rank's branch
        rt.admit(rid, hunyuan_spec(CFG, prompts), prompt_tokens=prompts)
        out[rid] = rt.runtime.owner(rid).prefix_ready
        spec, ready = hunyuan_spec(CFG, prompts), rt.runtime.owner(rid).prefix_ready
        with rt.forward(rid, "prefill", prefix_capacity=P, attention_mask=spec.padded_mask(P),
                        **({"suffix_from": ready[0]} if ready else {})):
            pass
        rt.release(rid)
    return out


def test_multirank_prefix_cache_cfg_parallel_ranks_find_their_own_branches_cached(gloo_ranks):
    outs = gloo_ranks.run(cfg_parallel_task, timeout=TIMEOUT_S)
    # rank 0: [system 8 | own 3] shares the system prompt's 2 blocks; rank 1 its whole 12-token negative prompt (3
    # blocks: its suffix is the target alone). The ranks decide differently, each for its own branch, and agree.
    assert outs == [{"a": (), "b": (8,)}, {"a": (), "b": (12,)}]


def test_multirank_prefix_cache_each_rank_caches_its_own_heads_in_the_same_blocks(gloo_ranks):
    outs = gloo_ranks.run(shared_heads_task, timeout=TIMEOUT_S)
    assert [o["ready"] for o in outs] == [(8, 8)] * 2
    assert outs[0]["rows"] == outs[1]["rows"]
    assert all(o["own_heads"] for o in outs)
    assert outs[0]["state"]["prefix_cache"] == outs[1]["state"]["prefix_cache"]


def test_multirank_prefix_cache_a_rank_deciding_otherwise_is_refused_on_every_rank(gloo_ranks):
    outs = gloo_ranks.run(divergent_decision_task, timeout=TIMEOUT_S)
    assert [o["outcome"] for o in outs] == ["DivergenceError"] * 2
    assert all(o["unchanged"] for o in outs)
