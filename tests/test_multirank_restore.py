"""A refusal on another rank restores this rank's pool bytes too, not only its scheduler, in place and at any pool
size; a rank whose own call faulted part-way is restored too (one process: the other rank's refusal is simulated
at the vote).

An admission with shared regions may evict the least recently used session and write the new regions into the
blocks that freed. If another rank then refuses the admission, this rank restores its scheduler, and the evicted
session is live again: its blocks must hold its K/V, not the refused admission's regions.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from paged_kv_compile import CapacityError
from paged_kv_compile.allocator import BuiltinAllocator
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


def _one_session_holding_regions(world):
    """A one-session pool whose session "old" holds shared regions: the next admission evicts it and reuses their
    blocks. Returns (runtime, ranks, spec, the absolute pool index of those region blocks in every layer)."""
    runtime = PagedKVRuntime(dreamzero_runtime_config(CFG, sessions=1, cross_regions=2, dtype=torch.float32),
                             max_sessions=1)
    ranks = RankRuntime(runtime, ParallelConfig(), group=world)
    spec = DreamZeroSpec.from_model_config(CFG)
    ranks.admit("old", spec, cross_kv=_cross(1), cache_salt="tenant-a")
    blocks = sorted({b for r in runtime.regions_of("old") for b in r.blocks})
    index = torch.tensor([base + b for base in runtime.pool.layer_bases.tolist() for b in blocks])
    return runtime, ranks, spec, index


def test_multirank_refused_admission_restores_the_evicted_sessions_kv(world, monkeypatch):
    runtime, ranks, spec, index = _one_session_holding_regions(world)
    kv, before = runtime.pool.tensor[:, index].clone(), runtime.state()

    def another_rank_refuses(ballot):
        raise CapacityError("rank 1 refused admit: simulated. Every rank refused it; nothing changed")

    monkeypatch.setattr(ranks.agreement, "vote", another_rank_refuses)
    with pytest.raises(CapacityError, match="rank 1 refused admit"):
        ranks.admit("new", spec, cross_kv=_cross(2), cache_salt="tenant-b")  # evicts "old", reuses its blocks
    assert runtime.state() == before
    assert torch.equal(runtime.pool.tensor[:, index], kv), "the restored session's region blocks were overwritten"


def _refuse_second_vote(ranks: RankRuntime, monkeypatch, error: Exception | None = None) -> None:
    """From now on the vote fails as the other rank's refusal would make it fail (`error`), or -- with no error --
    as it does on a rank whose own call raised: that rank's exception again (agreement._explain)."""

    def vote(ballot):
        if ballot.error is not None:
            raise ballot.error
        raise error

    monkeypatch.setattr(ranks.agreement, "vote", vote)


def test_multirank_a_rank_that_faults_part_way_through_a_lifecycle_call_is_restored(world, monkeypatch):
    """A reset that fails after freeing the history (a fault in the family's own records, on this rank only) must
    leave this rank where it started, as the other ranks' restore leaves them."""
    runtime = PagedKVRuntime(dreamzero_runtime_config(CFG, sessions=1, dtype=torch.float32))
    ranks = RankRuntime(runtime, ParallelConfig(), group=world)
    spec = DreamZeroSpec.from_model_config(CFG)
    ranks.admit("s", spec)
    for branch in (0, 1):
        with ranks.forward("s", "commit", branch=branch):
            pass
    owner, before = runtime.owner("s"), runtime.state()
    assert any(owner.rows), "the session holds history"

    def fault(_owner):
        raise RuntimeError("injected: the family's records could not be updated")

    monkeypatch.setattr(type(owner.family), "history_dropped", lambda self, o: fault(o))
    _refuse_second_vote(ranks, monkeypatch)
    with pytest.raises(RuntimeError, match="injected"):
        ranks.reset("s")
    assert runtime.state() == before, "the rank that faulted part-way kept what its call had changed"
    assert runtime.owner("s") is owner, "the restore replaced the owner object callers hold"


def test_multirank_a_refused_call_restores_in_place_at_a_real_pool_size(world, monkeypatch):
    """The snapshot costs what the call touches (an undo log), not the pool: 20000 blocks per layer, the built-in
    allocator; the free list's order comes back too, so the next allocation takes the ids it would have."""
    runtime = PagedKVRuntime(dreamzero_runtime_config(CFG, sessions=1, dtype=torch.float32, blocks_per_layer=20000))
    ranks = RankRuntime(runtime, ParallelConfig(), group=world)
    spec = DreamZeroSpec.from_model_config(CFG)
    ranks.admit("a", spec)
    allocator, before = runtime.scheduler.allocator, runtime.state()
    free_order = list(allocator._free)
    _refuse_second_vote(ranks, monkeypatch, CapacityError("rank 1 refused admit: simulated"))
    with pytest.raises(CapacityError, match="rank 1 refused"):
        ranks.admit("b", spec)
    assert runtime.scheduler.allocator is allocator and runtime.state() == before
    assert allocator._free == free_order, "the free list's order changed: the ranks' next block ids would differ"


@pytest.mark.parametrize("seed", range(12))
def test_multirank_builtin_allocator_undo_is_exact(seed):
    """Random allocate / free / share (duplicates included) after begin_undo: undo() gives back the refcounts and
    the free stack exactly."""
    rng = random.Random(seed)
    alloc = BuiltinAllocator(48)
    _random_calls(alloc, rng, 10)
    ref, free = list(alloc._ref), list(alloc._free)
    alloc.begin_undo()
    _random_calls(alloc, rng, 25)
    alloc.undo()
    assert alloc._ref == ref and alloc._free == free
    alloc.begin_undo()
    _random_calls(alloc, rng, 5)
    kept = (list(alloc._ref), list(alloc._free))
    alloc.end_undo()
    assert (alloc._ref, alloc._free) == kept, "end_undo keeps the calls"


def _random_calls(alloc, rng: random.Random, n: int) -> None:
    """`n` random valid allocator calls (the shared contract), shared by the undo tests of both allocators."""
    for _ in range(n):
        live = [b for b in range(alloc.num_blocks) if alloc.refcount(b) > 0]
        op = rng.choice(("allocate", "free", "share"))
        if op == "allocate" or not live:
            alloc.allocate(rng.randint(0, min(4, alloc.num_free)))
        elif op == "free":
            picks = rng.sample(live, rng.randint(1, min(3, len(live))))
            alloc.free(picks + [b for b in picks[:1] if alloc.refcount(b) > 1])
        else:
            alloc.share(rng.choices(live, k=rng.randint(1, 3)))


def test_multirank_a_region_write_that_faults_after_an_eviction_restores_the_evicted_session(world, monkeypatch):
    """An admission with shared regions evicts the least recently used session, then its region write faults part-way
    (on this rank only): the evicted session must be live again with its K/V, as on the ranks that restore."""
    runtime, ranks, spec, index = _one_session_holding_regions(world)
    kv, before = runtime.pool.tensor[:, index].clone(), runtime.state()
    write = runtime.pool.write_region

    def faulty_write(region_blocks, stored):
        write(region_blocks, stored)  # the bytes land (in the blocks the eviction freed), then the fault
        raise RuntimeError("injected: the device failed after the region write")

    monkeypatch.setattr(runtime.pool, "write_region", faulty_write)
    _refuse_second_vote(ranks, monkeypatch)
    with pytest.raises(RuntimeError, match="injected"):
        ranks.admit("new", spec, cross_kv=_cross(2), cache_salt="tenant-b")
    assert runtime.state() == before, "the evicted session stayed evicted"
    assert torch.equal(runtime.pool.tensor[:, index], kv), "the evicted session's region blocks were overwritten"
