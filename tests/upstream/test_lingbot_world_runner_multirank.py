"""LingBot-World behind vllm-omni's AR-Diffusion runner under Ulysses 2 on two gloo ranks: each rank's runner holds
its sessions in our runtime, whose pool keeps every token's K/V for the rank's local heads."""

from __future__ import annotations

import torch

from paged_kv_compile.adapters.vllm_omni_ar_runner import RUNNER_PATH

from . import lingbot_ranks
from . import lingbot_runner as lr

OURS = {"paged_kv": {"inner_compiler": "aot_eager", "kernel": "reference"}}


def test_lingbot_world_runner_ulysses_multirank_matches_the_dense_runner(ranks, omni):
    """Per rank, our runner's latents over 5 ticks (4 DMD probes + 1 commit each, a reset) equal the same rank's
    dense runner bit for bit and the one-rank dense runner within 1e-5; each rank's pool holds 1 of 2 heads; 4
    compiled frames per rank (probe and commit, two input layouts), no graph break; each rank's runtime is a
    `RankRuntime` whose every admission, forward and release the group agreed on, and both end in the same state."""
    od = lr.diffusion_config(runner_cls=lr.DENSE_RUNNER)
    with omni.model_context(od), torch.no_grad():
        one_rank = lr.latents(lr.serve(lr.build_runner(od), lingbot_ranks.runner_plan()))
    ranks.setup(ulysses_degree=2)
    dense = ranks.run(lingbot_ranks.runner_task, lr.DENSE_RUNNER, timeout=600)
    paged = ranks.run(lingbot_ranks.runner_task, RUNNER_PATH, OURS, timeout=600)
    for r, (d, p) in enumerate(zip(dense, paged)):
        same_rank = max((a - b).abs().max().item() for a, b in zip(p["latents"], d["latents"]))
        err = max((a - b).abs().max().item() for a, b in zip(p["latents"], one_rank))
        print(f"[figure] LingBot-World through the runner, Ulysses 2 rank {r}: ours vs its dense runner "
              f"{same_rank:.2e}, vs the one-rank dense runner {err:.2e}; pool {p['pool_bytes']} B")
        assert len(p["latents"]) == len(d["latents"]) == len(one_rank) == 5
        assert same_rank == 0.0 and err <= 1e-5, (same_rank, err)
        assert p["heads"] == d["heads"] == p["num_kv_heads"] == 1
        assert p["frames"] == 4 and p["graph_breaks"] == 0, (p["frames"], p["graph_breaks"])
        assert p["owners"] == 1 and p["voted"] and p["voted"] > len(p["latents"]) * 5, p["voted"]
    assert paged[0]["pool_bytes"] == paged[1]["pool_bytes"] and paged[0]["state"] == paged[1]["state"]
