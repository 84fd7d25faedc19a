"""vllm-omni's HunyuanImage-3 pipeline inputs for a tiny request, and a loop that runs decoder layers over them.

As vllm-omni's pipeline_hunyuan_image3.py makes them: CFG rows RIGHT-padded ([prompt | timestep + image | <eoi> |
pad], the mask of `_prepare_attention_mask_for_generation`: causal with each image span bidirectional), RoPE tables
from `build_batch_2d_rope` gathered by position (`get_pos_emb`), and every later step's position_ids and mask made
by the pipeline's own `_update_model_kwargs_for_generation` (the <eoi> the prefill has is not fed again).
"""

from __future__ import annotations

import contextlib

import torch

LAYERS, HW, LENS, STEPS, HIDDEN = 2, (2, 2), (7, 4), 3, 32


def request(seed: int = 3, *, lens: tuple[int, ...] = LENS, steps: int = STEPS) -> dict:
    """The pipeline's prefill inputs for right-padded CFG rows of prompt lengths `lens`, and its per-step inputs."""
    from vllm_omni.diffusion.models.hunyuan_image3.hunyuan_image3_transformer import build_batch_2d_rope
    from vllm_omni.diffusion.models.hunyuan_image3.pipeline_hunyuan_image3 import HunyuanImage3Pipeline

    h, w = HW
    hw = h * w
    S = max(lens) + 1 + hw + 1  # [prompt | timestep | image | <eoi>] of the longest row; shorter rows pad right
    mask = torch.ones(S, S, dtype=torch.bool).tril().repeat(len(lens), 1, 1)
    image_mask = torch.zeros(len(lens), S, dtype=torch.bool)
    spans, infos = [], []
    for r, p in enumerate(lens):
        image = slice(p + 1, p + 1 + hw)
        mask[r, image, image] = True
        image_mask[r, image] = True
        spans.append([(image.start, image.stop)])
        infos.append([(image, (h, w))])
    mask = mask[:, None]
    cos, sin = build_batch_2d_rope(S, 8, image_infos=infos)
    scatter = torch.tensor([[p] for p in lens])
    kwargs = dict(mode="gen_image", custom_pos_emb=(cos, sin), num_image_tokens=hw, num_special_tokens=1,
                  tokenizer_output=object(), image_mask=image_mask, gen_timestep_scatter_index=scatter,
                  attention_mask=mask, full_attn_spans=spans)
    step = HunyuanImage3Pipeline._update_model_kwargs_for_generation(None, {}, kwargs)
    g = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(len(lens), S, HIDDEN, generator=g)]
    hidden += [torch.randn(len(lens), step["position_ids"].shape[1], HIDDEN, generator=g) for _ in range(steps)]
    return dict(mask=mask, cos=cos, sin=sin, scatter=scatter, spans=spans, hidden=hidden, step=step, hw=hw)


def layer_kwargs(req: dict, first: bool) -> dict:
    """What the pipeline passes each decoder layer at the prefill (`first`) or a later step."""
    from vllm_omni.diffusion.models.hunyuan_image3.pipeline_hunyuan_image3 import HunyuanImage3Pipeline

    B = req["mask"].shape[0]
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


def run(layers, req: dict, around=None, *, autocast: torch.dtype | None = torch.bfloat16,
        start: int = 0) -> list[torch.Tensor]:
    """Prefill + every step through all layers; returns every forward's output (float32).

    around(phase, mask): a context per forward (the paged adapter's plan); autocast: the pipeline's bf16 autocast,
    or None to run in the layers' own dtype (fp32 runs also need `vllm_omni_cpu.hunyuan_fp32_rope()`); start: the
    first forward to run (0: the prefill, 1: the first step, ...)."""
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


def max_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))
