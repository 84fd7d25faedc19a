"""Who owns which blocks, and what each forward writes and sees, for both model families.

DreamZero sessions keep a chunk-granular sliding window (plus an optional resident sink) of committed
history per CFG row; denoising-step and action K/V go to per-row scratch and are never committed.
HunyuanImage-3 requests keep their prompt prefix per row; the target span is rewritten every step at
the same (scratch) slots. Every public method validates first and mutates after, so a refused call
leaves the state exactly as it was; a forward that fails is rolled back by `abort_forward`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .allocator import BlockAllocator
from .errors import CapacityError, ConfigError, RequestError
from .layout import RowLayout
from .pool import KVPool


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class DreamZeroSpec:
    """Token geometry of a DreamZero session (all counts in tokens are derived from frames)."""

    frame_seqlen: int
    chunk_frames: int
    window_frames: int
    sink_frames: int = 0
    action_tokens: int = 0

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_frames * self.frame_seqlen

    @property
    def window_tokens(self) -> int:
        return self.window_frames * self.frame_seqlen

    @property
    def sink_tokens(self) -> int:
        return self.sink_frames * self.frame_seqlen

    @property
    def tokens_per_forward(self) -> int:
        return self.chunk_tokens + self.action_tokens

    @classmethod
    def from_model_config(cls, cfg) -> "DreamZeroSpec":
        """From a `models.dreamzero.DreamZeroConfig` (or anything with the same fields)."""
        return cls(
            frame_seqlen=cfg.frame_seqlen,
            chunk_frames=cfg.num_frame_per_block,
            window_frames=cfg.window_frames,
            sink_frames=cfg.sink_size,
            action_tokens=cfg.action_register_length,
        )


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


@dataclass
class _Owner:
    """A DreamZero session or a HunyuanImage-3 request: one block list per row."""

    owner_id: str
    family: str
    spec: DreamZeroSpec | HunyuanSpec
    rows: list[list[int]]
    prefilled: bool = False  # HunyuanImage-3
    version: int = 0  # bumped whenever the blocks change: keys the metadata cache

    @property
    def num_rows(self) -> int:
        return len(self.rows)


@dataclass
class ForwardPlan:
    """What one forward does: per-row layouts, blocks taken for it, and how to finish it."""

    owner_id: str
    kind: str
    rows: list[RowLayout]
    tokens: int
    context: int
    new_blocks: list[list[int]] = field(default_factory=list)
    key: tuple = ()


class Scheduler:
    """Admission, windows, sinks, commit and release over a block allocator of local block ids."""

    FINISHED_MEMORY = 4096  # how many finished ids are remembered to explain a reuse

    def __init__(self, pool: KVPool, allocator: BlockAllocator, *, max_rows: int, max_sessions: int | None = None):
        if allocator.num_blocks != pool.blocks_per_layer:
            raise ConfigError(
                f"allocator manages {allocator.num_blocks} blocks but the pool has {pool.blocks_per_layer} per layer"
            )
        self.pool = pool
        self.allocator = allocator
        self.max_rows = max_rows
        self.max_sessions = max_sessions
        self.owners: OrderedDict[str, _Owner] = OrderedDict()  # LRU order: last used at the end
        self.finished: OrderedDict[str, str] = OrderedDict()  # id -> why it ended
        self.in_flight: ForwardPlan | None = None

    # ---- shared checks --------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def _check_new_id(self, owner_id: str) -> None:
        if owner_id in self.owners:
            raise RequestError(f"id {owner_id!r} is already live; finish or close it first, or use a new id")
        if owner_id in self.finished:
            raise RequestError(
                f"id {owner_id!r} was already used and is {self.finished[owner_id]}; ids are single-use: pick a new one"
            )

    def _check_rows(self, rows: int) -> None:
        if not 1 <= rows <= self.max_rows:
            raise RequestError(
                f"{rows} rows requested but this runtime serves 1..{self.max_rows} rows per forward "
                "(max_rows; with CFG-parallel each rank holds one branch): raise max_rows or split the rows"
            )

    def _get(self, owner_id: str, family: str) -> _Owner:
        owner = self.owners.get(owner_id)
        if owner is None:
            if owner_id in self.finished:
                raise RequestError(f"id {owner_id!r} is {self.finished[owner_id]}; open/admit a new one to continue")
            raise RequestError(f"unknown id {owner_id!r}; open a session or admit a request first")
        if owner.family != family:
            raise RequestError(f"id {owner_id!r} is a {owner.family} {self._noun(owner)}, not a {family} one")
        return owner

    @staticmethod
    def _noun(owner: _Owner) -> str:
        return "session" if owner.family == "dreamzero" else "request"

    def _check_idle(self) -> None:
        if self.in_flight is not None:
            raise RequestError(
                f"a forward for {self.in_flight.owner_id!r} is still in flight; finish or abort it before changing state"
            )

    def _allocate_rows(self, counts: list[int]) -> list[list[int]]:
        """All rows or nothing: one atomic allocation split per row."""
        need = sum(counts)
        if need > self.allocator.num_blocks:
            raise CapacityError(
                f"needs {need} blocks per layer (rows need {counts}) but the whole pool has "
                f"{self.allocator.num_blocks}: it can never fit; raise the pool budget or shorten the request"
            )
        if need > self.allocator.num_free:
            raise CapacityError(
                f"needs {need} free blocks per layer, {self.allocator.num_free} are free; retry after other "
                "requests finish, close idle sessions, or raise the pool budget"
            )
        ids = self.allocator.allocate(need)
        starts = [sum(counts[:i]) for i in range(len(counts))]
        return [ids[s : s + c] for s, c in zip(starts, counts)]

    def _release(self, owner: _Owner, why: str) -> None:
        for row in owner.rows:
            if row:
                self.allocator.free(row)
        owner.rows = [[] for _ in owner.rows]
        del self.owners[owner.owner_id]
        self.finished[owner.owner_id] = why
        while len(self.finished) > self.FINISHED_MEMORY:
            self.finished.popitem(last=False)

    def _touch(self, owner: _Owner) -> None:
        self.owners.move_to_end(owner.owner_id)

    def _scratch(self, row: int, first_logical_block: int, last_logical_block: int) -> list[int]:
        """Scratch blocks covering logical blocks [first, last] of a forward row."""
        count = last_logical_block - first_logical_block + 1
        if count > self.pool.scratch_blocks_per_row:
            raise RequestError(
                f"this forward needs {count} scratch blocks per row but the pool has "
                f"{self.pool.scratch_blocks_per_row}; raise scratch_tokens_per_row in the config"
            )
        return self.pool.scratch_block_ids(row)[:count].tolist() if count > 0 else []

    # ---- DreamZero sessions -------------------------------------------------------------------
    def open_session(self, session_id: str, spec: DreamZeroSpec, rows: int = 2) -> None:
        """Admit a DreamZero session with `rows` CFG rows; evicts the least recently used past the cap."""
        self._check_idle()
        self._check_new_id(session_id)
        self._check_rows(rows)
        B = self.block_size
        if spec.frame_seqlen % B:
            raise ConfigError(
                f"block_size={B} does not divide frame_seqlen={spec.frame_seqlen}: DreamZero pages by frame; "
                f"choose a block_size that divides {spec.frame_seqlen}"
            )
        if spec.chunk_tokens + spec.sink_tokens > spec.window_tokens:
            raise ConfigError(
                f"the window ({spec.window_frames} frames) is smaller than a chunk ({spec.chunk_frames} frames) "
                f"plus the sink ({spec.sink_frames} frames); enlarge local_attn_size or shrink the chunk/sink"
            )
        per_row = spec.window_tokens // B
        if rows * per_row > self.allocator.num_blocks:
            raise CapacityError(
                f"one full window needs {rows * per_row} blocks per layer ({rows} rows x {per_row}) but the whole "
                f"pool has {self.allocator.num_blocks}: it can never fit; raise the pool budget"
            )
        self._scratch_need_check(_ceil_div(spec.tokens_per_forward, B))
        if self.max_sessions is not None:
            live = [o for o in self.owners.values() if o.family == "dreamzero"]
            if len(live) >= self.max_sessions:
                self._release(live[0], "evicted (LRU cap on live sessions)")
        self.owners[session_id] = _Owner(session_id, "dreamzero", spec, [[] for _ in range(rows)])

    def _scratch_need_check(self, blocks: int) -> None:
        if blocks > self.pool.scratch_blocks_per_row:
            raise ConfigError(
                f"a forward needs {blocks} scratch blocks per row but the pool has {self.pool.scratch_blocks_per_row}; "
                "raise scratch_tokens_per_row in the config"
            )

    def _visible_history(self, owner: _Owner, row: list[int]) -> list[int]:
        spec: DreamZeroSpec = owner.spec
        B = self.block_size
        sink_blocks = min(len(row), spec.sink_tokens // B)
        keep = (spec.window_tokens - spec.sink_tokens - spec.chunk_tokens) // B
        rest = row[sink_blocks:]
        return row[:sink_blocks] + (rest[-keep:] if keep > 0 else [])

    def plan_dreamzero(self, session_id: str, *, commit: bool) -> ForwardPlan:
        """Plan one forward of a session's chunk: commit (its K/V becomes history) or denoise (scratch)."""
        self._check_idle()
        owner = self._get(session_id, "dreamzero")
        spec: DreamZeroSpec = owner.spec
        B = self.block_size
        n, a = spec.chunk_tokens, spec.action_tokens
        new_blocks = self._allocate_rows([n // B] * owner.num_rows) if commit else []
        try:
            layouts = [self._dreamzero_row(owner, r, row, new_blocks[r] if commit else []) for r, row in
                       enumerate(owner.rows)]
        except BaseException:
            for blocks in new_blocks:
                self.allocator.free(blocks)
            raise
        self._touch(owner)
        kind = "commit" if commit else "denoise"
        key = (session_id, kind, owner.version) if not commit else ()
        plan = ForwardPlan(session_id, kind, layouts, n + a, spec.window_tokens, new_blocks, key)
        self.in_flight = plan
        return plan

    def _dreamzero_row(self, owner: _Owner, r: int, row: list[int], new: list[int]) -> RowLayout:
        """[visible history | chunk (new managed blocks, or scratch) | action tokens (scratch)]."""
        spec: DreamZeroSpec = owner.spec
        B, n, a = self.block_size, spec.chunk_tokens, spec.action_tokens
        visible = self._visible_history(owner, row)
        h = len(visible) * B
        managed = visible + new
        scratch = self._scratch(r, len(managed), (h + n + a - 1) // B)
        positions = torch.arange(h, h + n + a, dtype=torch.int64)
        ends = torch.full((n + a,), h + n + a, dtype=torch.int64)
        return RowLayout.build(managed, scratch, positions, ends, h + n + a)

    def reset_window(self, session_id: str) -> None:
        """Clear a session's history (the generated latents are the caller's); rows stay admitted."""
        self._check_idle()
        owner = self._get(session_id, "dreamzero")
        for row in owner.rows:
            if row:
                self.allocator.free(row)
        owner.rows = [[] for _ in owner.rows]
        owner.version += 1

    def close_session(self, session_id: str) -> None:
        self._check_idle()
        self._release(self._get(session_id, "dreamzero"), "closed")

    # ---- HunyuanImage-3 requests --------------------------------------------------------------
    def admit_request(self, request_id: str, spec: HunyuanSpec) -> None:
        """Admit all CFG rows of a request (prefix blocks taken now) or none."""
        self._check_idle()
        self._check_new_id(request_id)
        self._check_rows(len(spec.prefix_lens))
        if spec.target_len < 1 or any(p < 1 for p in spec.prefix_lens):
            raise RequestError(f"prefix lengths and target_len must be >= 1 (got {spec.prefix_lens}, {spec.target_len})")
        for start, end in spec.full_spans:
            if not 0 <= start < end <= spec.target_len:
                raise RequestError(f"full span ({start}, {end}) must lie inside the target span [0, {spec.target_len})")
        B = self.block_size
        for p in spec.prefix_lens:
            self._scratch_need_check(_ceil_div(p + spec.target_len, B) - _ceil_div(p, B))
        rows = self._allocate_rows([_ceil_div(p, B) for p in spec.prefix_lens])
        self.owners[request_id] = _Owner(request_id, "hunyuan_image3", spec, rows)

    def plan_hunyuan(self, request_id: str, *, phase: str, prefix_capacity: int) -> ForwardPlan:
        """Plan a prefill (the whole padded sequence) or a denoising step (the target span only).

        The dense layout of a row is ``[prompt | pad up to prefix_capacity | target]``; the paged
        layout is ``[prompt | target]``: pad tokens are neither written nor read.
        """
        self._check_idle()
        owner = self._get(request_id, "hunyuan_image3")
        spec: HunyuanSpec = owner.spec
        if phase not in ("prefill", "step"):
            raise RequestError(f"unknown phase {phase!r}; use 'prefill' or 'step'")
        if phase == "step" and not owner.prefilled:
            raise RequestError(f"request {request_id!r} has not been prefilled; run its prefill forward first")
        if prefix_capacity < max(spec.prefix_lens):
            raise RequestError(
                f"prefix_capacity={prefix_capacity} is below the longest prompt ({max(spec.prefix_lens)} tokens); "
                "pad prompts to a capacity at least that long"
            )
        B, T = self.block_size, spec.target_len
        rel_ends = spec.target_visible_end()
        layouts = []
        for r, (row, p) in enumerate(zip(owner.rows, spec.prefix_lens)):
            target_pos = torch.arange(p, p + T, dtype=torch.int64)
            target_end = p + rel_ends
            if phase == "prefill":
                pad = prefix_capacity - p
                positions = torch.cat([torch.arange(p), torch.full((pad,), -1), target_pos])
                ends = torch.cat([torch.arange(1, p + 1), torch.zeros(pad, dtype=torch.int64), target_end])
            else:
                positions, ends = target_pos, target_end
            scratch = self._scratch(r, len(row), (p + T - 1) // B)
            layouts.append(RowLayout.build(row, scratch, positions, ends, p + T))
        self._touch(owner)
        tokens = prefix_capacity + T if phase == "prefill" else T
        key = (request_id, phase, owner.version, prefix_capacity)
        plan = ForwardPlan(request_id, phase, layouts, tokens, prefix_capacity, [], key)
        self.in_flight = plan
        return plan

    def finish_request(self, request_id: str) -> None:
        self._check_idle()
        self._release(self._get(request_id, "hunyuan_image3"), "finished")

    # ---- both ---------------------------------------------------------------------------------
    def abort(self, owner_id: str) -> None:
        """Abort a request or session at any point between forwards: all its blocks are freed."""
        self._check_idle()
        owner = self.owners.get(owner_id)
        if owner is None:
            self._get(owner_id, "")  # raises the right message
        self._release(owner, "aborted")

    def finish_forward(self, plan: ForwardPlan) -> None:
        """The forward ran: a DreamZero commit becomes history (out-of-window blocks are freed)."""
        self._check_plan(plan)
        owner = self.owners[plan.owner_id]
        if plan.kind == "commit":
            spec: DreamZeroSpec = owner.spec
            B = self.block_size
            sink_blocks = spec.sink_tokens // B
            # Keep what any later forward can read: the sink and the last (window - sink - chunk) tokens.
            keep = (spec.window_tokens - spec.sink_tokens - spec.chunk_tokens) // B
            for r, new in enumerate(plan.new_blocks):
                row = owner.rows[r] + new
                sink = row[: min(len(row), sink_blocks)]
                rest = row[len(sink) :]
                kept = rest[-keep:] if keep > 0 else []
                evicted = rest[: len(rest) - len(kept)]
                if evicted:
                    self.allocator.free(evicted)
                owner.rows[r] = sink + kept
            owner.version += 1
        elif plan.kind == "prefill":
            owner.prefilled = True
        self.in_flight = None

    def abort_forward(self, plan: ForwardPlan) -> None:
        """The forward failed: give back what it took; history and prefixes are as before."""
        self._check_plan(plan)
        for new in plan.new_blocks:
            if new:
                self.allocator.free(new)
        self.in_flight = None

    def _check_plan(self, plan: ForwardPlan) -> None:
        if self.in_flight is not plan:
            raise RequestError("this forward plan is not the one in flight (finished twice, or stale)")

    def owned_blocks(self) -> dict[str, list[list[int]]]:
        """Snapshot of ownership (for tests and the state-unchanged checks)."""
        return {oid: [list(r) for r in o.rows] for oid, o in self.owners.items()}
