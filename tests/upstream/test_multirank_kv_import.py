"""Two gloo ranks (tensor parallel 2, one KV head each) importing a HunyuanImage-3 prompt's K/V into reserved pages
(`kv_import.py` on `RankRuntime`s, driven by hand: no model, no vllm-omni).

Each rank imports its own heads -- sliced from a producer's full-head K/V, or given by a per-rank producer -- and
the ready/generation decision is voted: a refusal on one rank is every rank's, and every rank is put back where it
started (its pages' bytes included).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from paged_kv_compile import PagedKVRuntime, kv_import
from paged_kv_compile.distributed import ParallelConfig, RankRuntime
from paged_kv_compile.families.hunyuan_image3 import hunyuan_runtime_config, hunyuan_spec
from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config

from .multirank import RankPool, outcome

CFG = HunyuanImage3Config()  # 2 KV heads: one per TP rank
P, B = 12, 4
SPEC = hunyuan_spec(CFG, [torch.zeros(11, dtype=torch.int64), torch.zeros(5, dtype=torch.int64)])
TIMEOUT_S = 600.0  # per call: a loaded 2-core machine must never time one out


@pytest.fixture(scope="module")
def gloo_ranks():
    with RankPool(2, engine=False) as pool:
        yield pool


def _producer(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A producer's full-head K/V per layer, [rows, P, 2 KV heads, D]: the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(2, P, CFG.num_kv_heads, CFG.head_dim, generator=gen) for _ in "kv")
            for _ in range(CFG.num_layers)]


def _holds(runtime: PagedKVRuntime, request_id: str, kv, head: int) -> bool:
    """Whether the request's pages hold exactly `head` of the producer's K/V, every layer and row."""
    owner = runtime.owner(request_id)
    for r, (row, p) in enumerate(zip(owner.rows, SPEC.prefix_lens)):
        want = torch.stack([torch.stack([k[r, :p, head : head + 1], v[r, :p, head : head + 1]]) for k, v in kv])
        if not torch.equal(runtime.pool.read_region(row, p), want):
            return False
    return True


def tp_import_task() -> dict:
    rank = dist.get_rank()
    parallel = ParallelConfig(tensor_parallel=2, tp_rank=rank)
    one_rank = hunyuan_runtime_config(CFG, max_prefix=P, block_size=B, requests=2, kernel="reference")
    runtime = PagedKVRuntime(parallel.rank_config(one_rank))
    rt = RankRuntime(runtime, parallel, group=dist.group.WORLD, digest_every=1)
    out: dict = {"heads": runtime.pool.num_kv_heads}
    ticket = kv_import.reserve(rt, "r", SPEC, prefix_capacity=P)
    full = _producer(1)

    def step(rid: str = "r", **args):
        with rt.forward(rid, "step", prefix_capacity=P, **args):
            pass

    out["not_ready"] = outcome(step)
    # rank 1's producer gives the wrong head dim: refused on rank 1, so on both; rank 0 had written its pages
    before, pool = runtime.state(), runtime.pool.tensor.clone()
    bad = full if rank == 0 else [(k[..., :8], v[..., :8]) for k, v in full]
    out["one_rank_refuses"] = outcome(lambda: kv_import.import_dense(rt, ticket, bad))
    out["put_back"] = (runtime.state() == before and torch.equal(runtime.pool.tensor, pool)
                       and runtime.owner("r").state.imported.missing() == {0: [0, 1, 2], 1: [0, 1]})
    out["still_not_ready"] = outcome(step)
    kv_import.import_dense(rt, ticket, full)  # each rank slices its own TP head from the full-head K/V
    out["sliced_heads"] = _holds(runtime, "r", full, rank)
    out["ready"] = outcome(lambda: step(import_generation=ticket.generation))
    # per-rank producers: each rank brings only its own head
    mine = _producer(2)
    own = kv_import.reserve(rt, "q", SPEC, prefix_capacity=P)
    kv_import.import_dense(rt, own, [(k[:, :, rank : rank + 1], v[:, :, rank : rank + 1]) for k, v in mine])
    out["own_heads"] = _holds(runtime, "q", mine, rank)
    # a re-made reservation: the old ticket is refused on every rank, and a step naming its generation too
    renewed = kv_import.renew(rt, "q", prefix_capacity=P)
    out["stale_import"] = outcome(lambda: kv_import.import_dense(rt, own, mine))
    out["stale_step"] = outcome(lambda: step("q", import_generation=own.generation))
    out["generations"] = (own.generation, renewed.generation)
    for rid in ("r", "q"):
        rt.release(rid)
    out["all_free"] = runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer
    return out


def test_multirank_import_each_rank_imports_its_heads_and_the_decision_is_voted(gloo_ranks):
    results = gloo_ranks.run(tp_import_task, timeout=TIMEOUT_S)
    for rank, out in enumerate(results):
        assert out["heads"] == 1
        assert out["not_ready"][0] == "RequestError" and "not all its pages are ready" in out["not_ready"][1]
        kind, message = out["one_rank_refuses"]
        assert kind == "RequestError" and "head dim 8" in message
        if rank == 0:
            assert "rank 1 refused import" in message
        assert out["put_back"], f"rank {rank} kept what the refused import wrote"
        assert out["still_not_ready"][0] == "RequestError"
        assert out["sliced_heads"] and out["ready"] == ("ok", "")
        assert out["own_heads"]
        assert out["stale_import"][0] == "RequestError" and "generation" in out["stale_import"][1]
        assert out["stale_step"][0] == "RequestError" and "expects imported pages of generation" in out["stale_step"][1]
        assert out["generations"][1] > out["generations"][0]
        assert out["all_free"]
    assert results[0]["generations"] == results[1]["generations"]
