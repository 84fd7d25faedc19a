"""Our reference models on two gloo ranks, in the modes vllm-omni runs the real ones (distributed/reference.py):
DreamZero with CFG-parallel 2, tensor parallel 2 and Ulysses 2, HunyuanImage-3 with tensor parallel 2. The parallel
layout and the agreement group come from vllm-omni's parallel_state (`ParallelConfig.from_vllm_omni`,
`model_parallel_cpu_group`). Paged on each rank vs the one-rank dense model, eager fp32: 1e-5; one compiled frame
per bucket on every rank (the collective decisions add none)."""

from __future__ import annotations

import torch
from helpers import CountingBackend, compile_blocks, host_syncs

from paged_kv_compile import PagedKVRuntime
from paged_kv_compile.distributed import ParallelConfig, RankRuntime, model_parallel_cpu_group
from paged_kv_compile.distributed.reference import CfgBranch, rank_run, shard_heads, shard_sequence
from paged_kv_compile.families.dreamzero import dreamzero_runtime_config
from paged_kv_compile.families.hunyuan_image3 import hunyuan_runtime_config
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config, HunyuanImage3Model, hunyuan_generate

from .multirank import rank_info

ATOL = 1e-5
DZ = DreamZeroConfig(num_layers=2, window_reset_frames=6)  # chunks of 2 frames in a 6-frame window, reset after 3
DZ_LOOP = dict(num_chunks=4, num_inference_steps=2, seed=0)
DZ_ULYSSES = DreamZeroConfig(num_layers=2, window_reset_frames=6, action_register_length=6)  # 16 x frames + 6: even
HY = HunyuanImage3Config(num_layers=2, image_h=2, image_w=3)  # 4 query / 2 KV heads
HY_PROMPTS = [torch.arange(3, 12), torch.arange(5, 9)]  # two CFG rows of different prompt lengths
HY_LOOP = dict(num_steps=3, seed=0)


def _runtime(one_rank) -> RankRuntime:
    parallel = ParallelConfig.from_vllm_omni()
    return RankRuntime(PagedKVRuntime(parallel.rank_config(one_rank)), parallel)


def _compiled(blocks) -> CountingBackend:
    backend = CountingBackend({"inner_compiler": "aot_eager", "kernel": "reference"})
    compile_blocks(blocks, backend)
    return backend


def _hygiene(backend: CountingBackend, runtime: RankRuntime) -> dict:
    return {"frames": backend.frames, "host_syncs": [s for r in backend.results for s in host_syncs(r.graph_module)],
            "state": runtime.state(), "bytes": runtime.pool.nbytes, **rank_info()}


def dreamzero_task() -> dict:
    """This rank's DreamZero: its CFG branch (CFG-parallel) or its heads (TP); paged rollout with a window reset."""
    torch._dynamo.reset()
    parallel = ParallelConfig.from_vllm_omni()
    group = model_parallel_cpu_group()
    runtime = _runtime(dreamzero_runtime_config(DZ, block_size=8, kernel="reference"))
    model = shard_heads(DreamZeroModel(DZ, seed=1), parallel, group)
    runtime.bind(model.blocks)
    backend = _compiled(model.blocks)
    if parallel.cfg_parallel > 1:
        paged = rank_run(CfgBranch(model, parallel, group), runtime, rows=1, **DZ_LOOP)
    else:
        paged = rank_run(model, runtime, **DZ_LOOP)
    return {"video": paged["video"], "actions": paged["actions"], "resets": paged["resets"],
            "heads": model.blocks[0].self_attn.num_heads, **_hygiene(backend, runtime)}


def dreamzero_ulysses_task() -> dict:
    """This rank's DreamZero under Ulysses 2 (vllm-omni's Ulysses group): its tokens, every token's K/V for half the
    heads in its pool; dense (the same sharded model on dense caches) and paged rollouts with a window reset."""
    from vllm_omni.diffusion.distributed.parallel_state import get_sp_group

    torch._dynamo.reset()
    parallel = ParallelConfig.from_vllm_omni()
    group = get_sp_group().ulysses_group
    dense = dreamzero_rollout(shard_sequence(DreamZeroModel(DZ_ULYSSES, seed=1), parallel, group), **DZ_LOOP)
    runtime = _runtime(dreamzero_runtime_config(DZ_ULYSSES, block_size=8, kernel="reference"))
    model = shard_sequence(DreamZeroModel(DZ_ULYSSES, seed=1), parallel, group)
    runtime.bind(model.blocks)
    backend = _compiled(model.blocks)
    paged = rank_run(model, runtime, **DZ_LOOP)
    collectives = sorted({str(n.target) for r in backend.results for n in r.graph_module.graph.nodes
                          if "_c10d_functional" in str(n.target)})
    return {"dense": dense, "paged": paged, "heads": model.blocks[0].self_attn.num_heads, "collectives": collectives,
            **_hygiene(backend, runtime)}


def hunyuan_task() -> dict:
    """This rank's HunyuanImage-3 heads (TP): a paged request of two CFG rows."""
    torch._dynamo.reset()
    parallel = ParallelConfig.from_vllm_omni()
    runtime = _runtime(hunyuan_runtime_config(HY, max_prefix=12, kernel="reference"))
    model = shard_heads(HunyuanImage3Model(HY, seed=1), parallel, model_parallel_cpu_group())
    runtime.bind(model.layers)
    backend = _compiled(model.layers)
    latents = rank_run(model, runtime, prompts=HY_PROMPTS, **HY_LOOP)
    return {"latents": latents, "kv_heads": model.layers[0].self_attn.num_kv_heads, **_hygiene(backend, runtime)}


def config_task() -> dict:
    """This rank's ParallelConfig read from vllm-omni, and what an explicit one that disagrees gets."""
    engine = ParallelConfig.from_vllm_omni()
    try:
        RankRuntime(PagedKVRuntime(hunyuan_runtime_config(HY, max_prefix=12)), ParallelConfig(cfg_parallel=2))
    except Exception as e:  # noqa: BLE001 - compared by the test
        return {"engine": engine, "error": (type(e).__name__, str(e))}
    return {"engine": engine, "error": None}


def _dreamzero_dense() -> dict:
    return dreamzero_rollout(DreamZeroModel(DZ, seed=1), **DZ_LOOP)


def test_cfg_parallel_reference_dreamzero_matches_one_rank(ranks):
    dense = _dreamzero_dense()
    ranks.setup(cfg_parallel_size=2)
    outs = ranks.run(dreamzero_task)
    for r, out in enumerate(outs):
        err = max((out[k] - dense[k]).abs().max().item() for k in ("video", "actions"))
        print(f"[figure] reference DreamZero CFG-parallel 2 rank {r}: paged vs one-rank dense {err:.2e}")
        assert err <= ATOL and out["resets"] == dense["resets"] == [2]
        assert out["frames"] == 1 and out["host_syncs"] == [], "one frame serves commit and denoise, every layer"
    assert outs[0]["state"] == outs[1]["state"]


def test_tensor_parallel_reference_models_match_one_rank(ranks):
    dense_dz = _dreamzero_dense()
    dense_hy = hunyuan_generate(HunyuanImage3Model(HY, seed=1), HY_PROMPTS, **HY_LOOP)
    ranks.setup(tensor_parallel_size=2)
    for r, out in enumerate(ranks.run(config_task)):
        assert out["engine"] == ParallelConfig(tensor_parallel=2, tp_rank=r)
        name, message = out["error"]
        assert name == "ConfigError" and "tensor_parallel: given 1, vllm-omni has 2" in message
        assert "cfg_parallel: given 2, vllm-omni has 1" in message
    for r, out in enumerate(ranks.run(dreamzero_task)):
        err = max((out[k] - dense_dz[k]).abs().max().item() for k in ("video", "actions"))
        print(f"[figure] reference DreamZero TP 2 rank {r}: paged vs one-rank dense {err:.2e}")
        assert err <= ATOL and out["heads"] == DZ.num_heads // 2 and out["frames"] == 1 and out["host_syncs"] == []
    outs = ranks.run(hunyuan_task)
    for r, out in enumerate(outs):
        err = (out["latents"] - dense_hy).abs().max().item()
        print(f"[figure] reference HunyuanImage-3 TP 2 rank {r}: paged vs one-rank dense {err:.2e}")
        assert err <= ATOL and out["kv_heads"] == 1 and out["host_syncs"] == []
        assert out["frames"] == 2, "prefill and step buckets, shared by both layers"
    assert outs[0]["state"] == outs[1]["state"]


def test_ulysses_reference_dreamzero_matches_one_rank(ranks):
    """Ulysses 2 through a model: each rank holds every token's K/V for half the heads (half the one-rank pool),
    the all-to-alls are inside the one compiled frame, and both the dense and the paged rollout of the sharded model
    equal the one-rank dense rollout."""
    one_rank = dreamzero_rollout(DreamZeroModel(DZ_ULYSSES, seed=1), **DZ_LOOP)
    one_rank_bytes = PagedKVRuntime(dreamzero_runtime_config(DZ_ULYSSES, block_size=8, kernel="reference")).pool.nbytes
    ranks.setup(ulysses_degree=2)
    outs = ranks.run(dreamzero_ulysses_task)
    for r, out in enumerate(outs):
        assert out["ulysses"] == 2 and out["heads"] == DZ_ULYSSES.num_heads // 2
        for side in ("dense", "paged"):
            err = max((out[side][k] - one_rank[k]).abs().max().item() for k in ("video", "actions"))
            print(f"[figure] reference DreamZero Ulysses 2 rank {r}: {side} vs one-rank dense {err:.2e}")
            assert err <= ATOL and out[side]["resets"] == one_rank["resets"] == [2]
        assert out["bytes"] * 2 == one_rank_bytes, (out["bytes"], one_rank_bytes)
        assert out["frames"] == 1 and out["host_syncs"] == [], "one frame serves commit and denoise, every layer"
        assert out["collectives"] == ["_c10d_functional.all_to_all_single", "_c10d_functional.wait_tensor"]
    assert outs[0]["state"] == outs[1]["state"]
