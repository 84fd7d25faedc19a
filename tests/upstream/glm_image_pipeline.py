"""vllm-omni 0.30.0's GLM-Image image edit driven as its pipeline drives it, dense or paged (tests/upstream/
test_models_glm_image.py, test_multirank_glm_image.py): the real `GlmImageTransformer2DModel` at tiny size, the
pipeline's own `_prepare_condition_image_kv_cache` (a stand-in VAE encodes: no checkpoint here) and
`GlmImagePipeline.diffuse` (sequential CFG on one rank, CFG-parallel when vllm-omni's parallel state says so).

Paged: the transformer's blocks compiled with the paged backend, the condition K/V the WRITE forwards kept handed to
`store_prefix` (stored once) and replaced by the stand-ins it returns, every transformer call of `diffuse` one
``runtime.forward(request, "step", new_tokens=...)`` (the seam a serving adapter would own).
"""

from __future__ import annotations

import types

import torch

from paged_kv_compile.families.conditioning_prefix import ConditioningPrefixSpec, store_prefix

from . import vllm_omni_cpu as omni_cpu

ATOL = 1e-5
HEADS, HEAD_DIM, LAYERS, BLOCK = 2, 8, 2, 4
LATENT = 4  # latent height = width; patch 2: 4 image tokens
TEXT, NEG_TEXT = 5, 2  # the glyph embeddings of the prompt and of the negative prompt ("")


def tiny_od_config():
    from vllm_omni.diffusion.data import TransformerConfig

    od = omni_cpu.diffusion_config()
    od.set_tf_model_config(TransformerConfig.from_dict(dict(
        patch_size=2, in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
        time_embed_dim=16, condition_dim=8, prior_vq_quantizer_codebook_size=32, text_embed_dim=12, num_layers=LAYERS)))
    return od


class EditInputs:
    """One image edit's inputs: condition images and their prior tokens, the target's prior tokens, the prompts."""

    def __init__(self, condition_images: int = 1) -> None:
        g = torch.Generator().manual_seed(1)
        self.image_tokens = (LATENT // 2) ** 2
        self.condition_images = [torch.randn(4, LATENT * 8, LATENT * 8, generator=g) for _ in range(condition_images)]
        self.condition_priors = [torch.randint(0, 32, (1, self.image_tokens), generator=g)
                                 for _ in range(condition_images)]
        self.prior = torch.randint(0, 32, (1, self.image_tokens), generator=g)
        self.prompt = torch.randn(1, TEXT, 12, generator=g)
        self.negative = torch.randn(1, NEG_TEXT, 12, generator=g)
        self.latents = torch.randn(1, 4, LATENT, LATENT, generator=g)


class StandInVae:
    """What `_prepare_condition_image_kv_cache` reads of the VAE: its latent statistics and `encode` (here an 8x
    average pool, deterministic: no checkpoint on this machine)."""

    config = types.SimpleNamespace(latents_mean=[0.1, -0.2, 0.0, 0.3], latents_std=[1.5, 0.8, 1.0, 1.2],
                                   latent_channels=4)

    def encode(self, image: torch.Tensor):
        return types.SimpleNamespace(latents=torch.nn.functional.avg_pool2d(image, 8))


def write_condition_kv(transformer, x: EditInputs):
    """The pipeline's own `_prepare_condition_image_kv_cache` (one WRITE forward per condition image, the store
    accumulating them), then the mode `forward` leaves the caches in."""
    from vllm_omni.diffusion.models.glm_image import pipeline_glm_image as pg

    pipeline = types.SimpleNamespace(transformer=transformer, vae=StandInVae(), device=torch.device("cpu"))
    caches = pg.GlmImagePipeline._prepare_condition_image_kv_cache(pipeline, x.condition_images, x.condition_priors,
                                                                   x.prompt)
    caches.set_mode("read")
    return caches


def diffuse(transformer, caches, x: EditInputs, steps: int = 3) -> torch.Tensor:
    """The pipeline's own denoising loop (`GlmImagePipeline.diffuse`: sequential CFG, or CFG-parallel) over `transformer`."""
    from vllm_omni.diffusion.models.glm_image import pipeline_glm_image as pg

    scheduler = pg.FlowMatchEulerDiscreteScheduler()
    sigmas = torch.linspace(1.0, 1.0 / steps, steps).tolist()
    timesteps, _ = pg.retrieve_timesteps(scheduler, steps, "cpu", [s * 1000 for s in sigmas], sigmas, mu=0.5)
    pipeline = types.SimpleNamespace(transformer=transformer, scheduler=scheduler)
    return pg.GlmImagePipeline.diffuse(
        pipeline, latents=x.latents.clone(), prior_token_id=x.prior, prompt_embeds=x.prompt,
        negative_prompt_embeds=x.negative, timesteps=timesteps, target_size=torch.tensor([[32.0, 32.0]]),
        crop_coords=torch.zeros((1, 2)), guidance_scale=1.5, do_classifier_free_guidance=True, kv_caches=caches)


class PagedTransformer:
    """The transformer as `diffuse` calls it, each call one paged step of `request` (its new tokens: the forward's
    glyph tokens and image tokens)."""

    def __init__(self, transformer, runtime, request: str, image_tokens: int) -> None:
        self.transformer, self.runtime, self.request, self.image_tokens = transformer, runtime, request, image_tokens
        self.dtype = transformer.dtype

    def __call__(self, **kwargs):
        new_tokens = kwargs["encoder_hidden_states"].shape[1] + self.image_tokens
        with self.runtime.forward(self.request, "step", new_tokens=new_tokens):
            return self.transformer(**kwargs)


def tiny_transformer(od):
    """The real transformer, random weights (the same on every rank: seeded); call inside model_context(od)."""
    from vllm_omni.diffusion.models.glm_image.glm_image_transformer import GlmImageTransformer2DModel

    torch.manual_seed(0)
    transformer = GlmImageTransformer2DModel(od).eval()
    for p in transformer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return transformer


def compile_blocks(transformer, backend) -> None:
    for block in transformer.transformer_blocks:
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=True, dynamic=False)


def paged_edit(transformer, runtime, x: EditInputs, request: str = "edit") -> torch.Tensor:
    """The edit on `runtime` (blocks already bound and compiled): the WRITE forwards as written (dense), the
    condition K/V stored once, the denoising loop over stand-ins; the request is left admitted."""
    caches = write_condition_kv(transformer, x)  # compiled, dense: the store is an attribute assignment
    prefix = caches[0].k_cache.shape[1]
    runtime.admit(request, ConditioningPrefixSpec((prefix,), max_new_tokens=TEXT + x.image_tokens))
    k, v = store_prefix(runtime, request, [(c.k_cache, c.v_cache) for c in caches.caches])
    for c in caches.caches:
        c.k_cache, c.v_cache = k, v
    return diffuse(PagedTransformer(transformer, runtime, request, x.image_tokens), caches, x)
