"""The 2-rank harness proven on DENSE models first: vllm-omni's real layers at tensor parallel 2 and CFG-parallel 2
match the same layers on one rank (fp32).

The one-rank oracle runs in this process (one gloo rank, `omni` fixture); the two ranks (`ranks` fixture,
multirank.py) build the same layers at their parallel size and load the one-rank weights through each parameter's
own `weight_loader` (their tensor-parallel shard). Every rank's output is compared, not only rank 0's.
"""

from __future__ import annotations

import torch

from . import vllm_omni_cpu as omni_cpu
from .dreamzero_pipeline import DenseKV, run_session
from .hunyuan_pipeline import LAYERS, max_err, request_inputs, run_layers
from .multirank import (
    RankError,
    RankPool,
    hang_on_rank,
    load_full_weights,
    raise_on_rank,
    rank_info,
    sync_check,
)
from .rank_scenarios import DZ_CALLS, dreamzero_one_rank, hunyuan_one_rank

ATOL = 1e-5  # fp32 oracle bound


# ---- rank tasks -----------------------------------------------------------------------------------------


def hunyuan_layers_dense(states: list[dict]) -> list[torch.Tensor]:
    """This rank's HunyuanImage-3 decoder layers (its TP shard of `states`), fp32, prefill + steps."""
    with omni_cpu.model_context(), omni_cpu.hunyuan_fp32_rope():
        layers = [omni_cpu.tiny_hunyuan_layer(layer_idx=i) for i in range(LAYERS)]
        for layer, state in zip(layers, states):
            load_full_weights(layer, state)
        return run_layers(layers, request_inputs(), autocast=None)


def dreamzero_dense(state: dict, calls: int = DZ_CALLS) -> dict:
    """This rank's DreamZero `CausalWanModel` (its TP shard; under CFG-parallel its own branch), dense eager."""
    with omni_cpu.model_context():
        model = omni_cpu.tiny_dreamzero_model()
        load_full_weights(model, state)
        with torch.no_grad():
            out = run_session(model, DenseKV(model), calls=calls)
        heads = model.blocks[0].self_attn.tp_num_heads
    return {"video": out["video"], "actions": out["actions"], "resets": out["resets"], "heads": heads,
            "forwards": out["forwards"], **rank_info()}


# ---- one-rank oracles (this process) ------------------------------------------------------------------------


# ---- tests -------------------------------------------------------------------------------------------------


def test_tensor_parallel_hunyuan_decoder_layer_dense_matches_one_rank(omni, omni_ctx, ranks):
    """vllm-omni's HunyuanImage3DecoderLayer at TP 2 (4 query / 2 KV heads -> 2 / 1 per rank, o_proj and
    down_proj all-reduced): prefill + 3 steps of two right-padded CFG rows equal one rank's, fp32."""
    states, one = hunyuan_one_rank(omni)
    ranks.setup(tensor_parallel_size=2)
    for r, out in enumerate(ranks.run(hunyuan_layers_dense, states)):
        err = max_err(one, out)
        print(f"[figure] HunyuanImage-3 dense TP 2 rank {r} vs one rank: max {err:.2e}")
        assert err <= ATOL


def test_tensor_parallel_dreamzero_dense_matches_one_rank(omni, omni_ctx, ranks):
    """vllm-omni's CausalWanModel at TP 2 (heads split, qk-norm and o/ffn all-reduced) through commits, denoising
    steps and a window reset equals one rank, fp32."""
    state, one = dreamzero_one_rank(omni)
    ranks.setup(tensor_parallel_size=2)
    for r, out in enumerate(ranks.run(dreamzero_dense, state)):
        assert out["tp"] == 2 and out["heads"] == 1  # 2 heads, one per rank
        assert out["resets"] == one["resets"] == [2, 4]
        err = max(float((out[k] - one[k]).abs().max()) for k in ("video", "actions"))
        print(f"[figure] DreamZero dense TP 2 rank {r} vs one rank: max {err:.2e}")
        assert err <= ATOL


def test_cfg_parallel_dreamzero_dense_matches_one_rank(omni, omni_ctx, ranks):
    """CFG-parallel 2: each rank runs one branch with its own cache (rank 0 positive), predictions exchanged by the
    CFG group's all_gather; every rank's guided result equals one rank running both branches, fp32."""
    state, one = dreamzero_one_rank(omni)
    ranks.setup(cfg_parallel_size=2)
    outs = ranks.run(dreamzero_dense, state)
    for r, out in enumerate(outs):
        assert out["cfg"] == 2 and out["cfg_rank"] == r and out["heads"] == 2
        assert {branch for _, branch, _, _ in out["forwards"]} == {r}, "each rank computes its own branch only"
        err = max(float((out[k] - one[k]).abs().max()) for k in ("video", "actions"))
        print(f"[figure] DreamZero dense CFG-parallel 2 rank {r} vs one rank: max {err:.2e}")
        assert err <= ATOL


def test_multirank_harness_reports_errors_and_hangs():
    """Both ranks answer a collective; a rank's exception comes back with its traceback; a rank stuck in a
    collective fails the call within its timeout with its stack, and the next call gets a fresh pool. (A pool of
    its own, without vllm-omni: a hang stops the pool it happens in.)"""
    with RankPool(2, engine=False) as pool:
        assert pool.run(sync_check, 0.5) == [[0.5, 0.5], [0.5, 0.5]]
        try:
            pool.run(raise_on_rank, 1, "only rank 1 fails")
        except RankError as e:
            assert "rank(s) [1]" in str(e) and "ValueError: only rank 1 fails" in str(e)
        else:
            raise AssertionError("rank 1's exception did not come back")
        try:
            pool.run(hang_on_rank, 0, timeout=30)  # rank 0 never answers: the limit only has to be reached
        except RankError as e:
            assert "did not answer within 30 s" in str(e) and "hang_on_rank" in str(e) and "barrier" in str(e)
        else:
            raise AssertionError("a hung rank did not fail the call")
        assert not pool.procs, "a pool whose collectives hung is stopped"
        assert pool.run(sync_check, 1.0) == [[1.0, 1.0], [1.0, 1.0]], "the next call starts a fresh pool"
