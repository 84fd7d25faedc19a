"""HunyuanImage-3 behind vllm-omni's runner on 2 gloo ranks, through vllm-omni's own model code and pipeline.

Tensor parallel 2: each rank's pool holds its KV head (of 2), and every rank's image is the one-rank dense image
(fp32, 1e-5); at the same byte budget a rank's pool holds twice the blocks. Strict Ulysses 2: the same, each
rank's pool holding its KV head of the joined text prefix. CFG-parallel 2: each rank serves its
CFG branch's row (`_split_model_kwargs_for_cfg_parallel`), and every rank's image is the one-rank dense image
with each CFG row forwarded alone (`hunyuan_runner.rows_alone`, fp32, 1e-5), as is vllm-omni's own dense
CFG-parallel image. The one-rank batched image is not the oracle here: vllm-omni's RoPE gives row 1 row 0's
positions when the rows' prompt lengths differ (0.40 here;
`test_hunyuan_runner.py::test_hunyuan_batched_cfg_differs_from_rows_alone_only_by_the_rope_row0_defect`)."""

from __future__ import annotations

import pytest
import torch

from . import hunyuan_runner as hr
from .test_hunyuan_runner import ATOL, BUDGET, OURS, _prompts

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

RANK_TIMEOUT_S = 600.0  # compiles on both ranks of a loaded 2-core machine


def _one_rank(omni):
    """The one-rank weights, prompts, dense image (batched CFG rows), dense image with each CFG row alone, and the
    blocks our one-rank pool gets at BUDGET."""
    from paged_kv_compile.adapters.vllm_omni_hunyuan_runner import RUNNER_PATH

    prompts = _prompts(0)
    with hr.fp32_pipeline():
        od = hr.diffusion_config(dtype=torch.float32)
        with omni.model_context(od):
            pipeline = hr.build_pipeline(od)
            weights = {k: v.clone() for k, v in pipeline.state_dict().items()}
            runner = hr.build_runner(pipeline, od)
            dense = hr.serve(runner, hr.make_request("r", prompts)).output["payload"]["image"]
            with hr.rows_alone(pipeline.model):
                alone = hr.serve(runner, hr.make_request("r", prompts)).output["payload"]["image"]
        ours = hr.diffusion_config(dtype=torch.float32, runner_cls=RUNNER_PATH, model_config=OURS)
        with omni.model_context(ours):
            blocks = hr.build_runner(hr.build_pipeline(ours), ours, available_bytes=BUDGET).paged_kv.runtime.pool
            blocks = blocks.blocks_per_layer
    torch._dynamo.reset()
    return weights, prompts, dense, alone, blocks


def test_multirank_hunyuan_runner_tp2_parity_and_heads_per_rank(omni, ranks):
    weights, prompts, dense, _, one_rank_blocks = _one_rank(omni)
    ranks.setup(tensor_parallel_size=2)
    outs = ranks.run(hr.serve_on_rank, weights, prompts, 0, OURS, BUDGET, timeout=RANK_TIMEOUT_S)
    errs = [float((o["image"] - dense).abs().max()) for o in outs]
    print(f"TP 2: per rank vs one-rank dense {errs}; per rank {[o['kv_heads'] for o in outs]} KV heads, "
          f"{[o['blocks'] for o in outs]} blocks/layer in {[o['pool_bytes'] for o in outs]} bytes "
          f"(one rank: 2 KV heads, {one_rank_blocks} blocks/layer)")
    assert max(errs) <= ATOL, errs
    assert [o["tp"] for o in outs] == [2, 2] and [o["kv_heads"] for o in outs] == [1, 1]  # 2 KV heads / 2 ranks
    assert all(o["pool_bytes"] <= BUDGET and o["blocks"] >= 2 * one_rank_blocks - 2 for o in outs), outs
    assert all(o["at_baseline"] for o in outs)


def test_multirank_hunyuan_runner_cfg2_parity_with_each_row_alone_and_pool_per_rank(omni, ranks):
    weights, prompts, batched, alone, one_rank_blocks = _one_rank(omni)
    assert prompts[0].numel() != prompts[1].numel()  # right-padded CFG rows of different prompt lengths
    ranks.setup(cfg_parallel_size=2)
    ours = ranks.run(hr.serve_on_rank, weights, prompts, 0, OURS, BUDGET, timeout=RANK_TIMEOUT_S)
    dense = ranks.run(hr.serve_on_rank, weights, prompts, 0, None, None, timeout=RANK_TIMEOUT_S)
    errs = [float((o["image"] - alone).abs().max()) for o in ours]
    dense_errs = [float((d["image"] - alone).abs().max()) for d in dense]
    print(f"CFG-parallel 2: ours per rank vs one-rank dense rows alone {errs}; vllm-omni's dense CFG-parallel vs "
          f"the same {dense_errs}; one-rank batched vs rows alone {float((batched - alone).abs().max())}; per rank "
          f"{[o['blocks'] for o in ours]} blocks/layer in {[o['pool_bytes'] for o in ours]} bytes, "
          f"{[o['kv_heads'] for o in ours]} KV heads (one rank: {one_rank_blocks} blocks/layer)")
    assert max(errs) <= ATOL and max(dense_errs) <= ATOL, (errs, dense_errs)
    assert [o["cfg"] for o in ours] == [2, 2] and all(o["at_baseline"] for o in ours)
    # each rank holds its row's K/V for all KV heads: the one-rank geometry, in the budget
    assert all(o["pool_bytes"] <= BUDGET and o["blocks"] == one_rank_blocks and o["kv_heads"] == 2 for o in ours)


def test_multirank_hunyuan_runner_ulysses2_parity_and_kv_heads_per_rank(omni, ranks):
    """Strict Ulysses 2 through vllm-omni's own layer (its `_sp_plan` hooks, the text prefix joined in front of the
    all-to-all's image K/V, `joint_strategy="front"`), 3 denoising steps: every rank's image within 1e-5 of
    one-rank dense (vllm-omni's own dense Ulysses run is the floor: its difference from one rank is printed and
    held to the same bound), each rank's pool holding its KV head (1 of 2). A step's 5 timestep + image tokens are
    padded by vllm-omni to 6 (a multiple of the degree): the plan carries that padded token."""
    prompts = _prompts(0, lens=(6, 6))  # Ulysses needs one prompt length across the CFG rows (vllm-omni asserts it)
    with hr.fp32_pipeline():
        od = hr.diffusion_config(dtype=torch.float32)
        with omni.model_context(od):
            pipeline = hr.build_pipeline(od)
            weights = {k: v.clone() for k, v in pipeline.state_dict().items()}
            dense = hr.serve(hr.build_runner(pipeline, od), hr.make_request("r", prompts)).output["payload"]["image"]
    ranks.setup(ulysses_degree=2, sequence_parallel_size=2)
    ulysses = {"ulysses_degree": 2}
    ours = ranks.run(hr.serve_on_rank, weights, prompts, 0, OURS, BUDGET, ulysses, timeout=RANK_TIMEOUT_S)
    dense_sp = ranks.run(hr.serve_on_rank, weights, prompts, 0, None, None, ulysses, timeout=RANK_TIMEOUT_S)
    errs = [float((o["image"] - dense).abs().max()) for o in ours]
    dense_errs = [float((d["image"] - dense).abs().max()) for d in dense_sp]
    print(f"Ulysses 2: ours per rank vs one-rank dense {errs}; vllm-omni's dense Ulysses 2 vs the same {dense_errs}; "
          f"per rank {[o['kv_heads'] for o in ours]} KV heads, {[o['blocks'] for o in ours]} blocks/layer in "
          f"{[o['pool_bytes'] for o in ours]} bytes")
    assert max(errs) <= ATOL and max(dense_errs) <= ATOL, (errs, dense_errs)
    assert [o["sp"] for o in ours] == [2, 2] and [o["kv_heads"] for o in ours] == [1, 1]  # 2 KV heads / 2 ranks
    assert all(o["pool_bytes"] <= BUDGET and o["at_baseline"] for o in ours), ours
