"""vllm-omni's HunyuanImage-3 decoder layers driven as `pipeline_hunyuan_image3.py` drives them, at a tiny size.

bf16 under CPU autocast, CFG rows RIGHT-padded ([prompt | timestep + image | <eoi> | pad], the mask of
`_prepare_attention_mask_for_generation`: causal with each image span bidirectional), RoPE tables from
`build_batch_2d_rope` gathered by position (`get_pos_emb`), and every later step's position_ids and mask made by
the pipeline's own `_update_model_kwargs_for_generation` (the <eoi> the prefill has is not fed again).
Used by tests/upstream/test_vllm_omni_hunyuan.py, the multi-rank tests (fp32, per rank) and
benchmarks/vs_vllm_omni.py.
"""

from __future__ import annotations

import contextlib

import torch

LAYERS, HW, LENS, STEPS = 2, (2, 2), (7, 4), 3


def request_inputs(seed: int = 3):
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


def layer_kwargs(req, first: bool):
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


def run_layers(layers, req, around=None, *, autocast: torch.dtype | None = torch.bfloat16, start: int = 0):
    """Prefill + STEPS steps through all layers; returns every forward's output (float32).

    autocast: the pipeline's bf16 autocast, or None to run in the layers' own dtype (an fp32 run also needs
    `vllm_omni_cpu.hunyuan_fp32_rope()`); start: the first forward to run (0: the prefill, 1: the first step)."""
    around = around or (lambda phase, mask: contextlib.nullcontext())
    outs = []
    for i, hidden in enumerate(req["hidden"]):
        if i < start:
            continue
        kwargs = layer_kwargs(req, i == 0)
        cast = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with torch.no_grad(), cast, around("prefill" if i == 0 else "step", kwargs["attention_mask"]):
            for layer in layers:
                (hidden,) = layer(hidden, **kwargs)
        outs.append(hidden.float())
    return outs


def tiny_layers(omni):
    return [omni.tiny_hunyuan_layer(seed=10 + i, layer_idx=i) for i in range(LAYERS)]


def max_err(a, b, valid_prefill=None):
    """Max |a - b| over every forward's output; the prefill's only where `valid_prefill` (None: everywhere)."""
    errs = [(x - y).abs()[valid_prefill].max() if i == 0 and valid_prefill is not None else (x - y).abs().max()
            for i, (x, y) in enumerate(zip(a, b))]
    return max(float(e) for e in errs)
