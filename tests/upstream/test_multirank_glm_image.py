"""GLM-Image's image edit CFG-parallel on two gloo ranks (vllm-omni's own parallel_state, `cfg_parallel_size=2`):
`GlmImagePipeline.diffuse` runs the conditional forward on rank 0 and the unconditional one on rank 1, all-gathers
the predictions, steps on rank 0 and broadcasts the latents. Each rank holds the condition prefix in its own pool
(`RankRuntime`: `store_prefix` and every step are decisions both ranks agree on), and each rank's result equals
one-rank dense eager (sequential CFG), fp32.
"""

from __future__ import annotations

import torch
from helpers import CountingBackend

from paged_kv_compile import PagedKVConfig

from . import vllm_omni_cpu as omni_cpu
from .glm_image_pipeline import (ATOL, BLOCK, HEAD_DIM, HEADS, LAYERS, EditInputs, compile_blocks, diffuse, paged_edit,
                                 tiny_od_config, tiny_transformer, write_condition_kv)
from .rank_scenarios import hygiene, rank_runtime

ONE_RANK = PagedKVConfig(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, block_size=BLOCK,
                         blocks_per_layer=8, max_rows=1, scratch_tokens_per_row=16, kernel="reference")


def glm_cfg_parallel_task() -> dict:
    """On this rank: the edit dense (CFG-parallel, the pipeline's collectives) and paged on a RankRuntime."""
    od = tiny_od_config()
    with omni_cpu.model_context(od), torch.no_grad():
        transformer = tiny_transformer(od)
        x = EditInputs()
        dense = diffuse(transformer, write_condition_kv(transformer, x), x)
        runtime = rank_runtime(ONE_RANK)
        runtime.bind(list(transformer.transformer_blocks))
        backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
        compile_blocks(transformer, backend)
        paged = paged_edit(transformer, runtime, x, "edit")
        blocks = [len(r) for r in runtime.owner("edit").rows]
        runtime.release("edit")
        return {"dense": dense, "paged": paged, "blocks": blocks, "votes": runtime.agreement.votes, "forwards": runtime.forwards,
                "state": runtime.state(), **hygiene(backend)}


def glm_store_refused_on_one_rank_task() -> dict:
    """Rank 1 hands `store_prefix` K/V of the wrong length: every rank raises and is restored (no prefix stored,
    the request still storable), then both store and release."""
    from paged_kv_compile.families.conditioning_prefix import ConditioningPrefixSpec, store_prefix

    with omni_cpu.model_context():
        runtime = rank_runtime(ONE_RANK)
        runtime.admit("edit", ConditioningPrefixSpec((6,), 8))
        kv = [(torch.randn(1, 6, HEADS, HEAD_DIM), torch.randn(1, 6, HEADS, HEAD_DIM)) for _ in range(LAYERS)]
        bad = [(k[:, :4], v[:, :4]) for k, v in kv] if torch.distributed.get_rank() == 1 else kv
        before = runtime.state()
        try:
            store_prefix(runtime, "edit", bad)
            refused = ""
        except Exception as e:  # noqa: BLE001 - reported to the test
            refused = f"{type(e).__name__}: {e}"
        restored = runtime.state() == before and runtime.owner("edit").state.capacity is None
        store_prefix(runtime, "edit", kv)
        stored = runtime.owner("edit").state.capacity
        runtime.release("edit")
        return {"refused": refused, "restored": restored, "stored": stored, "state": runtime.state()}


def test_multirank_glm_image_cfg_parallel_edit_pages_on_each_rank(omni, ranks):
    od = tiny_od_config()
    with omni.model_context(od), torch.no_grad():
        transformer = tiny_transformer(od)
        x = EditInputs()
        one_rank = diffuse(transformer, write_condition_kv(transformer, x), x)
    ranks.setup(cfg_parallel_size=2)
    outs = ranks.run(glm_cfg_parallel_task)
    for r, out in enumerate(outs):
        err = (out["paged"] - one_rank).abs().max().item()
        print(f"[figure] GLM-Image edit CFG-parallel 2, rank {r}: paged vs one-rank dense {err:.2e}, frames "
              f"{out['frames']}")
        assert err <= ATOL and (out["dense"] - one_rank).abs().max().item() <= ATOL
        # one WRITE forward (dense) and this rank's branch's step bucket
        assert out["frames"] == 2 and out["patterns"] == ["conditioning-prefix"] and out["host_syncs"] == []
        assert out["blocks"] == [-(-x.image_tokens // BLOCK)]  # the prefix, once on each rank
        assert out["forwards"] == 3 and out["votes"] == 3 + 2 * 3  # admit, store_prefix, release; 2 per forward
    assert outs[0]["state"] == outs[1]["state"]
    outs = ranks.run(glm_store_refused_on_one_rank_task)
    for out in outs:
        assert out["refused"] and out["restored"] and out["stored"] == 6, out
    assert "fewer than the spec's prefix lengths" in outs[1]["refused"]
    assert outs[0]["state"] == outs[1]["state"]
