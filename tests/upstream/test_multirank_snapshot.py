"""A RankRuntime over vLLM's BlockPool (`allocator="vllm"`) restores a refused lifecycle call at real pool sizes:
its undo log puts vLLM's linked free queue back in place (a deep copy of that linked list overflowed the stack from
about 200 blocks per layer). One process: the other rank's refusal is simulated at the vote."""

from __future__ import annotations

import random

import pytest
import torch

from paged_kv_compile import CapacityError, PagedKVRuntime
from paged_kv_compile.allocator import VllmBlockPoolAdapter
from paged_kv_compile.distributed import ParallelConfig, RankRuntime
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config

from test_multirank_restore import CFG, _random_calls, _refuse_second_vote, world  # noqa: F401 (a fixture)


def _free_order(alloc: VllmBlockPoolAdapter) -> list[int]:
    return [blk.block_id for blk in alloc.pool.free_block_queue.get_all_free_blocks()]


def _refcounts(alloc: VllmBlockPoolAdapter) -> list[int]:
    return [alloc.refcount(b) for b in range(alloc.num_blocks)]


def test_multirank_vllm_allocator_restores_a_refused_admission_at_20000_blocks(world, monkeypatch):
    runtime = PagedKVRuntime(dreamzero_runtime_config(CFG, sessions=1, dtype=torch.float32, blocks_per_layer=20000),
                             allocator="vllm")
    ranks = RankRuntime(runtime, ParallelConfig(), group=world)
    spec = DreamZeroSpec.from_model_config(CFG)
    ranks.admit("a", spec)  # before: RecursionError from copy.deepcopy(BlockPool)
    alloc, before = runtime.scheduler.allocator, runtime.state()
    order = _free_order(alloc)
    _refuse_second_vote(ranks, monkeypatch, CapacityError("rank 1 refused admit: simulated"))
    with pytest.raises(CapacityError, match="rank 1 refused"):
        ranks.admit("b", spec)
    assert runtime.scheduler.allocator is alloc and runtime.state() == before
    assert _free_order(alloc) == order, "vLLM's free queue order changed: the ranks' next block ids would differ"


@pytest.mark.parametrize("seed", range(8))
def test_multirank_vllm_allocator_undo_is_exact(seed):
    rng = random.Random(seed)
    alloc = VllmBlockPoolAdapter(48)
    _random_calls(alloc, rng, 10)
    refs, order = _refcounts(alloc), _free_order(alloc)
    alloc.begin_undo()
    _random_calls(alloc, rng, 25)
    alloc.undo()
    assert _refcounts(alloc) == refs and _free_order(alloc) == order
    assert alloc.pool.get_num_free_blocks() == len(order)
