"""vllm-omni's real HunyuanImage-3 decoder layers, paged through `paged_kv_compile.adapters.vllm_omni_hunyuan`.

Driven as vllm-omni's pipeline_hunyuan_image3.py drives them: bf16 under CPU autocast, CFG rows RIGHT-padded
([prompt | timestep + image | <eoi> | pad], the mask of `_prepare_attention_mask_for_generation`: causal with
each image span bidirectional), RoPE tables from `build_batch_2d_rope` gathered by position (`get_pos_emb`),
and every later step's position_ids and mask made by the pipeline's own `_update_model_kwargs_for_generation`
(the <eoi> the prefill has is not fed again). The paged run must match dense eager within what dense
compilation itself changes (bf16).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from paged_kv_compile import PagedKVConfig, PagedKVRuntime
from paged_kv_compile.adapters import vllm_omni_hunyuan

LAYERS, HW, LENS, STEPS = 2, (2, 2), (7, 4), 3


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _request(seed: int = 3):
    """The pipeline's prefill inputs for two right-padded CFG rows, and its per-step inputs."""
    from vllm_omni.diffusion.models.hunyuan_image3.hunyuan_image3_transformer import build_batch_2d_rope
    from vllm_omni.diffusion.models.hunyuan_image3.pipeline_hunyuan_image3 import HunyuanImage3Pipeline

    h, w = HW
    hw = h * w
    S = max(LENS) + 1 + hw + 1  # [prompt | timestep | image | <eoi>] of the longest row; shorter rows pad right
    mask = torch.ones(S, S, dtype=torch.bool).tril().repeat(len(LENS), 1, 1)
    image_mask = torch.zeros(len(LENS), S, dtype=torch.bool)
    spans, infos = [], []
    for r, p in enumerate(LENS):
        image = slice(p + 1, p + 1 + hw)
        mask[r, image, image] = True
        image_mask[r, image] = True
        spans.append([(image.start, image.stop)])
        infos.append([(image, (h, w))])
    mask = mask[:, None]
    cos, sin = build_batch_2d_rope(S, 8, image_infos=infos)
    scatter = torch.tensor([[p] for p in LENS])
    kwargs = dict(mode="gen_image", custom_pos_emb=(cos, sin), num_image_tokens=hw, num_special_tokens=1,
                  tokenizer_output=object(), image_mask=image_mask, gen_timestep_scatter_index=scatter,
                  attention_mask=mask, full_attn_spans=spans)
    step = HunyuanImage3Pipeline._update_model_kwargs_for_generation(None, {}, kwargs)
    g = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(len(LENS), S, 32, generator=g)]
    hidden += [torch.randn(len(LENS), step["position_ids"].shape[1], 32, generator=g) for _ in range(STEPS)]
    return dict(mask=mask, cos=cos, sin=sin, scatter=scatter, spans=spans, hidden=hidden, step=step, hw=hw)


def _layer_kwargs(req, first: bool):
    from vllm_omni.diffusion.models.hunyuan_image3.pipeline_hunyuan_image3 import HunyuanImage3Pipeline

    B = len(LENS)
    if first:
        mask, pos = req["mask"], torch.arange(req["mask"].shape[-1]).expand(B, -1)
    else:
        mask, pos = req["step"]["attention_mask"], req["step"]["position_ids"]
    cos, sin = HunyuanImage3Pipeline.get_pos_emb((req["cos"], req["sin"]), pos)
    q, k = mask.shape[-2], mask.shape[-1]
    return dict(attention_mask=mask, position_ids=pos, positions=None, custom_pos_emb=(cos, sin), mode="gen_image",
                first_step=first, query_lens=[q] * B, seq_lens=[k] * B, num_image_tokens=req["hw"],
                gen_timestep_scatter_index=req["scatter"], shard_image_size=0, shard_padding_size=0,
                uncond_cfg_prefill=False, full_attn_spans=req["spans"])


def _run(layers, req, around=None):
    """Prefill + STEPS steps through all layers; returns every forward's output (float32)."""
    around = around or (lambda phase, mask: contextlib.nullcontext())
    outs = []
    for i, hidden in enumerate(req["hidden"]):
        kwargs = _layer_kwargs(req, i == 0)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), \
                around("prefill" if i == 0 else "step", kwargs["attention_mask"]):
            for layer in layers:
                (hidden,) = layer(hidden, **kwargs)
        outs.append(hidden.float())
    return outs


def _layers(omni):
    return [omni.tiny_hunyuan_layer(seed=10 + i, layer_idx=i) for i in range(LAYERS)]


def _max_err(a, b, valid_prefill):
    errs = [(x - y).abs()[valid_prefill].max() if i == 0 else (x - y).abs().max() for i, (x, y) in
            enumerate(zip(a, b))]
    return max(float(e) for e in errs)


def test_vllm_omni_hunyuan_pages_right_padded_cfg_rows(omni, omni_ctx):
    from helpers import CountingBackend, compile_blocks

    req = _request()
    # every prefill token of every row is a real or causal-pad token: all are compared
    valid = torch.ones(len(LENS), req["mask"].shape[-1], dtype=torch.bool)
    dense = _run(_layers(omni), req)

    compiled = _layers(omni)
    for layer in compiled:
        layer.compile(backend="inductor", dynamic=False)  # dense, as written (graph breaks at the .item() cache)
    bound = _max_err(dense, _run(compiled, req), valid)
    torch._dynamo.reset()

    layers = _layers(omni)
    runtime = PagedKVRuntime(PagedKVConfig(num_layers=LAYERS, num_kv_heads=2, head_dim=8, block_size=4,
                                           blocks_per_layer=8, max_rows=2, scratch_tokens_per_row=16,
                                           dtype=torch.bfloat16, kernel="reference"))
    adapter = vllm_omni_hunyuan.install(layers, runtime)
    backend = CountingBackend({"inner_compiler": "aot_eager", "check_mask": True})
    compile_blocks(torch.nn.ModuleList(layers), backend)
    spec = adapter.spec(req["mask"], req["scatter"], req["step"]["position_ids"].shape[1])
    runtime.admit("r", spec)

    def around(phase, mask):
        return adapter.forward("r", phase=phase, attention_mask=mask)

    paged = _run(layers, req, around)
    runtime.release("r")
    err = _max_err(dense, paged, valid)
    print(f"vllm-omni HunyuanImage-3 paged vs dense eager: max {err:.3e}; dense compiled vs eager: {bound:.3e}")
    assert err <= max(bound, 2 ** -8)  # bf16: within what dense compilation changes (floor: one bf16 ulp at 1)
    # Both layers share each frame. The step bucket compiles twice because the dense code itself differs
    # between the first step and later ones: HunYuanRotary2DEmbedder caches the step's cos/sin on itself
    # (`self.custom_pos_emb`) at the first step and reads the cache afterwards.
    assert backend.frames == 3
    patterns = sorted(r.pattern for res in backend.results for r in res.reports)
    assert patterns == ["prefill-store"] + ["prefix-step"] * 2
    assert all(r.status == "rewritten" for res in backend.results for r in res.reports)
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer
