"""Transcription of Tencent's HunyuanImage-3.0 static KV cache, attention and image-generation driving.

Source: github.com/Tencent-Hunyuan/HunyuanImage-3.0, hunyuan_image_3/hunyuan.py, commit
1d011c84a579a0292bd739a0cee2092243d73986. Kept as written: `HunyuanStaticCache.update` (the key_cache branch:
a static (B, Hkv, S, D) cache written with `index_copy_` at `cache_position`, one `index_copy_` per row when
the positions are 2-D), `repeat_kv`, `rotate_half`, `apply_rotary_pos_emb`, `HunyuanRMSNorm`, the SwiGLU
`HunyuanMLP`, `HunyuanImage3SDPAAttention.forward` (fused qkv_proj, RoPE then q/k norm, cache update, attention
over the WHOLE static cache with the 4-D mask), `HunyuanImage3DecoderLayer.forward`. The driver functions
transcribe how `HunyuanImage3ForCausalMM` drives image generation: `_prepare_attention_mask_for_generation`
(causal, each image span bidirectional; CFG rows right-padded by the tokenizer wrapper's `pad`, pads causal),
position_ids `arange(S)` expanded over the rows at the prefill (`prepare_model_inputs`, step 7), and
`_update_model_kwargs_for_generation` for the denoising steps (position_ids = [timestep | image tokens] per row,
the prefill mask's rows at those positions), `get_pos_emb` (RoPE rows gathered per position). Left out: the
transformers `StaticCache` base (its lazy init and the `dynamic` text mode), MoE, the flash-attention class,
timestep/patch embedding, the VAE and the tokenizer (the test builds the token layout directly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TinyConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    attention_head_dim: int = 8
    intermediate_size: int = 32
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    mlp_bias: bool = False
    use_qk_norm: bool = True
    use_rotary_pos_emb: bool = True


class HunyuanStaticCache:
    """`HunyuanStaticCache` (the transformers StaticCache subclass) reduced to what `update` reads: per-layer
    key/value tensors of (B, Hkv, max_cache_len, D). A paged driver passes cache stand-ins instead."""

    def __init__(self, key_cache: list[torch.Tensor], value_cache: list[torch.Tensor]) -> None:
        self.key_cache, self.value_cache = key_cache, value_cache

    @classmethod
    def zeros(cls, config: TinyConfig, layers: int, batch_size: int, max_cache_len: int) -> "HunyuanStaticCache":
        shape = (batch_size, config.num_key_value_heads, max_cache_len, config.attention_head_dim)
        return cls([torch.zeros(shape) for _ in range(layers)], [torch.zeros(shape) for _ in range(layers)])

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        cache_position = cache_kwargs.get("cache_position")
        if self.key_cache[layer_idx].device != key_states.device:
            self.key_cache[layer_idx] = self.key_cache[layer_idx].to(key_states.device)
            self.value_cache[layer_idx] = self.value_cache[layer_idx].to(value_states.device)
        k_out = self.key_cache[layer_idx]
        v_out = self.value_cache[layer_idx]
        key_states = key_states.to(k_out.dtype)
        value_states = value_states.to(v_out.dtype)

        if cache_position is None:
            k_out.copy_(key_states)
            v_out.copy_(value_states)
        else:
            if cache_position.dim() == 1:
                k_out.index_copy_(2, cache_position, key_states)
                v_out.index_copy_(2, cache_position, value_states)
            else:
                assert cache_position.dim() == 2, f"multiple batch dims not yet {cache_position.shape=}"
                batch_size, idx_size = cache_position.shape
                assert batch_size == k_out.size(0)
                assert batch_size == v_out.size(0)
                assert batch_size == key_states.size(0)
                assert batch_size == value_states.size(0)
                for i in range(batch_size):
                    unbatched_dim = 1
                    k_out[i].index_copy_(unbatched_dim, cache_position[i], key_states[i])
                    v_out[i].index_copy_(unbatched_dim, cache_position[i], value_states[i])
        return k_out, v_out


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    if position_ids is not None:
        cos = cos[position_ids]
        sin = sin[position_ids]
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def real_batched_index_select(t, dim, idx):
    assert t.ndim >= 2 and idx.ndim >= 2, f"{t.ndim=} {idx.ndim=}"
    assert len(t) == len(idx), f"{len(t)=} != {len(idx)=}"
    return torch.stack([torch.index_select(t[i], dim - 1, idx[i]) for i in range(len(t))])


def get_pos_emb(custom_pos_emb, position_ids):
    """`HunyuanImage3ForCausalMM.get_pos_emb`: the RoPE rows of each token's position."""
    cos, sin = custom_pos_emb
    cos = real_batched_index_select(cos, dim=1, idx=position_ids)
    sin = real_batched_index_select(sin, dim=1, idx=position_ids)
    return cos, sin


class HunyuanRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class HunyuanMLP(nn.Module):
    """The SwiGLU branch of `HunyuanMLP` (hidden_act="silu")."""

    def __init__(self, config: TinyConfig):
        super().__init__()
        self.gate_and_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x):
        gate_and_up_proj = self.gate_and_up_proj(x)
        x1, x2 = gate_and_up_proj.chunk(2, dim=2)
        return self.down_proj(x1 * F.silu(x2))


class HunyuanImage3SDPAAttention(nn.Module):
    def __init__(self, config: TinyConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.attention_head_dim
        self.num_key_value_heads = config.num_key_value_heads if config.num_key_value_heads else self.num_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.use_qk_norm = config.use_qk_norm
        self.use_rotary_pos_emb = config.use_rotary_pos_emb
        self.hidden_size_q = self.head_dim * self.num_heads
        self.hidden_size_kv = self.head_dim * self.num_key_value_heads
        self.qkv_proj = nn.Linear(self.hidden_size, self.hidden_size_q + 2 * self.hidden_size_kv,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.hidden_size_q, self.hidden_size, bias=config.attention_bias)
        if self.use_qk_norm:
            self.query_layernorm = HunyuanRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.key_layernorm = HunyuanRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, custom_pos_emb=None, **kwargs):
        bsz, q_len, _ = hidden_states.size()

        qkv_states = self.qkv_proj(hidden_states)
        qkv_states = qkv_states.reshape(bsz, q_len, self.num_key_value_heads, self.num_key_value_groups + 2,
                                        self.head_dim)
        query_states, key_states, value_states = torch.split(qkv_states, [self.num_key_value_groups, 1, 1], dim=3)

        query_states = query_states.reshape(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.reshape(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.reshape(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        if self.use_rotary_pos_emb:
            cos, sin = custom_pos_emb
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if self.use_qk_norm:
            query_states = self.query_layernorm(query_states)
            key_states = self.key_layernorm(key_states)

        query_states = query_states.to(value_states.dtype)
        key_states = key_states.to(value_states.dtype)

        if past_key_value is not None:
            cache_kwargs = {"cache_position": position_ids}
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx, cache_kwargs)
            query_states = query_states.to(key_states.dtype)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        if query_states.device.type == "cuda" and attention_mask is not None:
            query_states = query_states.contiguous()
            key_states = key_states.contiguous()
            value_states = value_states.contiguous()

        attn_output = torch.nn.functional.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=attention_mask, dropout_p=0.0
        )
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, q_len, -1)
        attn_output = self.o_proj(attn_output)
        return attn_output, None, past_key_value


class HunyuanImage3DecoderLayer(nn.Module):
    def __init__(self, config: TinyConfig, layer_idx: int, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.hidden_size = config.hidden_size
        self.layer_idx = layer_idx
        self.self_attn = HunyuanImage3SDPAAttention(config=config, layer_idx=layer_idx)
        self.mlp = HunyuanMLP(config)
        self.input_layernorm = HunyuanRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = HunyuanRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        with torch.no_grad():  # non-trivial norm weights (the released ones are not ones)
            for norm in (self.input_layernorm, self.post_attention_layernorm, self.self_attn.query_layernorm,
                         self.self_attn.key_layernorm):
                norm.weight.uniform_(0.5, 1.5)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, custom_pos_emb=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, self_attn_weights, present_key_value = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_value=past_key_value,
            output_attentions=output_attentions,
            use_cache=use_cache,
            custom_pos_emb=custom_pos_emb,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        outputs = (hidden_states,)
        if output_attentions:
            outputs += (self_attn_weights,)
        if use_cache:
            outputs += (present_key_value,)
        return outputs


# ---- how HunyuanImage3ForCausalMM drives image generation ------------------------------------------------------
def prepare_attention_mask(seq_len: int, batch_image_slices: list[list[slice]]) -> torch.Tensor:
    """`_prepare_attention_mask_for_generation`: causal (pads included), each image span bidirectional."""
    bsz = len(batch_image_slices)
    attention_mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril(diagonal=0).repeat(bsz, 1, 1)
    for i in range(bsz):
        for j, image_slice in enumerate(batch_image_slices[i]):
            attention_mask[i, image_slice, image_slice] = True
    return attention_mask.unsqueeze(1)


def step_kwargs(image_mask: torch.Tensor, gen_timestep_scatter_index: torch.Tensor,
                attention_mask: torch.Tensor) -> dict:
    """The gen_image branch of `_update_model_kwargs_for_generation` (after the prefill): every later step feeds
    the timestep token and the image tokens, at their prefill positions, with the prefill mask's rows there."""
    bsz, seq_len = image_mask.shape
    index = torch.arange(seq_len, device=image_mask.device).unsqueeze(0).repeat(bsz, 1)
    position_ids = index.masked_select(image_mask.bool()).reshape(bsz, -1)
    timestep_position_ids = index[torch.arange(bsz), gen_timestep_scatter_index[:, -1]].unsqueeze(-1)
    position_ids = torch.cat([timestep_position_ids, position_ids], dim=1)
    mask_list = []
    for attention_mask_i, position_ids_i in zip(attention_mask, position_ids):
        mask_list.append(torch.index_select(attention_mask_i, dim=1, index=position_ids_i.reshape(-1)))
    return {"position_ids": position_ids, "attention_mask": torch.stack(mask_list, dim=0)}
