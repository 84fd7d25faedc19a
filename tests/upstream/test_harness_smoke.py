"""The CPU harness runs vllm-omni's real DreamZero block and HunyuanImage-3 decoder layer, unchanged.

Each test builds a tiny real layer and runs one dense forward, then checks something only the real code
path produces (the block's returned window cache; the layer's stored prompt K/V), so a harness that
silently ran something else would fail.
"""

from __future__ import annotations

import torch


def test_platform_shims_installed(omni):
    from vllm_omni.platforms import current_omni_platform

    assert type(current_omni_platform).__name__ == "CpuOmniPlatform"
    assert current_omni_platform.dist_backend == "gloo"
    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1


def test_dreamzero_block_dense_forward(omni, omni_ctx):
    """vllm-omni's CausalWanAttentionBlock: denoise-shaped forward (video chunk + action registers)."""
    fs, nfpb, h, w, regs = 8, 2, 2, 4, 4  # frame_seqlen = h * w; 3 actions + 1 state per block
    block = omni.tiny_dreamzero_block(frame_seqlen=fs, num_frame_per_block=nfpb, num_action_per_block=3,
                                      num_state_per_block=1)
    attn = block.self_attn
    assert attn.attn.attn_backend.get_name() == "SDPA"
    window = attn.max_attention_size
    assert window == (2 * nfpb + 1) * fs  # local_attn_size = max_chunk_size * nfpb + 1 frames
    n = nfpb * fs
    freqs, fa, fst = omni.dreamzero_freqs(16, frames=nfpb, height=h, width=w, start_frame=1)
    torch.manual_seed(1)
    x, e = torch.randn(1, n + regs, 32), torch.randn(1, n + regs, 6, 32)
    cache = torch.randn(2, 1, window, 2, 16)
    with torch.no_grad():
        out, new_cache = block(x=x, e=e, freqs=freqs, freqs_action=fa, freqs_state=fst, context=torch.randn(1, 5, 32),
                               action_register_length=regs, kv_cache=cache, current_start_frame=1)
    assert out.shape == (1, n + regs, 32) and torch.isfinite(out).all()
    # The block keeps the last `window` tokens of [cache | chunk]: history shifted by the chunk, no registers.
    assert new_cache.shape == (2, 1, window, 2, 16)
    torch.testing.assert_close(new_cache[:, :, : window - n], cache[:, :, n:], rtol=0, atol=0)


def test_hunyuan_decoder_layer_dense_forward(omni, omni_ctx):
    """vllm-omni's HunyuanImage3DecoderLayer: first step (prefill) in gen_image mode under bf16 autocast."""
    layer = omni.tiny_hunyuan_layer()
    bs, L, P = 2, 12, 5
    torch.manual_seed(2)
    mask = torch.tril(torch.ones(L, L, dtype=torch.bool))
    mask[P:, P:] = True  # bidirectional image span
    cos, sin = torch.randn(L, 4), torch.randn(L, 4)  # half head_dim, as vllm-omni's RotaryEmbedding reads them
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        (out,) = layer(torch.randn(bs, L, 32), attention_mask=mask.expand(bs, 1, L, L), positions=None,
                       custom_pos_emb=(cos, sin), mode="gen_image", first_step=True, query_lens=[L] * bs,
                       seq_lens=[L] * bs, num_image_tokens=L - P, gen_timestep_scatter_index=torch.tensor([[P], [P]]))
    assert out.shape == (bs, L, 32) and torch.isfinite(out.float()).all()
    manager = layer.self_attn.image_attn
    assert manager.attn.attn_backend.get_name() == "SDPA"
    cached_k, cached_v = manager.image_kv_cache_map  # the prompt K/V the dense path keeps for later steps
    assert cached_k.shape == (bs, P, 2, 8) and manager.image_kv_cache_lens.tolist() == [P, P]
