"""HunyuanImage-3: image generation with a retained prompt prefix and a target span rewritten every step.

A request keeps its prompt prefix per CFG row in managed blocks (taken at admission, all rows or
none). The prefill forward writes the whole sequence; each later step writes only the target span,
at the same scratch slots every step. Where the dense model pads its rows (our reference model in the
middle, vllm-omni's tokenizer on the right, HF on the left) is read from the model's own prefill mask
once per request (`layout.layout_from_prefill_mask`): the paged layout of a row is its kept tokens in
order, ``[prompt | target | tail]``; pad tokens are neither written nor read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..config import Bucket, PagedKVConfig
from ..errors import ConfigError, RequestError
from ..imported_pages import ImportRecord
from ..layout import MaskLayout, RowLayout, layout_from_prefill_mask, mask_disagreement, mask_rows
from ..models.hunyuan_image3 import (HUNYUAN_IMAGE3_MID, HunyuanImage3Config, HunyuanImage3Model, HunyuanKVCache,
                                     hunyuan_steps)
from ..passes.idioms import PREFILL_STORE, PREFIX_STEP, STATIC_CACHE, PrefixExpect
from .base import BlockSource, Family, ForwardPlan, ModelRuntime, Owner, ceil_div, pool_config, reuse_layouts
from .demo import Demo, DemoLane

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

    @classmethod
    def from_prefill_mask(cls, attention_mask: torch.Tensor, prefix_lens: Sequence[int],
                          target_len: int) -> "HunyuanSpec":
        """A spec whose full spans are read from the model's prefill mask (its first row's target tokens).

        Host side, once per request; the prefill then checks every row against it.
        """
        ml = layout_from_prefill_mask(mask_rows(attention_mask, len(prefix_lens))[0], 0)
        p = int(prefix_lens[0])
        if ml.kept < p + target_len:
            raise RequestError(f"row 0 of the mask keeps {ml.kept} tokens, fewer than prompt {p} + target {target_len}")
        rel = (ml.ends_by_position[p : p + target_len] - p).tolist()
        spans, i = [], 0
        while i < target_len:
            if rel[i] > i + 1:  # token i sees ahead: a bidirectional span [i, rel[i])
                spans.append((i, int(rel[i])))
                i = int(rel[i])
            else:
                i += 1
        return cls(tuple(int(x) for x in prefix_lens), target_len, tuple(spans))

    def padded_mask(self, prefix_capacity: int) -> torch.Tensor:
        """The (rows, 1, P + T, P + T) boolean prefill mask of the middle-padded layout this spec describes:
        ``[prompt | pad up to prefix_capacity | target]``, causal, full spans bidirectional, each pad seeing only
        itself (the reference model's layout; for callers that drive the runtime without a model)."""
        P, T = prefix_capacity, self.target_len
        masks = []
        for p in self.prefix_lens:
            keep = torch.cat([torch.arange(P) < p, torch.ones(T, dtype=torch.bool)])
            logical = torch.cumsum(keep, 0) - 1
            ends = torch.cat([torch.arange(1, P + 1), p + self.target_visible_end()])
            m = keep[None, :] & keep[:, None] & (logical[None, :] < ends[:, None])
            pads = torch.nonzero(~keep).flatten()
            m[pads, pads] = True
            masks.append(m)
        return torch.stack(masks)[:, None]


def hunyuan_buckets(model_cfg, prefix_capacities: Sequence[int], rows: Sequence[int] = (1, 2),
                    cached_prefixes: Sequence[int] = ()) -> tuple[Bucket, ...]:
    """A prefill bucket (P + T tokens) and a step bucket (T tokens) per capacity and row count; per cached prefix
    length C < P (a multiple of the block size: what the prefix cache serves), the bucket of a prefill's suffix
    (P + T - C tokens over a context of C, `hunyuan_steps(..., suffix_from=C)`). C = P / 2 is refused: that suffix
    has the shape of a prefill of capacity C (C + T tokens over C), and warm-up could compile only one of the two."""
    T = model_cfg.target_len
    clash = sorted({(p, c) for p in prefix_capacities for c in cached_prefixes if 2 * c == p})
    if clash:
        raise ConfigError(f"cached prefix C = P / 2 (capacity, cached: {clash}) gives a suffix bucket of a prefill's "
                          "shape (C + T tokens over C): choose another cached prefix length")
    return tuple(
        Bucket(r, t, p) for p in prefix_capacities for r in rows for t in (p + T, T)
    ) + tuple(Bucket(r, p + T - c, c) for p in prefix_capacities for r in rows for c in cached_prefixes if 0 < c < p)


def hunyuan_runtime_config(model_cfg, *, max_prefix: int, block_size: int = 16, requests: int = 1, rows: int = 2,
                           **overrides) -> PagedKVConfig:
    """A pool for `requests` HunyuanImage-3 requests whose prompts are at most `max_prefix` tokens."""
    return pool_config(
        num_layers=model_cfg.num_layers, num_kv_heads=model_cfg.num_kv_heads, head_dim=model_cfg.head_dim,
        block_size=block_size, owners=requests, rows=rows, tokens_per_row=max_prefix,
        scratch_tokens_per_row=model_cfg.target_len,
        overrides={"kv_gaps": False, **overrides},  # a request's rows are whole prompts: nothing hidden inside
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


@dataclass
class HunyuanRecord:
    """What a request keeps beyond its blocks (`Owner.state`): each row's layout read from its prefill mask (None
    before the prefill, and after a reset), whether a step's mask was checked against it, and -- for a request whose
    prompt K/V another stage writes (`kv_import.py`) -- which of its pages are ready, of which generation."""

    layouts: list[MaskLayout] | None = None
    step_mask_checked: bool = False
    imported: ImportRecord | None = None


class HunyuanImage3Family(Family):
    """The `Family` of HunyuanImage-3 requests (see `families/base.py`)."""

    name = NAME
    noun = "request"
    spec_type = HunyuanSpec
    evict_lru = False
    idioms = (PREFILL_STORE, PREFIX_STEP, STATIC_CACHE)

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

    def cacheable_prefix(self, spec: HunyuanSpec) -> list[int]:
        """Each row's prompt: causal text whose K/V depend on the tokens before them and the caller's keys."""
        return list(spec.prefix_lens)

    def new_state(self, spec: HunyuanSpec, rows: int) -> HunyuanRecord:
        return HunyuanRecord()

    def plan(self, owner: Owner, blocks: BlockSource, kind: str, *, prefix_capacity: int | None = None,
             attention_mask: torch.Tensor | None = None, **args: Any) -> ForwardPlan:
        """A prefill (the whole dense sequence, `_plan_prefill`) or a denoising step (the target span only,
        `_plan_step`).

        The layout is read from the model's own prefill `attention_mask` once per request (required at the
        prefill): which dense token is which logical position, where each row's padding sits (left, middle,
        right; causal pads are kept tokens nobody reads), what each query sees. It is checked against the
        spec. A step feeds the `target_len` tokens after each row's prompt (plus `step_padding` trailing tokens
        under sequence parallel, keys no target query sees); its mask, when given, is checked against that layout
        once per request (unpadded steps).
        """
        spec: HunyuanSpec = owner.spec
        if kind not in KINDS:
            raise RequestError(f"unknown phase {kind!r}; use 'prefill' or 'step'")
        if kind == "step":
            _check_prompt_present(owner, args.get("import_generation"))
        if prefix_capacity is None:
            raise RequestError("a HunyuanImage-3 forward needs prefix_capacity (the dense prefix length)")
        if prefix_capacity < max(spec.prefix_lens):
            raise RequestError(
                f"prefix_capacity={prefix_capacity} is below the longest prompt ({max(spec.prefix_lens)} tokens); "
                "pad prompts to a capacity at least that long"
            )
        # Sequence-parallel step padding (vllm-omni's Ulysses pads a step's image shard to a multiple of the
        # degree): `step_padding` tokens after the target, keys no target query sees, dropped by the model after.
        pad = int(args.get("step_padding") or 0) if kind == "step" else 0
        if pad < 0:
            raise RequestError(f"step_padding={pad} must be >= 0 (the padded tokens after the target)")
        suffix_from = args.get("suffix_from")
        context = prefix_capacity
        if kind == "prefill" and (owner.prefix_ready or suffix_from is not None):
            layouts, key_positions, taken, state, tokens = self._plan_suffix(owner, blocks, attention_mask,
                                                                             suffix_from)
            context = suffix_from
        elif kind == "prefill":
            layouts, key_positions, taken, state, tokens = self._plan_prefill(owner, blocks, prefix_capacity,
                                                                              attention_mask)
        else:
            layouts, key_positions, taken, state, tokens = self._plan_step(owner, blocks, prefix_capacity,
                                                                           attention_mask, pad)
        # A prefill's layout comes from its mask, which no cheap key names: it is always built (once per request).
        key = (owner.serial, kind, owner.version, prefix_capacity, pad) if kind == "step" else ()
        return ForwardPlan(owner.owner_id, kind, layouts, tokens, context, taken, key,
                           keeps_kv=kind == "prefill", key_positions=key_positions, state=state)

    def _prefill_layouts(self, owner: Owner, attention_mask: torch.Tensor | None) -> list[MaskLayout]:
        """Each row's layout read from the model's whole prefill mask, checked against the spec."""
        spec: HunyuanSpec = owner.spec
        if attention_mask is None:
            raise RequestError(
                f"the prefill of request {owner.owner_id!r} needs the model's attention_mask: the runtime reads "
                "each row's layout (where padding sits, which tokens are kept) from it once per request. Pass "
                "runtime.forward(request_id, 'prefill', prefix_capacity=P, attention_mask=<the mask the model gets>)"
            )
        return _mask_layouts(spec, attention_mask)

    def _plan_prefill(self, owner: Owner, blocks: BlockSource, prefix_capacity: int,
                      attention_mask: torch.Tensor | None) -> tuple:
        """(layouts, key positions, blocks taken, record, tokens) of a prefill: each row's layout read from the mask,
        checked against the spec, and the prompt's blocks taken again after a reset."""
        spec: HunyuanSpec = owner.spec
        mask_layouts = self._prefill_layouts(owner, attention_mask)
        B = blocks.block_size
        # After a reset (`history_dropped`) the request holds no prompt blocks: its prefill takes them again (admission
        # reserved them), or the prompt would be written into scratch, which the next forward overwrites.
        taken = blocks.allocate_rows([ceil_div(p, B) for p in spec.prefix_lens]) if not any(owner.rows) else []
        try:
            layouts = []
            for r, (row, ml) in enumerate(zip(taken or owner.rows, mask_layouts)):
                scratch = blocks.scratch(r, len(row), (ml.kept - 1) // B)
                layouts.append(RowLayout.build(row, scratch, ml.positions, ml.visible_end, ml.kept))
        except BaseException:
            for ids in taken:
                blocks.free(ids)
            raise
        # a prefill (again: a retry, another mask) makes the next step's mask checked against its layout
        key_positions = [ml.positions for ml in mask_layouts]
        return layouts, key_positions, taken, HunyuanRecord(mask_layouts), len(mask_layouts[0].positions)

    def _plan_suffix(self, owner: Owner, blocks: BlockSource, attention_mask: torch.Tensor | None,
                     suffix_from: int | None) -> tuple:
        """(layouts, key positions, blocks taken, record, tokens) of a prefill whose rows' leading tokens are already
        in their blocks (`Owner.prefix_ready`: a prompt prefix served from the prefix cache; pages imported from
        another producer, every prompt token ready): the model feeds only dense tokens [suffix_from, S) and reads
        dense tokens [0, suffix_from) from its cache, as a step does (`hunyuan_steps(..., suffix_from=C)`: the
        prefix-step idiom, at bucket (rows, S - C, C)). This is the general first forward over a ready history; the
        layout is still read from the whole prefill mask (`attention_mask`: (rows, 1, S, S)).

        Every row's dense tokens before `suffix_from` must be exactly its ready tokens (or padding) and no later
        one may be ready: the forward writes only what it computes, never a ready (shared or imported) block."""
        spec: HunyuanSpec = owner.spec
        ready = owner.prefix_ready or (0,) * len(spec.prefix_lens)
        if suffix_from is None or isinstance(suffix_from, bool) or not isinstance(suffix_from, int) or suffix_from < 1:
            raise RequestError(
                f"request {owner.owner_id!r} holds {list(ready)} ready prompt tokens per row (a cached or imported "
                "prefix): its prefill computes only the rest. Feed the model dense tokens [C, S) over a cache of "
                "capacity C and pass suffix_from=C (hunyuan_steps(..., suffix_from=C); C = "
                f"{min(ready) if min(ready) else '?'} for a cached prefix); got suffix_from={suffix_from!r}")
        mask_layouts = self._prefill_layouts(owner, attention_mask)
        B = blocks.block_size
        layouts = []
        for r, (row, ml, n) in enumerate(zip(owner.rows, mask_layouts, ready)):
            pos = ml.positions
            if suffix_from >= len(pos):
                raise RequestError(f"suffix_from={suffix_from} leaves no token to compute ({len(pos)} dense tokens)")
            before = pos[:suffix_from]
            before = torch.sort(before[before >= 0]).values
            later = pos[suffix_from:]
            if not torch.equal(before, torch.arange(n, dtype=before.dtype)) or bool((later[later >= 0] < n).any()):
                raise RequestError(
                    f"row {r}: dense tokens [0, {suffix_from}) hold logical positions {before.tolist()[:8]}"
                    f"{'...' if len(before) > 8 else ''} but the row's ready prefix is positions [0, {n}): the suffix "
                    "forward must start right after the ready tokens (and their padding); pass suffix_from = the dense "
                    "column after them")
            if not row:
                raise RequestError(f"row {r} of {owner.owner_id!r} holds no prompt blocks; admit it again")
            scratch = blocks.scratch(r, len(row), (ml.kept - 1) // B)
            layouts.append(RowLayout.build(row, scratch, pos[suffix_from:], ml.visible_end[suffix_from:], ml.kept))
        key_positions = [ml.positions for ml in mask_layouts]  # dense key columns: [cache (C) | suffix] = 0..S-1
        return layouts, key_positions, [], HunyuanRecord(mask_layouts), len(mask_layouts[0].positions) - suffix_from

    def _plan_step(self, owner: Owner, blocks: BlockSource, prefix_capacity: int,
                   attention_mask: torch.Tensor | None, pad: int = 0) -> tuple:
        """(layouts, key positions, blocks taken, record, tokens) of a denoising step: the target span after each
        row's prompt (and `pad` trailing tokens), laid out as the prefill's mask said (the same at every step:
        reused), its mask checked against that layout once per request (an unpadded step's)."""
        spec: HunyuanSpec = owner.spec
        mask_layouts = owner.state.layouts
        B, T = blocks.block_size, spec.target_len

        def make() -> tuple[list[RowLayout], list[torch.Tensor]]:
            layouts, key_positions = [], []
            for r, (row, p, ml) in enumerate(zip(owner.rows, spec.prefix_lens, mask_layouts)):
                positions = torch.arange(p, p + T + pad, dtype=torch.int32)
                ends, seq_len = ml.ends_by_position[p : p + T], p + T + pad
                if pad:  # a pad query sees every key (its output is dropped); no target query sees a pad
                    ends = torch.cat([ends, torch.full((pad,), seq_len, dtype=ends.dtype)])
                key_positions.append(_step_key_positions(ml, p, prefix_capacity, positions))
                scratch = blocks.scratch(r, len(row), (seq_len - 1) // B)
                layouts.append(RowLayout.build(row, scratch, positions, ends, seq_len, max_position=seq_len - 1))
            return layouts, key_positions

        layouts, key_positions = reuse_layouts(owner, ("step", owner.version, prefix_capacity,
                                                       blocks.first_scratch_row, pad), make)
        state = None
        if attention_mask is not None and not pad and not owner.state.step_mask_checked:
            _check_step_mask(mask_rows(attention_mask, len(spec.prefix_lens)), layouts, key_positions)
            state = dataclasses.replace(owner.state, step_mask_checked=True)  # an import's record stays
        return layouts, key_positions, [], state, T + pad

    def finish(self, owner: Owner, plan: ForwardPlan, blocks: BlockSource) -> None:
        """Nothing moves (the prefix was written in place, or into the blocks a prefill after a reset took); the
        prefill's layout is kept for the steps (a new version: the steps' layouts and the metadata's repeat key
        follow a prefill run again with another mask)."""
        if plan.state is not None:
            owner.state = plan.state
        if plan.new_blocks:
            owner.rows = [list(ids) for ids in plan.new_blocks]
        if plan.kind == "prefill":
            owner.version += 1

    def history_dropped(self, owner: Owner) -> None:
        """A reset freed the prompt blocks: the request must be prefilled again before a step (found by the
        differential fuzzer: a step read its prompt from scratch, 1.44 off dense)."""
        owner.phases_done.discard("prefill")
        owner.state = self.new_state(owner.spec, owner.num_rows)

    def import_state(self, owner: Owner, blocks: BlockSource, generation: int, *, prefix_capacity: int | None = None,
                     attention_mask: torch.Tensor | None = None) -> tuple[HunyuanRecord, list[list[int]]]:
        """(record, blocks taken) of a request whose prompt K/V another stage writes (`kv_import.reserve`): each row's
        layout read from `attention_mask` (the prefill mask the dense model would get; default: the reference
        model's middle-padded one at `prefix_capacity`, `HunyuanSpec.padded_mask`), checked against the spec; the
        prompt's pages taken again when a reset freed them. No page is ready yet."""
        spec: HunyuanSpec = owner.spec
        if attention_mask is None:
            if prefix_capacity is None:
                raise RequestError(
                    f"reserving pages of request {owner.owner_id!r} needs its layout: pass attention_mask=<the "
                    "prefill mask the dense model would get> or prefix_capacity=P (the reference model's layout)"
                )
            if prefix_capacity < max(spec.prefix_lens):
                raise RequestError(f"prefix_capacity={prefix_capacity} is below the longest prompt "
                                   f"({max(spec.prefix_lens)} tokens)")
            attention_mask = spec.padded_mask(prefix_capacity)
        layouts = _mask_layouts(spec, attention_mask)
        B = blocks.block_size
        taken = blocks.allocate_rows([ceil_div(p, B) for p in spec.prefix_lens]) if not any(owner.rows) else []
        rows = taken or owner.rows
        return HunyuanRecord(layouts, imported=ImportRecord.empty(generation, [len(r) for r in rows])), taken

    def import_destinations(self, owner: Owner) -> list[int]:
        """Per row, how many prompt tokens its pages (`owner.rows[r]`) hold: the row's prompt length."""
        return list(owner.spec.prefix_lens)

    def check_expectation(self, expect: PrefixExpect, owner: Owner, plan: ForwardPlan) -> None:
        """The prefix capacity is the bucket's context, which the runtime already checks per call."""

    # ---- the model side -----------------------------------------------------------------------
    def owns_model(self, model: torch.nn.Module) -> bool:
        return isinstance(model, HunyuanImage3Model)

    def blocks(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        return model.layers

    def spec_for(self, model: torch.nn.Module, *, prompts: list[torch.Tensor], **loop: Any) -> HunyuanSpec:
        return hunyuan_spec(model.cfg, prompts)

    def steps(self, model: torch.nn.Module, hooks: Any, *, prompts: list[torch.Tensor], **loop: Any):
        """`models.hunyuan_image3.hunyuan_steps` (prompts=, prefix_capacity=, num_steps=, seed=, ...)."""
        return hunyuan_steps(model, prompts, hooks=hooks, **loop)

    def loop_arguments(self, runtime: ModelRuntime, spec: HunyuanSpec, loop: dict[str, Any]) -> dict[str, Any]:
        """The prefix capacity: the caller's, else the smallest the runtime's buckets serve for this spec."""
        if loop.get("prefix_capacity") is None:
            loop = {**loop, "prefix_capacity": prefix_capacity_for(runtime.config.buckets, spec.prefix_lens,
                                                                   spec.target_len)}
        return loop

    def default_buckets(self, model_cfg) -> None:
        return None  # the prefix capacities are the deployment's choice: configure them

    def example_inputs(self, model: torch.nn.Module, runtime: ModelRuntime, bucket: Bucket) -> tuple[tuple, dict]:
        return hunyuan_layer_inputs(model, runtime, bucket)

    def standin_caches(self, runtime: ModelRuntime, model: torch.nn.Module, batch: int, *, prefix_capacity: int,
                       **geometry: Any) -> list:
        """Per layer a `HunyuanKVCache` over one writable stand-in (the model stores its prefix in place), with the
        KV heads the attention holds (the rank's under tensor parallel, `distributed/reference.py`)."""
        cfg = model.cfg
        heads = model.layers[0].self_attn.num_kv_heads
        standin = runtime.standin(batch, prefix_capacity, heads, cfg.head_dim, writable=True)
        return [HunyuanKVCache(standin, standin) for _ in range(cfg.num_layers)]

    # ---- the `paged-kv demo` scene --------------------------------------------------------------
    def demo(self, size: str, *, short: bool, device: str, **runtime_options: Any) -> Demo:
        """Requests for parity, then three requests of different prompt lengths at different steps on one pool
        (`_demo`). `size`: "tiny" or "mid" (`HUNYUAN_IMAGE3_MID`)."""
        return _demo(size, short=short, device=device, **runtime_options)


def _mask_layouts(spec: HunyuanSpec, attention_mask: torch.Tensor) -> list[MaskLayout]:
    """Each row's layout read from the prefill mask, checked against the spec."""
    rows = len(spec.prefix_lens)
    masks = mask_rows(attention_mask, rows)
    mask_layouts = [layout_from_prefill_mask(masks[0], 0)]
    for r in range(1, rows):  # a broadcast (1, ...) mask gives every row row 0's view: read once
        mask_layouts.append(mask_layouts[0] if masks[r] is masks[0] else layout_from_prefill_mask(masks[r], r))
    for r, (ml, p) in enumerate(zip(mask_layouts, spec.prefix_lens)):
        _check_against_spec(r, ml, p, spec)
    return mask_layouts


def _check_prompt_present(owner: Owner, generation: int | None) -> None:
    """A step reads the prompt's pages: computed by the request's prefill, or imported (all ready, of the
    generation the caller expects, when it names one)."""
    record: ImportRecord | None = owner.state.imported
    if record is None:
        if generation is not None:
            raise RequestError(
                f"this step of request {owner.owner_id!r} expects imported pages of generation {generation}, but the "
                "request holds no import (it was reset, or its own prefill replaced it): reserve again "
                "(kv_import.renew) and import, or prefill"
            )
        if "prefill" not in owner.phases_done:
            raise RequestError(f"request {owner.owner_id!r} has not been prefilled; run its prefill forward first "
                               "(or import its prompt K/V: kv_import.reserve, then import_dense/import_vllm_blocks)")
        return
    record.check_ready(owner.owner_id, generation)


def _check_against_spec(r: int, ml: MaskLayout, p: int, spec: HunyuanSpec) -> None:
    """The mask's target tokens must see what the spec says (else prefix_lens/target_len/spans are wrong)."""
    T = spec.target_len
    if ml.kept < p + T:
        raise RequestError(
            f"row {r}: the prefill mask keeps {ml.kept} tokens but the request spec needs prompt {p} + target {T}: "
            "the request spec (prefix_lens, target_len) does not describe this mask"
        )
    # The steps feed the target's T tokens, consecutive in the dense sequence. A dense token inside the target's
    # span that reads as padding (it sees only itself and nobody sees it) is ambiguous: a real token there gets no
    # output (the op computes none for padding) while dense attention gives it its own value.
    dense = torch.nonzero((ml.positions >= p) & (ml.positions < p + T)).flatten()
    if len(dense) and int(dense[-1] - dense[0]) != T - 1:
        pad = int(dense[0]) + int(torch.nonzero(ml.positions[dense[0] : dense[-1]] < 0)[0])
        raise RequestError(
            f"row {r}: dense token {pad} lies inside the target span (dense tokens {int(dense[0])}..{int(dense[-1])}) "
            "but reads as padding in the prefill mask (it sees only itself and no other token sees it): padding "
            "cannot sit inside the target, and a real token that sees only itself cannot be paged (its output would "
            "be zeros, dense gives its value); fix the mask or the request spec, or run this request densely"
        )
    want = p + spec.target_visible_end()
    got = ml.ends_by_position[p : p + T]
    if not torch.equal(got, want):
        i = int((got != want).nonzero()[0])
        raise RequestError(
            f"row {r}: target token {i} (logical position {p + i}) sees {int(got[i])} tokens in the model's mask "
            f"but {int(want[i])} in the request spec: the request spec (prefix_lens, target_len, full_spans) does "
            "not describe this mask (a wrong prompt length, image span, or a token the steps do not feed)"
        )


def _cached_positions(ml: MaskLayout, p: int, capacity: int) -> torch.Tensor:
    """Logical position of each dense cache column at a step: the cache holds the prefill's first `capacity`
    dense keys, of which the row's prompt (logical < p) is kept; the rest reads as padding."""
    pos = ml.positions[:capacity]
    pos = torch.where((pos >= 0) & (pos < p), pos, -1)
    return torch.cat([pos, torch.full((capacity - len(pos),), -1, dtype=torch.int64)])


def _step_key_positions(ml: MaskLayout, p: int, capacity: int, positions: torch.Tensor) -> torch.Tensor:
    """The logical position each dense key column of a step holds (-1: never visible).

    A prefix cache (capacity below the prefill's dense length: vllm-omni, the reference model) is read as
    ``[cached prefix | new tokens]``. A static cache as long as the whole prefill (Tencent's HunyuanStaticCache,
    written at position_ids) keeps every dense column where the prefill put it, the target rewritten in place.
    """
    if capacity < len(ml.positions):
        return torch.cat([_cached_positions(ml, p, capacity), positions])
    return torch.cat([ml.positions, torch.full((capacity - len(ml.positions),), -1, dtype=torch.int64)])


def _check_step_mask(masks: list[torch.Tensor], layouts: list[RowLayout], key_positions: list[torch.Tensor]) -> None:
    for r, (row, keys) in enumerate(zip(layouts, key_positions)):
        why = mask_disagreement(masks[r], row, keys)
        if why:
            raise RequestError(
                f"row {r}: the step's mask disagrees with the layout read at the prefill ({why}): the steps do "
                "not feed the tokens after each row's prompt that the prefill had there"
            )


def hunyuan_layer_inputs(model, runtime: ModelRuntime, bucket: Bucket) -> tuple[tuple, dict]:
    """Arguments of one `HunyuanDecoderLayer` call of `bucket` (prefill or step, from the token count; more tokens
    than a step over a context C: a prefill's suffix over C ready tokens, `hunyuan_steps(..., suffix_from=C)`)."""
    cfg, p = model.cfg, next(model.parameters())
    R, T, P = bucket.rows, bucket.tokens, bucket.context
    target = cfg.target_len
    if P >= 1 and T > target and T != P + target:  # a suffix: step-mode call over the dense tokens [C, S)
        req = model.build_request([torch.zeros(P + T - target, dtype=torch.int64)] * R, P + T - target)
        cache = HUNYUAN_IMAGE3.standin_caches(runtime, model, R, prefix_capacity=P)[0]
        hidden = torch.zeros(R, T, cfg.hidden, dtype=p.dtype, device=p.device)
        return (hidden, req.rope_cos[:, P:].contiguous(), req.rope_sin[:, P:].contiguous(),
                req.attention_mask[:, :, P:].contiguous(), cache, req.prefix_valid, "step"), {}
    if P < 1 or T not in (P + target, target):
        raise ConfigError(
            f"bucket {bucket} is not a HunyuanImage-3 forward: tokens must be prefix capacity + {target} "
            f"(prefill), {target} (step) or more (a prefill's suffix over a ready prefix of `context` tokens), with a "
            "capacity >= 1; use hunyuan_buckets(model.cfg, capacities)"
        )
    req = model.build_request([torch.zeros(P, dtype=torch.int64)] * R, P)
    cache = HUNYUAN_IMAGE3.standin_caches(runtime, model, R, prefix_capacity=P)[0]  # what the driver hands over
    hidden = torch.zeros(R, T, cfg.hidden, dtype=p.dtype, device=p.device)
    if T == P + target:
        return (hidden, req.rope_cos, req.rope_sin, req.attention_mask, cache, req.prefix_valid, "prefill"), {}
    return (hidden, req.step_rope_cos, req.step_rope_sin, req.step_attention_mask, cache, req.prefix_valid, "step"), {}


HUNYUAN_IMAGE3 = HunyuanImage3Family()


# ---- the `paged-kv demo` scene (`HunyuanImage3Family.demo`) -----------------------------------------------


def _demo(size: str, *, short: bool, device: str, **runtime_options: Any) -> Demo:
    if size not in ("tiny", "mid"):
        raise ConfigError(f"unknown demo size {size!r}; use 'tiny' or 'mid'")
    cfg = HunyuanImage3Config() if size == "tiny" else HUNYUAN_IMAGE3_MID
    tiny = size == "tiny"
    capacity, block_size, steps = (12, 4, 4) if tiny else (256, 16, 4)
    steps = 2 if short else steps
    gen = torch.Generator().manual_seed(0)

    def prompts(*lengths: int) -> list[torch.Tensor]:
        return [torch.randint(0, cfg.vocab, (n,), generator=gen) for n in lengths]

    # parity: a 1-row request, then a 2-row (CFG) one
    loop_lengths = [[9]] if short else ([[9], [11, 4]] if tiny else [[200], [200, 60]])
    loops = [dict(prompts=prompts(*lens), prefix_capacity=capacity, num_steps=steps, seed=5) for lens in loop_lengths]
    # the scene: three requests of different prompt lengths, stopped at different steps
    scene = [("short", (3,) if tiny else (40,), 1), ("cfg", (11, 4) if tiny else (200, 60), 2),
             ("long", (12,) if tiny else (250,), steps)]
    lanes = [DemoLane(name, f"{'2 CFG rows, prompts' if len(lens) == 2 else 'prompt'} "
                            f"{' + '.join(map(str, lens))} tokens: {done} of {steps} steps done",
                      dict(prompts=prompts(*lens), prefix_capacity=capacity, num_steps=steps, seed=6), done)
             for name, lens, done in scene]
    T = cfg.target_len
    return Demo(
        describe=(f"hunyuan-image3 ({size}: hidden {cfg.hidden}, {cfg.num_heads}/{cfg.num_kv_heads} heads x "
                  f"{cfg.head_dim}): {cfg.num_layers} layers, prompt prefixes padded to {capacity} tokens, "
                  f"{T} target tokens"),
        make_model=lambda: HunyuanImage3Model(cfg, seed=2).to(device),
        runtime_config=hunyuan_runtime_config(cfg, max_prefix=capacity, block_size=block_size, requests=3,
                                              buckets=hunyuan_buckets(cfg, [capacity]), device=device,
                                              **runtime_options),
        loops=loops,
        loops_describe=f"{len(loops)} request(s) of {[len(lens) for lens in loop_lengths]} row(s), {steps} steps each",
        dense_baseline=f"each request's prefix caches, preallocated for every row at the padded capacity ({capacity} "
                       "tokens) its compiled shape needs",
        compare=lambda dense, paged: (dense.float() - paged.float()).abs().max().item(),
        # what the loop reads of a forward: the target span's hidden states
        compare_rows=lambda dense, paged: (dense[:, -T:].float() - paged[:, -T:].float()).abs().flatten(1).amax(1),
        dense_kv_bytes=_demo_dense_kv_bytes,
        lanes=lanes,
        info={"size": size, "requests": len(loops), "steps": steps},
    )


def _demo_dense_kv_bytes(caches: list[HunyuanKVCache]) -> list[int]:
    """Per row, the bytes of the preallocated dense prefix caches of every layer (reserved at the capacity)."""
    rows = caches[0].cached_key.shape[0]
    return [sum((c.cached_key.nbytes + c.cached_value.nbytes) // rows for c in caches)] * rows
