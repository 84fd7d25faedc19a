"""A read-only conditioning prefix, computed once and reused by every denoising step (image edits, unified models,
robot policies).

The model computes the prefix K/V in a forward of its own (GLM-Image's WRITE pass over the condition image, another
tower, the first step) and keeps them by attribute assignment or a return value; no cache the passes can see is
written, so that forward runs dense as written. How a model hands its prefix over:

1. ``runtime.admit(request_id, ConditioningPrefixSpec(prefix_lens=(P,), max_new_tokens=T))``: one row per prefix
   the steps read (one for GLM-Image, whose conditional and unconditional forwards read the same prefix; one per
   CFG branch for a model whose branches keep their own); the prefix blocks are taken now.
2. Run the prefix forward as the model's code runs it (dense: compiled or eager), then hand what it kept, per
   layer ``(key, value)`` of shape (rows, L, Hkv, D), to ``standins = store_prefix(runtime, request_id, kv)``. The
   K/V is written ONCE into the request's prefix blocks (`pool.write_region`), and `store_prefix` returns the
   zero-stride (key, value) stand-ins of the dense shape the model keeps instead (assign them where it kept the
   tensors; the dense tensors can be dropped).
3. Every step: ``with runtime.forward(request_id, "step", new_tokens=T):`` around the model call. Its compiled
   attention is the conditioning-prefix idiom (``cat([prefix_k, k])``, no mask: `passes/idioms/conditioning.py`)
   or, with rows of different prefix lengths, the prefix-step idiom with the model's padding mask (then pass the
   same mask: ``runtime.forward(..., attention_mask=mask)``; it is checked against the layout before the forward).
   The step's own K/V go to scratch and are thrown away.
4. ``runtime.release(request_id)`` frees the prefix.

Where a row's prefix sits in the dense tensors (rows shorter than L are padded) is `pad_side`: "right" (tokens
[0, p), vllm-omni's default) or "left" (tokens [L - p, L), BAGEL's `left_pad_stack`), or, for padding inside the
prefix (pi0's empty camera slots before its prompt), `prefix_columns`: per row, which of the L dense columns hold
its prefix. A step's new tokens see the whole prefix and, by default, every new token; `new_visible` gives per new
token how many of the step's new tokens it sees instead (pi0's state token sees itself only, its action tokens all).
Both are checked against the model's mask at every step, as the padding is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..config import Bucket
from ..errors import ConfigError, RequestError
from ..layout import RowLayout, mask_disagreement, mask_rows
from ..passes.idioms import PREFIX_STEP, PrefixExpect
from ..passes.idioms.conditioning import CONDITIONING_PREFIX, ConditioningPrefixExpect
from .base import BlockSource, Family, ForwardPlan, ModelRuntime, Owner, ceil_div, reuse_layouts

NAME = "conditioning_prefix"
KINDS = ("step",)
PAD_SIDES = ("right", "left")


@dataclass(frozen=True)
class ConditioningPrefixSpec:
    """One request: per row the prefix length its steps read, the most new tokens a step computes, and where a
    shorter row's prefix sits in the dense (rows, L, H, D) tensors."""

    prefix_lens: tuple[int, ...]
    max_new_tokens: int
    pad_side: str = "right"
    #: per row, which dense prefix columns hold its prefix (padding inside the prefix); None: `pad_side` says
    prefix_columns: tuple[tuple[bool, ...], ...] | None = None
    #: per new token, how many of the step's new tokens (the first ones) it sees; None: all of them
    new_visible: tuple[int, ...] | None = None


@dataclass
class ConditioningPrefixRecord:
    """What a request keeps beyond its blocks (`Owner.state`): the dense prefix length L the model holds (its
    stand-ins' length), set by `store_prefix`; None until then and after a reset."""

    capacity: int | None = None


class ConditioningPrefixFamily(Family):
    """The `Family` of conditioning-prefix requests (see the module docstring and `families/base.py`)."""

    name = NAME
    noun = "request"
    spec_type = ConditioningPrefixSpec
    evict_lru = False
    idioms = (CONDITIONING_PREFIX, PREFIX_STEP)

    # ---- admission and forwards -------------------------------------------------------------
    def rows(self, spec: ConditioningPrefixSpec, requested: int | None) -> int:
        if requested is not None and requested != len(spec.prefix_lens):
            raise RequestError(f"{requested} rows requested but the spec has {len(spec.prefix_lens)} prefix lengths "
                               "(one per row)")
        return len(spec.prefix_lens)

    def admission_blocks(self, spec: ConditioningPrefixSpec, rows: int, blocks: BlockSource) -> list[int]:
        """The prefix of every row, taken now (written by `store_prefix`)."""
        if not spec.prefix_lens or any(p < 1 for p in spec.prefix_lens) or spec.max_new_tokens < 1:
            raise RequestError(f"prefix lengths and max_new_tokens must be >= 1 (got {spec.prefix_lens}, "
                               f"{spec.max_new_tokens})")
        if spec.pad_side not in PAD_SIDES:
            raise RequestError(f"pad_side={spec.pad_side!r}; use one of {PAD_SIDES}")
        if spec.prefix_columns is not None and (
                len(spec.prefix_columns) != len(spec.prefix_lens)
                or any(sum(map(bool, c)) != p for c, p in zip(spec.prefix_columns, spec.prefix_lens))
                or len({len(c) for c in spec.prefix_columns}) != 1):
            raise RequestError("prefix_columns must give every row the same number of dense columns, as many of them "
                               f"True as the row's prefix length {spec.prefix_lens}")
        if spec.new_visible is not None and (len(spec.new_visible) != spec.max_new_tokens or not all(
                1 <= v <= spec.max_new_tokens for v in spec.new_visible)):
            raise RequestError(f"new_visible must give each of the {spec.max_new_tokens} new tokens how many new "
                               f"tokens it sees (1..{spec.max_new_tokens}), got {spec.new_visible}")
        B = blocks.block_size
        for p in spec.prefix_lens:
            blocks.check_scratch(ceil_div(p + spec.max_new_tokens, B) - ceil_div(p, B))
        return [ceil_div(p, B) for p in spec.prefix_lens]

    def new_state(self, spec: ConditioningPrefixSpec, rows: int) -> ConditioningPrefixRecord:
        return ConditioningPrefixRecord()

    def plan(self, owner: Owner, blocks: BlockSource, kind: str, *, new_tokens: int | None = None,
             prefix_capacity: int | None = None, attention_mask: torch.Tensor | None = None,
             **args: Any) -> ForwardPlan:
        """A denoising step: `new_tokens` tokens after each row's prefix, every one seeing the whole prefix and
        every new token. `prefix_capacity` (default: the stored prefix's dense length) is the stand-in's length;
        `attention_mask`, the model's padding mask when it passes one, is checked against the layout."""
        spec: ConditioningPrefixSpec = owner.spec
        if kind not in KINDS:
            raise RequestError(f"unknown phase {kind!r} of a conditioning-prefix request; use 'step' (the prefix is "
                               "stored by families.conditioning_prefix.store_prefix, not by a forward)")
        if args:
            raise RequestError(f"unknown step arguments {sorted(args)}; a step takes new_tokens, prefix_capacity "
                               "and attention_mask")
        record: ConditioningPrefixRecord = owner.state
        if record.capacity is None:
            raise RequestError(f"request {owner.owner_id!r} has no stored prefix: run the model's prefix forward and "
                               "hand its K/V to families.conditioning_prefix.store_prefix first")
        T = spec.max_new_tokens if new_tokens is None else int(new_tokens)
        if not 1 <= T <= spec.max_new_tokens:
            raise RequestError(f"new_tokens={T}: a step of {owner.owner_id!r} computes 1..{spec.max_new_tokens} "
                               "tokens (the spec's max_new_tokens sized its scratch)")
        P = record.capacity if prefix_capacity is None else int(prefix_capacity)
        if P != record.capacity:
            raise RequestError(f"prefix_capacity={P} but the stored prefix's dense length is {record.capacity}: the "
                               "model's stand-ins have that length")
        if spec.new_visible is not None and T != spec.max_new_tokens:
            raise RequestError(f"new_tokens={T}: a request with new_visible computes all {spec.max_new_tokens} new "
                               "tokens at every step")
        seen = torch.tensor(spec.new_visible if spec.new_visible is not None else (T,) * T, dtype=torch.int32)

        def make() -> tuple[list[RowLayout], list[torch.Tensor]]:
            layouts, keys = [], []
            for r, (row, p) in enumerate(zip(owner.rows, spec.prefix_lens)):
                positions = torch.arange(p, p + T, dtype=torch.int32)
                scratch = blocks.scratch(r, len(row), (p + T - 1) // blocks.block_size)
                layouts.append(RowLayout.build(row, scratch, positions, p + seen, p + T, max_position=p + T - 1))
                columns = prefix_columns(p, P, spec.pad_side,
                                         None if spec.prefix_columns is None else spec.prefix_columns[r])
                keys.append(torch.cat([columns, positions.to(torch.int64)]))
            return layouts, keys

        layouts, keys = reuse_layouts(owner, ("step", owner.version, P, T, blocks.first_scratch_row), make)
        if attention_mask is not None:
            masks = mask_rows(attention_mask, len(layouts))
            for r, (row, k) in enumerate(zip(layouts, keys)):
                why = mask_disagreement(masks[r], row, k)
                if why:
                    raise RequestError(
                        f"row {r}: the step's mask disagrees with the request's layout ({why}): row {r} holds a "
                        f"{spec.prefix_lens[r]}-token prefix in {P} dense columns ({_where(spec)}), then {T} new "
                        f"tokens ({_seen(spec)}); fix the spec's prefix_lens/pad_side/prefix_columns/new_visible or "
                        "the mask")
        phase = {"mask_checked": attention_mask is not None}
        return ForwardPlan(owner.owner_id, kind, layouts, T, P, [], ("step", owner.serial, owner.version, P, T),
                           key_positions=keys, phase=phase)

    def finish(self, owner: Owner, plan: ForwardPlan, blocks: BlockSource) -> None:
        """Nothing moves: a step's K/V was transient, the prefix is read-only."""

    def history_dropped(self, owner: Owner) -> None:
        """A reset freed the prefix blocks: the request must store its prefix again before a step."""
        owner.state = self.new_state(owner.spec, owner.num_rows)

    def check_expectation(self, expect: ConditioningPrefixExpect | PrefixExpect, owner: Owner,
                          plan: ForwardPlan) -> None:
        """An unmasked site attends over all P dense prefix columns, so every row must hold exactly P prefix tokens;
        a masked (prefix-step) site is right only when its mask was checked against the layout."""
        spec: ConditioningPrefixSpec = owner.spec
        if isinstance(expect, ConditioningPrefixExpect):
            if spec.new_visible is not None and set(spec.new_visible) != {plan.tokens}:
                raise RequestError(
                    f"this compiled conditioning-prefix site lets every new token see every other (no mask), but "
                    f"{owner.owner_id!r}'s new tokens see {spec.new_visible} of them: pass the mask in the model")
            short = [(r, p) for r, p in enumerate(spec.prefix_lens) if p != expect.prefix_tokens]
            if short:
                raise RequestError(
                    f"this compiled conditioning-prefix site attends over all {expect.prefix_tokens} prefix columns "
                    f"with no mask, but rows {[r for r, _ in short]} of {owner.owner_id!r} hold "
                    f"{[p for _, p in short]} prefix tokens: the dense model would attend over their padding. Pass a "
                    "padding mask in the model (the prefix-step idiom), or give every row a prefix of that length")
        elif isinstance(expect, PrefixExpect):
            if expect.idiom != "prefix-step":
                raise RequestError(f"a {expect.idiom} site cannot run a conditioning-prefix request")
            if not plan.phase.get("mask_checked"):
                raise RequestError(
                    f"this compiled site attends over the prefix with a mask, which the paged op does not read: pass "
                    f"the same mask to runtime.forward({owner.owner_id!r}, 'step', attention_mask=mask) so that it is "
                    "checked against the layout before the forward")

    # ---- the model side: no reference model; a model's code is driven by its own loop ---------------------
    def owns_model(self, model: torch.nn.Module) -> bool:
        return False

    def blocks(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        raise ConfigError(f"{NAME} has no reference model: compile the model's own blocks")

    def spec_for(self, model: torch.nn.Module, **loop: Any) -> ConditioningPrefixSpec:
        raise ConfigError(f"{NAME} has no reference model: admit a ConditioningPrefixSpec for the model's prefix")

    def steps(self, model: torch.nn.Module, hooks: Any, **loop: Any):
        raise ConfigError(f"{NAME} has no reference model loop: drive the model's own pipeline (module docstring)")

    def default_buckets(self, model_cfg: Any) -> None:
        return None

    def example_inputs(self, model: torch.nn.Module, runtime: ModelRuntime, bucket: Bucket) -> tuple[tuple, dict]:
        raise ConfigError(f"{NAME} has no reference model: give CapturedBlocks example_inputs=fn(bucket)")

    def standin_caches(self, runtime: ModelRuntime, model: torch.nn.Module, batch: int, *, prefix_capacity: int,
                       **geometry: Any) -> list:
        """Per layer the (key, value) prefix stand-ins of shape (batch, prefix_capacity, Hkv, D)."""
        cfg = runtime.config
        standin = runtime.standin(batch, prefix_capacity, cfg.num_kv_heads, cfg.head_dim)
        return [(standin, standin) for _ in range(cfg.num_layers)]


def _where(spec: ConditioningPrefixSpec) -> str:
    return f"padded on the {spec.pad_side}" if spec.prefix_columns is None else "at its prefix_columns"


def _seen(spec: ConditioningPrefixSpec) -> str:
    return "all visible" if spec.new_visible is None else f"each seeing the first {list(spec.new_visible)} of them"


def prefix_columns(prefix_len: int, capacity: int, pad_side: str,
                   columns: Sequence[bool] | None = None) -> torch.Tensor:
    """The logical position each of the `capacity` dense prefix columns holds (-1: padding). `columns`: which hold
    the prefix, in order (padding inside the prefix); otherwise `pad_side` places it."""
    if columns is not None:
        held = torch.tensor([bool(c) for c in columns])
        if len(held) != capacity:
            raise RequestError(f"prefix_columns gives {len(held)} dense columns but the prefix stand-ins have "
                               f"{capacity}")
        return torch.where(held, held.cumsum(0) - 1, torch.full((capacity,), -1)).to(torch.int64)
    cols = torch.arange(capacity, dtype=torch.int64)
    pos = cols if pad_side == "right" else cols - (capacity - prefix_len)
    return torch.where((pos >= 0) & (pos < prefix_len), pos, torch.full_like(pos, -1))


def _prefix_problem(kv: Any, layers: int, rows: int, heads: int, head_dim: int) -> str:
    """Why `kv` is not per layer (key, value) of one shape (rows, L, heads, head_dim) ("" if it is)."""
    if not isinstance(kv, (list, tuple)) or len(kv) != layers:
        return f"it must give {layers} per-layer (key, value) pairs, got " + (
            f"{len(kv)}" if isinstance(kv, (list, tuple)) else type(kv).__name__)
    shapes = set()
    for pair in kv:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(
                isinstance(t, torch.Tensor) and t.dtype.is_floating_point for t in pair):
            return "each layer's entry must be a (key, value) pair of floating tensors (None: the prefix forward ran?)"
        shapes.update(tuple(t.shape) for t in pair)
    shape = next(iter(shapes))
    if len(shapes) != 1 or len(shape) != 4 or shape[0] != rows or shape[2:] != (heads, head_dim):
        return (f"every key and value must be (rows={rows}, L, {heads}, {head_dim}) (token-major, the pool's kv heads "
                f"and head dim), got shapes {sorted(shapes)}")
    return ""


def store_prefix(runtime: Any, owner_id: str, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the prefix K/V the model's own prefix forward kept (per layer (key, value), (rows, L, Hkv, D)) once in
    `owner_id`'s prefix blocks; returns the (key, value) stand-ins of shape (rows, L, Hkv, D) the model keeps instead.

    Host side, between forwards; write-once: a request stores its prefix once (again only after a reset). Refused
    before anything changes when the K/V does not fit the request's spec. On a `distributed.RankRuntime` it is a
    lifecycle call every rank of the group agrees on (each rank stores its own heads / its own branch's rows; the
    K/V are compared by shape): a refusal on any rank restores every rank.
    """
    lifecycle = getattr(runtime, "_lifecycle", None)  # a RankRuntime: apply, vote, restore if any rank refused
    if lifecycle is None:
        return _store_prefix(runtime, owner_id, kv)
    shapes = [tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in pair)
              if isinstance(pair, (list, tuple)) else type(pair).__name__ for pair in kv] \
        if isinstance(kv, (list, tuple)) else type(kv).__name__
    stored: list = []
    lifecycle("store_prefix", owner_id, shapes, lambda: stored.append(_store_prefix(runtime.runtime, owner_id, kv)))
    return stored[0]


def _store_prefix(runtime: Any, owner_id: str, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`store_prefix` on one `PagedKVRuntime`."""
    if runtime.active is not None:
        raise RequestError("store_prefix ran inside a forward: store the prefix between forwards")
    owner = runtime.owner(owner_id)
    if owner is None:
        raise RequestError(f"no live request {owner_id!r}: admit it with a ConditioningPrefixSpec first")
    if owner.family is not CONDITIONING_PREFIX_FAMILY:
        raise RequestError(f"{owner_id!r} is a {owner.family.name} {owner.family.noun}, not a {NAME} request")
    record: ConditioningPrefixRecord = owner.state
    if record.capacity is not None:
        raise RequestError(f"request {owner_id!r} already stored its prefix (write-once); release it and admit again")
    spec: ConditioningPrefixSpec = owner.spec
    cfg, pool = runtime.config, runtime.pool
    why = _prefix_problem(kv, cfg.num_layers, owner.num_rows, pool.num_kv_heads, pool.head_dim)
    if why:
        raise ConfigError(f"store_prefix({owner_id!r}): {why}")
    L = kv[0][0].shape[1]
    if spec.prefix_columns is not None and len(spec.prefix_columns[0]) != L:
        raise ConfigError(f"store_prefix({owner_id!r}): the K/V holds {L} tokens per row but the spec's "
                          f"prefix_columns name {len(spec.prefix_columns[0])}")
    if L < max(spec.prefix_lens):
        raise ConfigError(f"store_prefix({owner_id!r}): the K/V holds {L} tokens per row, fewer than the spec's "
                          f"prefix lengths {spec.prefix_lens}")
    if not any(owner.rows):  # a reset dropped the prefix blocks: take them again (admission reserved them)
        owner.rows = runtime.scheduler.allocate_rows([ceil_div(p, pool.block_size) for p in spec.prefix_lens])
    per_layer = torch.stack([torch.stack([k.detach(), v.detach()]) for k, v in kv])  # (layers, 2, rows, L, H, D)
    for r, p in enumerate(spec.prefix_lens):
        if spec.prefix_columns is not None:
            held = torch.tensor([bool(c) for c in spec.prefix_columns[r]]).nonzero()[:, 0]
            pool.write_region(owner.rows[r], pool.to_stored(per_layer[:, :, r].index_select(2, held)))
            continue
        start = 0 if spec.pad_side == "right" else L - p
        pool.write_region(owner.rows[r], pool.to_stored(per_layer[:, :, r, start:start + p]))
    owner.state = ConditioningPrefixRecord(capacity=L)
    owner.version += 1
    standin = runtime.standin(owner.num_rows, L, pool.num_kv_heads, pool.head_dim)
    return standin, standin


CONDITIONING_PREFIX_FAMILY = ConditioningPrefixFamily()
