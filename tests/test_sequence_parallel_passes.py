"""A Ulysses block's new K/V come out of an all-to-all's receive buffer, read sequence-major: the passes page them
(one process; tests/upstream/test_multirank_reference.py runs the real all-to-all on 2 gloo ranks).

vllm-omni's `all_to_all_4D` (and `distributed/reference.py: shard_sequence`, which follows it) receives into a
(U, S/U, B, H/U, D) buffer and reads it as (S, B, H/U, D) transposed to (B, S, H/U, D). Before the passes read
sequence-major leaves, every such site was refused ("does not map batch/heads/head_dim the way the paged op reads
them"), and a compiled Ulysses model was rejected. Here the exchange is the one-rank one (degree 1: a copy into the
buffer, the shape dynamo gives `dist.all_to_all_single`), so the layout code under test is the shipped one.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend, compile_blocks

from paged_kv_compile.distributed.reference import _HeadsToTokens, _TokensToHeads
from paged_kv_compile.driver import paged_run
from paged_kv_compile.families.dreamzero import dreamzero_runtime_config
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.runtime import PagedKVRuntime

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
CFG = DreamZeroConfig(num_layers=2)


class _OneRankExchange:
    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        got = torch.empty_like(send)
        got.copy_(send)  # what every rank receives from itself
        return got


class OneRankTokensToHeads(_OneRankExchange, _TokensToHeads):
    pass


class OneRankHeadsToTokens(_OneRankExchange, _HeadsToTokens):
    pass


def _model() -> DreamZeroModel:
    model = DreamZeroModel(CFG, seed=1)
    for block in model.blocks:
        block.self_attn.tokens_to_heads = OneRankTokensToHeads(None, 1)
        block.self_attn.heads_to_tokens = OneRankHeadsToTokens(None, 1)
    return model


def test_keys_and_values_read_sequence_major_from_an_all_to_all_buffer_are_paged():
    dense = dreamzero_rollout(DreamZeroModel(CFG, seed=1), num_chunks=3, num_inference_steps=2, seed=3)
    model = _model()
    runtime = PagedKVRuntime(dreamzero_runtime_config(CFG, block_size=8, kernel="reference"))
    runtime.bind(model.blocks)
    backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
    compile_blocks(model.blocks, backend)
    paged = paged_run(model, runtime, num_chunks=3, num_inference_steps=2, seed=3)
    statuses = [r.status for res in backend.results for r in res.reports]
    assert sorted(statuses) == ["dense", "rewritten"], statuses  # self-attention paged; cross-attention reads no cache
    assert backend.frames == 1
    for key in ("video", "actions"):
        assert torch.equal(dense[key], paged[key]), (dense[key] - paged[key]).abs().max()
