"""ParallelConfig (one process, no ranks): what each rank's pool holds, the modes refused, and the per-rank bytes.

Per-rank pool bytes equal the one-rank bytes / (TP x U) within one block per layer (and / C for CFG-parallel rows),
except where vLLM replicates KV heads (TP > Hkv) or Ulysses pads them, where the copies are counted.
"""

from __future__ import annotations

import pytest
import torch

from paged_kv_compile import Bucket, ConfigError, KVPool, PagedKVConfig
from paged_kv_compile.distributed import ParallelConfig, rank_pool_bytes


def _one_rank(**kw) -> PagedKVConfig:
    fields = dict(num_layers=4, num_kv_heads=8, head_dim=16, block_size=8, max_rows=2, scratch_tokens_per_row=40,
                  dtype=torch.bfloat16, buckets=(Bucket(2, 32, 64), Bucket(1, 32, 64)))
    fields.update(kw)
    return PagedKVConfig(**fields)


def _block_bytes_all_layers(cfg: PagedKVConfig) -> int:
    return KVPool.bytes_per_block_all_layers(cfg)


@pytest.mark.parametrize("sizing", [{"blocks_per_layer": 37}, {"budget_bytes": 3_000_000}])
@pytest.mark.parametrize("tp,ulysses", [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (1, 4)])
def test_multirank_rank_bytes_are_one_rank_bytes_over_tp_times_ulysses(sizing, tp, ulysses):
    one = _one_rank(**sizing)
    par = ParallelConfig(tensor_parallel=tp, ulysses=ulysses)
    local = par.rank_config(one)
    assert local.num_kv_heads == 8 // (tp * ulysses)
    assert local.max_rows == one.max_rows and local.buckets == one.buckets
    got = rank_pool_bytes(one, par)
    assert got["bytes"] == KVPool.from_config(local).nbytes, "nbytes_for is what from_config allocates"
    assert got["kv_replication"] == 1.0
    # within one block per layer of the exact share
    assert abs(got["bytes"] - got["one_rank_bytes"] / (tp * ulysses)) <= _block_bytes_all_layers(local)
    assert abs(got["blocks_per_layer"] - KVPool.blocks_per_layer_for(one)) <= 1


def test_multirank_tp_above_kv_heads_replicates_and_counts_the_copies():
    """vLLM: TP > Hkv gives every rank one KV head, each held by TP / Hkv ranks; the copies cost memory."""
    one = _one_rank(num_kv_heads=2, blocks_per_layer=10)
    for tp, rep in ((2, 1.0), (4, 2.0), (8, 4.0)):
        par = ParallelConfig(tensor_parallel=tp)
        got = rank_pool_bytes(one, par)
        assert got["kv_heads"] == 1 and got["kv_replication"] == rep
        assert got["bytes"] == got["one_rank_bytes"] // 2, "one of two heads per rank, whatever TP"
    with pytest.raises(ConfigError, match="TP % Hkv == 0"):
        ParallelConfig(tensor_parallel=3).rank_config(one)
    with pytest.raises(ConfigError, match="Hkv % TP == 0"):
        ParallelConfig(tensor_parallel=4).rank_config(_one_rank(num_kv_heads=6, blocks_per_layer=10))


def test_multirank_ulysses_pads_kv_heads_like_vllm_omni():
    """advanced_uaa pads KV heads up to a multiple of U: 8 heads at TP 4 (2 per rank) and U 4 -> 1 per rank,
    padded from 0.5; counted as replication 2."""
    par = ParallelConfig(tensor_parallel=4, ulysses=4)
    assert par.local_kv_heads(8) == 1 and par.kv_replication(8) == 2.0


@pytest.mark.parametrize("rank", [0, 1])
def test_multirank_cfg_parallel_splits_rows_blocks_and_buckets(rank):
    one = _one_rank(blocks_per_layer=40, max_rows=4, buckets=(Bucket(4, 32, 64), Bucket(2, 32, 64)))
    par = ParallelConfig(cfg_parallel=2, cfg_rank=rank)
    local = par.rank_config(one)
    assert local.max_rows == 2 and local.blocks_per_layer == 20 and local.num_kv_heads == 8
    assert local.buckets == (Bucket(2, 32, 64), Bucket(1, 32, 64))
    assert par.local_branches(2) == [rank]
    got = rank_pool_bytes(one, par)
    assert abs(got["bytes"] - got["one_rank_bytes"] / 2) <= _block_bytes_all_layers(local)


def test_multirank_cfg_parallel_round_robin_odd_branches():
    """3 branches on 2 CFG ranks: vllm-omni's `_dispatch_branches` gives rank 0 branches 0 and 2, rank 1 branch 1."""
    one = _one_rank(blocks_per_layer=30, max_rows=3, buckets=())
    r0, r1 = (ParallelConfig(cfg_parallel=2, cfg_rank=r) for r in (0, 1))
    assert r0.local_branches(3) == [0, 2] and r1.local_branches(3) == [1]
    assert (r0.rank_config(one).max_rows, r1.rank_config(one).max_rows) == (2, 1)
    assert (r0.rank_config(one).blocks_per_layer, r1.rank_config(one).blocks_per_layer) == (20, 10)


@pytest.mark.parametrize("mode", [{"ring": 2}, {"kv_gather": 2}, {"ring": 2, "ulysses": 2}])
def test_multirank_sequence_slicing_modes_are_refused_with_the_supported_ones(mode):
    with pytest.raises(ConfigError, match="tensor parallel, CFG-parallel and Ulysses") as err:
        ParallelConfig(**mode)
    assert "slice of each sequence" in str(err.value)


def test_multirank_bad_sizes_and_pipeline_parallel_are_refused():
    with pytest.raises(ConfigError, match="pipeline_parallel=2"):
        ParallelConfig(pipeline_parallel=2)
    with pytest.raises(ConfigError, match="tp_rank=2 is outside"):
        ParallelConfig(tensor_parallel=2, tp_rank=2)
    with pytest.raises(ConfigError, match="must be an int >= 1"):
        ParallelConfig(cfg_parallel=0)


def test_multirank_explicit_and_engine_configs_must_agree():
    engine = ParallelConfig(tensor_parallel=2, tp_rank=1)
    assert ParallelConfig.resolve(engine, engine=engine) == engine
    assert ParallelConfig.resolve(None, engine=engine) == engine
    with pytest.raises(ConfigError, match="tensor_parallel: given 4, vllm-omni has 2") as err:
        ParallelConfig.resolve(ParallelConfig(tensor_parallel=4, tp_rank=1), engine=engine)
    assert "ParallelConfig.from_vllm_omni()" in str(err.value)
