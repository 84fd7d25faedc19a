"""KVPool: layout of the one stacked tensor, sizing, vectorized absolute addressing, impossible geometry."""

from __future__ import annotations

import pytest
import torch

from paged_kv_compile import ConfigError, KVPool, PagedKVConfig


def config(**kw) -> PagedKVConfig:
    base = dict(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, max_rows=2, scratch_tokens_per_row=8)
    base.update(kw)
    if "budget_bytes" not in base:
        base.setdefault("blocks_per_layer", 5)
    return PagedKVConfig(**base)


def test_layout_of_the_block_axis():
    pool = KVPool.from_config(config())
    # 3 layers x 5 managed blocks, then 2 rows x (8/4 + 1) scratch blocks, then one pad block
    assert pool.tensor.shape == (2, 3 * 5 + 2 * 3 + 1, 4, 2, 4)
    assert pool.scratch_base == 15 and pool.pad_block == 21 and pool.num_blocks_total == 22
    assert pool.layer_bases.tolist() == [0, 5, 10]
    assert pool.scratch_block_ids(1).tolist() == [18, 19, 20]
    info = pool.describe()
    assert info["bytes"] == pool.tensor.numel() * 4 and info["blocks_per_layer"] == 5
    assert info["tokens_per_layer"] == 20 and info["scratch_blocks"] == 6


def test_sizing_from_a_byte_budget_uses_it_without_exceeding_it():
    per_block = 2 * 4 * 2 * 4 * 4  # K and V of one block of one layer, fp32
    budget = per_block * (3 * 7 + 2 * 3 + 1) + per_block - 1  # room for 7 blocks per layer, not 8
    pool = KVPool.from_config(config(budget_bytes=budget))
    assert pool.blocks_per_layer == 7 and pool.nbytes <= budget
    assert KVPool.bytes_per_block_all_layers(config()) == per_block * 3


def test_vectorized_addressing():
    pool = KVPool.from_config(config())
    layers = torch.tensor([[0], [2]])
    local = torch.tensor([[0, 4], [1, 3]])
    assert pool.block_id(layers, local).tolist() == [[0, 4], [11, 13]]
    assert pool.slot(torch.tensor([11, 13]), torch.tensor([3, 0])).tolist() == [47, 52]
    table = torch.tensor([[7, 2, 9]])
    positions = torch.tensor([[0, 3, 4, 9, -1]])
    assert pool.slots_for_positions(table, positions).tolist() == [[28, 31, 8, 37, -1]]


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: config(block_size=0), "block_size must be >= 1"),
        (lambda: config(blocks_per_layer=0), "blocks_per_layer must be >= 1"),
        (lambda: KVPool.from_config(config(blocks_per_layer=None, budget_bytes=100)), "cannot hold one block"),
        (lambda: KVPool.from_config(config(), min_tokens_per_layer=64), "below one window of 64 tokens"),
        (lambda: KVPool(2, 4, 4, 1, 4, dtype=torch.int32), "floating type"),
        (lambda: KVPool(2, 0, 4, 1, 4), "at least 1"),
        (lambda: KVPool.from_config(config()).block_id(3, 0), "layer ids"),
        (lambda: KVPool.from_config(config()).block_id(0, 5), "local block ids"),
    ],
)
def test_impossible_geometry_is_refused_with_the_fix(make, pattern):
    with pytest.raises((ConfigError, IndexError), match=pattern):
        make()
