"""Matching is structural: other spellings of the same idioms are rewritten; other semantics are refused.

Each variant replaces the attention forward of a reference model (for the dense run and the paged
run alike) and runs the whole loop: supported variants must match the dense loop within 1e-5;
unsupported ones must fail loudly (warning, then PassError; PassError at once in strict mode).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import CountingBackend, compile_blocks, hunyuan_qkv, hunyuan_qkv_cached, raises_paged

from paged_kv_compile import PassError, RequestError
from paged_kv_compile.driver import paged_run
from paged_kv_compile.families.dreamzero import dreamzero_runtime_config
from paged_kv_compile.families.hunyuan_image3 import hunyuan_runtime_config
from paged_kv_compile.models import dreamzero as dz
from paged_kv_compile.models import hunyuan_image3 as hy
from paged_kv_compile.models.common import apply_rope_3d
from paged_kv_compile.runtime import PagedKVRuntime

ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class SDPAWrapper(torch.nn.Module):
    """A small attention wrapper module, as many codebases have."""

    def forward(self, q, k, v, mask=None, scale=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


_WRAPPER = SDPAWrapper()


def dreamzero_bhsd_concat(self, x, rope_cos, rope_sin, kv_cache):
    """The window idiom written in (B, H, S, D) layout with torch.concat, fused-QKV chunk and a wrapper."""
    b, s, _ = x.shape
    A, H, D, M = self.action_register_length, self.num_heads, self.head_dim, self.max_attention_size
    q, k, v = (t.reshape(b, s, H, D) for t in self.qkv(x).chunk(3, dim=-1))
    q, k = self.norm_q(q), self.norm_k(k)
    roped_q = apply_rope_3d(q[:, :-A], rope_cos, rope_sin).transpose(1, 2)
    roped_k = apply_rope_3d(k[:, :-A], rope_cos, rope_sin).transpose(1, 2)
    new_k = torch.concat([kv_cache[0].transpose(1, 2), roped_k], dim=2)[:, :, -M:]
    new_v = torch.concat([kv_cache[1].transpose(1, 2), v[:, :-A].transpose(1, 2)], dim=2)[:, :, -M:]
    q = torch.concat([roped_q, q[:, -A:].transpose(1, 2)], dim=2)
    k = torch.concat([new_k, k[:, -A:].transpose(1, 2)], dim=2)
    v = torch.concat([new_v, v[:, -A:].transpose(1, 2)], dim=2)
    out = _WRAPPER(q, k, v).transpose(1, 2)
    return self.o(out.flatten(2)), torch.stack([new_k.transpose(1, 2), new_v.transpose(1, 2)])


def hunyuan_additive_interleave(self, hidden_states, rope_cos, rope_sin, attention_mask, past_key_value,
                                prefix_valid, mode):
    """Prefix idiom with torch.concat, repeat_interleave GQA and an additive float mask."""
    b, s, _ = hidden_states.shape
    q, k, v = hunyuan_qkv(self, hidden_states, rope_cos, rope_sin)
    if mode == "prefill":
        past_key_value.store(k, v, prefix_valid)
    else:
        k = torch.concat([past_key_value.cached_key, k], dim=1)
        v = torch.concat([past_key_value.cached_value, v], dim=1)
    k = k.transpose(1, 2).repeat_interleave(self.n_rep, dim=1)
    v = v.transpose(1, 2).repeat_interleave(self.n_rep, dim=1)
    additive = torch.zeros(attention_mask.shape, dtype=q.dtype).masked_fill(~attention_mask, float("-inf"))
    out = _WRAPPER(q.transpose(1, 2), k, v, additive, self.head_dim**-0.5)
    return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def hunyuan_tiled_gqa(self, hidden_states, rope_cos, rope_sin, attention_mask, past_key_value, prefix_valid, mode):
    """Another GQA head mapping (query head h uses kv head h % Hkv): not what the paged op computes."""
    b, s, _ = hidden_states.shape
    q, k, v = hunyuan_qkv_cached(self, hidden_states, rope_cos, rope_sin, past_key_value, prefix_valid, mode)
    k = k.transpose(1, 2).repeat(1, self.n_rep, 1, 1)
    v = v.transpose(1, 2).repeat(1, self.n_rep, 1, 1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=attention_mask)
    return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def dreamzero_rope_all_then_slice(self, x, rope_cos, rope_sin, kv_cache):
    """vllm-omni's idiom (causal_wan_model.py): RoPE over [video | registers] in ONE call, then slice both.

    Video and register keys are then slices of one roped tensor: only the graph says which of its tokens
    pass the cache concatenation and the window slice (the chunk) and which are appended after (registers).
    """
    b, s, _ = x.shape
    A, M = self.action_register_length, self.max_attention_size
    q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, self.head_dim).unbind(2)
    q, k = self.norm_q(q), self.norm_k(k)
    cos = torch.cat([rope_cos, torch.ones_like(rope_cos[:A])])  # registers: their own (here identity) angles
    sin = torch.cat([rope_sin, torch.zeros_like(rope_sin[:A])])
    roped_q, roped_k = apply_rope_3d(q, cos, sin), apply_rope_3d(k, cos, sin)
    roped_action_q, roped_q = roped_q[:, -A:], roped_q[:, :-A]
    roped_action_k, roped_k = roped_k[:, -A:], roped_k[:, :-A]
    action_v, v = v[:, -A:], v[:, :-A]
    new_k = torch.cat([kv_cache[0], roped_k], dim=1)[:, -M:]
    new_v = torch.cat([kv_cache[1], v], dim=1)[:, -M:]
    q = torch.cat([roped_q, roped_action_q], dim=1)
    k = torch.cat([new_k, roped_action_k], dim=1)
    v = torch.cat([new_v, action_v], dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    return self.o(out.flatten(2)), torch.stack([new_k, new_v])


def dreamzero_registers_through_window(self, x, rope_cos, rope_sin, kv_cache):
    """Registers concatenated with the chunk BEFORE the window slice: the cache would keep them."""
    b, s, _ = x.shape
    M = self.max_attention_size
    q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, self.head_dim).unbind(2)
    new_k = torch.cat([kv_cache[0], k], dim=1)[:, -M:]
    new_v = torch.cat([kv_cache[1], v], dim=1)[:, -M:]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), new_k.transpose(1, 2), new_v.transpose(1, 2))
    return self.o(out.transpose(1, 2).flatten(2)), torch.stack([new_k, new_v])


def dreamzero_manual_softmax(self, x, rope_cos, rope_sin, kv_cache):
    """Attention written by hand (matmul + softmax), read as the SDPA it computes."""
    b, s, _ = x.shape
    A, M = self.action_register_length, self.max_attention_size
    q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, self.head_dim).unbind(2)
    new_k = torch.cat([kv_cache[0], k[:, :-A]], dim=1)[:, -M:]
    new_v = torch.cat([kv_cache[1], v[:, :-A]], dim=1)[:, -M:]
    kk, vv = torch.cat([new_k, k[:, -A:]], 1).transpose(1, 2), torch.cat([new_v, v[:, -A:]], 1).transpose(1, 2)
    att = (q.transpose(1, 2) @ kk.transpose(-1, -2) * self.head_dim**-0.5).softmax(-1)
    return self.o((att @ vv).transpose(1, 2).flatten(2)), torch.stack([new_k, new_v])


def _run_dreamzero(monkeypatch, forward, options, num_chunks=6):
    monkeypatch.setattr(dz.CausalWanSelfAttention, "forward", forward)
    cfg = dz.DreamZeroConfig()
    dense = dz.dreamzero_rollout(dz.DreamZeroModel(cfg, seed=1), num_chunks=num_chunks, num_inference_steps=2)
    model = dz.DreamZeroModel(cfg, seed=1)
    rt = PagedKVRuntime(dreamzero_runtime_config(cfg, block_size=8, kernel="reference"))
    rt.bind(model.blocks)
    backend = CountingBackend(options)
    compile_blocks(model.blocks, backend)
    paged = paged_run(model, rt, num_chunks=num_chunks, num_inference_steps=2)
    return dense, paged, backend


def _run_hunyuan(monkeypatch, forward, options):
    monkeypatch.setattr(hy.HunyuanAttention, "forward", forward)
    cfg = hy.HunyuanImage3Config()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (9,), generator=g), torch.randint(0, 64, (5,), generator=g)]
    dense = hy.hunyuan_generate(hy.HunyuanImage3Model(cfg, seed=1), prompts, prefix_capacity=9, num_steps=3)
    model = hy.HunyuanImage3Model(cfg, seed=1)
    rt = PagedKVRuntime(hunyuan_runtime_config(cfg, max_prefix=9, block_size=4, kernel="reference"))
    rt.bind(model.layers)
    backend = CountingBackend(options)
    compile_blocks(model.layers, backend)
    paged = paged_run(model, rt, prompts=prompts, prefix_capacity=9, num_steps=3)
    return dense, paged, backend


def test_dreamzero_rope_over_registers_then_slice_is_rewritten(monkeypatch):
    """Which new keys are the chunk comes from the cache concatenation in the graph, not from separate leaves."""
    dense, paged, backend = _run_dreamzero(monkeypatch, dreamzero_rope_all_then_slice, {"inner_compiler": "aot_eager"})
    assert (dense["video"] - paged["video"]).abs().max().item() <= ATOL
    assert (dense["actions"] - paged["actions"]).abs().max().item() <= ATOL
    assert backend.frames == 1
    result = backend.results[0]
    assert [r.pattern for r in result.reports if r.status == "rewritten"] == ["window"]
    cfg = dz.DreamZeroConfig()
    assert (result.expect.chunk_tokens, result.expect.action_tokens) == (cfg.chunk_tokens, cfg.action_register_length)


def test_dreamzero_registers_kept_by_the_window_are_refused(monkeypatch):
    """All new tokens pass the window (the registers would become history): not the session's layout."""
    with raises_paged(RequestError, "chunk_tokens"):
        _run_dreamzero(monkeypatch, dreamzero_registers_through_window, {"inner_compiler": "aot_eager"})


def test_dreamzero_bhsd_concat_wrapper_is_rewritten(monkeypatch):
    dense, paged, backend = _run_dreamzero(monkeypatch, dreamzero_bhsd_concat, {"inner_compiler": "aot_eager"})
    assert (dense["video"] - paged["video"]).abs().max().item() <= ATOL
    assert backend.frames == 1
    assert [r.pattern for r in backend.results[0].reports if r.status == "rewritten"] == ["window"]


def test_hunyuan_additive_mask_repeat_interleave_is_rewritten(monkeypatch):
    dense, paged, backend = _run_hunyuan(monkeypatch, hunyuan_additive_interleave, {"inner_compiler": "aot_eager"})
    assert (dense - paged).abs().max().item() <= ATOL
    assert sorted(r.pattern for res in backend.results for r in res.reports) == [
        "prefill-store", "prefix-step"]


def test_other_gqa_mapping_is_refused_with_a_warning(monkeypatch):
    with pytest.warns(UserWarning, match="cannot be rewritten"), raises_paged(PassError, "still reads a KV-cache"):
        _run_hunyuan(monkeypatch, hunyuan_tiled_gqa, {"inner_compiler": "aot_eager"})


def test_other_gqa_mapping_raises_in_strict_mode(monkeypatch):
    with raises_paged(PassError, "GQA as head h -> kv head h // rep"):
        _run_hunyuan(monkeypatch, hunyuan_tiled_gqa, {"inner_compiler": "aot_eager", "strict": True})


def test_hand_written_attention_is_read_as_sdpa(monkeypatch):
    """matmul + softmax + matmul is rewritten like SDPA (passes/handwritten.py; its refusals:
    tests/test_pass_handwritten.py)."""
    dense, paged, backend = _run_dreamzero(monkeypatch, dreamzero_manual_softmax, {"inner_compiler": "aot_eager"},
                                           num_chunks=2)
    assert (dense["video"] - paged["video"]).abs().max().item() <= ATOL
    assert [r.pattern for r in backend.results[0].reports if r.status == "rewritten"] == ["window"]
