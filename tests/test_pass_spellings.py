"""Any spelling that moves the same elements is read the same: the fused-QKV splits people write.

Each spelling replaces DreamZero's attention split (for the dense run and the paged run alike; no q/k norm, so the
action registers' query/keys and every value are read straight from the fused projection) and runs the whole
loop: compiled paged vs dense eager within 1e-5, one frame, the window site rewritten. And one order that moves
other elements (RoPE after the cache concatenation), refused with the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import raises_paged
from test_pass_matching import ATOL, _run_dreamzero

from paged_kv_compile import PassError
from paged_kv_compile.models.common import apply_rope_3d

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def vit_permute_index(qkv, b, s, H, D):
    """The ViT spelling: (3, B, H, L, D) by permute, then an index on the selector axis."""
    qkv = qkv.view(b, s, 3, H, D).permute(2, 0, 3, 1, 4)
    return [qkv[i].transpose(1, 2) for i in range(3)]


def unflatten_select(qkv, b, s, H, D):
    qkv = qkv.unflatten(-1, (3, H, D))
    return [qkv.select(2, i) for i in range(3)]


def heads_outer_selector(qkv, b, s, H, D):
    """The selector inside the heads: (B, L, H, 3, D)."""
    qkv = qkv.view(b, s, H, 3, D)
    return [qkv[:, :, :, i] for i in range(3)]


def head_axis_slices(qkv, b, s, H, D):
    """q, k, v as slices of a (B, L, 3H, D) head axis."""
    qkv = qkv.view(b, s, 3 * H, D)
    return [qkv[:, :, i * H:(i + 1) * H] for i in range(3)]


def permute_chunk_squeeze(qkv, b, s, H, D):
    """chunk on the leading selector axis: each piece (1, B, H, L, D)."""
    parts = qkv.reshape(b, s, 3, H, D).permute(2, 0, 3, 1, 4).chunk(3, dim=0)
    return [p.squeeze(0).transpose(1, 2) for p in parts]


def feature_slices_then_view(qkv, b, s, H, D):
    """Slices of the fused feature axis, each viewed as heads."""
    n = H * D
    return [qkv[..., i * n:(i + 1) * n].reshape(b, s, H, D) for i in range(3)]


def _forward(split):
    def forward(self, x, rope_cos, rope_sin, kv_cache):
        b, s, _ = x.shape
        A, M = self.action_register_length, self.max_attention_size
        q, k, v = split(self.qkv(x), b, s, self.num_heads, self.head_dim)
        roped_q = apply_rope_3d(q[:, :-A], rope_cos, rope_sin)
        roped_k = apply_rope_3d(k[:, :-A], rope_cos, rope_sin)
        new_k = torch.cat([kv_cache[0], roped_k], dim=1)[:, -M:]
        new_v = torch.cat([kv_cache[1], v[:, :-A]], dim=1)[:, -M:]
        q = torch.cat([roped_q, q[:, -A:]], dim=1)
        k = torch.cat([new_k, k[:, -A:]], dim=1)
        v = torch.cat([new_v, v[:, -A:]], dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o(out.transpose(1, 2).flatten(2)), torch.stack([new_k, new_v])

    return forward


@pytest.mark.parametrize("split", [vit_permute_index, unflatten_select, heads_outer_selector, head_axis_slices,
                                   permute_chunk_squeeze, feature_slices_then_view])
def test_fused_qkv_spelling_pages_like_unbind(monkeypatch, split):
    dense, paged, backend = _run_dreamzero(monkeypatch, _forward(split), {"inner_compiler": "aot_eager"},
                                           num_chunks=3)
    assert (dense["video"] - paged["video"]).abs().max().item() <= ATOL
    assert (dense["actions"] - paged["actions"]).abs().max().item() <= ATOL
    assert backend.frames == 1
    reports = backend.results[0].reports  # one frame serves every layer: its self- and cross-attention
    assert [(r.status, r.pattern if r.status == "rewritten" else None) for r in reports] == [
        ("rewritten", "window"), ("dense", None)]


def rope_after_concatenation(self, x, rope_cos, rope_sin, kv_cache):
    """LongCat-Video-Avatar's order: the cache holds keys before RoPE, RoPE runs over cat([k_cache, k])."""
    b, s, _ = x.shape
    A, M = self.action_register_length, self.max_attention_size
    q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, self.head_dim).unbind(2)
    cached = kv_cache.shape[2]
    cos = torch.cat([rope_cos.new_ones(cached, rope_cos.shape[1]), rope_cos])
    sin = torch.cat([rope_sin.new_zeros(cached, rope_sin.shape[1]), rope_sin])
    k_full = torch.cat([kv_cache[0], k[:, :-A]], dim=1)
    roped_k = apply_rope_3d(k_full, cos, sin)[:, -M:]
    new_v = torch.cat([kv_cache[1], v[:, :-A]], dim=1)[:, -M:]
    q = torch.cat([apply_rope_3d(q[:, :-A], rope_cos, rope_sin), q[:, -A:]], dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), torch.cat([roped_k, k[:, -A:]], 1).transpose(1, 2),
                                         torch.cat([new_v, v[:, -A:]], 1).transpose(1, 2))
    return self.o(out.transpose(1, 2).flatten(2)), torch.stack([k_full[:, -M:], new_v])


def test_rope_after_the_cache_concatenation_is_refused_with_the_fix(monkeypatch):
    """The paged op keeps the keys it attends with; keys roped after the concatenation are not those: refused,
    naming the concatenation and the fix (RoPE on the new keys before it)."""
    with raises_paged(PassError, r"computed from the concatenation \w+ of cached and new tokens .*Fix: apply "
                                 r"the computation \(RoPE"):
        _run_dreamzero(monkeypatch, rope_after_concatenation, {"inner_compiler": "aot_eager", "strict": True},
                       num_chunks=2)
