"""HunyuanImage-3: image generation with a retained prompt prefix and a target span rewritten every step.

A request keeps its prompt prefix per CFG row in managed blocks (taken at admission, all rows or
none). The prefill forward writes the whole sequence; each later step writes only the target span,
at the same scratch slots every step. The dense model pads every prompt to a prefix capacity; the
paged layout of a row is ``[prompt | target]``: pad tokens are neither written nor read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..config import Bucket, PagedKVConfig
from ..errors import ConfigError, RequestError
from ..layout import RowLayout
from ..models.hunyuan_image3 import HunyuanImage3Model, HunyuanKVCache
from .base import BlockSource, ForwardPlan, Owner, ceil_div, pool_config

NAME = "hunyuan_image3"
KINDS = ("prefill", "step")


@dataclass(frozen=True)
class HunyuanSpec:
    """One HunyuanImage-3 request: a prompt prefix per CFG row, a target span rewritten every step.

    full_spans are (start, end) offsets inside the target span that attend bidirectionally (the
    image tokens); every other token is causal.
    """

    prefix_lens: tuple[int, ...]
    target_len: int
    full_spans: tuple[tuple[int, int], ...] = ()

    def target_visible_end(self) -> torch.Tensor:
        """Per target token, the end of its visible range relative to the target start."""
        ends = torch.arange(1, self.target_len + 1, dtype=torch.int64)
        for start, end in self.full_spans:
            ends[start:end] = end
        return ends


@dataclass(frozen=True)
class HunyuanExpect:
    """What a compiled prefix site assumes (read from the graph by `passes/hunyuan_image3.py`)."""

    prefix_capacity: int
    family: str = field(default=NAME, init=False)

    @property
    def context(self) -> int:
        return self.prefix_capacity


def hunyuan_buckets(model_cfg, prefix_capacities: Sequence[int], rows: Sequence[int] = (1, 2)) -> tuple[Bucket, ...]:
    """A prefill bucket (P + T tokens) and a step bucket (T tokens) per capacity and row count."""
    T = model_cfg.target_len
    return tuple(
        Bucket(r, t, p) for p in prefix_capacities for r in rows for t in (p + T, T)
    )


def hunyuan_runtime_config(model_cfg, *, max_prefix: int, block_size: int = 16, requests: int = 1, rows: int = 2,
                           **overrides) -> PagedKVConfig:
    """A pool for `requests` HunyuanImage-3 requests whose prompts are at most `max_prefix` tokens."""
    return pool_config(
        num_layers=model_cfg.num_layers, num_kv_heads=model_cfg.num_kv_heads, head_dim=model_cfg.head_dim,
        block_size=block_size, owners=requests, rows=rows, tokens_per_row=max_prefix,
        scratch_tokens_per_row=model_cfg.target_len, overrides=overrides,
    )


def hunyuan_spec(model_cfg, prompts: list[torch.Tensor]) -> HunyuanSpec:
    """The request layout of `prompts` (1 or 2 CFG rows): image tokens attend bidirectionally."""
    image = model_cfg.image_tokens
    return HunyuanSpec(tuple(int(p.numel()) for p in prompts), model_cfg.target_len, ((1, 1 + image),))


def prefix_capacity_for(buckets: Sequence[Bucket], prefix_lens: Sequence[int], target_len: int) -> int:
    """The padded prefix capacity a request should use: the smallest configured one that fits."""
    longest = max(prefix_lens)
    if not buckets:
        return longest
    fits = sorted(
        b.context for b in buckets
        if b.rows == len(prefix_lens) and b.tokens == target_len and b.context >= longest
    )
    if not fits:
        raise RequestError(
            f"no configured step bucket with rows={len(prefix_lens)}, tokens={target_len} and context >= "
            f"{longest}; add one (and its prefill bucket) to the config"
        )
    return fits[0]


class HunyuanImage3Family:
    """The `Family` of HunyuanImage-3 requests (see `families/base.py`)."""

    name = NAME
    noun = "request"
    spec_type = HunyuanSpec
    evict_lru = False

    # ---- admission and forwards -------------------------------------------------------------
    def rows(self, spec: HunyuanSpec, requested: int | None) -> int:
        if requested is not None and requested != len(spec.prefix_lens):
            raise RequestError(
                f"{requested} rows requested but the spec has {len(spec.prefix_lens)} prefix lengths (one per row)"
            )
        return len(spec.prefix_lens)

    def admission_blocks(self, spec: HunyuanSpec, rows: int, blocks: BlockSource) -> list[int]:
        """The prompt prefix of every row, taken now."""
        if spec.target_len < 1 or any(p < 1 for p in spec.prefix_lens):
            raise RequestError(f"prefix lengths and target_len must be >= 1 (got {spec.prefix_lens}, {spec.target_len})")
        for start, end in spec.full_spans:
            if not 0 <= start < end <= spec.target_len:
                raise RequestError(f"full span ({start}, {end}) must lie inside the target span [0, {spec.target_len})")
        B = blocks.block_size
        for p in spec.prefix_lens:
            blocks.check_scratch(ceil_div(p + spec.target_len, B) - ceil_div(p, B))
        return [ceil_div(p, B) for p in spec.prefix_lens]

    def plan(self, owner: Owner, blocks: BlockSource, kind: str, *, prefix_capacity: int | None = None,
             **info: Any) -> ForwardPlan:
        """A prefill (the whole padded sequence) or a denoising step (the target span only).

        The dense layout of a row is ``[prompt | pad up to prefix_capacity | target]``; the paged
        layout is ``[prompt | target]``.
        """
        spec: HunyuanSpec = owner.spec
        if kind not in KINDS:
            raise RequestError(f"unknown phase {kind!r}; use 'prefill' or 'step'")
        if kind == "step" and "prefill" not in owner.phases_done:
            raise RequestError(f"request {owner.owner_id!r} has not been prefilled; run its prefill forward first")
        if prefix_capacity is None:
            raise RequestError("a HunyuanImage-3 forward needs prefix_capacity (the dense prefix length)")
        if prefix_capacity < max(spec.prefix_lens):
            raise RequestError(
                f"prefix_capacity={prefix_capacity} is below the longest prompt ({max(spec.prefix_lens)} tokens); "
                "pad prompts to a capacity at least that long"
            )
        B, T = blocks.block_size, spec.target_len
        rel_ends = spec.target_visible_end()
        layouts = []
        for r, (row, p) in enumerate(zip(owner.rows, spec.prefix_lens)):
            target_pos = torch.arange(p, p + T, dtype=torch.int64)
            target_end = p + rel_ends
            if kind == "prefill":
                pad = prefix_capacity - p
                positions = torch.cat([torch.arange(p), torch.full((pad,), -1), target_pos])
                ends = torch.cat([torch.arange(1, p + 1), torch.zeros(pad, dtype=torch.int64), target_end])
            else:
                positions, ends = target_pos, target_end
            scratch = blocks.scratch(r, len(row), (p + T - 1) // B)
            layouts.append(RowLayout.build(row, scratch, positions, ends, p + T))
        tokens = prefix_capacity + T if kind == "prefill" else T
        key = (owner.owner_id, kind, owner.version, prefix_capacity)
        return ForwardPlan(owner.owner_id, kind, layouts, tokens, prefix_capacity, [], key,
                           keeps_kv=kind == "prefill")

    def finish(self, owner: Owner, plan: ForwardPlan, blocks: BlockSource) -> None:
        """Nothing moves: the prefix was written in place (the scheduler records the prefill as done)."""

    def check_expectation(self, expect: HunyuanExpect, owner: Owner, plan: ForwardPlan) -> None:
        """The prefix capacity is the bucket's context, which the runtime already checks per call."""

    # ---- the model side -----------------------------------------------------------------------
    def owns_model(self, model: torch.nn.Module) -> bool:
        return isinstance(model, HunyuanImage3Model)

    def blocks(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        return model.layers

    def spec_for(self, model: torch.nn.Module, *, prompts: list[torch.Tensor], **request: Any) -> HunyuanSpec:
        return hunyuan_spec(model.cfg, prompts)

    def default_buckets(self, model_cfg) -> None:
        return None  # the prefix capacities are the deployment's choice: configure them

    def example_inputs(self, model: torch.nn.Module, runtime, bucket: Bucket) -> tuple[tuple, dict]:
        return hunyuan_layer_inputs(model, runtime, bucket)

    def standin_caches(self, runtime, model: torch.nn.Module, batch: int, *, prefix_capacity: int,
                       **geometry: Any) -> list:
        """Per layer a `HunyuanKVCache` over one writable stand-in (the model stores its prefix in place)."""
        cfg = model.cfg
        standin = runtime.standin(batch, prefix_capacity, cfg.num_kv_heads, cfg.head_dim, writable=True)
        return [HunyuanKVCache(standin, standin) for _ in range(cfg.num_layers)]


def hunyuan_layer_inputs(model, runtime, bucket: Bucket) -> tuple[tuple, dict]:
    """Arguments of one `HunyuanDecoderLayer` call of `bucket` (prefill or step, from the token count)."""
    cfg, p = model.cfg, next(model.parameters())
    R, T, P = bucket.rows, bucket.tokens, bucket.context
    target = cfg.target_len
    if P < 1 or T not in (P + target, target):
        raise ConfigError(
            f"bucket {bucket} is not a HunyuanImage-3 forward: tokens must be prefix capacity + {target} "
            f"(prefill) or {target} (step), with a capacity >= 1; use hunyuan_buckets(model.cfg, capacities)"
        )
    req = model.build_request([torch.zeros(P, dtype=torch.int64)] * R, P)
    cache = HUNYUAN_IMAGE3.standin_caches(runtime, model, R, prefix_capacity=P)[0]  # what the driver hands over
    hidden = torch.zeros(R, T, cfg.hidden, dtype=p.dtype, device=p.device)
    if T == P + target:
        return (hidden, req.rope_cos, req.rope_sin, req.attention_mask, cache, req.prefix_valid, "prefill"), {}
    return (hidden, req.step_rope_cos, req.step_rope_sin, req.step_attention_mask, cache, req.prefix_valid, "step"), {}


HUNYUAN_IMAGE3 = HunyuanImage3Family()
