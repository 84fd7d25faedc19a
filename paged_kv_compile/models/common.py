"""Pieces shared by both reference models: RMSNorm, RoPE helpers, seeded init.

Kept free of model specifics so that the FX passes see the same small ops in both families.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (computed in fp32, cast back), as Wan and HF Llama-style models do."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.weight


def rope_angles(positions: torch.Tensor, dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Rotation angles (..., dim // 2) for integer positions (...) over a rotary dim of `dim`.

    Computed in fp64 (like Wan's `rope_params`) so that tables are identical whatever the offset.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return positions.to(torch.float64)[..., None] * inv_freq


def apply_rope_3d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved (complex-pair) RoPE, Wan style.

    x: (B, L, H, D); cos/sin: (L, D // 2), pair i = (x[..., 2i], x[..., 2i+1]). Computed in the
    table's dtype and cast back to x's dtype.
    """
    b, s, h, d = x.shape
    pairs = x.to(cos.dtype).reshape(b, s, h, d // 2, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    c, sn = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack([re * c - im * sn, re * sn + im * c], dim=-1)
    return out.flatten(3).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation: (x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope_2d(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox RoPE on q/k (b, s, H, D) with per-row tables cos/sin (b, s, D), broadcast over heads."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Wan's 1-D sinusoidal embedding of (B,) floats -> (B, dim) as [cos | sin], in fp32."""
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64) / half)
    arg = t.to(torch.float64)[:, None] * freqs.to(t.device)
    return torch.cat([torch.cos(arg), torch.sin(arg)], dim=1).float()


def seeded_init_(
    module: nn.Module,
    seed: int,
    *,
    residual_names: Iterable[str] = (),
    residual_scale: float = 1.0,
    overrides: Mapping[str, float] | None = None,
) -> nn.Module:
    """Overwrite every parameter from a private `torch.Generator` (the global RNG is untouched).

    Weights and free tensors (tokens, modulation) ~ N(0, 1/sqrt(last dim)), which keeps activations
    at unit scale, so that attention over the KV cache visibly moves the outputs (a reference that
    ignores its cache would make paged-vs-dense checks blind). Biases 0; norm weights 1. Names
    containing one of `residual_names` (projections writing into the residual stream) get their std
    times `residual_scale`; `overrides` maps a name substring to an explicit std. Deterministic given
    the seed and the module structure (parameters visited in name order).
    """
    gen = torch.Generator().manual_seed(seed)
    residual_names, overrides = tuple(residual_names), dict(overrides or {})
    norm_params = {
        id(p)
        for m in module.modules()
        if isinstance(m, (RMSNorm, nn.LayerNorm))
        for p in m.parameters(recurse=False)
    }
    with torch.no_grad():
        for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            if id(p) in norm_params:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                std = next((s for key, s in overrides.items() if key in name), None)
                if std is None:
                    std = p.shape[-1] ** -0.5
                    if any(r in name for r in residual_names):
                        std *= residual_scale
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
    return module


def residual_scale(num_layers: int) -> float:
    """GPT-2 style down-scaling of residual writes: 1 / sqrt(2 * num_layers)."""
    return 1.0 / math.sqrt(2 * num_layers)


def build_quietly(fn):
    """Run a module constructor without advancing the global RNG (default inits use it)."""
    with torch.random.fork_rng(devices=[]):
        return fn()
