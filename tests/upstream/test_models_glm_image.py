"""vllm-omni 0.30.0's GLM-Image (the real classes at tiny size, random weights) paged as written: its image-edit
condition K/V, kept by `GlmImageLayerKVCache` (an attribute assignment at the WRITE forward), concatenated before
every denoising step's keys, ``cat([k_cached, key], dim=1)``, with no mask.

The pipeline's own code drives it (`glm_image_pipeline.py`): `_prepare_condition_image_kv_cache` (a WRITE forward
of the transformer at timestep 0 per condition image, no text), then `GlmImagePipeline.diffuse` (its denoising loop:
a conditional and an unconditional forward per step, each batch 1 with its own glyph-embedding length, CFG
combined, the flow-matching scheduler step). The paged side hands `diffuse` a transformer whose call is bracketed
by ``runtime.forward`` and caches whose K/V are stand-ins after `store_prefix` wrote the prefix once.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend, raises_paged

from paged_kv_compile import PagedKVConfig, PagedKVRuntime
from paged_kv_compile.errors import ConfigError, RequestError
from paged_kv_compile.families.conditioning_prefix import ConditioningPrefixSpec, store_prefix

from .glm_image_pipeline import (ATOL, BLOCK, HEAD_DIM, HEADS, LAYERS, EditInputs, compile_blocks, diffuse, paged_edit,
                                 tiny_od_config, tiny_transformer, write_condition_kv)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _runtime(rows: int = 1, layers: int = LAYERS) -> PagedKVRuntime:
    return PagedKVRuntime(PagedKVConfig(num_layers=layers, num_kv_heads=HEADS, head_dim=HEAD_DIM, block_size=BLOCK,
                                        blocks_per_layer=8, max_rows=rows, scratch_tokens_per_row=16,
                                        kernel="reference"))


@pytest.mark.parametrize("condition_images", [1, 2])
def test_glm_image_edit_pages_as_written_through_its_diffuse_loop(omni, condition_images):
    """Compiled paged vs dense eager, fp32: the condition K/V (of one or two condition images, accumulated by the
    store) stored once (one row: the conditional and the unconditional forwards read the same prefix), every
    step's attention rewritten, one frame per bucket."""
    od = tiny_od_config()
    with omni.model_context(od), torch.no_grad():
        transformer = tiny_transformer(od)
        x = EditInputs(condition_images)
        dense = diffuse(transformer, write_condition_kv(transformer, x), x)

        runtime = _runtime()
        runtime.bind(list(transformer.transformer_blocks))
        backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
        compile_blocks(transformer, backend)
        free = runtime.state()["num_free"]
        paged = paged_edit(transformer, runtime, x, "edit")
        prefix = condition_images * x.image_tokens
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
        assert runtime.owner("edit").state.capacity == prefix
        assert runtime.state()["num_free"] == free - -(-prefix // BLOCK)  # steps took no managed block
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
    attention's padding mask: the prefix-step idiom; the mask is checked against the layout before each step (and,
    with the backend's check_mask, the model's own mask at every call)."""
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
        backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True, "check_mask": True})
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
        # check_mask: the mask the model itself gets is compared with the layout at every call
        with pytest.raises(RequestError, match="check_mask: row 1's dense mask disagrees"):
            with runtime.forward("cfg", "step", new_tokens=text + image, attention_mask=mask):
                compiled(hidden, glyph, attention_mask=wrong, kv_cache=paged_cache, kv_cache_mode=KVCacheMode.READ)
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
