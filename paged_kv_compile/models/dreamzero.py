"""DreamZero: an autoregressive-diffusion video(+action) world model on Wan-2.1 causal blocks.

A small, dense, paging-unaware reference. What matters for the FX passes is the self-attention KV
idiom in `CausalWanSelfAttention.forward` (cache concat, window slice, action registers appended,
non-causal SDPA, stacked cache returned): it is written exactly as the published model writes it.

Token layout of one forward (per CFG row): `[video tokens of the chunk (L) | action/state registers (A)]`
with L = frames * frame_seqlen. Only video K/V is ever cached; the cache of one layer is one tensor
(2, B, Lc, H, D) that grows by `chunk_tokens` per commit until it holds `max_attention_size` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .common import (
    RMSNorm,
    apply_rope_3d,
    build_quietly,
    residual_scale,
    rope_angles,
    seeded_init_,
    sinusoidal_embedding,
)
from .hooks import DenseHooks, Forward, Steps, drive

UNBOUNDED_WINDOW_FRAMES = 21  # Wan causal models attend over 21 frames when local_attn_size == -1


def _grid_hw(frame_seqlen: int) -> tuple[int, int]:
    """The most square h x w factorisation of frame_seqlen (h <= w)."""
    h = max(d for d in range(1, int(math.isqrt(frame_seqlen)) + 1) if frame_seqlen % d == 0)
    return h, frame_seqlen // h


@dataclass(frozen=True)
class DreamZeroConfig:
    """Geometry of a DreamZero model. Frames are latent frames; tokens are per CFG row."""

    num_layers: int = 4
    dim: int = 64
    num_heads: int = 4
    head_dim: int = 16
    ffn_dim: int = 128
    frame_seqlen: int = 16  # video tokens per latent frame
    frame_hw: tuple[int, int] | None = None  # RoPE grid of one frame; default: most square h*w
    num_frame_per_block: int = 2  # frames per chunk
    local_attn_size: int = 6  # window in frames; -1 = unbounded (21 frames)
    sink_size: int = 0  # frames kept resident at the window start
    window_reset_frames: int = 16  # current_start_frame reaching this resets the window
    action_register_length: int = 5  # action + state register tokens at the end of every forward
    text_len: int = 8
    text_dim: int = 32
    image_len: int = 0  # image tokens (i2v) in the cross-attention K/V
    image_dim: int = 32
    in_channels: int = 8  # video latent channels per token (patchified)
    action_dim: int = 8
    freq_dim: int = 32  # sinusoidal timestep features
    num_inference_steps: int = 3
    rope_theta: float = 10000.0
    eps: float = 1e-6

    def __post_init__(self) -> None:
        positive = (
            "num_layers", "dim", "num_heads", "head_dim", "ffn_dim", "frame_seqlen",
            "num_frame_per_block", "window_reset_frames", "action_register_length", "text_len",
            "text_dim", "image_dim", "in_channels", "action_dim", "freq_dim", "num_inference_steps",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"DreamZeroConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.image_len < 0:
            raise ValueError(f"DreamZeroConfig.image_len must be >= 0, got {self.image_len}")
        if self.dim != self.num_heads * self.head_dim:
            raise ValueError(
                f"dim ({self.dim}) must equal num_heads * head_dim ({self.num_heads} * {self.head_dim})"
            )
        if self.head_dim % 2 or self.head_dim < 6:
            raise ValueError(f"head_dim must be even and >= 6 for 3-D RoPE, got {self.head_dim}")
        if self.freq_dim % 2:
            raise ValueError(f"freq_dim must be even, got {self.freq_dim}")
        h, w = self.grid_hw
        if h * w != self.frame_seqlen:
            raise ValueError(f"frame_hw {self.frame_hw} must multiply to frame_seqlen {self.frame_seqlen}")
        if self.local_attn_size != -1 and self.local_attn_size < 1:
            raise ValueError(f"local_attn_size must be -1 (unbounded) or >= 1, got {self.local_attn_size}")
        if not 0 <= self.sink_size < self.window_frames:
            raise ValueError(
                f"sink_size ({self.sink_size}) must be in [0, window frames = {self.window_frames})"
            )
        if self.num_frame_per_block > self.window_frames - self.sink_size:
            raise ValueError(
                f"a chunk of {self.num_frame_per_block} frames does not fit the sliding part of the "
                f"window ({self.window_frames} - sink {self.sink_size} frames): its own K/V would be evicted"
            )
        if self.window_reset_frames % self.num_frame_per_block:
            raise ValueError(
                f"window_reset_frames ({self.window_reset_frames}) must be a multiple of "
                f"num_frame_per_block ({self.num_frame_per_block}) so the reset falls on a chunk boundary"
            )

    @property
    def grid_hw(self) -> tuple[int, int]:
        return tuple(self.frame_hw) if self.frame_hw is not None else _grid_hw(self.frame_seqlen)

    @property
    def window_frames(self) -> int:
        return UNBOUNDED_WINDOW_FRAMES if self.local_attn_size == -1 else self.local_attn_size

    @property
    def max_attention_size(self) -> int:
        """Video tokens kept in (and attended from) the self-attention cache."""
        return self.window_frames * self.frame_seqlen

    @property
    def sink_tokens(self) -> int:
        return self.sink_size * self.frame_seqlen

    @property
    def chunk_tokens(self) -> int:
        """Video tokens of one chunk (= cache growth per commit)."""
        return self.num_frame_per_block * self.frame_seqlen

    @property
    def tokens_per_forward(self) -> int:
        """Query tokens of one forward per row: the chunk plus the action/state registers."""
        return self.chunk_tokens + self.action_register_length

    @property
    def cross_len(self) -> int:
        """Cross-attention K/V tokens: [image tokens | text tokens]."""
        return self.image_len + self.text_len

    @property
    def chunks_per_window(self) -> int:
        """Chunks generated between two window resets."""
        return self.window_reset_frames // self.num_frame_per_block

    @property
    def rope_pairs(self) -> tuple[int, int, int]:
        """Rotary (complex) pairs given to the (frame, height, width) axes, Wan's split."""
        c = self.head_dim // 2
        return c - 2 * (c // 3), c // 3, c // 3

    def kv_cache_bytes(self, batch: int = 2, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of a full dense self-attention window over all layers (K and V)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_layer = 2 * batch * self.max_attention_size * self.num_heads * self.head_dim
        return self.num_layers * per_layer * itemsize


# Real DreamZero-14B (Wan-2.1 14B backbone). Window/chunk numbers are the configuration the
# families note describes (880 tokens per stitched frame, 32 action + 1 state registers).
#: Mid-size DreamZero (benchmarks, the demo's timing): dim 512 (8 heads x 64), 64 tokens per frame, chunk 2
#: frames, window 8 frames, 33 action/state registers as in the real model.
DREAMZERO_MID = DreamZeroConfig(
    num_layers=4, dim=512, num_heads=8, head_dim=64, ffn_dim=1536, frame_seqlen=64, num_frame_per_block=2,
    local_attn_size=8, window_reset_frames=16, action_register_length=33, text_len=32, text_dim=256,
    in_channels=16, action_dim=32, freq_dim=64,
)

DREAMZERO_14B = DreamZeroConfig(
    num_layers=40,
    dim=5120,
    num_heads=40,
    head_dim=128,
    ffn_dim=13824,
    frame_seqlen=880,
    num_frame_per_block=2,
    local_attn_size=-1,
    sink_size=0,
    window_reset_frames=20,
    action_register_length=33,
    text_len=512,
    text_dim=4096,
    image_len=257,
    image_dim=1280,
    in_channels=64,
    action_dim=32,
    freq_dim=256,
    num_inference_steps=16,
)


class CausalWanSelfAttention(nn.Module):
    """Windowed self-attention over [cached video K/V | chunk video K/V | action registers]."""

    def __init__(self, cfg: DreamZeroConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.action_register_length = cfg.action_register_length
        self.max_attention_size = cfg.max_attention_size  # same Python constant in every layer
        self.sink = cfg.sink_tokens
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.o = nn.Linear(cfg.dim, cfg.dim)
        self.norm_q = RMSNorm(cfg.head_dim, cfg.eps)
        self.norm_k = RMSNorm(cfg.head_dim, cfg.eps)
        # Sequence parallel (Ulysses, distributed/reference.py) makes these all-to-alls: this rank's tokens with
        # every head in, every token with `num_heads` (the rank's share of the heads) attended and cached, back out.
        self.tokens_to_heads: nn.Module = nn.Identity()
        self.heads_to_tokens: nn.Module = nn.Identity()

    def forward(
        self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        A, sink = self.action_register_length, self.sink
        qkv = self.qkv(x)
        q, k, v = qkv.view(b, s, 3, -1, self.head_dim).unbind(2)
        q, k = self.norm_q(q), self.norm_k(k)
        q, k, v = self.tokens_to_heads(q), self.tokens_to_heads(k), self.tokens_to_heads(v)
        q_video, q_action = q[:, :-A], q[:, -A:]
        k_video, k_action = k[:, :-A], k[:, -A:]
        v_video, v_action = v[:, :-A], v[:, -A:]
        roped_q = apply_rope_3d(q_video, rope_cos, rope_sin)
        roped_k = apply_rope_3d(k_video, rope_cos, rope_sin)
        if sink == 0:
            new_k = torch.cat([kv_cache[0], roped_k], dim=1)[:, -self.max_attention_size :]
            new_v = torch.cat([kv_cache[1], v_video], dim=1)[:, -self.max_attention_size :]
        else:  # the first `sink` tokens stay resident, the rest slides
            new_k = torch.cat(
                [
                    kv_cache[0][:, :sink],
                    torch.cat([kv_cache[0][:, sink:], roped_k], dim=1)[:, -(self.max_attention_size - sink) :],
                ],
                dim=1,
            )
            new_v = torch.cat(
                [
                    kv_cache[1][:, :sink],
                    torch.cat([kv_cache[1][:, sink:], v_video], dim=1)[:, -(self.max_attention_size - sink) :],
                ],
                dim=1,
            )
        q = torch.cat([roped_q, q_action], dim=1)
        k = torch.cat([new_k, k_action], dim=1)
        v = torch.cat([new_v, v_action], dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        out = self.o(self.heads_to_tokens(out).flatten(2))
        return out, torch.stack([new_k, new_v])


class WanCrossAttention(nn.Module):
    """Cross-attention to the session's write-once [image | text] K/V (no mask)."""

    def __init__(self, cfg: DreamZeroConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.o = nn.Linear(cfg.dim, cfg.dim)
        self.norm_q = RMSNorm(cfg.head_dim, cfg.eps)
        self.norm_k = RMSNorm(cfg.head_dim, cfg.eps)

    def kv(self, context: torch.Tensor) -> torch.Tensor:
        """(B, Lt, dim) embedded context -> (2, B, Lt, H, D); computed once per session."""
        b, n, _ = context.shape
        k = self.norm_k(self.k(context).view(b, n, self.num_heads, self.head_dim))
        v = self.v(context).view(b, n, self.num_heads, self.head_dim)
        return torch.stack([k, v])

    def forward(self, x: torch.Tensor, cross_kv: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.norm_q(self.q(x).view(b, s, self.num_heads, self.head_dim))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), cross_kv[0].transpose(1, 2), cross_kv[1].transpose(1, 2)
        ).transpose(1, 2)
        return self.o(out.flatten(2))


class CausalWanBlock(nn.Module):
    """Wan-2.1 causal block: modulated self-attn, cross-attn, modulated FFN, gated residuals."""

    def __init__(self, cfg: DreamZeroConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=False)
        self.self_attn = CausalWanSelfAttention(cfg)
        self.norm3 = nn.LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=True)
        self.cross_attn = WanCrossAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=False)
        self.ffn = nn.Sequential(
            nn.Linear(cfg.dim, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, cfg.dim)
        )
        self.modulation = nn.Parameter(torch.zeros(1, 6, cfg.dim))

    def forward(
        self,
        x: torch.Tensor,
        e: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        kv_cache: torch.Tensor,
        cross_kv: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, L+A, dim), e (B, 6, dim), rope (L, D/2), kv_cache (2, B, Lc, H, D),
        cross_kv (2, B, Lt, H, D) -> (x, new cache (2, B, min(Lc+L, max), H, D))."""
        e = (self.modulation + e).chunk(6, dim=1)  # each (B, 1, dim)
        y, new_cache = self.self_attn(self.norm1(x) * (1 + e[1]) + e[0], rope_cos, rope_sin, kv_cache)
        x = x + y * e[2]
        x = x + self.cross_attn(self.norm3(x), cross_kv)
        y = self.ffn(self.norm2(x) * (1 + e[4]) + e[3])
        x = x + y * e[5]
        return x, new_cache


class CausalHead(nn.Module):
    """Modulated LayerNorm, then separate read-outs for video tokens and action registers."""

    def __init__(self, cfg: DreamZeroConfig) -> None:
        super().__init__()
        self.action_register_length = cfg.action_register_length
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=False)
        self.modulation = nn.Parameter(torch.zeros(1, 2, cfg.dim))
        self.video = nn.Linear(cfg.dim, cfg.in_channels)
        self.action = nn.Linear(cfg.dim, cfg.action_dim)

    def forward(self, x: torch.Tensor, e0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shift, scale = (self.modulation + e0[:, None]).chunk(2, dim=1)
        x = self.norm(x) * (1 + scale) + shift
        A = self.action_register_length
        return self.video(x[:, :-A]), self.action(x[:, -A:])


class DreamZeroModel(nn.Module):
    """Dense DreamZero: embeddings, `blocks` (one CausalWanBlock per layer), head."""

    def __init__(self, cfg: DreamZeroConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg = cfg or DreamZeroConfig()

        def build() -> None:
            self.patch_embed = nn.Linear(cfg.in_channels, cfg.dim)
            self.action_embed = nn.Linear(cfg.action_dim, cfg.dim)
            self.text_embedding = nn.Sequential(
                nn.Linear(cfg.text_dim, cfg.dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.dim, cfg.dim)
            )
            self.image_embedding = (
                nn.Sequential(
                    nn.LayerNorm(cfg.image_dim), nn.Linear(cfg.image_dim, cfg.dim), nn.GELU(),
                    nn.Linear(cfg.dim, cfg.dim),
                )  # fmt: skip
                if cfg.image_len
                else None
            )
            self.time_embedding = nn.Sequential(
                nn.Linear(cfg.freq_dim, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim)
            )
            self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(cfg.dim, 6 * cfg.dim))
            self.blocks = nn.ModuleList(CausalWanBlock(cfg) for _ in range(cfg.num_layers))
            self.head = CausalHead(cfg)

        build_quietly(build)
        # Sequence parallel (distributed/reference.py) makes these this rank's share of the tokens before the
        # blocks and all of them after; identity on one rank.
        self.shard_tokens: nn.Module = nn.Identity()
        self.gather_tokens: nn.Module = nn.Identity()
        seeded_init_(
            self,
            seed,
            residual_names=("self_attn.o.", "cross_attn.o.", "ffn.2."),
            residual_scale=residual_scale(cfg.num_layers),
        )

    # ---- eager-side helpers (never inside a block) -------------------------------------------
    def dense_caches(self, batch: int) -> list[torch.Tensor]:
        """Per layer an empty cache (2, batch, 0, H, D): K at [0], V at [1]; it grows by concat. H: the heads the
        self-attention attends (all of them on one rank; a rank's share under tensor or sequence parallel)."""
        p = next(self.parameters())
        heads = [(block.self_attn.num_heads, block.self_attn.head_dim) for block in self.blocks]
        return [torch.zeros(2, batch, 0, h, d, dtype=p.dtype, device=p.device) for h, d in heads]

    def rope_tables(
        self, start_frame: int, num_frames: int, device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (num_frames * frame_seqlen, head_dim // 2) fp32 for frames starting at start_frame.

        Token order inside a chunk is (frame, y, x) row-major; the frame axis is offset by start_frame.
        """
        cfg = self.cfg
        h, w = cfg.grid_hw
        pf, ph, pw = cfg.rope_pairs
        af = rope_angles(torch.arange(start_frame, start_frame + num_frames), 2 * pf, cfg.rope_theta)
        ah = rope_angles(torch.arange(h), 2 * ph, cfg.rope_theta)
        aw = rope_angles(torch.arange(w), 2 * pw, cfg.rope_theta)
        ang = torch.cat(
            [
                af[:, None, None].expand(num_frames, h, w, pf),
                ah[None, :, None].expand(num_frames, h, w, ph),
                aw[None, None, :].expand(num_frames, h, w, pw),
            ],
            dim=-1,
        ).reshape(num_frames * h * w, -1)
        return ang.cos().float().to(device), ang.sin().float().to(device)

    def prepare_cross_kv(
        self, context: torch.Tensor, image_context: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Write-once cross-attention K/V per layer, (2, B, image_len + text_len, H, D).

        context: (B, text_len, text_dim) text-encoder features; image_context: (B, image_len,
        image_dim) image-encoder features, required iff cfg.image_len > 0.
        """
        cfg = self.cfg
        if context.dim() != 3 or tuple(context.shape[1:]) != (cfg.text_len, cfg.text_dim):
            raise ValueError(f"context must be (B, {cfg.text_len}, {cfg.text_dim}), got {tuple(context.shape)}")
        ctx = self.text_embedding(context)
        if cfg.image_len:
            if image_context is None or tuple(image_context.shape[1:]) != (cfg.image_len, cfg.image_dim):
                raise ValueError(
                    f"image_context (B, {cfg.image_len}, {cfg.image_dim}) is required when image_len > 0"
                )
            ctx = torch.cat([self.image_embedding(image_context), ctx], dim=1)
        elif image_context is not None:
            raise ValueError("image_context given but cfg.image_len == 0")
        return [block.cross_attn.kv(ctx) for block in self.blocks]

    def forward(
        self,
        latents: torch.Tensor,
        actions: torch.Tensor,
        timestep: torch.Tensor,
        start_frame: int,
        kv_caches: list[torch.Tensor],
        cross_kvs: list[torch.Tensor],
        update_kv_cache: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """One forward of a chunk: latents (B, L, in_channels), actions (B, A, action_dim),
        timestep (B,) in [0, 1000]. Returns (video (B, L, in_channels), actions (B, A, action_dim),
        kv caches): the blocks' new caches if update_kv_cache (commit) else `kv_caches` unchanged
        (denoise). The flag is consumed here, so commit and denoise share one block graph."""
        cfg = self.cfg
        b, n, _ = latents.shape
        if n % cfg.frame_seqlen or n == 0:
            raise ValueError(f"latents carry {n} tokens, not a positive multiple of frame_seqlen {cfg.frame_seqlen}")
        if actions.shape[1] != cfg.action_register_length:
            raise ValueError(f"actions must carry {cfg.action_register_length} register tokens, got {actions.shape[1]}")
        if len(kv_caches) != cfg.num_layers or len(cross_kvs) != cfg.num_layers:
            raise ValueError(f"need one kv cache and one cross K/V per layer ({cfg.num_layers})")
        rope_cos, rope_sin = self.rope_tables(start_frame, n // cfg.frame_seqlen, latents.device)
        x = torch.cat([self.patch_embed(latents), self.action_embed(actions)], dim=1)
        e0 = self.time_embedding(sinusoidal_embedding(timestep, cfg.freq_dim).to(x.dtype))
        e = self.time_projection(e0).unflatten(1, (6, cfg.dim))
        new_caches = []
        x = self.shard_tokens(x)
        for block, kv_cache, cross_kv in zip(self.blocks, kv_caches, cross_kvs):
            x, new_cache = block(x, e, rope_cos, rope_sin, kv_cache, cross_kv)
            new_caches.append(new_cache)
        video, action = self.head(self.gather_tokens(x), e0)
        return video, action, (new_caches if update_kv_cache else kv_caches)


def dreamzero_steps(
    model: DreamZeroModel,
    *,
    num_chunks: int,
    num_inference_steps: int | None = None,
    guidance_scale: float = 5.0,
    seed: int = 0,
    hooks: DenseHooks | None = None,
    context: torch.Tensor | None = None,
    image_context: torch.Tensor | None = None,
    out: dict | None = None,
) -> Steps:
    """The rollout as a step generator: yields a `Forward` per model forward (see `models/hooks.py`).

    Completed chunks are appended to `out["video"]` / `out["actions"]` as they finish (what a session
    stopped early produced); returns what `dreamzero_rollout` returns.
    """
    cfg = model.cfg
    hooks = hooks if hooks is not None else DenseHooks()
    steps = num_inference_steps if num_inference_steps is not None else cfg.num_inference_steps
    if num_chunks < 1 or steps < 1:
        raise ValueError(f"num_chunks and num_inference_steps must be >= 1, got {num_chunks}, {steps}")
    p = next(model.parameters())
    dtype, device = p.dtype, p.device
    gen = torch.Generator().manual_seed(seed)

    def noise(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

    # Session start: cross K/V (write-once) and empty self-attention caches.
    if context is None:
        context = noise(1, cfg.text_len, cfg.text_dim)
    context = torch.cat([context, torch.zeros_like(context)])  # cond row, uncond (empty) row
    if cfg.image_len and image_context is None:
        image_context = noise(1, cfg.image_len, cfg.image_dim)
    if image_context is not None:
        image_context = image_context.expand(2, -1, -1)  # both branches see the image
    cross_kvs = hooks.write_once_kv(model, model.prepare_cross_kv(context, image_context))
    caches = hooks.caches(model, 2)

    sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
    L, A = cfg.chunk_tokens, cfg.action_register_length
    current_start_frame, previous = 0, None
    out = out if out is not None else {}
    for key in ("video", "actions"):
        out.setdefault(key, [])
    start_frames, resets = [], []
    for chunk in range(num_chunks):
        if previous is not None:
            prev_start, prev_video, prev_action = previous
            _, _, caches = yield Forward(
                "commit", chunk,
                lambda: model(prev_video.expand(2, -1, -1), prev_action.expand(2, -1, -1),
                              torch.zeros(2, device=device), prev_start, caches, cross_kvs, update_kv_cache=True),
                dict(start_frame=prev_start, num_frames=cfg.num_frame_per_block),
            )  # fmt: skip
        x, a = noise(1, L, cfg.in_channels), noise(1, A, cfg.action_dim)
        for i in range(steps):
            t = torch.full((2,), sigmas[i] * 1000.0, device=device)
            v_x, v_a, _ = yield Forward(
                "denoise", chunk,
                lambda: model(x.expand(2, -1, -1), a.expand(2, -1, -1), t, current_start_frame, caches, cross_kvs,
                              update_kv_cache=False),
                dict(start_frame=current_start_frame, num_frames=cfg.num_frame_per_block, step=i),
            )  # fmt: skip
            v_x = v_x[1:] + guidance_scale * (v_x[:1] - v_x[1:])
            v_a = v_a[1:] + guidance_scale * (v_a[:1] - v_a[1:])
            x = x + (sigmas[i + 1] - sigmas[i]) * v_x
            a = a + (sigmas[i + 1] - sigmas[i]) * v_a
        out["video"].append(x[0])
        out["actions"].append(a[0])
        start_frames.append(current_start_frame)
        previous = (current_start_frame, x, a)
        current_start_frame += cfg.num_frame_per_block
        if current_start_frame >= cfg.window_reset_frames:
            hooks.reset_history()
            caches = hooks.caches(model, 2)
            current_start_frame, previous = 0, None
            resets.append(chunk)
    return {
        "video": torch.stack(out["video"]),
        "actions": torch.stack(out["actions"]),
        "start_frames": start_frames,
        "resets": resets,
    }


@torch.no_grad()
def dreamzero_rollout(
    model: DreamZeroModel,
    *,
    num_chunks: int,
    num_inference_steps: int | None = None,
    guidance_scale: float = 5.0,
    seed: int = 0,
    hooks: DenseHooks | None = None,
    context: torch.Tensor | None = None,
    image_context: torch.Tensor | None = None,
) -> dict:
    """Generate `num_chunks` chunks autoregressively; one call is one session (`drive(dreamzero_steps(...))`).

    Two CFG branches are batch rows (row 0: conditional text, row 1: empty text), each with its own
    cache row. Per chunk:
      1. if a previous clean chunk exists: commit forward over it at its own start frame, timestep 0,
         `update_kv_cache=True`, inside `hooks.forward("commit", start_frame=...)`; its K/V becomes
         history (the window slides once it is full);
      2. `num_inference_steps` denoising forwards of the current chunk at `current_start_frame`
         (`hooks.forward("denoise", start_frame=..., step=i)`, `update_kv_cache=False`), CFG
         combine v = v_u + g (v_c - v_u), Euler step x += (t_next - t) v from seeded noise;
      3. advance current_start_frame by num_frame_per_block; when it reaches window_reset_frames:
         `hooks.reset_history()`, fresh caches from `hooks.caches`, current_start_frame = 0,
         nothing to commit next.
    context (1, text_len, text_dim) / image_context (1, image_len, image_dim) default to seeded
    random features. Returns dict(video (num_chunks, chunk_tokens, in_channels), actions
    (num_chunks, A, action_dim), start_frames [int], resets [chunk index after which the window reset]).
    """
    hooks = hooks if hooks is not None else DenseHooks()
    return drive(dreamzero_steps(model, num_chunks=num_chunks, num_inference_steps=num_inference_steps,
                                 guidance_scale=guidance_scale, seed=seed, hooks=hooks, context=context,
                                 image_context=image_context), hooks)
