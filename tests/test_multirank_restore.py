"""A refusal on another rank restores this rank's pool bytes too, not only its scheduler (one process: the other
rank's refusal is simulated at the vote).

An admission with shared regions may evict the least recently used session and write the new regions into the
blocks that freed. If another rank then refuses the admission, this rank restores its scheduler, and the evicted
session is live again: its blocks must hold its K/V, not the refused admission's regions.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from paged_kv_compile import CapacityError
from paged_kv_compile.distributed import ParallelConfig, RankRuntime
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
from paged_kv_compile.models.dreamzero import DreamZeroConfig
from paged_kv_compile.runtime import PagedKVRuntime

CFG = DreamZeroConfig(num_layers=2, frame_seqlen=4, num_frame_per_block=1, local_attn_size=3, window_reset_frames=64,
                      action_register_length=2, text_len=6)


@pytest.fixture
def world(tmp_path):
    """A gloo group of one rank (an existing one is reused: a vllm-omni test may have made it in this process)."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    if made:
        dist.destroy_process_group()


def _cross(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, CFG.cross_len, CFG.num_heads, CFG.head_dim, generator=gen) for _ in range(CFG.num_layers)]


def test_multirank_refused_admission_restores_the_evicted_sessions_kv(world, monkeypatch):
    runtime = PagedKVRuntime(dreamzero_runtime_config(CFG, sessions=1, cross_regions=2, dtype=torch.float32),
                             max_sessions=1)
    ranks = RankRuntime(runtime, ParallelConfig(), group=world)
    spec = DreamZeroSpec.from_model_config(CFG)
    ranks.admit("old", spec, cross_kv=_cross(1), cache_salt="tenant-a")
    blocks = sorted({b for r in runtime.regions_of("old") for b in r.blocks})
    index = torch.tensor([base + b for base in runtime.pool.layer_bases.tolist() for b in blocks])
    kv, before = runtime.pool.tensor[:, index].clone(), runtime.state()

    def another_rank_refuses(ballot):
        raise CapacityError("rank 1 refused admit: simulated. Every rank refused it; nothing changed")

    monkeypatch.setattr(ranks.agreement, "vote", another_rank_refuses)
    with pytest.raises(CapacityError, match="rank 1 refused admit"):
        ranks.admit("new", spec, cross_kv=_cross(2), cache_salt="tenant-b")  # evicts "old", reuses its blocks
    assert runtime.state() == before
    assert torch.equal(runtime.pool.tensor[:, index], kv), "the restored session's region blocks were overwritten"
