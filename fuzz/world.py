"""The differential fuzzer's oracle: dense eager twins of paged owners, on the unmodified reference models.

A twin is what the dense model computes when it is driven through the same operations as a paged owner: its own
dense caches (per CFG row), a fork clones them, a reset empties them, a refused, aborted or faulted forward leaves
them as they were. Nothing here imports the runtime, the scheduler or the mask reader (`layout.py`): the twin must
not share the code it judges. It uses only the dense reference models (`paged_kv_compile.models`) and torch.

FP8 twins follow the pool's documented rule (`pool.py`, `ops/fp8.py`): a stored value is its FP8 rounding of
x / scale, read back as q * scale; scales are static per (layer, kv head); a row's K/V are rounded with the scales of
its first table block, which is a managed block of the layer (history, a new commit, a prompt prefix) or else a
scratch block (per kv head the largest scale over layers); and K/V keep the scales in force when they were written.
So a twin rounds history when it is written (a commit, a prefill, a shared region at admission) and the new tokens
of a forward inside its attention (`Fp8Attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from paged_kv_compile.models.dreamzero import DreamZeroModel
from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Model, HunyuanKVCache, hunyuan_rope_tables

# ---- FP8 ----------------------------------------------------------------------------------------------------


def fp8_round_trip(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as an FP8 pool stores and returns it: (x / scale) saturated and rounded to `dtype`, times scale (fp32)."""
    fmax = torch.finfo(dtype).max
    q = (x.to(torch.float32) / scale).clamp(-fmax, fmax).to(dtype)
    return (q.to(torch.float32) * scale).to(x.dtype)


@dataclass
class Fp8Scales:
    """The scales in force: K and V, (layers, kv heads) each, as `KVPool.set_scales` takes them."""

    dtype: torch.dtype
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def ones(cls, dtype: torch.dtype, layers: int, kv_heads: int) -> "Fp8Scales":
        return cls(dtype, torch.ones(layers, kv_heads), torch.ones(layers, kv_heads))

    def of_row(self, layer: int, managed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) scales per kv head of a row whose first table block is the layer's (managed) or scratch."""
        if managed:
            return self.k[layer], self.v[layer]
        return self.k.amax(0), self.v.amax(0)


def round_kv(kv: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype,
             head_dim: int = -2) -> torch.Tensor:
    """Round K (kv[0]) and V (kv[1]) of a `(2, ..., H, D)` tensor with per-head scales."""
    shape = [1] * (kv.dim() - 1)
    shape[head_dim] = -1
    return torch.stack([fp8_round_trip(kv[i], s.view(shape), dtype) for i, s in enumerate(scales)])


class Fp8Attention(TorchFunctionMode):
    """Inside the dense model's self-attention of layer `layer`, SDPA reads the last `new` key columns rounded with
    each row's scales, as the op writes a forward's new tokens into the FP8 pool and attends over what it wrote
    (the earlier columns are history, rounded when they were written). Which layer runs is known from forward
    hooks on the self-attention modules; other SDPA calls (DreamZero's cross-attention) pass through."""

    def __init__(self, attention_modules, kv_heads: int) -> None:
        super().__init__()
        self.kv_heads = kv_heads
        self.layer: int | None = None
        self.rows: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer: (k, v) scales (rows, Hkv)
        self.new = 0
        self.dtype: torch.dtype | None = None
        for i, module in enumerate(attention_modules):
            module.register_forward_pre_hook(lambda _m, _a, i=i: setattr(self, "layer", i))
            module.register_forward_hook(lambda _m, _a, _o: setattr(self, "layer", None))

    def run(self, dtype: torch.dtype, per_layer_row_scales, new: int):
        """Configure the next model call: `per_layer_row_scales[l]` = (k (rows, Hkv), v (rows, Hkv))."""
        self.dtype, self.rows, self.new = dtype, per_layer_row_scales, new
        return self

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.layer is not None and self.rows is not None:
            q, k, v = args[:3]
            B, H, L, D = k.shape
            rep = H // self.kv_heads
            out = []
            for t, s in zip((k, v), self.rows[self.layer]):
                scale = s.repeat_interleave(rep, dim=1)[:, :, None, None]  # (B, H, 1, 1)
                t = t.clone()
                t[:, :, L - self.new:] = fp8_round_trip(t[:, :, L - self.new:], scale, self.dtype)
                out.append(t)
            args = (q, *out, *args[3:])
        return func(*args, **kwargs)


# ---- DreamZero ----------------------------------------------------------------------------------------------


@dataclass
class DreamZeroRow:
    """One CFG row of a dense DreamZero session."""

    caches: list[torch.Tensor]  # per layer (2, 1, Lc, H, D): its history as attention reads it (never mutated)
    cross: list[torch.Tensor]  # per layer (2, 1, Lt, H, D): its cross-attention K/V, dense
    region: list[torch.Tensor] | None  # the same as its shared region holds them (FP8: rounded at admission)

    def fork(self) -> "DreamZeroRow":
        return DreamZeroRow(list(self.caches), self.cross, self.region)


@dataclass
class DreamZeroTwin:
    rows: list[DreamZeroRow]
    incarnation: int  # the fuzzer's name of this owner (an admission or a fork): unique for the run

    def fork(self, incarnation: int) -> "DreamZeroTwin":
        return DreamZeroTwin([r.fork() for r in self.rows], incarnation)

    def reset(self, model: DreamZeroModel) -> None:
        empty = model.dense_caches(1)
        for row in self.rows:
            row.caches = list(empty)


class DreamZeroOracle:
    """The dense DreamZero model, eager, driven one row at a time for the twins."""

    def __init__(self, model: DreamZeroModel, fp8: torch.dtype | None = None) -> None:
        self.model = model
        self.cfg = model.cfg
        self.fp8 = fp8
        self.attention = (Fp8Attention([b.self_attn for b in model.blocks], model.cfg.num_heads)
                          if fp8 is not None else None)

    def new_twin(self, cross_rows: list[list[torch.Tensor]], regions: bool, scales: Fp8Scales | None,
                 incarnation: int) -> DreamZeroTwin:
        """cross_rows[r]: row r's dense cross K/V per layer (2, 1, Lt, H, D)."""
        rows = []
        for cross in cross_rows:
            region = None
            if regions:
                region = cross
                if self.fp8 is not None:  # written into the pool at admission, with the layer's scales then
                    region = [round_kv(kv, scales.of_row(layer, True), self.fp8) for layer, kv in enumerate(cross)]
            rows.append(DreamZeroRow(self.model.dense_caches(1), cross, region))
        return DreamZeroTwin(rows, incarnation)

    @torch.no_grad()
    def forward_row(self, row: DreamZeroRow, x, a, t, start_frame: int, commit: bool, regions: bool,
                    scales: Fp8Scales | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One row's forward (batch 1); a commit makes the chunk history. Returns (video, action)."""
        cfg = self.cfg
        cross = row.region if regions else row.cross
        if self.fp8 is None:
            video, action, caches = self.model(x, a, t, start_frame, row.caches, cross, update_kv_cache=commit)
        else:
            # the row's first table block is managed when it commits (new blocks) or sees history
            managed = commit or row.caches[0].shape[2] > 0
            per_layer = [tuple(s[None] for s in scales.of_row(layer, managed)) for layer in range(cfg.num_layers)]
            with self.attention.run(self.fp8, per_layer, x.shape[1] + a.shape[1]):
                video, action, caches = self.model(x, a, t, start_frame, row.caches, cross, update_kv_cache=commit)
            if commit:  # the chunk's K/V as the pool stores them: rounded now, with the scales in force now
                n = x.shape[1]
                caches = [torch.cat([c[:, :, :-n], round_kv(c[:, :, -n:], scales.of_row(layer, True), self.fp8)], 2)
                          for layer, c in enumerate(caches)]
        if commit:
            row.caches = list(caches)
        return video, action


# ---- HunyuanImage-3 -----------------------------------------------------------------------------------------

STYLES = ("middle", "left", "right")


@dataclass
class DenseRequest:
    """One request's dense inputs for a padding style (what a pipeline builds; the mask is boolean here)."""

    style: str
    capacity: int
    starts: list[int]  # dense index of each row's target span in the prefill
    embeds: torch.Tensor  # (b, S, hidden)
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor  # (b, 1, S, S) bool
    real: torch.Tensor  # (b, S) bool: dense tokens whose output is compared (not padding that only sees itself)
    prefix_valid: torch.Tensor  # (b, capacity): which cached columns hold the row's prompt
    step_cos: torch.Tensor
    step_sin: torch.Tensor
    step_mask: torch.Tensor  # (b, 1, T, capacity + T) bool


def dense_request(model: HunyuanImage3Model, prompts: list[torch.Tensor], capacity: int, style: str,
                  target: torch.Tensor) -> DenseRequest:
    """The prefill of `prompts` padded to `capacity` tokens, S = capacity + T dense tokens per row:

    middle: [prompt | pad | target] (the reference model's layout); left: [pad | prompt | target] (HF); right:
    [prompt | target | pad] (vllm-omni's tokenizer, the prefill's <eoi> left out). Middle and left pads see only
    themselves and nobody sees them; right pads are causal tokens nobody reads. Causal everywhere else, the image
    tokens bidirectional. RoPE positions follow each row's own tokens (prompt 0..n-1, timestep n, image (n+1+y,
    n+1+x), tail n+1+max(h, w)), as `hunyuan_positions` places them."""
    cfg = model.cfg
    T, hw, P = cfg.target_len, cfg.image_tokens, capacity
    b, S = len(prompts), P + T
    embeds = torch.zeros(b, S, cfg.hidden)
    pos = torch.zeros(b, S, 2, dtype=torch.int64)
    mask = torch.zeros(b, S, S, dtype=torch.bool)
    real = torch.ones(b, S, dtype=torch.bool)
    prefix_valid = torch.zeros(b, P, dtype=torch.bool)
    ys, xs = torch.meshgrid(torch.arange(cfg.image_h), torch.arange(cfg.image_w), indexing="ij")
    starts = []
    with torch.no_grad():
        for r, p in enumerate(prompts):
            n = len(p)
            first = P - n if style == "left" else 0  # dense index of the first prompt token
            start = first + n if style != "middle" else P  # dense index of the timestep token
            starts.append(start)
            embeds[r, first:first + n] = model.embed_tokens(p)
            embeds[r, start:start + T] = target[r]
            pos[r, first:first + n] = torch.arange(n)[:, None]
            pos[r, start] = n
            pos[r, start + 1:start + 1 + hw, 0] = n + 1 + ys.flatten()
            pos[r, start + 1:start + 1 + hw, 1] = n + 1 + xs.flatten()
            pos[r, start + 1 + hw] = n + 1 + max(cfg.image_h, cfg.image_w)
            m = torch.ones(S, S, dtype=torch.bool).tril()
            m[start + 1:start + 1 + hw, start + 1:start + 1 + hw] = True
            if style in ("middle", "left"):
                pads = torch.arange(first + n, P) if style == "middle" else torch.arange(0, first)
                m[:, pads] = False
                m[pads] = False
                m[pads, pads] = True
                real[r, pads] = False
            mask[r] = m
            prefix_valid[r, first:first + n] = True
    cos, sin = hunyuan_rope_tables(pos, cfg.head_dim, cfg.rope_theta)
    idx = [torch.arange(s, s + T) for s in starts]
    step_cos = torch.stack([cos[r, i] for r, i in enumerate(idx)])
    step_sin = torch.stack([sin[r, i] for r, i in enumerate(idx)])
    step_mask = torch.stack([torch.cat([mask[r][i][:, :P] & prefix_valid[r], mask[r][i][:, i]], dim=1)
                             for r, i in enumerate(idx)])
    return DenseRequest(style, P, starts, embeds, cos, sin, mask[:, None], real, prefix_valid, step_cos, step_sin,
                        step_mask[:, None])


#: Mask encodings: (name, what a masked entry holds, what an attended entry holds, whether the runtime must accept
#: it). Additive masks are float32 (the model's dtype). "attend" is 0 (or -0.0); "masked" is any value at or below
#: -8192 (e.g. -inf, every finfo.min, -1e4, -1e9; bf16's lowest value stored in fp32); anything else is a bias the
#: paged op cannot express, and must be refused.
ENCODINGS = {
    "bool": (None, None, True),
    "-inf": (float("-inf"), 0.0, True),
    "finfo.min": (torch.finfo(torch.float32).min, 0.0, True),
    "-1e4": (-1e4, 0.0, True),
    "-1e9": (-1e9, 0.0, True),
    "bf16.min-in-fp32": (torch.finfo(torch.bfloat16).min, 0.0, True),
    "-0.0-attends": (float("-inf"), -0.0, True),
    "bias-5": (-5.0, 0.0, False),
    "bias-1e3": (-1e3, 0.0, False),
    "nan": (float("nan"), 0.0, False),
}
VALID_ENCODINGS = tuple(name for name, (_, _, ok) in ENCODINGS.items() if ok)


def encode_mask(allowed: torch.Tensor, encoding: str) -> torch.Tensor:
    """A boolean mask (True = attend) in `encoding`."""
    masked, attend, _ = ENCODINGS[encoding]
    if masked is None:
        return allowed.clone()
    return torch.where(allowed, torch.tensor(attend), torch.tensor(masked)).to(torch.float32)


def batch_masks(masks: list[torch.Tensor]) -> torch.Tensor:
    """One model mask for a batched forward: the requests' rows in order; mixed encodings become additive
    (bool True -> 0, False -> -inf), never cast (True would become 1.0)."""
    if len({m.dtype for m in masks}) > 1:
        masks = [torch.where(m, 0.0, float("-inf")) if m.dtype == torch.bool else m for m in masks]
    return torch.cat(masks)


@dataclass
class HunyuanTwin:
    prompts: list[torch.Tensor]
    capacity: int
    incarnation: int
    request: DenseRequest | None = None  # the last prefill's dense inputs (its steps use them)
    encoding: str = "bool"
    caches: list[HunyuanKVCache] | None = None  # (rows, capacity, Hkv, D) per layer after a prefill
    extra: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return len(self.prompts)


class HunyuanOracle:
    """The dense HunyuanImage-3 model, eager, per request."""

    def __init__(self, model: HunyuanImage3Model, fp8: torch.dtype | None = None) -> None:
        self.model = model
        self.cfg = model.cfg
        self.fp8 = fp8
        self.attention = (Fp8Attention([layer.self_attn for layer in model.layers], model.cfg.num_kv_heads)
                          if fp8 is not None else None)

    def _scales(self, rows: int, scales: Fp8Scales) -> list:
        # a request's first table block is always a managed prompt block (prompts have >= 1 token)
        return [tuple(s[None].expand(rows, -1) for s in scales.of_row(layer, True))
                for layer in range(self.cfg.num_layers)]

    @torch.no_grad()
    def prefill(self, twin: HunyuanTwin, request: DenseRequest, encoding: str,
                scales: Fp8Scales | None) -> torch.Tensor:
        """The dense prefill (fresh caches); returns (rows, S, hidden). The twin keeps the request for its steps."""
        model = self.model
        caches = model.dense_caches(twin.rows, twin.capacity)
        mask = encode_mask(request.mask, encoding)
        args = (request.embeds, request.cos, request.sin, mask, caches, request.prefix_valid, "prefill")
        if self.fp8 is None:
            out = model(*args)
        else:
            with self.attention.run(self.fp8, self._scales(twin.rows, scales), request.embeds.shape[1]):
                out = model(*args)
            for layer, cache in enumerate(caches):  # the prompt's K/V as the pool keeps them: rounded now
                k, v = scales.of_row(layer, True)
                cache.cached_key.copy_(fp8_round_trip(cache.cached_key, k[:, None], self.fp8))
                cache.cached_value.copy_(fp8_round_trip(cache.cached_value, v[:, None], self.fp8))
        twin.request, twin.encoding, twin.caches = request, encoding, caches
        return out

    @torch.no_grad()
    def step(self, twin: HunyuanTwin, target: torch.Tensor, encoding: str, scales: Fp8Scales | None) -> torch.Tensor:
        """A denoising step over the target span; returns (rows, T, hidden)."""
        req = twin.request
        mask = encode_mask(req.step_mask, encoding)
        args = (target, req.step_cos, req.step_sin, mask, twin.caches, req.prefix_valid, "step")
        if self.fp8 is None:
            return self.model(*args)
        with self.attention.run(self.fp8, self._scales(twin.rows, scales), target.shape[1]):
            return self.model(*args)
