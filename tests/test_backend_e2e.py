"""End-to-end: unmodified dense models under backend="paged_kv" match their dense eager loops.

Also the compile hygiene the design promises: one compiled frame per shape bucket for all layers,
no recompiles over a whole rollout, no host sync in the rewritten graph.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend, compile_blocks, host_syncs

from paged_kv_compile import RequestError
from paged_kv_compile.config import Bucket
from paged_kv_compile.driver import paged_run
from paged_kv_compile.families.dreamzero import dreamzero_runtime_config
from paged_kv_compile.families.hunyuan_image3 import hunyuan_runtime_config
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config, HunyuanImage3Model, hunyuan_generate
from paged_kv_compile.runtime import PagedKVRuntime

ATOL = 1e-5

# Tiny DreamZero: chunk = 2 frames, window = 6 frames (slides after 3 commits), a 2-frame sink,
# reset when the start frame reaches 16 (after 8 chunks): 10 chunks see eviction, sink and a reset.
DZ_CFG = DreamZeroConfig(sink_size=2)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _dreamzero_pair(cfg: DreamZeroConfig, inner: str, num_chunks: int, steps: int = 3):
    dense = dreamzero_rollout(DreamZeroModel(cfg, seed=1), num_chunks=num_chunks, num_inference_steps=steps, seed=3)
    model = DreamZeroModel(cfg, seed=1)
    runtime = PagedKVRuntime(dreamzero_runtime_config(cfg, block_size=8, kernel="reference"))
    runtime.bind(model.blocks)
    backend = CountingBackend({"inner_compiler": inner})
    compile_blocks(model.blocks, backend)
    paged = paged_run(model, runtime, num_chunks=num_chunks, num_inference_steps=steps, seed=3)
    return dense, paged, runtime, backend


@pytest.mark.parametrize("sink", [0, 2], ids=["window", "window+sink"])
def test_dreamzero_rollout_parity_aot_eager(sink):
    cfg = DreamZeroConfig(sink_size=sink)
    dense, paged, runtime, backend = _dreamzero_pair(cfg, "aot_eager", num_chunks=10)
    assert dense["resets"] == paged["resets"] and dense["resets"], "the rollout must include a window reset"
    for key in ("video", "actions"):
        assert (dense[key] - paged[key]).abs().max().item() <= ATOL
    # One frame serves every layer, commit and denoise, at every window fill, across the reset.
    assert backend.frames == 1
    result = backend.results[0]
    assert [r.status for r in result.reports].count("rewritten") == 1
    assert not host_syncs(result.graph_module)
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


def test_dreamzero_rollout_parity_inductor():
    dense, paged, runtime, backend = _dreamzero_pair(DZ_CFG, "inductor", num_chunks=9, steps=3)
    for key in ("video", "actions"):
        assert (dense[key] - paged[key]).abs().max().item() <= ATOL
    assert backend.frames == 1


def _hunyuan_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_hunyuan_requests_parity(inner):
    cfg = HunyuanImage3Config()
    capacity = 12
    T = cfg.target_len
    buckets = tuple(Bucket(r, t, capacity) for r in (1, 2) for t in (capacity + T, T))
    requests = [_hunyuan_prompts([9]), _hunyuan_prompts([11, 4], seed=1)]  # 1 and 2 rows, different prefixes
    dense = [hunyuan_generate(HunyuanImage3Model(cfg, seed=2), p, prefix_capacity=capacity, num_steps=4, seed=5)
             for p in requests]
    model = HunyuanImage3Model(cfg, seed=2)
    runtime = PagedKVRuntime(hunyuan_runtime_config(cfg, max_prefix=capacity, block_size=4, kernel="reference",
                                                    buckets=buckets))
    runtime.bind(model.layers)
    backend = CountingBackend({"inner_compiler": inner})
    compile_blocks(model.layers, backend)
    for i, (prompts, want) in enumerate(zip(requests, dense)):
        got = paged_run(model, runtime, prompts=prompts, owner_id=f"r{i}", num_steps=4, seed=5)
        assert (got - want).abs().max().item() <= ATOL
    # prefill and step buckets, for 1 and 2 rows: one frame each, shared by all layers.
    assert backend.frames == 4
    patterns = sorted(r.pattern for res in backend.results for r in res.reports)
    assert patterns == ["prefill-store"] * 2 + ["prefix-step"] * 2
    for res in backend.results:
        assert all(r.status == "rewritten" for r in res.reports)
        assert not host_syncs(res.graph_module)
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


def _hunyuan_with_mask_check(monkeypatch=None):
    cfg = HunyuanImage3Config()
    prompts = _hunyuan_prompts([7, 4], seed=3)
    model = HunyuanImage3Model(cfg, seed=2)
    runtime = PagedKVRuntime(hunyuan_runtime_config(cfg, max_prefix=8, block_size=4, kernel="reference"))
    runtime.bind(model.layers)
    compile_blocks(model.layers, CountingBackend({"inner_compiler": "aot_eager", "check_mask": True}))
    return paged_run(model, runtime, prompts=prompts, prefix_capacity=8, num_steps=2), runtime


def test_hunyuan_mask_check_accepts_the_models_mask():
    _, runtime = _hunyuan_with_mask_check()
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


def test_hunyuan_mask_check_catches_a_mask_the_layout_does_not_describe(monkeypatch):
    from paged_kv_compile.models import hunyuan_image3 as hy

    original = hy.hunyuan_attention_mask

    def causal_only(prefix_lens, prefix_capacity, h, w):  # the image span is no longer bidirectional
        mask, spans = original(prefix_lens, prefix_capacity, h, w)
        return mask & torch.ones_like(mask).tril(), spans

    monkeypatch.setattr(hy, "hunyuan_attention_mask", causal_only)
    # Read at the prefill, before any op runs (the runtime takes each request's layout from its mask).
    with pytest.raises(RequestError, match=r"row 0: target token \d+ .* request spec .* does not describe this mask"):
        _hunyuan_with_mask_check()


def test_hunyuan_whole_model_compile_parity():
    """One graph holding every layer's site: each site still finds its own layer's metadata."""
    cfg = HunyuanImage3Config()
    prompts = _hunyuan_prompts([10, 6], seed=4)
    dense = hunyuan_generate(HunyuanImage3Model(cfg, seed=2), prompts, prefix_capacity=10, num_steps=3, seed=1)
    model = HunyuanImage3Model(cfg, seed=2)
    runtime = PagedKVRuntime(hunyuan_runtime_config(cfg, max_prefix=10, block_size=4, kernel="reference"))
    runtime.bind(model.layers)
    backend = CountingBackend({"inner_compiler": "aot_eager"})
    model.compile(backend=backend, fullgraph=True, dynamic=False)
    got = paged_run(model, runtime, prompts=prompts, prefix_capacity=10, num_steps=3, seed=1)
    assert (got - dense).abs().max().item() <= ATOL
    assert backend.frames == 2  # prefill and step
    for res in backend.results:
        assert [r.status for r in res.reports] == ["rewritten"] * cfg.num_layers
        assert len({r.layer_key for r in res.reports}) == cfg.num_layers
