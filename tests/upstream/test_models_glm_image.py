"""vllm-omni 0.30.0's GLM-Image attention (`GlmImageAttention`, the real class at tiny size) in its image-edit
READ mode: the condition image's K/V, kept by `GlmImageLayerKVCache` (an attribute assignment at the WRITE forward),
concatenated before every denoising step's keys, `cat([k_cached, key], dim=1)`, with no mask.

Today no idiom the passes accept is this one (a read-only conditioning prefix reused by every step, unmasked: the
conditioning-prefix idiom and family are not built, docs/models.md): the site must be refused with the reason,
never computed on a stand-in's zeros. This test pins that reason on the model's own code, handed a cache stand-in
as the cached K/V.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend, raises_paged

from paged_kv_compile import PagedKVConfig, PagedKVRuntime, PassError

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

B, TEXT, IMAGE, PREFIX, HEADS, HEAD_DIM = 2, 3, 5, 7, 2, 8


def test_glm_image_condition_kv_read_step_is_refused_with_the_reason(omni, omni_ctx):
    from vllm_omni.diffusion.models.glm_image.glm_image_transformer import (
        GlmImageAttention,
        GlmImageLayerKVCache,
        KVCacheMode,
    )

    torch.manual_seed(0)
    attention = GlmImageAttention(dim=HEADS * HEAD_DIM, num_heads=HEADS, head_dim=HEAD_DIM)
    for p in attention.parameters():
        torch.nn.init.normal_(p, std=0.2)
    runtime = PagedKVRuntime(PagedKVConfig(num_layers=1, num_kv_heads=HEADS, head_dim=HEAD_DIM, block_size=4,
                                           blocks_per_layer=8, max_rows=B, scratch_tokens_per_row=16,
                                           kernel="reference"))
    runtime.bind([attention])
    cache = GlmImageLayerKVCache()
    cache.k_cache = runtime.standin(B, PREFIX, HEADS, HEAD_DIM)
    cache.v_cache = runtime.standin(B, PREFIX, HEADS, HEAD_DIM)
    hidden, text = torch.randn(B, IMAGE, HEADS * HEAD_DIM), torch.randn(B, TEXT, HEADS * HEAD_DIM)
    backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
    compiled = torch.compile(attention.forward, backend=backend, fullgraph=True, dynamic=False)
    with raises_paged(PassError, "a prefix idiom's attention carries a 4-D mask; this site has none"):
        compiled(hidden, text, kv_cache=cache, kv_cache_mode=KVCacheMode.READ)
