"""vllm-omni's LingBot-World under Ulysses 2 on two gloo ranks (its `_sp_plan` hooks, one fused `all_to_all_5D` of
q/k/v per self-attention), paged as written: each rank's pool holds every token's K/V for its local heads."""

from __future__ import annotations

import torch

from . import lingbot_ranks

ATOL = 1e-5


def test_lingbot_world_ulysses_multirank_paged_matches_one_rank(ranks, omni_ctx):
    """Per rank, the paged rollout (4 AR blocks of 4 DMD probes + 1 commit) equals the same rank's dense rollout bit
    for bit and the one-rank dense rollout within 1e-5, every forward; each rank's pool is half the one-rank pool
    (1 of 2 heads); the all-to-alls are inside the 4 compiled frames (as on one rank); both ranks end in the same
    runtime state."""
    with torch.no_grad():
        one_rank = lingbot_ranks.one_rank_dense()
    ranks.setup(ulysses_degree=2)
    dense = ranks.run(lingbot_ranks.dense_task, timeout=600)
    paged = ranks.run(lingbot_ranks.paged_task, timeout=600)
    for r, (d, p) in enumerate(zip(dense, paged)):
        assert p["heads"] == d["heads"] == 1
        assert len(p["outputs"]) == len(one_rank) == lingbot_ranks.BLOCKS * 5
        same_rank = max((a - b).abs().max().item() for a, b in zip(p["outputs"], d["outputs"]))
        err = max((a - b).abs().max().item() for a, b in zip(p["outputs"], one_rank))
        print(f"[figure] LingBot-World Ulysses 2 rank {r}: paged vs its dense {same_rank:.2e}, vs one-rank dense "
              f"{err:.2e}; pool {p['bytes']} B vs one-rank {p['one_rank_bytes']} B")
        assert same_rank == 0.0 and err <= ATOL, (same_rank, err)
        assert p["bytes"] * 2 == p["one_rank_bytes"], (p["bytes"], p["one_rank_bytes"])
        assert p["frames"] == 4 and p["patterns"] == ["capacity-window"], (p["frames"], p["patterns"])
        assert p["collectives"] == ["_c10d_functional.all_to_all_single", "_c10d_functional.wait_tensor"]
    assert paged[0]["state"] == paged[1]["state"]
