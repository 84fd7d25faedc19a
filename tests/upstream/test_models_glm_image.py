"""vllm-omni 0.30.0's GLM-Image (the real classes at tiny size, random weights) paged as written: its image-edit
condition K/V, kept by `GlmImageLayerKVCache` (an attribute assignment at the WRITE forward), concatenated before
every denoising step's keys, ``cat([k_cached, key], dim=1)``, with no mask.

The pipeline's own code drives it: `_prepare_condition_image_kv_cache` (a WRITE forward of the transformer at
timestep 0 per condition image, no text; a stand-in VAE encodes, there is no checkpoint here), then
`GlmImagePipeline.diffuse` (its denoising loop: a conditional and an unconditional forward per step, each batch 1
with its own glyph-embedding length, CFG combined, the flow-matching scheduler step). The paged side hands `diffuse` a transformer whose call is bracketed by ``runtime.forward`` (the
seam a serving adapter would own) and caches whose K/V are stand-ins after `store_prefix` wrote the prefix once.
"""

from __future__ import annotations

import types

import pytest
import torch
from helpers import CountingBackend, raises_paged

from paged_kv_compile import PagedKVConfig, PagedKVRuntime
from paged_kv_compile.errors import ConfigError, RequestError
from paged_kv_compile.families.conditioning_prefix import ConditioningPrefixSpec, store_prefix

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

ATOL = 1e-5
HEADS, HEAD_DIM, LAYERS, BLOCK = 2, 8, 2, 4
LATENT = 4  # latent height = width; patch 2: 4 image tokens
TEXT, NEG_TEXT = 5, 2  # the glyph embeddings of the prompt and of the negative prompt ("")


def _tiny_od_config(omni):
    from vllm_omni.diffusion.data import TransformerConfig

    od = omni.diffusion_config()
    od.set_tf_model_config(TransformerConfig.from_dict(dict(
        patch_size=2, in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
        time_embed_dim=16, condition_dim=8, prior_vq_quantizer_codebook_size=32, text_embed_dim=12, num_layers=LAYERS)))
    return od


class _Inputs:
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


class _StandInVae:
    """What `_prepare_condition_image_kv_cache` reads of the VAE: its latent statistics and `encode` (here an 8x
    average pool, deterministic: no checkpoint on this machine)."""

    config = types.SimpleNamespace(latents_mean=[0.1, -0.2, 0.0, 0.3], latents_std=[1.5, 0.8, 1.0, 1.2],
                                   latent_channels=4)

    def encode(self, image: torch.Tensor):
        return types.SimpleNamespace(latents=torch.nn.functional.avg_pool2d(image, 8))


def _write_condition_kv(transformer, x: _Inputs):
    """The pipeline's own `_prepare_condition_image_kv_cache` (one WRITE forward per condition image, the store
    accumulating them), then the mode `forward` leaves the caches in."""
    from vllm_omni.diffusion.models.glm_image import pipeline_glm_image as pg

    pipeline = types.SimpleNamespace(transformer=transformer, vae=_StandInVae(), device=torch.device("cpu"))
    caches = pg.GlmImagePipeline._prepare_condition_image_kv_cache(pipeline, x.condition_images, x.condition_priors,
                                                                   x.prompt)
    caches.set_mode("read")
    return caches


def _diffuse(transformer, caches, x: _Inputs, steps: int = 3) -> torch.Tensor:
    """The pipeline's own denoising loop (`GlmImagePipeline.diffuse`, sequential CFG) over `transformer`."""
    from vllm_omni.diffusion.models.glm_image import pipeline_glm_image as pg

    scheduler = pg.FlowMatchEulerDiscreteScheduler()
    sigmas = torch.linspace(1.0, 1.0 / steps, steps).tolist()
    timesteps, _ = pg.retrieve_timesteps(scheduler, steps, "cpu", [s * 1000 for s in sigmas], sigmas, mu=0.5)
    pipeline = types.SimpleNamespace(transformer=transformer, scheduler=scheduler)
    return pg.GlmImagePipeline.diffuse(
        pipeline, latents=x.latents.clone(), prior_token_id=x.prior, prompt_embeds=x.prompt,
        negative_prompt_embeds=x.negative, timesteps=timesteps, target_size=torch.tensor([[32.0, 32.0]]),
        crop_coords=torch.zeros((1, 2)), guidance_scale=1.5, do_classifier_free_guidance=True, kv_caches=caches)


class _PagedTransformer:
    """The transformer as `diffuse` calls it, each call one paged step of `request` (its new tokens: the forward's
    glyph tokens and image tokens)."""

    def __init__(self, transformer, runtime: PagedKVRuntime, request: str, image_tokens: int) -> None:
        self.transformer, self.runtime, self.request, self.image_tokens = transformer, runtime, request, image_tokens
        self.dtype = transformer.dtype

    def __call__(self, **kwargs):
        new_tokens = kwargs["encoder_hidden_states"].shape[1] + self.image_tokens
        with self.runtime.forward(self.request, "step", new_tokens=new_tokens):
            return self.transformer(**kwargs)


def _runtime(rows: int = 1, layers: int = LAYERS) -> PagedKVRuntime:
    return PagedKVRuntime(PagedKVConfig(num_layers=layers, num_kv_heads=HEADS, head_dim=HEAD_DIM, block_size=BLOCK,
                                        blocks_per_layer=8, max_rows=rows, scratch_tokens_per_row=16,
                                        kernel="reference"))


@pytest.mark.parametrize("condition_images", [1, 2])
def test_glm_image_edit_pages_as_written_through_its_diffuse_loop(omni, condition_images):
    """Compiled paged vs dense eager, fp32: the condition K/V (of one or two condition images, accumulated by the
    store) stored once (one row: the conditional and the unconditional forwards read the same prefix), every
    step's attention rewritten, one frame per bucket."""
    od = _tiny_od_config(omni)
    with omni.model_context(od), torch.no_grad():
        from vllm_omni.diffusion.models.glm_image.glm_image_transformer import GlmImageTransformer2DModel

        torch.manual_seed(0)
        transformer = GlmImageTransformer2DModel(od).eval()
        for p in transformer.parameters():
            torch.nn.init.normal_(p, std=0.2)
        x = _Inputs(condition_images)
        dense_caches = _write_condition_kv(transformer, x)
        dense = _diffuse(transformer, dense_caches, x)

        runtime = _runtime()
        runtime.bind(list(transformer.transformer_blocks))
        backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
        for block in transformer.transformer_blocks:
            block.forward = torch.compile(block.forward, backend=backend, fullgraph=True, dynamic=False)
        caches = _write_condition_kv(transformer, x)  # compiled, dense: the store is an attribute assignment
        prefix = caches[0].k_cache.shape[1]
        assert prefix == condition_images * x.image_tokens
        runtime.admit("edit", ConditioningPrefixSpec((prefix,), max_new_tokens=TEXT + x.image_tokens))
        free_before = runtime.state()["num_free"]
        k, v = store_prefix(runtime, "edit", [(c.k_cache, c.v_cache) for c in caches.caches])
        for c in caches.caches:
            c.k_cache, c.v_cache = k, v
        assert runtime.is_standin(k) and k.stride() == (0, 0, 0, 0)  # the model keeps no dense prefix
        paged = _diffuse(_PagedTransformer(transformer, runtime, "edit", x.image_tokens), caches, x)

        diff = (dense - paged).abs().max().item()
        print(f"glm_image edit, {condition_images} condition image(s), 3 steps x 2 CFG forwards: max abs diff "
              f"{diff:.3g}, frames {backend.frames}")
        assert diff <= ATOL
        # the WRITE forward (no stand-in: dense; a second image's WRITE finds a cache to concatenate to: its own
        # frame), the conditional step, the unconditional step (its own glyph length)
        assert backend.frames == condition_images + 2
        reports = [[(r.pattern, r.status) for r in res.reports] for res in backend.results]
        assert reports == [[("-", "dense")]] * condition_images + [[("conditioning-prefix", "rewritten")]] * 2
        assert [len(r) for r in runtime.owner("edit").rows] == [-(-prefix // BLOCK)]  # stored once
        assert free_before == runtime.state()["num_free"]  # steps took no managed block
        runtime.release("edit")
        assert runtime.state()["num_free"] == 8  # released with the request


def _attention(omni):
    from vllm_omni.diffusion.models.glm_image.glm_image_transformer import GlmImageAttention

    torch.manual_seed(0)
    attention = GlmImageAttention(dim=HEADS * HEAD_DIM, num_heads=HEADS, head_dim=HEAD_DIM)
    for p in attention.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return attention


def _condition_kv(attention, lengths: list[int], pad_side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's condition K/V from its own WRITE forward, padded with zeros to the longest on `pad_side`."""
    from vllm_omni.diffusion.models.glm_image.glm_image_transformer import GlmImageLayerKVCache, KVCacheMode

    g = torch.Generator().manual_seed(3)
    keys, values = [], []
    longest = max(lengths)
    for n in lengths:
        cache = GlmImageLayerKVCache()
        attention(torch.randn(1, n, HEADS * HEAD_DIM, generator=g), torch.zeros(1, 0, HEADS * HEAD_DIM),
                  kv_cache=cache, kv_cache_mode=KVCacheMode.WRITE)
        pad = (0, 0, 0, 0, 0, longest - n) if pad_side == "right" else (0, 0, 0, 0, longest - n, 0)
        keys.append(torch.nn.functional.pad(cache.k_cache, pad))
        values.append(torch.nn.functional.pad(cache.v_cache, pad))
    return torch.cat(keys), torch.cat(values)


def _padding_mask(lengths: list[int], new: int, pad_side: str) -> torch.Tensor:
    longest = max(lengths)
    cols = torch.arange(longest)
    rows = [(cols < n) if pad_side == "right" else (cols >= longest - n) for n in lengths]
    keep = torch.stack([torch.cat([r, torch.ones(new, dtype=torch.bool)]) for r in rows])
    return keep[:, None, None, :].expand(len(lengths), 1, new, longest + new)


@pytest.mark.parametrize("pad_side", ["right", "left"])
def test_glm_image_attention_cfg_rows_of_different_prefix_lengths_page_with_a_padding_mask(omni, omni_ctx, pad_side):
    """Two CFG rows holding condition prefixes of 7 and 5 tokens, padded in the dense cache, read with the
    attention's padding mask: the prefix-step idiom; the mask is checked against the layout before each step."""
    from vllm_omni.diffusion.models.glm_image.glm_image_transformer import GlmImageLayerKVCache, KVCacheMode

    lengths, text, image = [7, 5], 3, 5
    attention = _attention(omni)
    with torch.no_grad():
        k, v = _condition_kv(attention, lengths, pad_side)
        dense_cache = GlmImageLayerKVCache()
        dense_cache.k_cache, dense_cache.v_cache = k, v
        runtime = _runtime(rows=2, layers=1)
        runtime.bind([attention])
        runtime.admit("cfg", ConditioningPrefixSpec(tuple(lengths), text + image, pad_side=pad_side))
        paged_cache = GlmImageLayerKVCache()
        paged_cache.k_cache, paged_cache.v_cache = store_prefix(runtime, "cfg", [(k, v)])
        mask = _padding_mask(lengths, text + image, pad_side)
        backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
        compiled = torch.compile(attention.forward, backend=backend, fullgraph=True, dynamic=False)
        g = torch.Generator().manual_seed(4)
        for _ in range(2):
            hidden = torch.randn(2, image, HEADS * HEAD_DIM, generator=g)
            glyph = torch.randn(2, text, HEADS * HEAD_DIM, generator=g)
            dense = attention(hidden, glyph, attention_mask=mask, kv_cache=dense_cache,
                              kv_cache_mode=KVCacheMode.READ)
            with runtime.forward("cfg", "step", new_tokens=text + image, attention_mask=mask):
                paged = compiled(hidden, glyph, attention_mask=mask, kv_cache=paged_cache,
                                 kv_cache_mode=KVCacheMode.READ)
            diff = max((a - b).abs().max().item() for a, b in zip(dense, paged))
            assert diff <= ATOL
        assert backend.frames == 1
        assert [r.pattern for res in backend.results for r in res.reports] == ["prefix-step"]
        # a mask that does not say what the spec says is refused before the forward, nothing taken
        wrong = _padding_mask([7, 6], text + image, pad_side)
        with pytest.raises(RequestError, match="the step's mask disagrees with the request's layout"):
            runtime.forward("cfg", "step", new_tokens=text + image, attention_mask=wrong)
        # the masked site run without handing the runtime the mask: refused at the call, not computed
        with pytest.raises(RequestError, match="pass the same mask to runtime.forward"):
            with runtime.forward("cfg", "step", new_tokens=text + image):
                compiled(hidden, glyph, attention_mask=mask, kv_cache=paged_cache, kv_cache_mode=KVCacheMode.READ)
        assert not runtime.state()["in_flight"]


def test_glm_image_unmasked_read_of_a_shorter_prefix_is_refused_with_the_reason(omni, omni_ctx):
    """Without a mask the dense code attends over every stand-in column: a row whose prefix is shorter would read
    its padding, which the pool does not hold. The call is refused, never computed."""
    from vllm_omni.diffusion.models.glm_image.glm_image_transformer import GlmImageLayerKVCache, KVCacheMode

    attention = _attention(omni)
    with torch.no_grad():
        k, v = _condition_kv(attention, [7, 5], "right")
        runtime = _runtime(rows=2, layers=1)
        runtime.bind([attention])
        runtime.admit("cfg", ConditioningPrefixSpec((7, 5), 8))
        cache = GlmImageLayerKVCache()
        cache.k_cache, cache.v_cache = store_prefix(runtime, "cfg", [(k, v)])
        backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
        compiled = torch.compile(attention.forward, backend=backend, fullgraph=True, dynamic=False)
        with raises_paged(RequestError, r"rows \[1\] of 'cfg' hold \[5\] prefix tokens"):
            with runtime.forward("cfg", "step", new_tokens=8):
                compiled(torch.randn(2, 5, HEADS * HEAD_DIM), torch.randn(2, 3, HEADS * HEAD_DIM), kv_cache=cache,
                         kv_cache_mode=KVCacheMode.READ)
        assert [r.pattern for res in backend.results for r in res.reports] == ["conditioning-prefix"]


def test_glm_image_store_prefix_refuses_bad_input_and_leaves_the_request_as_it_was(omni, omni_ctx):
    """A step before the prefix is stored, K/V of the wrong shape or layer count, a second store: each refused
    with the fix, the request unchanged (still storable once)."""
    attention = _attention(omni)
    with torch.no_grad():
        k, v = _condition_kv(attention, [6], "right")
        runtime = _runtime(layers=1)
        runtime.admit("edit", ConditioningPrefixSpec((6,), 8))
        before = runtime.state()
        with pytest.raises(RequestError, match="has no stored prefix"):
            runtime.forward("edit", "step", new_tokens=8)
        with pytest.raises(ConfigError, match="1 per-layer"):
            store_prefix(runtime, "edit", [(k, v), (k, v)])
        with pytest.raises(ConfigError, match=r"\(rows=1, L, 2, 8\)"):
            store_prefix(runtime, "edit", [(k[..., :4], v[..., :4])])
        with pytest.raises(ConfigError, match="fewer than the spec's prefix lengths"):
            store_prefix(runtime, "edit", [(k[:, :4], v[:, :4])])
        assert runtime.state() == before
        store_prefix(runtime, "edit", [(k, v)])
        with pytest.raises(RequestError, match="already stored its prefix"):
            store_prefix(runtime, "edit", [(k, v)])
        stored = runtime.pool.read_region(runtime.owner("edit").rows[0], 6)
        assert torch.equal(stored[0, 0], k[0]) and torch.equal(stored[0, 1], v[0])
