"""HunyuanImage-3.0: a decoder that is causal over text and bidirectional inside the image span.

A small, dense, paging-unaware reference. What matters for the FX passes is the KV idiom in
`HunyuanAttention.forward`: step 0 ("prefill") stores the prefix K/V into a preallocated per-layer
cache (zero-padded per row); steps >= 1 ("step") feed only the target span and attend over
`cat([cached, new])` after `repeat_kv`, with the mask sliced to the target rows.

Dense row layout (S = P + T tokens, P = prefix capacity >= every row's prompt length):

    [prompt (prefix_len_b) | pad up to P | timestep token | image tokens (h*w) | tail token]
     0 ...                  prefix_len_b  P                P+1 ... P+h*w        P+1+h*w

The target span [P, S) has T = 1 + h*w + 1 tokens and is rewritten every step; the bidirectional
(full-attention) span is the image tokens [P+1, P+1+h*w) for every row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .common import (
    RMSNorm,
    apply_rope_2d,
    build_quietly,
    residual_scale,
    seeded_init_,
    sinusoidal_embedding,
)
from .hooks import DenseHooks, Forward, Steps, drive

MODES = ("prefill", "step")


@dataclass(frozen=True)
class HunyuanImage3Config:
    """Geometry of a HunyuanImage-3 model (dense MLP in place of the released MoE)."""

    num_layers: int = 4
    hidden: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    vocab: int = 64
    latent_channels: int = 8
    image_h: int = 4
    image_w: int = 4
    qk_norm: bool = True
    rope_theta: float = 10000.0
    eps: float = 1e-6
    freq_dim: int = 32  # sinusoidal timestep features

    def __post_init__(self) -> None:
        positive = (
            "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "vocab",
            "latent_channels", "image_h", "image_w", "freq_dim",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"HunyuanImage3Config.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 4:
            raise ValueError(f"head_dim must be a multiple of 4 for 2-D RoPE (y and x halves), got {self.head_dim}")
        if self.freq_dim % 2:
            raise ValueError(f"freq_dim must be even, got {self.freq_dim}")

    @property
    def image_tokens(self) -> int:
        return self.image_h * self.image_w

    @property
    def target_len(self) -> int:
        """T: timestep token + image tokens + tail token (the span fed at steps >= 1)."""
        return 1 + self.image_tokens + 1

    @property
    def n_rep(self) -> int:
        return self.num_heads // self.num_kv_heads

    def seq_len(self, prefix_capacity: int) -> int:
        return prefix_capacity + self.target_len

    def kv_cache_bytes(self, batch: int, prefix_capacity: int, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of the dense prefix caches (K and V, all layers)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * batch * prefix_capacity * self.num_kv_heads * self.head_dim * itemsize


# Released HunyuanImage-3.0 attention geometry: 1024x1024 -> 64x64 latent tokens (VAE /16, 32
# channels); timestep + image = 4097 tokens, target_len 4098 with the tail token. The released MLP is
# a 64-expert MoE (expert width 3072); here a dense MLP of that width stands in.
#: Mid-size HunyuanImage-3 (benchmarks, the demo's timing): hidden 512, 8/2 heads x 64, image 16x16 (target 258).
HUNYUAN_IMAGE3_MID = HunyuanImage3Config(
    num_layers=4, hidden=512, num_heads=8, num_kv_heads=2, head_dim=64, intermediate=1536, vocab=1024,
    latent_channels=16, image_h=16, image_w=16,
)

HUNYUAN_IMAGE3 = HunyuanImage3Config(
    num_layers=32,
    hidden=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate=3072,
    vocab=133120,
    latent_channels=32,
    image_h=64,
    image_w=64,
    qk_norm=True,
    rope_theta=10000.0,
    eps=1e-5,
    freq_dim=256,
)


class HunyuanKVCache:
    """One layer's dense prefix cache: (b, P, Hkv, D) tensors, preallocated, written in place.

    A plain class (not a Module): dynamo traces `store`/`extend` inline inside the layer graph.
    """

    def __init__(self, cached_key: torch.Tensor, cached_value: torch.Tensor) -> None:
        self.cached_key = cached_key
        self.cached_value = cached_value

    @property
    def prefix_capacity(self) -> int:
        return self.cached_key.shape[1]

    def store(self, key: torch.Tensor, value: torch.Tensor, prefix_valid: torch.Tensor) -> None:
        """Step 0: keep key/value[:, :P] where the row's prompt is valid, zeros at its pads."""
        P = self.cached_key.shape[1]
        self.cached_key.copy_(torch.where(prefix_valid[:, :, None, None], key[:, :P], 0))
        self.cached_value.copy_(torch.where(prefix_valid[:, :, None, None], value[:, :P], 0))

    def extend(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps >= 1: the full K/V (b, P + T, Hkv, D) = cached prefix + the new target span."""
        return torch.cat([self.cached_key, key], dim=1), torch.cat([self.cached_value, value], dim=1)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """HF repeat_kv: (b, Hkv, s, D) -> (b, Hkv * n_rep, s, D)."""
    b, hkv, s, d = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None].expand(b, hkv, n_rep, s, d)
    return hidden_states.reshape(b, hkv * n_rep, s, d)


class HunyuanAttention(nn.Module):
    """GQA attention with fused QKV, optional qk RMSNorm, 2-D neox RoPE and the prefix-cache idiom."""

    def __init__(self, cfg: HunyuanImage3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.n_rep = cfg.n_rep
        self.qk_norm = cfg.qk_norm
        self.qkv_proj = nn.Linear(cfg.hidden, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden, bias=False)
        if cfg.qk_norm:
            self.query_layernorm = RMSNorm(cfg.head_dim, cfg.eps)
            self.key_layernorm = RMSNorm(cfg.head_dim, cfg.eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        attention_mask: torch.Tensor,
        past_key_value: HunyuanKVCache,
        prefix_valid: torch.Tensor,
        mode: str,
    ) -> torch.Tensor:
        b, s, _ = hidden_states.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.reshape(b, s, Hq, D), k.reshape(b, s, Hkv, D), v.reshape(b, s, Hkv, D)
        if self.qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k = apply_rope_2d(q, k, rope_cos, rope_sin)
        if mode == "prefill":  # step 0: whole sequence
            past_key_value.store(k, v, prefix_valid)
        else:  # steps >= 1: only the target span was fed
            k, v = past_key_value.extend(k, v)
        k = repeat_kv(k.transpose(1, 2), self.n_rep)
        v = repeat_kv(v.transpose(1, 2), self.n_rep)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=attention_mask, scale=D**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, Hq * D))


class HunyuanMLP(nn.Module):
    """SwiGLU MLP (the dense stand-in for the released MoE)."""

    def __init__(self, cfg: HunyuanImage3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HunyuanDecoderLayer(nn.Module):
    """Pre-norm decoder layer: RMSNorm, attention, residual, RMSNorm, MLP, residual."""

    def __init__(self, cfg: HunyuanImage3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.self_attn = HunyuanAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.mlp = HunyuanMLP(cfg)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        attention_mask: torch.Tensor,
        past_key_value: HunyuanKVCache,
        prefix_valid: torch.Tensor,
        mode: str,
    ) -> torch.Tensor:
        """hidden_states (b, s, hidden); rope (b, s, D); attention_mask bool (b, 1, s, kv_len);
        prefix_valid bool (b, P); mode "prefill" (s = kv_len = P + T) or "step" (s = T, kv_len = P + T)."""
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), rope_cos, rope_sin, attention_mask, past_key_value,
            prefix_valid, mode,
        )  # fmt: skip
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


# ---- request geometry (eager, outside the layers) ---------------------------------------------


def hunyuan_positions(prefix_lens: list[int], prefix_capacity: int, h: int, w: int) -> torch.Tensor:
    """(b, S, 2) int64 (y, x) RoPE positions per row.

    Text (prompt) token p -> (p, p); pads -> (0, 0); timestep token -> (n, n) with n = prefix_len_b;
    image token (y, x) -> (n + 1 + y, n + 1 + x); tail -> (n + 1 + max(h, w)) on both axes.
    Positions depend on the row's prompt length only, never on the capacity P.
    """
    P, hw = prefix_capacity, h * w
    pos = torch.zeros(len(prefix_lens), P + hw + 2, 2, dtype=torch.int64)
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    for row, n in enumerate(prefix_lens):
        pos[row, :n] = torch.arange(n)[:, None]
        pos[row, P] = n
        base = n + 1
        pos[row, P + 1 : P + 1 + hw, 0] = base + ys.flatten()
        pos[row, P + 1 : P + 1 + hw, 1] = base + xs.flatten()
        pos[row, P + 1 + hw] = base + max(h, w)
    return pos


def hunyuan_rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float = 10000.0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox cos/sin (b, S, head_dim) from (b, S, 2) positions: half the rotary frequencies follow y,
    half follow x (each axis its own frequency ladder over head_dim // 4 pairs)."""
    quarter = head_dim // 4
    inv_freq = 1.0 / theta ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    pos = positions.to(torch.float64)
    ang = torch.cat([pos[..., 0:1] * inv_freq, pos[..., 1:2] * inv_freq], dim=-1)  # (b, S, D/2)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def hunyuan_attention_mask(
    prefix_lens: list[int], prefix_capacity: int, h: int, w: int
) -> tuple[torch.Tensor, list[list[tuple[int, int]]]]:
    """Boolean mask (b, 1, S, S) and full_attn_spans per row (dense coordinates).

    Causal everywhere, bidirectional inside the image span; pad columns [prefix_len_b, P) hidden from
    every query; each pad query sees only itself so no softmax row is empty (no NaN).
    """
    P, hw = prefix_capacity, h * w
    S = P + hw + 2
    mask = torch.ones(S, S, dtype=torch.bool).tril().repeat(len(prefix_lens), 1, 1)
    mask[:, P + 1 : P + 1 + hw, P + 1 : P + 1 + hw] = True
    for row, n in enumerate(prefix_lens):
        mask[row, :, n:P] = False
        pads = torch.arange(n, P)
        mask[row, pads] = False
        mask[row, pads, pads] = True
    spans = [[(P + 1, P + 1 + hw)] for _ in prefix_lens]
    return mask[:, None], spans


@dataclass
class HunyuanRequest:
    """Everything about one request that is fixed across its denoising steps (built eagerly).

    The `step_*` tensors are the target-row views ([:, P:]) made contiguous, for steps >= 1.
    """

    prefix_lens: list[int]
    prefix_capacity: int
    prefix_embeds: torch.Tensor  # (b, P, hidden), zeros at pads
    prefix_valid: torch.Tensor  # (b, P) bool
    rope_cos: torch.Tensor  # (b, S, D)
    rope_sin: torch.Tensor
    attention_mask: torch.Tensor  # (b, 1, S, S) bool
    full_attn_spans: list[list[tuple[int, int]]]
    step_rope_cos: torch.Tensor  # (b, T, D)
    step_rope_sin: torch.Tensor
    step_attention_mask: torch.Tensor  # (b, 1, T, S)

    @property
    def batch(self) -> int:
        return len(self.prefix_lens)


class HunyuanImage3Model(nn.Module):
    """Dense HunyuanImage-3: embeddings, `layers` (one HunyuanDecoderLayer each), final norm, head."""

    def __init__(self, cfg: HunyuanImage3Config | None = None, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg = cfg or HunyuanImage3Config()

        def build() -> None:
            self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
            self.timestep_embedder = nn.Sequential(
                nn.Linear(cfg.freq_dim, cfg.hidden), nn.SiLU(), nn.Linear(cfg.hidden, cfg.hidden)
            )
            self.patch_embed = nn.Linear(cfg.latent_channels, cfg.hidden)
            self.tail_token = nn.Parameter(torch.zeros(cfg.hidden))
            self.layers = nn.ModuleList(HunyuanDecoderLayer(cfg) for _ in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.hidden, cfg.eps)
            self.head = nn.Linear(cfg.hidden, cfg.latent_channels)

        build_quietly(build)
        seeded_init_(
            self,
            seed,
            residual_names=("o_proj", "down_proj"),
            residual_scale=residual_scale(cfg.num_layers),
            overrides={"embed_tokens": 1.0, "tail_token": 1.0},
        )

    # ---- eager-side helpers ------------------------------------------------------------------
    def dense_caches(self, batch: int, prefix_capacity: int) -> list[HunyuanKVCache]:
        """Per layer a preallocated prefix cache of zeros (batch, prefix_capacity, Hkv, D)."""
        cfg, p = self.cfg, next(self.parameters())
        shape = (batch, prefix_capacity, cfg.num_kv_heads, cfg.head_dim)
        return [
            HunyuanKVCache(
                torch.zeros(shape, dtype=p.dtype, device=p.device),
                torch.zeros(shape, dtype=p.dtype, device=p.device),
            )
            for _ in range(cfg.num_layers)
        ]

    def build_request(self, prompts: list[torch.Tensor], prefix_capacity: int | None = None) -> HunyuanRequest:
        """Embeddings of the prefix, RoPE tables, mask and validity for 1 or 2 rows (CFG)."""
        cfg = self.cfg
        if not 1 <= len(prompts) <= 2:
            raise ValueError(f"a request has 1 or 2 rows (cond[, uncond]), got {len(prompts)}")
        for p in prompts:
            if p.dim() != 1 or p.dtype not in (torch.int64, torch.int32):
                raise ValueError("each prompt must be a 1-D LongTensor of token ids")
            if p.numel() and (int(p.min()) < 0 or int(p.max()) >= cfg.vocab):
                raise ValueError(f"prompt token ids must lie in [0, {cfg.vocab})")
        lens = [int(p.numel()) for p in prompts]
        P = max(lens) if prefix_capacity is None else prefix_capacity
        if P < max(lens):
            raise ValueError(f"prefix_capacity {P} is smaller than the longest prompt ({max(lens)} tokens)")
        param = next(self.parameters())
        dtype, device = param.dtype, param.device
        ids = torch.zeros(len(prompts), P, dtype=torch.int64)
        for row, p in enumerate(prompts):
            ids[row, : lens[row]] = p
        prefix_valid = (torch.arange(P)[None] < torch.tensor(lens)[:, None]).to(device)
        prefix_embeds = self.embed_tokens(ids.to(device)) * prefix_valid[..., None].to(dtype)
        pos = hunyuan_positions(lens, P, cfg.image_h, cfg.image_w)
        cos, sin = hunyuan_rope_tables(pos, cfg.head_dim, cfg.rope_theta, dtype)
        mask, spans = hunyuan_attention_mask(lens, P, cfg.image_h, cfg.image_w)
        cos, sin, mask = cos.to(device), sin.to(device), mask.to(device)
        return HunyuanRequest(
            prefix_lens=lens,
            prefix_capacity=P,
            prefix_embeds=prefix_embeds,
            prefix_valid=prefix_valid,
            rope_cos=cos,
            rope_sin=sin,
            attention_mask=mask,
            full_attn_spans=spans,
            step_rope_cos=cos[:, P:].contiguous(),
            step_rope_sin=sin[:, P:].contiguous(),
            step_attention_mask=mask[:, :, P:].contiguous(),
        )

    def embed_target(self, latents: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        """Target span embeddings (b, T, hidden): [timestep token | patch_embed(latents) | tail].

        latents (b, h*w, latent_channels); timestep (b,) in [0, 1000].
        """
        b = latents.shape[0]
        t_tok = self.timestep_embedder(sinusoidal_embedding(timestep, self.cfg.freq_dim).to(latents.dtype))
        tail = self.tail_token.expand(b, 1, -1)
        return torch.cat([t_tok[:, None], self.patch_embed(latents), tail], dim=1)

    def velocity(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Head read at the image tokens of the target span: (b, T, hidden) -> (b, h*w, C)."""
        return self.head(target_hidden[:, 1 : 1 + self.cfg.image_tokens])

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        attention_mask: torch.Tensor,
        caches: list[HunyuanKVCache],
        prefix_valid: torch.Tensor,
        mode: str,
    ) -> torch.Tensor:
        """Run all layers; returns the final-normed hidden states (b, s, hidden).

        "prefill": inputs (b, P + T), full tables/mask, caches are written.
        "step": inputs (b, T), tables [:, P:], mask [:, :, P:], caches are read.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if len(caches) != self.cfg.num_layers:
            raise ValueError(f"need one cache per layer ({self.cfg.num_layers}), got {len(caches)}")
        h = inputs_embeds
        for layer, cache in zip(self.layers, caches):
            h = layer(h, rope_cos, rope_sin, attention_mask, cache, prefix_valid, mode)
        return self.norm(h)


def hunyuan_steps(
    model: HunyuanImage3Model,
    prompts: list[torch.Tensor],
    *,
    prefix_capacity: int | None = None,
    num_steps: int = 4,
    guidance_scale: float = 4.0,
    seed: int = 0,
    hooks: DenseHooks | None = None,
    suffix_from: int = 0,
) -> Steps:
    """`hunyuan_generate` as a step generator: yields a `Forward` per model forward (see `models/hooks.py`).

    suffix_from=C > 0: the first forward feeds only dense tokens [C, S) and reads [0, C) from a cache of capacity C,
    as a step does (the idiom the passes page as a prefix step): for paged hooks whose runtime already holds those
    tokens' K/V (a prompt prefix from the prefix cache, imported pages: `Owner.prefix_ready`). A dense cache holds
    nothing there: the dense loop computes the whole sequence (C = 0)."""
    cfg = model.cfg
    hooks = hooks if hooks is not None else DenseHooks()
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    req = model.build_request(prompts, prefix_capacity)
    b, P = req.batch, req.prefix_capacity
    p = next(model.parameters())
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(cfg.image_tokens, cfg.latent_channels, generator=gen).to(device=p.device, dtype=p.dtype)
    sigmas = torch.linspace(1.0, 0.0, num_steps + 1).tolist()
    if not 0 <= suffix_from < P + cfg.target_len:
        raise ValueError(f"suffix_from must lie in [0, {P + cfg.target_len}), got {suffix_from}")
    if suffix_from and type(hooks).caches is DenseHooks.caches:
        raise ValueError(f"suffix_from={suffix_from} reads tokens [0, {suffix_from}) from a cache that already holds "
                         "them (a paged runtime's cached or imported prefix); a dense cache holds nothing there: run "
                         "the dense loop with suffix_from=0")
    first_caches = hooks.caches(model, b, prefix_capacity=suffix_from) if suffix_from else None
    caches = hooks.caches(model, b, prefix_capacity=P)
    info = dict(prefix_lens=list(req.prefix_lens), prefix_capacity=P, target_len=cfg.target_len)
    for i in range(num_steps):
        t = torch.full((b,), sigmas[i] * 1000.0, device=p.device)
        target = model.embed_target(x.expand(b, -1, -1), t)
        if i == 0 and suffix_from:
            C = suffix_from
            hidden = yield Forward("prefill", i, lambda: model(
                torch.cat([req.prefix_embeds, target], dim=1)[:, C:].contiguous(), req.rope_cos[:, C:].contiguous(),
                req.rope_sin[:, C:].contiguous(), req.attention_mask[:, :, C:].contiguous(), first_caches,
                req.prefix_valid, "step",
            ), dict(attention_mask=req.attention_mask, suffix_from=C, **info))  # fmt: skip
            hidden = hidden[:, P - C:]
        elif i == 0:
            hidden = yield Forward("prefill", i, lambda: model(
                torch.cat([req.prefix_embeds, target], dim=1), req.rope_cos, req.rope_sin,
                req.attention_mask, caches, req.prefix_valid, "prefill",
            ), dict(attention_mask=req.attention_mask, **info))  # fmt: skip
            hidden = hidden[:, P:]
        else:
            hidden = yield Forward("step", i, lambda: model(
                target, req.step_rope_cos, req.step_rope_sin, req.step_attention_mask, caches,
                req.prefix_valid, "step",
            ), dict(step=i, attention_mask=req.step_attention_mask, **info))  # fmt: skip
        v = model.velocity(hidden)
        v = v[1] + guidance_scale * (v[0] - v[1]) if b == 2 else v[0]
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


@torch.no_grad()
def hunyuan_generate(
    model: HunyuanImage3Model,
    prompts: list[torch.Tensor],
    *,
    prefix_capacity: int | None = None,
    num_steps: int = 4,
    guidance_scale: float = 4.0,
    seed: int = 0,
    hooks: DenseHooks | None = None,
) -> torch.Tensor:
    """Generate one image's latents (h*w, latent_channels) for a request of 1 or 2 rows.

    prompts: [cond] or [cond, uncond] 1-D token ids (lengths may differ); prefix_capacity P (default:
    longest prompt) is the padded prefix length of the dense layout. Step 0 runs `"prefill"` over the
    whole (b, P + T) sequence inside `hooks.forward("prefill", ...)`; steps 1..num_steps-1 run
    `"step"` over the target span (b, T) only, inside `hooks.forward("step", step=i, ...)`. Each
    step: velocity at the image tokens, CFG combine v = v_u + g (v_c - v_u) with 2 rows, Euler
    update x += (t_next - t) v (t from 1 to 0) starting from seeded noise. `drive(hunyuan_steps(...))`.
    """
    hooks = hooks if hooks is not None else DenseHooks()
    return drive(hunyuan_steps(model, prompts, prefix_capacity=prefix_capacity, num_steps=num_steps,
                               guidance_scale=guidance_scale, seed=seed, hooks=hooks), hooks)
