"""Tencent's HunyuanImage-3.0 static cache (transcribed in tencent_hunyuan.py), paged as written.

Driven as `HunyuanImage3ForCausalMM` drives image generation: two CFG rows of different prompt lengths,
right-padded (``[prompt | timestep | image | <eoi> | pad]``, causal pads), the mask of
`_prepare_attention_mask_for_generation`, a prefill that writes every position (`position_ids = arange(S)`
expanded: one `index_copy_` per row), then denoising steps that write the timestep + image tokens again at
their prefill positions and attend over the whole static cache (`_update_model_kwargs_for_generation`). The
oracle is the same layers run densely in eager mode with a real static cache (fp32).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import CountingBackend, compile_blocks, raises_paged

from paged_kv_compile import PagedKVConfig, PagedKVRuntime, PassError, RequestError
from paged_kv_compile.adapters.tencent_hunyuan import LAYER_IDX_SOURCE, static_cache_standins
from paged_kv_compile.families.hunyuan_image3 import HunyuanSpec

from . import tencent_hunyuan as th

CFG = th.TinyConfig()
LAYERS, HW, STEPS = 2, 4, 3


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _request(lens, seed: int = 0):
    """The pipeline's inputs: prefill mask/positions, per-step position_ids and masks, RoPE tables, hidden states."""
    B, S = len(lens), max(lens) + 1 + HW + 1  # the longest row: [prompt | timestep | image | <eoi>]
    mask = th.prepare_attention_mask(S, [[slice(p + 1, p + 1 + HW)] for p in lens])
    image_mask = torch.zeros(B, S, dtype=torch.bool)
    for r, p in enumerate(lens):
        image_mask[r, p + 1:p + 1 + HW] = True
    scatter = torch.tensor([[p] for p in lens])  # gen_timestep_scatter_index: the timestep token of each row
    step = th.step_kwargs(image_mask, scatter, mask)
    T = step["position_ids"].shape[1]
    g = torch.Generator().manual_seed(seed)
    rope = tuple(torch.randn(B, S, CFG.attention_head_dim, generator=g) for _ in range(2))
    hidden = [torch.randn(B, S, CFG.hidden_size, generator=g)]
    hidden += [torch.randn(B, T, CFG.hidden_size, generator=g) for _ in range(STEPS)]
    return dict(lens=lens, S=S, T=T, mask=mask, scatter=scatter, step=step, rope=rope, hidden=hidden)


def _run(layers, cache, req, around=None, one_d=False, step_positions=None, forwards=slice(None)):
    """Prefill + STEPS steps (or the `forwards` slice of them) through every layer; each forward's output."""
    around = around or (lambda phase, mask: contextlib.nullcontext())
    B, S = len(req["lens"]), req["S"]
    outs = []
    for i, hidden in list(enumerate(req["hidden"]))[forwards]:
        if i == 0:
            mask, pos = req["mask"], torch.arange(S)[None].expand(B, -1)
        else:
            mask, pos = req["step"]["attention_mask"], req["step"]["position_ids"]
            if step_positions is not None:
                pos = step_positions
        pos_emb = th.get_pos_emb(req["rope"], pos)
        cache_pos = pos[0] if one_d else pos  # 1-D: one index_copy_ for the whole batch
        with torch.no_grad(), around("prefill" if i == 0 else "step", mask):
            for layer in layers:
                (hidden,) = layer(hidden, attention_mask=mask, position_ids=cache_pos, past_key_value=cache,
                                  custom_pos_emb=pos_emb)
        outs.append(hidden)
    return outs


def _layers():
    return [th.HunyuanImage3DecoderLayer(CFG, i, seed=10 + i) for i in range(LAYERS)]


def _paged(req, options=None):
    """Layers compiled with the paged backend, a runtime with the request admitted, and the stand-in cache."""
    B, S = len(req["lens"]), req["S"]
    layers = _layers()
    rt = PagedKVRuntime(PagedKVConfig(num_layers=LAYERS, num_kv_heads=CFG.num_key_value_heads,
                                      head_dim=CFG.attention_head_dim, block_size=4, blocks_per_layer=8, max_rows=B,
                                      scratch_tokens_per_row=16, kernel="reference"))
    rt.bind(layers)
    backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True, **(options or {})})
    compile_blocks(torch.nn.ModuleList(layers), backend)
    rt.admit("r", HunyuanSpec.from_prefill_mask(req["mask"], req["scatter"][:, -1].tolist(), req["T"]))
    keys, values = static_cache_standins(rt, rows=B, num_kv_heads=CFG.num_key_value_heads, max_cache_len=S,
                                         head_dim=CFG.attention_head_dim, num_layers=LAYERS)

    def around(phase, mask):
        return rt.forward("r", phase, prefix_capacity=S, attention_mask=mask)

    return layers, rt, backend, th.HunyuanStaticCache(keys, values), around


@pytest.mark.parametrize("case", ["cfg-rows-2d", "one-row-1d"])
def test_tencent_static_cache_pages_as_written(case):
    """0 model lines: paged == dense eager (fp32, 1e-5) over prefill + steps; one frame per bucket, all layers."""
    lens, one_d = ((6, 3), False) if case == "cfg-rows-2d" else ((5,), True)
    req = _request(lens)
    dense = _run(_layers(), th.HunyuanStaticCache.zeros(CFG, LAYERS, len(lens), req["S"]), req, one_d=one_d)
    with torch.compiler.config.patch(dynamic_sources=LAYER_IDX_SOURCE):
        layers, rt, backend, cache, around = _paged(req, {"check_mask": True})
        paged = _run(layers, cache, req, around, one_d=one_d)
    rt.release("r")
    err = max((a - b).abs().max().item() for a, b in zip(dense, paged))
    print(f"[figure] Tencent HunyuanImage-3 static cache ({case}) paged vs dense eager: max abs error {err:.2e}")
    assert err <= 1e-5, err
    assert backend.frames == 2  # prefill bucket + step bucket, each serving both layers
    reports = [r for res in backend.results for r in res.reports]
    assert [r.pattern for r in reports] == ["static-cache"] * 2 and all(r.status == "rewritten" for r in reports)
    assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer


@pytest.mark.parametrize("case", ["cfg-rows-2d", "one-row-1d"])
def test_static_cache_sites_warm_up_then_serve(case):
    """Issue 23, suspected (a), confirmed: the warm-up forward (`runtime.warmup_forward`, what `warm_up` and
    CUDA-graph capture run) has a plan of no rows, and the per-row position check (`backend._check_write_positions`)
    refused it ("a static-cache write for row 0 but the forward has 0 rows") for the pipeline's 2-D position_ids.
    The warm-up writes nothing (every slot -1) and now runs; the request then serves exactly, checks included."""
    from paged_kv_compile.config import Bucket

    lens, one_d = ((6, 3), False) if case == "cfg-rows-2d" else ((5,), True)
    req = _request(lens)
    dense = _run(_layers(), th.HunyuanStaticCache.zeros(CFG, LAYERS, len(lens), req["S"]), req, one_d=one_d)
    with torch.compiler.config.patch(dynamic_sources=LAYER_IDX_SOURCE):
        layers, rt, backend, cache, around = _paged(req)
        before = rt.pool.tensor.clone()
        for tokens, forwards in ((req["S"], slice(0, 1)), (req["T"], slice(1, 2))):  # prefill and step buckets
            with rt.warmup_forward(Bucket(len(lens), tokens, req["S"])):
                _run(layers, cache, req, one_d=one_d, forwards=forwards)
        assert torch.equal(rt.pool.tensor, before), "a warm-up writes nothing"
        frames = backend.frames
        paged = _run(layers, cache, req, around, one_d=one_d)
        assert backend.frames == frames == 2, "serving compiles nothing new"
    assert max((a - b).abs().max().item() for a, b in zip(dense, paged)) <= 1e-5
    rt.release("r")


@pytest.mark.parametrize("wrong", ["shifted", "one-row-off"])
def test_position_ids_that_disagree_with_the_layout_are_refused(wrong):
    """A step that writes its tokens anywhere but their prefill columns would make the dense cache and the
    paged one differ: refused before the op runs, the runtime left as it was."""
    req = _request((6, 3))
    good = req["step"]["position_ids"]
    bad = good + 1 if wrong == "shifted" else torch.stack([good[0], good[1] - 1])
    with torch.compiler.config.patch(dynamic_sources=LAYER_IDX_SOURCE):
        layers, rt, backend, cache, around = _paged(req)
        _run(layers, cache, req, around, forwards=slice(0, 1))  # the prefill
        before = rt.state()
        with pytest.raises(RequestError, match="position_ids that disagree with the layout"):
            _run(layers, cache, req, around, step_positions=bad, forwards=slice(1, 2))
    assert rt.state() == before


class _ComputedPositions(th.HunyuanStaticCache):
    """The same cache, but the write positions are computed inside the graph (not an input)."""

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        return super().update(key_states, value_states, layer_idx,
                              {"cache_position": cache_kwargs["cache_position"] + 0})


def test_write_positions_computed_in_the_graph_are_refused():
    """Positions the runtime cannot see cannot be checked against its layout: the pass refuses the site."""
    req = _request((6, 3))
    with torch.compiler.config.patch(dynamic_sources=LAYER_IDX_SOURCE):
        layers, rt, backend, cache, around = _paged(req)
        cache = _ComputedPositions(cache.key_cache, cache.value_cache)
        with raises_paged(PassError, "positions computed inside the graph"):
            _run(layers, cache, req, around, forwards=slice(0, 1))
