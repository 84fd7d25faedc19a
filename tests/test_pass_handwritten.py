"""Hand-written attention (matmul, softmax, matmul) is read like SDPA: rewritten where the pass proves what it
computes, left as written with the reason otherwise (the graph is then refused: never computed on zeros).

Each variant replaces the attention of a reference model for the dense run and the paged run alike; compiled paged
vs dense eager within 1e-5, one frame, the KV site rewritten.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import hunyuan_qkv_cached, raises_paged
from test_pass_matching import ATOL, _run_dreamzero, _run_hunyuan

from paged_kv_compile import PassError
from paged_kv_compile.models.common import apply_rope_3d

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def matmul_scale(q, k, v, d, mask=None):
    att = (q @ k.transpose(-1, -2) * d**-0.5).softmax(-1)
    return att @ v


def einsum_div_sqrt(q, k, v, d, mask=None):
    scores = torch.einsum("bhld,bhsd->bhls", q, k) / math.sqrt(d)
    return torch.einsum("bhls,bhsd->bhld", scores.softmax(dim=-1), v)


def float32_softmax_cast_back(q, k, v, d, mask=None):
    scores = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(d))
    if mask is not None:
        scores = scores + mask
    probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def bmm_merged_heads(q, k, v, d, mask=None):
    """(B*H, L, D) operands, as code written for bmm does."""
    b, h, length, _ = q.shape
    q3, k3, v3 = (x.reshape(b * h, x.shape[2], d) for x in (q, k, v))
    probs = torch.bmm(q3, k3.transpose(1, 2)).mul(d**-0.5).softmax(-1)
    return torch.bmm(probs, v3).view(b, h, length, d)


def baddbmm_alpha(q, k, v, d, mask=None):
    """The baddbmm form (beta=0, the scale as alpha)."""
    b, h, length, _ = q.shape
    q3, k3, v3 = (x.reshape(b * h, x.shape[2], d) for x in (q, k, v))
    scores = torch.baddbmm(q3.new_zeros(b * h, length, k3.shape[1]), q3, k3.transpose(1, 2), beta=0, alpha=d**-0.5)
    return torch.bmm(scores.softmax(dim=-1), v3).view(b, h, length, d)


def softmax_over_queries(q, k, v, d, mask=None):
    return (q @ k.transpose(-1, -2) * d**-0.5).softmax(-2) @ v


def mask_before_scale(q, k, v, d, mask=None):
    return ((q @ k.transpose(-1, -2) + mask) * d**-0.5).softmax(-1) @ v


def masked_fill_float32(q, k, v, d, mask):
    scores = (q @ k.transpose(-1, -2)).float() * d**-0.5
    return scores.masked_fill(~mask, float("-inf")).softmax(-1).type_as(q) @ v


def masked_fill_before_scale(q, k, v, d, mask):
    return ((q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf")) * d**-0.5).softmax(-1) @ v


def scale_by_a_tensor(q, k, v, d, mask):
    scores = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
    return (scores * q.new_tensor(d**-0.5)).softmax(-1) @ v


def bool_mask_added(q, k, v, d, mask):
    """Adds the boolean mask as numbers (0/1): not what SDPA's bool mask means."""
    return (q @ k.transpose(-1, -2) * d**-0.5 + mask).softmax(-1) @ v


def _dreamzero(attend):
    def forward(self, x, rope_cos, rope_sin, kv_cache):
        b, s, _ = x.shape
        A, M = self.action_register_length, self.max_attention_size
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, self.head_dim).unbind(2)
        q, k = self.norm_q(q), self.norm_k(k)
        roped_q = apply_rope_3d(q[:, :-A], rope_cos, rope_sin)
        roped_k = apply_rope_3d(k[:, :-A], rope_cos, rope_sin)
        new_k = torch.cat([kv_cache[0], roped_k], dim=1)[:, -M:]
        new_v = torch.cat([kv_cache[1], v[:, :-A]], dim=1)[:, -M:]
        q = torch.cat([roped_q, q[:, -A:]], dim=1).transpose(1, 2)
        k = torch.cat([new_k, k[:, -A:]], dim=1).transpose(1, 2)
        v = torch.cat([new_v, v[:, -A:]], dim=1).transpose(1, 2)
        out = attend(q, k, v, self.head_dim)
        return self.o(out.transpose(1, 2).flatten(2)), torch.stack([new_k, new_v])

    return forward


def _hunyuan(attend):
    def forward(self, hidden_states, rope_cos, rope_sin, attention_mask, past_key_value, prefix_valid, mode):
        b, s, _ = hidden_states.shape
        q, k, v = hunyuan_qkv_cached(self, hidden_states, rope_cos, rope_sin, past_key_value, prefix_valid, mode)
        k = k.transpose(1, 2).repeat_interleave(self.n_rep, dim=1)
        v = v.transpose(1, 2).repeat_interleave(self.n_rep, dim=1)
        out = attend(q.transpose(1, 2), k, v, self.head_dim, attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    return forward


@pytest.mark.parametrize("attend", [matmul_scale, einsum_div_sqrt, float32_softmax_cast_back, bmm_merged_heads,
                                    baddbmm_alpha])
def test_hand_written_window_attention_is_rewritten(monkeypatch, attend):
    dense, paged, backend = _run_dreamzero(monkeypatch, _dreamzero(attend), {"inner_compiler": "aot_eager"},
                                           num_chunks=3)
    assert (dense["video"] - paged["video"]).abs().max().item() <= ATOL
    assert (dense["actions"] - paged["actions"]).abs().max().item() <= ATOL
    assert backend.frames == 1
    assert [r.pattern for r in backend.results[0].reports if r.status == "rewritten"] == ["window"]


@pytest.mark.parametrize("attend, reason", [
    (softmax_over_queries, "the softmax runs over axis -2, not over the keys"),
])
def test_hand_written_attention_it_cannot_prove_is_refused_with_the_reason(monkeypatch, attend, reason):
    with raises_paged(PassError, reason):
        _run_dreamzero(monkeypatch, _dreamzero(attend), {"inner_compiler": "aot_eager", "strict": True},
                       num_chunks=2)


def test_hand_written_masked_prefix_attention_is_rewritten(monkeypatch):
    """HunyuanImage-3's prefill and steps, attention written by hand with its boolean mask (masked_fill)."""
    dense, paged, backend = _run_hunyuan(monkeypatch, _hunyuan(masked_fill_float32), {"inner_compiler": "aot_eager"})
    assert (dense - paged).abs().max().item() <= ATOL
    assert sorted(r.pattern for res in backend.results for r in res.reports) == ["prefill-store", "prefix-step"]


@pytest.mark.parametrize("attend, reason", [
    (masked_fill_before_scale, "is added before the scale: SDPA adds it after"),
    (scale_by_a_tensor, "the scores are scaled by a tensor"),
    (bool_mask_added, "is not floating point"),
])
def test_hand_written_masked_attention_it_cannot_prove_is_refused(monkeypatch, attend, reason):
    with raises_paged(PassError, reason):
        _run_hunyuan(monkeypatch, _hunyuan(attend), {"inner_compiler": "aot_eager", "strict": True})
