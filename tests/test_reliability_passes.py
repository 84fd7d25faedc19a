"""Pass robustness: dense attention written in other styles than the reference models.

Each variant replaces the self-attention forward of a reference model for both the dense run and the
paged run, and runs the whole loop (window slides, sink, reset; prefill and steps, 2 CFG rows):

- supported spellings of the same idiom are rewritten and match the dense loop within 1e-5;
- anything the passes do not understand (dropout, is_causal, a mask on the window, arithmetic on the
  cache, another read order, a gather, another window) never produces an output: by default a warning
  naming the reason and then PassError (a stand-in holds no data), and in strict mode PassError at
  once, naming the reason. The runtime is left clean (every block free, the pool never written).

`tests/test_pass_matching.py` covers (B, H, S, D) + torch.concat + a wrapper module, additive masks +
repeat_interleave, a tiled GQA mapping and hand-written softmax; the variants here are other ones.
The last four unsupported HunyuanImage-3 variants ran and were silently wrong before the checks added
with these tests: a store that is not the attended keys (`passes/writes.py: store_problem`), a refused prefill whose store
dead-code elimination dropped without an error (`passes/rewrite.py`), a mask narrowed inside the layer
(`families/hunyuan_image3.py`, `match`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import CountingBackend, compile_blocks, hunyuan_qkv, hunyuan_qkv_cached, raises_paged

from paged_kv_compile import PassError
from paged_kv_compile.driver import paged_run
from paged_kv_compile.families.dreamzero import dreamzero_runtime_config
from paged_kv_compile.families.hunyuan_image3 import hunyuan_runtime_config
from paged_kv_compile.models import dreamzero as dz
from paged_kv_compile.models import hunyuan_image3 as hy
from paged_kv_compile.models.common import apply_rope_2d, apply_rope_3d
from paged_kv_compile.runtime import PagedKVRuntime

ATOL = 1e-5
# Window 3 frames of 4 tokens, chunk 1 frame: the window slides after 2 commits, resets after 5 chunks.
DZ_CFG = dz.DreamZeroConfig(num_layers=2, frame_seqlen=4, num_frame_per_block=1, local_attn_size=3,
                            window_reset_frames=5, action_register_length=2)
DZ_SINK_CFG = dz.DreamZeroConfig(num_layers=2, frame_seqlen=4, num_frame_per_block=1, local_attn_size=4, sink_size=1,
                                 window_reset_frames=6, action_register_length=2)
HY_CFG = hy.HunyuanImage3Config(num_layers=2, image_h=2, image_w=3)
HY_CAPACITY = 9


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


# ---- DreamZero pieces ------------------------------------------------------------------------------------
def _dz_qkv(self, x, rope_cos, rope_sin):
    """(roped q, roped k, v) of the video tokens and (q, k, v) of the action registers, all (B, S, H, D)."""
    b, s, _ = x.shape
    A = self.action_register_length
    q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, self.head_dim).unbind(2)
    q, k = self.norm_q(q), self.norm_k(k)
    rq, rk = apply_rope_3d(q[:, :-A], rope_cos, rope_sin), apply_rope_3d(k[:, :-A], rope_cos, rope_sin)
    return rq, rk, v[:, :-A], q[:, -A:], k[:, -A:], v[:, -A:]


def _dz_attend(self, q, k, v, **sdpa):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **sdpa)
    return self.o(out.transpose(1, 2).flatten(2))


# supported ---------------------------------------------------------------------------------------------------
def dz_tuple_unpack_narrow(self, x, rope_cos, rope_sin, kv_cache):
    """K/V halves by tuple-unpacking the cache, a tuple to torch.cat with a negative dim, narrow for the window."""
    rq, rk, rv, qa, ka, va = _dz_qkv(self, x, rope_cos, rope_sin)
    M = self.max_attention_size
    cache_k, cache_v = kv_cache
    full_k, full_v = torch.cat((cache_k, rk), dim=-3), torch.cat((cache_v, rv), dim=-3)
    L = full_k.shape[1]  # dense: grows until the window is full; paged: always window + chunk
    new_k, new_v = full_k.narrow(1, max(L - M, 0), min(L, M)), full_v.narrow(1, max(L - M, 0), min(L, M))
    out = _dz_attend(self, torch.cat((rq, qa), -3), torch.cat((new_k, ka), -3), torch.cat((new_v, va), -3))
    return out, torch.stack((new_k, new_v))


def dz_explicit_sink_window(self, x, rope_cos, rope_sin, kv_cache):
    """The sink window as explicit index arithmetic: [sink | cache[sink + chunk:] | new] instead of nested cats."""
    rq, rk, rv, qa, ka, va = _dz_qkv(self, x, rope_cos, rope_sin)
    sink, chunk, M = self.sink, rk.shape[1], self.max_attention_size
    drop = max(0, kv_cache.shape[2] - sink + chunk - (M - sink))  # what overflows the sliding part
    new_k = torch.cat([kv_cache[0][:, :sink], kv_cache[0][:, sink + drop:], rk], dim=1)
    new_v = torch.cat([kv_cache[1][:, :sink], kv_cache[1][:, sink + drop:], rv], dim=1)
    out = _dz_attend(self, torch.cat([rq, qa], 1), torch.cat([new_k, ka], 1), torch.cat([new_v, va], 1))
    return out, torch.stack([new_k, new_v])


def dz_queries_in_another_order(self, x, rope_cos, rope_sin, kv_cache):
    """Queries ordered [actions | video] while keys are [history | video | actions]: non-causal, so fine."""
    rq, rk, rv, qa, ka, va = _dz_qkv(self, x, rope_cos, rope_sin)
    M, A = self.max_attention_size, self.action_register_length
    new_k = torch.cat([kv_cache[0], rk], dim=1)[:, -M:]
    new_v = torch.cat([kv_cache[1], rv], dim=1)[:, -M:]
    q = torch.cat([qa, rq], 1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), torch.cat([new_k, ka], 1).transpose(1, 2),
                                         torch.cat([new_v, va], 1).transpose(1, 2)).transpose(1, 2)
    out = torch.cat([out[:, A:], out[:, :A]], 1)  # back to [video | actions]
    return self.o(out.flatten(2)), torch.stack([new_k, new_v])


def dz_custom_scale_keywords(self, x, rope_cos, rope_sin, kv_cache):
    """SDPA called with keyword arguments only and a non-default softmax scale."""
    rq, rk, rv, qa, ka, va = _dz_qkv(self, x, rope_cos, rope_sin)
    M = self.max_attention_size
    new_k = torch.cat([kv_cache[0], rk], dim=1)[:, -M:]
    new_v = torch.cat([kv_cache[1], rv], dim=1)[:, -M:]
    out = F.scaled_dot_product_attention(
        query=torch.cat([rq, qa], 1).transpose(1, 2), key=torch.cat([new_k, ka], 1).transpose(1, 2),
        value=torch.cat([new_v, va], 1).transpose(1, 2), scale=0.7 / self.head_dim**0.5)
    return self.o(out.transpose(1, 2).flatten(2)), torch.stack([new_k, new_v])


# unsupported -------------------------------------------------------------------------------------------------
def _dz_window(self, kv_cache, rk, rv):
    M = self.max_attention_size
    return torch.cat([kv_cache[0], rk], dim=1)[:, -M:], torch.cat([kv_cache[1], rv], dim=1)[:, -M:]


def dz_dropout(self, x, rope_cos, rope_sin, kv_cache):
    rq, rk, rv, qa, ka, va = _dz_qkv(self, x, rope_cos, rope_sin)
    new_k, new_v = _dz_window(self, kv_cache, rk, rv)
    out = _dz_attend(self, torch.cat([rq, qa], 1), torch.cat([new_k, ka], 1), torch.cat([new_v, va], 1), dropout_p=0.1)
    return out, torch.stack([new_k, new_v])


def dz_is_causal(self, x, rope_cos, rope_sin, kv_cache):
    rq, rk, rv, qa, ka, va = _dz_qkv(self, x, rope_cos, rope_sin)
    new_k, new_v = _dz_window(self, kv_cache, rk, rv)
    out = _dz_attend(self, torch.cat([rq, qa], 1), torch.cat([new_k, ka], 1), torch.cat([new_v, va], 1),
                     is_causal=True)
    return out, torch.stack([new_k, new_v])


def dz_frame_causal_mask(self, x, rope_cos, rope_sin, kv_cache):
    """A mask that hides the oldest cached frame from the video queries: another visibility than the window."""
    rq, rk, rv, qa, ka, va = _dz_qkv(self, x, rope_cos, rope_sin)
    new_k, new_v = _dz_window(self, kv_cache, rk, rv)
    q, k = torch.cat([rq, qa], 1), torch.cat([new_k, ka], 1)
    mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool)
    mask[: rq.shape[1], : rk.shape[1]] = False
    out = _dz_attend(self, q, k, torch.cat([new_v, va], 1), attn_mask=mask)
    return out, torch.stack([new_k, new_v])


def dz_cache_arithmetic(self, x, rope_cos, rope_sin, kv_cache):
    """History decayed by 0.5 before use (and stored decayed): arithmetic on the cache."""
    rq, rk, rv, qa, ka, va = _dz_qkv(self, x, rope_cos, rope_sin)
    M = self.max_attention_size
    new_k = torch.cat([kv_cache[0] * 0.5, rk], dim=1)[:, -M:]
    new_v = torch.cat([kv_cache[1] * 0.5, rv], dim=1)[:, -M:]
    out = _dz_attend(self, torch.cat([rq, qa], 1), torch.cat([new_k, ka], 1), torch.cat([new_v, va], 1))
    return out, torch.stack([new_k, new_v])


def dz_swapped_halves(self, x, rope_cos, rope_sin, kv_cache):
    """A consistent model that stores V at [0] and K at [1]: the paged op's pool layout is the other way round."""
    rq, rk, rv, qa, ka, va = _dz_qkv(self, x, rope_cos, rope_sin)
    M = self.max_attention_size
    new_k = torch.cat([kv_cache[1], rk], dim=1)[:, -M:]
    new_v = torch.cat([kv_cache[0], rv], dim=1)[:, -M:]
    out = _dz_attend(self, torch.cat([rq, qa], 1), torch.cat([new_k, ka], 1), torch.cat([new_v, va], 1))
    return out, torch.stack([new_v, new_k])


def dz_newest_first(self, x, rope_cos, rope_sin, kv_cache):
    """A consistent model whose cache keeps the newest tokens first: history is read after the new tokens."""
    rq, rk, rv, qa, ka, va = _dz_qkv(self, x, rope_cos, rope_sin)
    M = self.max_attention_size
    new_k = torch.cat([rk, kv_cache[0]], dim=1)[:, :M]
    new_v = torch.cat([rv, kv_cache[1]], dim=1)[:, :M]
    out = _dz_attend(self, torch.cat([rq, qa], 1), torch.cat([new_k, ka], 1), torch.cat([new_v, va], 1))
    return out, torch.stack([new_k, new_v])


def dz_shorter_window(self, x, rope_cos, rope_sin, kv_cache):
    """Attends over one frame less history than it stores: not the window the runtime pages."""
    rq, rk, rv, qa, ka, va = _dz_qkv(self, x, rope_cos, rope_sin)
    new_k, new_v = _dz_window(self, kv_cache, rk, rv)
    F_ = rk.shape[1]
    out = _dz_attend(self, torch.cat([rq, qa], 1), torch.cat([new_k[:, F_:], ka], 1),
                     torch.cat([new_v[:, F_:], va], 1))
    return out, torch.stack([new_k, new_v])


def dz_gathered_history(self, x, rope_cos, rope_sin, kv_cache):
    """History gathered with index_select (a reordering the pass cannot read structurally)."""
    rq, rk, rv, qa, ka, va = _dz_qkv(self, x, rope_cos, rope_sin)
    M, chunk, L = self.max_attention_size, rk.shape[1], kv_cache.shape[2]
    keep = min(L, M - chunk)
    if keep:  # newest-last history, gathered in reverse order (attention over it is order-free)
        index = torch.arange(L - keep, L).flip(0)
        hist_k, hist_v = kv_cache[0].index_select(1, index), kv_cache[1].index_select(1, index)
    else:
        hist_k, hist_v = kv_cache[0][:, :0], kv_cache[1][:, :0]
    new_k, new_v = torch.cat([hist_k, rk], dim=1), torch.cat([hist_v, rv], dim=1)
    out = _dz_attend(self, torch.cat([rq, qa], 1), torch.cat([new_k, ka], 1), torch.cat([new_v, va], 1))
    return out, torch.stack([new_k, new_v])


def dz_unbind_cache(self, x, rope_cos, rope_sin, kv_cache):
    """kv_cache.unbind(0): correct dense code, but unbind ends the pass's data-movement trace (refused, safe)."""
    rq, rk, rv, qa, ka, va = _dz_qkv(self, x, rope_cos, rope_sin)
    M = self.max_attention_size
    cache_k, cache_v = kv_cache.unbind(0)
    new_k, new_v = torch.cat([cache_k, rk], 1)[:, -M:], torch.cat([cache_v, rv], 1)[:, -M:]
    out = _dz_attend(self, torch.cat([rq, qa], 1), torch.cat([new_k, ka], 1), torch.cat([new_v, va], 1))
    return out, torch.stack([new_k, new_v])


# ---- HunyuanImage-3 pieces ---------------------------------------------------------------------------------
def _hy_out(self, out, b, s):
    return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def hy_enable_gqa(self, hidden_states, rope_cos, rope_sin, attention_mask, past_key_value, prefix_valid, mode):
    """No repeat_kv: SDPA's enable_gqa does the head sharing (head h uses kv head h // rep)."""
    b, s, _ = hidden_states.shape
    q, k, v = hunyuan_qkv_cached(self, hidden_states, rope_cos, rope_sin, past_key_value, prefix_valid, mode)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=attention_mask, enable_gqa=True)
    return _hy_out(self, out, b, s)


def hy_bhsd_expand_flatten(self, hidden_states, rope_cos, rope_sin, attention_mask, past_key_value, prefix_valid,
                           mode):
    """Prefix concat in (B, H, S, D) with torch.concatenate, GQA by expand + flatten, a where-built float mask,
    the prefill store as slice assignment, SDPA with keyword arguments."""
    b, s, _ = hidden_states.shape
    q, k, v = hunyuan_qkv(self, hidden_states, rope_cos, rope_sin)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    if mode == "prefill":
        P = past_key_value.cached_key.shape[1]
        past_key_value.cached_key[:, :P] = k.transpose(1, 2)[:, :P]
        past_key_value.cached_value[:, :P] = v.transpose(1, 2)[:, :P]
    else:
        k = torch.concatenate([past_key_value.cached_key.transpose(1, 2), k], dim=2)
        v = torch.concatenate([past_key_value.cached_value.transpose(1, 2), v], dim=2)
    Hkv, L = k.shape[1], k.shape[2]
    k = k[:, :, None].expand(b, Hkv, self.n_rep, L, self.head_dim).flatten(1, 2)
    v = v[:, :, None].expand(b, Hkv, self.n_rep, L, self.head_dim).flatten(1, 2)
    bias = torch.where(attention_mask, 0.0, float("-inf"))
    out = F.scaled_dot_product_attention(query=q.transpose(1, 2), key=k, value=v, attn_mask=bias)
    return _hy_out(self, out, b, s)


def hy_prefix_after_new(self, hidden_states, rope_cos, rope_sin, attention_mask, past_key_value, prefix_valid, mode):
    """Steps read [new | prefix] (and permute the mask to match): consistent, but not the paged order."""
    b, s, _ = hidden_states.shape
    q, k, v = hunyuan_qkv(self, hidden_states, rope_cos, rope_sin)
    if mode == "prefill":
        past_key_value.store(k, v, prefix_valid)
    else:
        P = past_key_value.cached_key.shape[1]
        k = torch.cat([k, past_key_value.cached_key], 1)
        v = torch.cat([v, past_key_value.cached_value], 1)
        attention_mask = torch.cat([attention_mask[..., P:], attention_mask[..., :P]], -1)
    k = hy.repeat_kv(k.transpose(1, 2), self.n_rep)
    v = hy.repeat_kv(v.transpose(1, 2), self.n_rep)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=attention_mask)
    return _hy_out(self, out, b, s)


def hy_is_causal(self, hidden_states, rope_cos, rope_sin, attention_mask, past_key_value, prefix_valid, mode):
    """is_causal=True instead of the model's causal/bidirectional mask."""
    b, s, _ = hidden_states.shape
    q, k, v = hunyuan_qkv_cached(self, hidden_states, rope_cos, rope_sin, past_key_value, prefix_valid, mode)
    k = hy.repeat_kv(k.transpose(1, 2), self.n_rep)
    v = hy.repeat_kv(v.transpose(1, 2), self.n_rep)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)
    return _hy_out(self, out, b, s)


def hy_scaled_prefix(self, hidden_states, rope_cos, rope_sin, attention_mask, past_key_value, prefix_valid, mode):
    """The cached prefix read through arithmetic (a 0.5 temperature on the prefix keys)."""
    b, s, _ = hidden_states.shape
    q, k, v = hunyuan_qkv(self, hidden_states, rope_cos, rope_sin)
    if mode == "prefill":
        past_key_value.store(k, v, prefix_valid)
    else:
        k = torch.cat([past_key_value.cached_key * 0.5, k], 1)
        v = torch.cat([past_key_value.cached_value, v], 1)
    k = hy.repeat_kv(k.transpose(1, 2), self.n_rep)
    v = hy.repeat_kv(v.transpose(1, 2), self.n_rep)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=attention_mask)
    return _hy_out(self, out, b, s)


def hy_store_scaled(self, hidden_states, rope_cos, rope_sin, attention_mask, past_key_value, prefix_valid, mode):
    """Prefill attends with k but caches 2 * k: the later steps read something the attention never saw."""
    b, s, _ = hidden_states.shape
    q, k, v = hunyuan_qkv(self, hidden_states, rope_cos, rope_sin)
    if mode == "prefill":
        past_key_value.store(k * 2.0, v, prefix_valid)
    else:
        k, v = past_key_value.extend(k, v)
    k = hy.repeat_kv(k.transpose(1, 2), self.n_rep)
    v = hy.repeat_kv(v.transpose(1, 2), self.n_rep)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=attention_mask)
    return _hy_out(self, out, b, s)


def hy_store_before_rope(self, hidden_states, rope_cos, rope_sin, attention_mask, past_key_value, prefix_valid, mode):
    """Prefill caches the keys before RoPE but attends with the rotated ones."""
    b, s, _ = hidden_states.shape
    Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
    q, k, v = self.qkv_proj(hidden_states).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(b, s, Hq, D), k.view(b, s, Hkv, D), v.view(b, s, Hkv, D)
    q, k = self.query_layernorm(q), self.key_layernorm(k)
    raw_k = k
    q, k = apply_rope_2d(q, k, rope_cos, rope_sin)
    if mode == "prefill":
        past_key_value.store(raw_k, v, prefix_valid)
    else:
        k, v = past_key_value.extend(k, v)
    k = hy.repeat_kv(k.transpose(1, 2), self.n_rep)
    v = hy.repeat_kv(v.transpose(1, 2), self.n_rep)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=attention_mask)
    return _hy_out(self, out, b, s)


def hy_prefill_dropout(self, hidden_states, rope_cos, rope_sin, attention_mask, past_key_value, prefix_valid, mode):
    """Dropout in the prefill forward only: the prefill site is refused, the step sites alone would match."""
    b, s, _ = hidden_states.shape
    q, k, v = hunyuan_qkv_cached(self, hidden_states, rope_cos, rope_sin, past_key_value, prefix_valid, mode)
    k = hy.repeat_kv(k.transpose(1, 2), self.n_rep)
    v = hy.repeat_kv(v.transpose(1, 2), self.n_rep)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=attention_mask,
                                         dropout_p=0.1 if mode == "prefill" else 0.0)
    return _hy_out(self, out, b, s)


def hy_own_causal_mask(self, hidden_states, rope_cos, rope_sin, attention_mask, past_key_value, prefix_valid, mode):
    """The layer narrows the mask it is given to plain causal (the image span loses its bidirectionality)."""
    b, s, _ = hidden_states.shape
    q, k, v = hunyuan_qkv_cached(self, hidden_states, rope_cos, rope_sin, past_key_value, prefix_valid, mode)
    L = k.shape[1]
    mask = attention_mask & torch.ones(s, L, dtype=torch.bool).tril(L - s)
    k = hy.repeat_kv(k.transpose(1, 2), self.n_rep)
    v = hy.repeat_kv(v.transpose(1, 2), self.n_rep)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)
    return _hy_out(self, out, b, s)


# ---- runs -------------------------------------------------------------------------------------------------------
def run_dreamzero(monkeypatch, forward, options, cfg=DZ_CFG, num_chunks=6):
    monkeypatch.setattr(dz.CausalWanSelfAttention, "forward", forward)
    dense = dz.dreamzero_rollout(dz.DreamZeroModel(cfg, seed=1), num_chunks=num_chunks, num_inference_steps=2, seed=2)
    model = dz.DreamZeroModel(cfg, seed=1)
    rt = PagedKVRuntime(dreamzero_runtime_config(cfg, kernel="reference", inner_compiler="aot_eager"))
    rt.bind(model.blocks)
    backend = CountingBackend(options)
    compile_blocks(model.blocks, backend)
    try:
        paged = paged_run(model, rt, num_chunks=num_chunks, num_inference_steps=2, seed=2)
    finally:
        assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer and not rt.scheduler.owners
    return dense, paged, backend, rt


def run_hunyuan(monkeypatch, forward, options):
    monkeypatch.setattr(hy.HunyuanAttention, "forward", forward)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, HY_CFG.vocab, (9,), generator=g), torch.randint(0, HY_CFG.vocab, (5,), generator=g)]
    dense = hy.hunyuan_generate(hy.HunyuanImage3Model(HY_CFG, seed=1), prompts, prefix_capacity=HY_CAPACITY,
                                num_steps=3)
    model = hy.HunyuanImage3Model(HY_CFG, seed=1)
    rt = PagedKVRuntime(hunyuan_runtime_config(HY_CFG, max_prefix=HY_CAPACITY, block_size=4, kernel="reference",
                                               inner_compiler="aot_eager"))
    rt.bind(model.layers)
    backend = CountingBackend(options)
    compile_blocks(model.layers, backend)
    try:
        paged = paged_run(model, rt, prompts=prompts, prefix_capacity=HY_CAPACITY, num_steps=3)
    finally:
        assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer and not rt.scheduler.owners
    return dense, paged, backend, rt


SUPPORTED = [
    ("dreamzero: tuple-unpacked cache, cat of a tuple at dim -3, narrow", "dz", dz_tuple_unpack_narrow, DZ_CFG,
     "window"),
    ("dreamzero: sink window by explicit index arithmetic", "dz", dz_explicit_sink_window, DZ_SINK_CFG,
     "window"),
    ("dreamzero: queries in another order than keys", "dz", dz_queries_in_another_order, DZ_CFG, "window"),
    ("dreamzero: keyword-only SDPA with a custom scale", "dz", dz_custom_scale_keywords, DZ_CFG, "window"),
    ("hunyuan: enable_gqa instead of repeat_kv", "hy", hy_enable_gqa, None, "pref"),
    ("hunyuan: (B, H, S, D) concatenate, expand+flatten GQA, where-mask, slice-assigned store", "hy",
     hy_bhsd_expand_flatten, None, "pref"),
]


@pytest.mark.parametrize("case", SUPPORTED, ids=[c[0] for c in SUPPORTED])
def test_supported_spellings_are_rewritten_and_exact(monkeypatch, case):
    _, family, forward, cfg, pattern = case
    opts = {"strict": True}  # supported means no site is refused, not even once
    if family == "dz":
        dense, paged, backend, rt = run_dreamzero(monkeypatch, forward, opts, cfg=cfg)
        assert dense["resets"] and dense["resets"] == paged["resets"]
        for key in ("video", "actions"):
            assert (dense[key] - paged[key]).abs().max().item() <= ATOL
    else:
        dense, paged, backend, rt = run_hunyuan(monkeypatch, forward, opts)
        assert (dense - paged).abs().max().item() <= ATOL
    rewritten = [r for res in backend.results for r in res.reports if r.status == "rewritten"]
    assert rewritten and all(r.pattern.startswith(pattern) for r in rewritten)
    assert not [r for res in backend.results for r in res.reports if r.status == "refused"]


UNSUPPORTED = [
    ("dreamzero: attention dropout", "dz", dz_dropout, r"attention dropout is not supported by the paged op"),
    ("dreamzero: is_causal=True on the cached keys", "dz", dz_is_causal,
     r"window: a sliding-window attention is non-causal and unmasked; this site has a mask or is_causal"),
    ("dreamzero: a mask over the window", "dz", dz_frame_causal_mask, r"this site has a mask or is_causal"),
    ("dreamzero: cache * 0.5", "dz", dz_cache_arithmetic,
     r"a cache stand-in feeds its keys/values through computation, not only data movement"),
    ("dreamzero: K read from cache[1], V from cache[0]", "dz", dz_swapped_halves,
     r"keys must come from cache\[0\] and values from cache\[1\]"),
    ("dreamzero: newest-first cache (history after the new tokens)", "dz", dz_newest_first,
     r"cache history columns come after new tokens"),
    ("dreamzero: attends over a shorter window than it stores", "dz", dz_shorter_window,
     r"the window keeps \d+ history tokens; expected window - chunk = \d+"),
    ("dreamzero: history gathered with index_select", "dz", dz_gathered_history,
     r"through computation, not only data movement"),
    ("dreamzero: kv_cache.unbind(0)", "dz", dz_unbind_cache, r"through computation, not only data movement"),
    ("hunyuan: prefix read after the new tokens", "hy", hy_prefix_after_new,
     r"cache history columns come after new tokens"),
    ("hunyuan: is_causal=True instead of the mask", "hy", hy_is_causal,
     r"prefix-step: is_causal=True is not a prefix idiom"),
    # The scaled prefix is read as computed tokens, so the pass sees more new keys than queries.
    ("hunyuan: prefix keys scaled by 0.5", "hy", hy_scaled_prefix,
     r"query, keys and values do not carry the same number of new tokens"),
    ("hunyuan: prefill caches 2 * k", "hy", hy_store_scaled,
     r"it stores something else into the cache than the keys/values it attends with"),
    ("hunyuan: prefill caches the keys before RoPE", "hy", hy_store_before_rope,
     r"it stores something else into the cache than the keys/values it attends with"),
    ("hunyuan: dropout in the prefill forward only", "hy", hy_prefill_dropout,
     r"attention dropout is not supported by the paged op"),
    ("hunyuan: the layer narrows its mask to causal", "hy", hy_own_causal_mask,
     r"its mask is computed in the graph \(\w+: and_\), so it may differ from the layout the paged op uses"),
]


def _run(monkeypatch, family, forward, options):
    return (run_dreamzero if family == "dz" else run_hunyuan)(monkeypatch, forward, options)


@pytest.mark.parametrize("case", UNSUPPORTED, ids=[c[0] for c in UNSUPPORTED])
def test_unsupported_attention_warns_then_is_rejected_never_computed(monkeypatch, case):
    _, family, forward, reason = case
    with pytest.warns(UserWarning, match=reason) as warned, \
            raises_paged(PassError, r"still reads a KV-cache stand-in after rewriting .* a stand-in holds "
                                    r"no data"):
        _run(monkeypatch, family, forward, {})
    assert any("cannot be rewritten" in str(w.message) for w in warned)


@pytest.mark.parametrize("case", UNSUPPORTED, ids=[c[0] for c in UNSUPPORTED])
def test_unsupported_attention_raises_at_once_in_strict_mode(monkeypatch, case):
    _, family, forward, reason = case
    with raises_paged(PassError, r"reads a KV-cache stand-in but cannot be rewritten: .*" + reason):
        _run(monkeypatch, family, forward, {"strict": True})


def test_a_refused_rollout_never_wrote_the_pool(monkeypatch):
    """The refusal comes at compile time, before any op runs: the pool is still all zeros."""
    seen = {}
    original = PagedKVRuntime.__init__

    def keep(self, *a, **k):
        original(self, *a, **k)
        seen["rt"] = self

    monkeypatch.setattr(PagedKVRuntime, "__init__", keep)
    with pytest.warns(UserWarning), raises_paged(PassError, "still reads a KV-cache stand-in"):
        run_dreamzero(monkeypatch, dz_cache_arithmetic, {})
    assert not seen["rt"].pool.tensor.any()


def test_a_refused_prefill_does_not_lose_its_cache_store_silently(monkeypatch):
    """Non-strict mode: the prefill site is refused (warning) and its store into the cache must not vanish with
    dead-code elimination, or the steps would read a pool nothing wrote."""
    with pytest.warns(UserWarning, match="attention dropout is not supported"), \
            raises_paged(PassError, r"copy_: call_method copy_.*a store into it would be lost: later forwards would "
                                    r"read a cache that was never written"):
        run_hunyuan(monkeypatch, hy_prefill_dropout, {})
