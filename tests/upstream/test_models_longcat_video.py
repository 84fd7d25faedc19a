"""vllm-omni 0.30.0's LongCat-Video-Avatar self-attention (`Attention.forward_with_kv_cache`, the real class at tiny
size): the reference frames' K/V are kept BEFORE RoPE (`k.clone()` ahead of `rope_3d` in `forward(return_kv=True)`),
and a later forward ropes ``cat([k_cache, k], dim=2)`` as a whole, over the conditioning frames and the new ones.

The paged op keeps the keys it attends with; keys roped after the concatenation are not those. The passes refuse
the site, naming the concatenation and the fix (RoPE on the new keys before it): the reason pinned on our DreamZero
reference in that order
(`tests/test_pass_spellings.py::test_rope_after_the_cache_concatenation_is_refused_with_the_fix`) is the one the
real class gets, handed cache stand-ins as its `kv_cache` (the passes read its ``k_cache.to(device, dtype)``, a
no-op here, as the identity). Never computed on a stand-in's zeros.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend, raises_paged

from paged_kv_compile import PagedKVConfig, PagedKVRuntime, PassError

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "no_grad")

B, HEADS, HEAD_DIM = 1, 2, 16
COND_FRAMES, FRAMES, H, W = 1, 2, 2, 2  # one conditioning frame kept, two new frames of 2x2 latent tokens


def test_longcat_rope_after_the_cache_concatenation_is_refused_with_the_fix(omni, omni_ctx):
    from vllm_omni.diffusion.models.longcat_video.longcat_video_avatar_transformer import Attention

    torch.manual_seed(0)
    attention = Attention(dim=HEADS * HEAD_DIM, num_heads=HEADS)
    runtime = PagedKVRuntime(PagedKVConfig(num_layers=1, num_kv_heads=HEADS, head_dim=HEAD_DIM, block_size=4,
                                           blocks_per_layer=8, max_rows=B, scratch_tokens_per_row=16,
                                           kernel="reference"))
    runtime.bind([attention])
    cached = COND_FRAMES * H * W
    kv_cache = (runtime.standin(B, HEADS, cached, HEAD_DIM), runtime.standin(B, HEADS, cached, HEAD_DIM))
    x = torch.randn(B, FRAMES * H * W, HEADS * HEAD_DIM)
    shape = (FRAMES, H, W)
    dense, _ = attention.forward_with_kv_cache(x, shape=shape, num_cond_latents=COND_FRAMES,
                                               kv_cache=(torch.randn_like(kv_cache[0]), torch.randn_like(kv_cache[1])))
    assert dense.shape == x.shape  # the dense path runs as written (and fills rope_3d's frequency table)
    backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
    compiled = torch.compile(attention.forward_with_kv_cache, backend=backend, fullgraph=True, dynamic=False)
    with raises_paged(PassError, r"computed from the concatenation \w+ of cached and new tokens .*Fix: apply "
                                 r"the computation \(RoPE"):
        compiled(x, shape=shape, num_cond_latents=COND_FRAMES, kv_cache=kv_cache)
