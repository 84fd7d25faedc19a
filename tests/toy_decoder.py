"""A third model family in one file: a plain causal decoder with a growing KV cache, paged through the passes.

Everything a family needs is here and nowhere else: the dense model and its loop (prefill a prompt, then decode
one token at a time, each forward's K/V kept), the idiom its attention is written in (`cat` the cache with the
new keys, attend with a causal mask, return the grown cache), and the `Family` that admits, plans and finishes
its sequences. `tests/test_families.py` registers it and checks the compiled paged model against the dense one.

The dense model grows its caches by concatenation (up to a capacity), as decoders without a static cache do; in
paged mode it gets a full-capacity stand-in instead, and the mask it is handed has the stand-in's columns (what is
filled so far, then the new tokens), so the graph keeps one shape per (rows, tokens) for every fill level.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from paged_kv_compile.config import Bucket
from paged_kv_compile.errors import RequestError
from paged_kv_compile.families.base import BlockSource, Family, ForwardPlan, Owner, ceil_div
from paged_kv_compile.layout import RowLayout
from paged_kv_compile.models.hooks import DenseHooks, Forward
from paged_kv_compile.passes.idioms import Idiom, Match, mask_problem

NAME = "toy_decoder"


# ---- the dense model ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecoderConfig:
    num_layers: int = 2
    dim: int = 32
    num_heads: int = 2
    head_dim: int = 16
    capacity: int = 16  # the most tokens a sequence holds (prompt + decoded)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        inner = cfg.num_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.dim, 3 * inner, bias=False)
        self.out = nn.Linear(inner, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, mask: torch.Tensor):
        """x (B, T, dim); cache (2, B, L, H, D): K and V so far; mask (B, 1, T, L + T) boolean.
        Returns the layer's output and the grown cache (2, B, L + T, H, D), of at most `capacity` tokens."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).unflatten(-1, (3, self.cfg.num_heads, self.cfg.head_dim)).unbind(2)
        keys = torch.cat([cache[0], k], dim=1)
        values = torch.cat([cache[1], v], dim=1)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask)
        return x + self.out(att.transpose(1, 2).flatten(2)), torch.stack([keys, values])[:, :, -self.cfg.capacity:]


class ToyDecoder(nn.Module):
    def __init__(self, cfg: DecoderConfig = DecoderConfig(), seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.head = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def dense_caches(self, batch: int, **geometry: Any) -> list[torch.Tensor]:
        cfg = self.cfg
        return [torch.zeros(2, batch, 0, cfg.num_heads, cfg.head_dim)] * cfg.num_layers

    def forward(self, x: torch.Tensor, caches: list, mask: torch.Tensor):
        new = []
        for layer, cache in zip(self.layers, caches):
            x, grown = layer(x, cache, mask)
            new.append(grown)
        return x, new


def causal_mask(batch: int, filled: int, columns: int, tokens: int) -> torch.Tensor:
    """(B, 1, T, columns + T): a query at position filled + i sees the `filled` cached columns and new tokens <= i;
    cache columns at or past `filled` (a stand-in's unfilled capacity) are never seen."""
    cached = (torch.arange(columns) < filled).expand(tokens, columns)
    new = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    return torch.cat([cached, new], dim=1).expand(batch, 1, tokens, columns + tokens)


def decoder_steps(model: ToyDecoder, *, prompts: torch.Tensor, num_new: int, hooks: DenseHooks | None = None):
    """Prefill `prompts` (B, P, dim), then decode `num_new` tokens, each the head of the last output; returns
    (B, num_new, dim)."""
    hooks = hooks if hooks is not None else DenseHooks()
    caches = hooks.caches(model, prompts.shape[0], capacity=model.cfg.capacity)
    x, filled, outs = prompts, 0, []
    for i in range(num_new + 1):
        B, T = x.shape[0], x.shape[1]
        mask = causal_mask(B, filled, caches[0].shape[2], T)
        kind = "prefill" if i == 0 else "decode"
        out, grown = yield Forward(kind, i, lambda x=x, mask=mask: model(x, caches, mask), {})
        caches, filled = grown, filled + T
        x = model.head(out[:, -1:])
        if i:
            outs.append(x)
    return torch.cat(outs, dim=1)


# ---- the idiom ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AppendExpect:
    """A compiled site of the causal-append idiom: it reads `capacity` cache columns before its new keys."""

    capacity: int
    idiom: str = field(default="causal-append", init=False)

    @property
    def context(self) -> int:
        return self.capacity


def match_causal_append(site) -> Match | str:
    """``keys = cat([cache[0], k])`` over a (2, B, C, H, D) cache, every cache column in order then the new keys,
    attended with a mask that is a graph input (the causal structure is the runtime's layout)."""
    if site.args["is_causal"] or site.args["attn_mask"] is None:
        return "the causal-append idiom attends with an explicit mask"
    why = mask_problem(site.args["attn_mask"])
    if why:
        return why
    if site.writes.read_back or site.writes.positioned or site.writes.stores:
        return "it writes into its cache in place (the causal-append idiom returns a grown cache instead)"
    if site.cache.ndim != 5 or site.cache.key_half != 0 or site.cache.value_half != 1:
        return "keys and values must come from cache[0] and cache[1] of a (2, B, C, H, D) cache"
    if site.keys.history != list(range(site.cache.length)) or len(site.keys.new_sizes) != 1:
        return "it must read every cache column in order, then one new key tensor"
    return Match("causal-append", AppendExpect(site.cache.length))


CAUSAL_APPEND = Idiom("causal-append", match_causal_append)


# ---- the family ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeSpec:
    prompt_len: int
    max_new: int
    capacity: int
    rows: int = 1


@dataclass(frozen=True)
class DecodeRecord:
    """What a sequence keeps beyond its blocks (`Owner.state`): how many tokens it holds."""

    filled: int


class ToyDecoderFamily(Family):
    """Causal decoding: the prefill writes the prompt, each decode step appends one token; all kept."""

    name = NAME
    noun = "sequence"
    spec_type = DecodeSpec
    evict_lru = False
    idioms = (CAUSAL_APPEND,)
    kinds = ("prefill", "decode")

    def rows(self, spec: DecodeSpec, requested: int | None) -> int:
        if requested not in (None, spec.rows):
            raise RequestError(f"{requested} rows requested but the spec has {spec.rows}")
        return spec.rows

    def admission_blocks(self, spec: DecodeSpec, rows: int, blocks: BlockSource) -> list[int]:
        if spec.prompt_len + spec.max_new > spec.capacity:
            raise RequestError(f"prompt {spec.prompt_len} + {spec.max_new} new tokens exceed capacity {spec.capacity}")
        return [ceil_div(spec.prompt_len + spec.max_new, blocks.block_size)] * rows  # the whole sequence, up front

    def new_state(self, spec: DecodeSpec, rows: int) -> DecodeRecord:
        return DecodeRecord(0)

    def plan(self, owner: Owner, blocks: BlockSource, kind: str, **args: Any) -> ForwardPlan:
        spec: DecodeSpec = owner.spec
        filled = owner.state.filled
        if kind not in self.kinds or (kind == "prefill") != (filled == 0):
            raise RequestError(f"sequence {owner.owner_id!r} holds {filled} tokens: its next forward is "
                               f"{'prefill' if filled == 0 else 'decode'}, not {kind!r}")
        count = spec.prompt_len if kind == "prefill" else 1
        if filled + count > spec.prompt_len + spec.max_new:
            raise RequestError(f"sequence {owner.owner_id!r} has decoded its {spec.max_new} tokens")
        positions = np.arange(filled, filled + count, dtype=np.int32)
        layouts = [RowLayout.build(row, [], positions, positions + 1, filled + count) for row in owner.rows]
        return ForwardPlan(owner.owner_id, kind, layouts, count, spec.capacity, keeps_kv=True,
                           state=DecodeRecord(filled + count))

    def finish(self, owner: Owner, plan: ForwardPlan, blocks: BlockSource) -> None:
        owner.state = plan.state
        owner.version += 1

    def check_expectation(self, expect: AppendExpect, owner: Owner, plan: ForwardPlan) -> None:
        if expect.capacity != owner.spec.capacity:
            raise RequestError(f"the compiled site reads {expect.capacity} cache columns but sequence "
                               f"{owner.owner_id!r} has capacity {owner.spec.capacity}")

    # ---- the model side ----
    def owns_model(self, model: nn.Module) -> bool:
        return isinstance(model, ToyDecoder)

    def blocks(self, model: ToyDecoder) -> nn.ModuleList:
        return model.layers

    def spec_for(self, model: ToyDecoder, *, prompts: torch.Tensor, num_new: int, **loop: Any) -> DecodeSpec:
        return DecodeSpec(prompts.shape[1], num_new, model.cfg.capacity, rows=prompts.shape[0])

    def steps(self, model: ToyDecoder, hooks: Any, **loop: Any):
        return decoder_steps(model, hooks=hooks, **loop)

    def default_buckets(self, model_cfg: DecoderConfig) -> None:
        return None  # one bucket per prompt length: configure them

    def example_inputs(self, model: ToyDecoder, runtime, bucket: Bucket) -> tuple[tuple, dict]:
        cache = self.standin_caches(runtime, model, bucket.rows)[0]
        x = torch.zeros(bucket.rows, bucket.tokens, model.cfg.dim)
        return (x, cache, causal_mask(bucket.rows, 0, bucket.context, bucket.tokens)), {}

    def standin_caches(self, runtime, model: ToyDecoder, batch: int, **geometry: Any) -> list:
        cfg = model.cfg
        return [runtime.standin(2, batch, cfg.capacity, cfg.num_heads, cfg.head_dim)] * cfg.num_layers


TOY_DECODER = ToyDecoderFamily()
