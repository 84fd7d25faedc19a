"""The compiled model reads its cross-attention K/V from shared write-once regions with `paged_kv::attend`.

Oracle: the dense eager model (fp32) over the same rollout, <= 1e-5. Hygiene as the other pass tests: one
compiled frame for every layer and forward, both sites rewritten (window `write_attend`, region `attend`), no
host sync in the graph. A row without a region, or a region stand-in the pass cannot read, is refused: never
wrong numbers.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend, compile_blocks, host_syncs, raises_paged

from paged_kv_compile import PassError, RequestError, families
from paged_kv_compile.driver import paged_run
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.runtime import PagedKVRuntime

ATOL = 1e-5
# image 3 + text 5 = 8 cross tokens: one block of 8 (block_size 8), window 6 frames with a 2-frame sink.
CFG = DreamZeroConfig(num_layers=2, sink_size=2, text_len=5, image_len=3)

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "no_grad")


def make_rig(sessions: int = 1, max_rows: int = 2, inner: str = "aot_eager"):
    model = DreamZeroModel(CFG, seed=1)
    runtime = PagedKVRuntime(dreamzero_runtime_config(CFG, block_size=8, sessions=sessions, max_rows=max_rows,
                                                      cross_regions=2 * sessions, kernel="reference",
                                                      inner_compiler=inner))
    runtime.bind(model.blocks)
    backend = CountingBackend({"inner_compiler": inner})
    compile_blocks(model.blocks, backend)
    return model, runtime, backend


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_shared_region_rollout_reads_cross_attention_from_the_pool(inner):
    dense = dreamzero_rollout(DreamZeroModel(CFG, seed=1), num_chunks=9, num_inference_steps=2, seed=3)
    model, runtime, backend = make_rig(inner=inner)
    paged = paged_run(model, runtime, num_chunks=9, num_inference_steps=2, seed=3, shared_kv=True,
                      cache_salt="tenant")
    assert dense["resets"] == paged["resets"] and dense["resets"]
    worst = max((dense[key] - paged[key]).abs().max().item() for key in ("video", "actions"))
    print(f"shared-region rollout, {inner}: max abs difference vs dense eager {worst:.3g}")
    assert worst <= ATOL
    assert backend.frames == 1  # one frame: every layer, commit and denoise, across the reset
    result = backend.results[0]
    assert sorted(r.pattern for r in result.reports if r.status == "rewritten") == ["shared-region", "window"]
    assert result.region_tokens == CFG.cross_len
    code = result.graph_module.code
    assert "paged_kv.attend" in code and "paged_kv.write_attend" in code
    assert not host_syncs(result.graph_module)
    assert runtime.scheduler.regions.held == {}
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer  # regions freed at close


def test_shared_region_warmup_then_rollout_compiles_nothing_and_matches_dense():
    """Warm-up (and CUDA-graph capture, on a GPU) compiles the region graph: serving then compiles nothing."""
    from paged_kv_compile.capture import warm_up

    dense = dreamzero_rollout(DreamZeroModel(CFG, seed=1), num_chunks=5, num_inference_steps=2, seed=3)
    model, runtime, backend = make_rig()
    captured = warm_up(model, runtime, progress=False)
    assert backend.frames == 1 and backend.results[0].region_tokens == CFG.cross_len
    with captured.serving():  # fail_on_recompile
        paged = paged_run(model, runtime, num_chunks=5, num_inference_steps=2, seed=3,
                          shared_kv=True, cache_salt="t")
    assert backend.frames == 1 and captured.stats["fallback_calls"] == 0
    assert max((dense[k] - paged[k]).abs().max().item() for k in ("video", "actions")) <= ATOL


def _inputs(seed: int, rows: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, CFG.chunk_tokens, CFG.in_channels, generator=g)
    a = torch.randn(rows, CFG.action_register_length, CFG.action_dim, generator=g)
    return x, a


def _cross(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    text = torch.randn(1, CFG.text_len, CFG.text_dim, generator=g)
    image = torch.randn(1, CFG.image_len, CFG.image_dim, generator=g).expand(2, -1, -1)
    return model.prepare_cross_kv(torch.cat([text, torch.zeros_like(text)]), image)


def test_shared_region_batched_sessions_read_their_own_regions():
    """Two tenants' sessions with different prompts, one forward: each row reads its own region (a row-wise table)."""
    model, runtime, backend = make_rig(sessions=3, max_rows=4)
    dense = DreamZeroModel(CFG, seed=1)
    spec = DreamZeroSpec.from_model_config(CFG)
    cross = {"a": _cross(model, 10), "b": _cross(model, 20)}
    runtime.admit("a", spec, cross_kv=cross["a"], cache_salt="t1")
    runtime.admit("b", spec, cross_kv=cross["b"], cache_salt="t2")
    runtime.admit("a2", spec, cross_kv=cross["a"], cache_salt="t1")  # shares a's regions
    assert [r.blocks for r in runtime.regions_of("a2")] == [r.blocks for r in runtime.regions_of("a")]
    both = [torch.cat([cross["a"][layer], cross["b"][layer]], dim=1) for layer in range(CFG.num_layers)]
    standins = families.get("dreamzero").region_standins(runtime, model, 4)
    caches, worst = dense.dense_caches(4), 0.0
    for start, commit in ((0, True), (2, True), (4, False)):
        x, a = _inputs(start, 4)
        t = torch.full((4,), 0.0 if commit else 500.0)
        with runtime.forward_batch([("a", "commit" if commit else "denoise"), ("b", "commit" if commit else "denoise")]):
            got = model(x, a, t, start, families.for_model(model).standin_caches(runtime, model, 4), standins,
                        update_kv_cache=commit)
        want = dense(x, a, t, start, caches, both, update_kv_cache=commit)
        caches = want[2]
        worst = max(worst, *((g - w).abs().max().item() for g, w in zip(got[:2], want[:2])))
    assert worst <= ATOL, worst
    # a2 holds a's regions but no history: alone, its denoise reads the shared region and an empty window.
    x, a = _inputs(9, 2)
    with runtime.forward("a2", "denoise"):
        got = model(x, a, torch.full((2,), 500.0), 0, families.for_model(model).standin_caches(runtime, model, 2),
                    families.get("dreamzero").region_standins(runtime, model, 2), update_kv_cache=False)
    want = dense(x, a, torch.full((2,), 500.0), 0, dense.dense_caches(2), cross["a"], update_kv_cache=False)
    assert max((g - w).abs().max().item() for g, w in zip(got[:2], want[:2])) <= ATOL
    assert backend.frames == 2  # one per bucket: 4 rows, 2 rows


def test_shared_region_site_refuses_a_row_without_a_region():
    model, runtime, _ = make_rig()
    runtime.admit("plain", DreamZeroSpec.from_model_config(CFG))  # no cross_kv: nothing to read
    x, a = _inputs(0, 2)
    before = runtime.state()
    with pytest.raises(RequestError, match="row 0 of this commit forward .* holds no shared region: admit the owner"):
        with runtime.forward("plain", "commit"):
            model(x, a, torch.zeros(2), 0, families.for_model(model).standin_caches(runtime, model, 2),
                  families.get("dreamzero").region_standins(runtime, model, 2), update_kv_cache=True)
    assert runtime.state() == before  # rolled back
    # The dense cross K/V still work (a cross-attention that reads no stand-in stays dense).
    with runtime.forward("plain", "commit"):
        model(x, a, torch.zeros(2), 0, families.for_model(model).standin_caches(runtime, model, 2), _cross(model, 1),
              update_kv_cache=True)


class _SlicedCross(torch.nn.Module):
    """A cross-attention that reads only part of its K/V: not a whole region, so it cannot be paged."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, e, cos, sin, kv_cache, cross_kv):
        return self.block(x, e, cos, sin, kv_cache, cross_kv[:, :, 1:])


def test_shared_region_site_the_pass_cannot_read_is_refused_not_wrong():
    model, runtime, _ = make_rig()
    block = _SlicedCross(model.blocks[0])
    compiled = torch.compile(block, backend=CountingBackend({"inner_compiler": "aot_eager", "strict": True}),
                             fullgraph=True, dynamic=False)
    runtime.admit("s", DreamZeroSpec.from_model_config(CFG), cross_kv=_cross(model, 1), cache_salt="t")
    R, T = 2, CFG.tokens_per_forward
    cos, sin = model.rope_tables(0, CFG.num_frame_per_block, torch.device("cpu"))
    with raises_paged(PassError, "reads a shared-region stand-in but cannot be rewritten: its key is not exactly"):
        with runtime.forward("s", "denoise"):
            compiled(torch.zeros(R, T, CFG.dim), torch.zeros(R, 6, CFG.dim), cos, sin,
                     families.for_model(model).standin_caches(runtime, model, R)[0],
                     families.get("dreamzero").region_standins(runtime, model, R)[0])


def test_shared_region_in_an_fp8_pool_reads_what_the_layer_scales_store():
    """FP8 pool: a region holds its K/V quantized with each layer's scales, and `attend` dequantizes them with the
    same ones. Oracle: the same paged FP8 rollout handed those quantize-dequantized K/V densely."""
    from paged_kv_compile.driver import PagedHooks
    from paged_kv_compile.ops.fp8 import dequantize, quantize

    scales = torch.tensor([[0.02], [0.05]])  # per layer (the same for every head), K and V alike
    fp8 = torch.float8_e4m3fn

    def rig():
        model = DreamZeroModel(CFG, seed=1)
        runtime = PagedKVRuntime(dreamzero_runtime_config(CFG, block_size=8, cross_regions=2, kernel="reference",
                                                          inner_compiler="aot_eager", kv_dtype=fp8))
        runtime.pool.set_scales(scales, scales)
        runtime.bind(model.blocks)
        compile_blocks(model.blocks, CountingBackend({"inner_compiler": "aot_eager"}))
        return model, runtime

    class QuantizedDenseCross(PagedHooks):
        def write_once_kv(self, model, cross_kvs):
            return [dequantize(quantize(kv, s, fp8), s, kv.dtype) for kv, s in zip(cross_kvs, scales)]

    model, runtime = rig()
    paged = paged_run(model, runtime, num_chunks=3, num_inference_steps=2, seed=3, shared_kv=True,
                      cache_salt="t")
    torch._dynamo.reset()
    model, runtime = rig()
    want = paged_run(model, runtime, num_chunks=3, num_inference_steps=2, seed=3,
                     make_hooks=QuantizedDenseCross)
    worst = max((want[k] - paged[k]).abs().max().item() for k in ("video", "actions"))
    assert worst <= ATOL, worst
