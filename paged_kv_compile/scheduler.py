"""Who owns which blocks, and what each forward writes and sees: the family-independent part.

The scheduler keeps ids, admission (all rows or none), block ownership, the LRU cap on live
sessions, the one forward in flight and its rollback. What a forward's rows look like and what
finishing it changes is the owner's family's (`families/`), asked through the `Family` protocol
(`families/base.py`). Every public method validates first and mutates after, so a refused call
leaves the state exactly as it was; a forward that fails is rolled back by `abort_forward`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np
import torch

from . import families
from .allocator import BlockAllocator
from .errors import CapacityError, ConfigError, RequestError
from .families.base import ForwardPlan, Owner
from .layout import RowLayout
from .pool import KVPool
from .prefix_cache import PrefixCache, check_prompt_admission
from .regions import Region, SharedRegions
from .reservations import Reservations

__all__ = ["Scheduler", "ForwardPlan", "Owner"]


def row_written_blocks(row: RowLayout, block_size: int) -> list[int]:
    """The managed (local) blocks a forward writes through this row: where its non-padding tokens land.
    On the row's numpy arrays, like the metadata build: no torch operator on the planning path."""
    table, managed, positions, _ = row.arrays
    hit = np.zeros(len(table), dtype=bool)
    hit[positions[positions >= 0] // block_size] = True
    return table[hit & managed].tolist()


class _PlanningFor:
    """The scheduler as the `BlockSource` one owner's family plans with when the plan needs more than the scheduler:
    a part of a batched forward plans its rows 0.. as if alone and gets the scratch of rows first_row..; a fork
    with a budget (`Owner.take_budget`) may not take more blocks than the budget has left."""

    def __init__(self, scheduler: "Scheduler", owner: Owner, first_row: int) -> None:
        self._scheduler = scheduler
        self._owner = owner
        self._first = first_row

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)

    @property
    def first_scratch_row(self) -> int:
        return self._first

    def allocate_rows(self, counts: list[int]) -> list[list[int]]:
        budget = self._owner.take_budget
        if budget is not None and sum(counts) > budget:
            raise RequestError(
                f"this forward would take {sum(counts)} blocks per layer for {self._owner.owner_id!r}, a fork with a "
                f"budget of {budget} more: release it, or fork with a larger budget. Nothing was planned"
            )
        return self._scheduler.allocate_rows(counts)

    def scratch(self, row: int, first_logical_block: int, last_logical_block: int) -> list[int]:
        row += self._first
        if row >= self._scheduler.max_rows:
            raise RequestError(
                f"this batched forward carries more than max_rows={self._scheduler.max_rows} rows (scratch exists "
                "for that many): raise max_rows (and add buckets for the row counts) or batch fewer owners"
            )
        return self._scheduler.scratch(row, first_logical_block, last_logical_block)


class Scheduler:
    """Admission, ownership, eviction and the forward in flight over a block allocator of local block ids.

    It is also the `BlockSource` the families plan with (`families/base.py`).
    """

    FINISHED_MEMORY = 4096  # how many finished ids are remembered to explain a reuse

    def __init__(self, pool: KVPool, allocator: BlockAllocator, *, max_rows: int, max_sessions: int | None = None):
        if allocator.num_blocks != pool.blocks_per_layer:
            raise ConfigError(
                f"allocator manages {allocator.num_blocks} blocks but the pool has {pool.blocks_per_layer} per layer"
            )
        self.pool = pool
        self.allocator = allocator
        self.max_rows = max_rows
        self.max_sessions = max_sessions  # LRU cap on live owners of families with `evict_lru`
        self.owners: OrderedDict[str, Owner] = OrderedDict()  # LRU order: last used at the end
        self.finished: OrderedDict[str, str] = OrderedDict()  # id -> why it ended
        self.in_flight: ForwardPlan | None = None
        #: owners that hold blocks a fork shares (their plans are checked never to write one: `_check_writes`)
        self.sharing: set[str] = set()
        #: shared write-once regions (cross-attention K/V) and who holds them (`regions.py`)
        self.regions = SharedRegions()
        #: prompt blocks shared across requests by a hash chain, and who holds which (`prefix_cache.py`)
        self.prefix_cache = PrefixCache()
        self._serials = itertools.count()  # Owner.serial: one per admission or fork, never reused

    # ---- the BlockSource the families use -----------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def scratch_blocks_per_row(self) -> int:
        return self.pool.scratch_blocks_per_row

    def allocate_rows(self, counts: list[int]) -> list[list[int]]:
        """All rows or nothing: one atomic allocation split per row."""
        need = sum(counts)
        if need > self.allocator.num_blocks:
            raise CapacityError(
                f"needs {need} blocks per layer (rows need {counts}) but the whole pool has "
                f"{self.allocator.num_blocks}: it can never fit; raise the pool budget or shorten the request"
            )
        if need > self.allocator.num_free + self.prefix_cache.idle_count:
            raise CapacityError(
                f"needs {need} free blocks per layer, {self.allocator.num_free} are free"
                + (f" (and {self.prefix_cache.idle_count} idle cached prompt blocks)" if self.prefix_cache.idle_count
                   else "")
                + "; retry after other requests finish, close idle sessions, or raise the pool budget"
            )
        if need > self.allocator.num_free:  # idle cached prompt blocks count as free: evict the least recently used
            self.prefix_cache.evict(need - self.allocator.num_free, self.allocator)
        ids = self.allocator.allocate(need) if need else []
        starts = [sum(counts[:i]) for i in range(len(counts))]
        return [ids[s : s + c] for s, c in zip(starts, counts)]

    def free(self, blocks: list[int]) -> None:
        if blocks:
            self.allocator.free(blocks)

    #: a forward planned directly starts at row 0 (a batched forward's later parts: `_PlanningFor`)
    first_scratch_row = 0

    def scratch(self, row: int, first_logical_block: int, last_logical_block: int) -> list[int]:
        """Scratch blocks covering logical blocks [first, last] of a forward row."""
        count = last_logical_block - first_logical_block + 1
        if count > self.pool.scratch_blocks_per_row:
            raise RequestError(
                f"this forward needs {count} scratch blocks per row but the pool has "
                f"{self.pool.scratch_blocks_per_row}; raise scratch_tokens_per_row in the config"
            )
        if count <= 0:
            return []
        start = self.pool.scratch_start(row)  # plain ints: no torch op on the planning path
        return list(range(start, start + count))

    def check_scratch(self, blocks: int) -> None:
        """A config check at admission: a forward of this owner needs `blocks` scratch blocks per row."""
        if blocks > self.pool.scratch_blocks_per_row:
            raise ConfigError(
                f"a forward needs {blocks} scratch blocks per row but the pool has {self.pool.scratch_blocks_per_row}; "
                "raise scratch_tokens_per_row in the config"
            )

    # ---- shared checks --------------------------------------------------------------------------
    def _check_new_id(self, owner_id: str) -> None:
        if owner_id in self.owners:
            raise RequestError(f"id {owner_id!r} is already live; finish or close it first, or use a new id")
        if owner_id in self.finished:
            raise RequestError(
                f"id {owner_id!r} was already used and is {self.finished[owner_id]}; pick a new id (the last "
                f"{self.FINISHED_MEMORY} finished ids are refused, to catch a resubmitted request)"
            )

    def _check_rows(self, rows: int) -> None:
        if not 1 <= rows <= self.max_rows:
            raise RequestError(
                f"{rows} rows requested but this runtime serves 1..{self.max_rows} rows per forward "
                "(max_rows; with CFG-parallel each rank holds one branch): raise max_rows or split the rows"
            )

    def _get(self, owner_id: str) -> Owner:
        owner = self.owners.get(owner_id)
        if owner is None:
            if owner_id in self.finished:
                raise RequestError(f"id {owner_id!r} is {self.finished[owner_id]}; admit a new one to continue")
            raise RequestError(f"unknown id {owner_id!r}; admit it first (runtime.admit)")
        return owner

    @staticmethod
    def noun(owner: Owner) -> str:
        return owner.family.noun

    def _check_idle(self) -> None:
        if self.in_flight is not None:
            raise RequestError(
                f"a forward for {self.in_flight.owner_id!r} is still in flight; finish or abort it before changing state"
            )

    @property
    def reservations(self) -> Reservations:
        """The admission arithmetic over the live allocator, owners and regions (`reservations.py`)."""
        return Reservations(self.allocator, self.owners, self.regions, self.prefix_cache)

    def held_blocks(self) -> int:
        """Managed blocks per layer holding K/V now, idle cached prompt blocks included (they were quantized with the
        current scales): an FP8 pool refuses new scales while any is (`KVPool.set_scales`)."""
        return self.allocator.num_blocks - self.allocator.num_free

    def _check_reserved(self, what: str, need: int, victim: Owner | None, *, shared: Owner | None = None,
                        budget: int | None = None) -> None:
        """Refuse an admission or fork whose reservation does not fit (`Reservations.check`)."""
        self.reservations.check(what, need, victim, shared=shared, budget=budget)

    def _release(self, owner: Owner, why: str) -> None:
        for row in owner.rows:
            self.free(row)
        owner.rows = [[] for _ in owner.rows]
        self.regions.release(owner.owner_id, self.free)
        self.prefix_cache.release(owner.owner_id)
        del self.owners[owner.owner_id]
        self.sharing.discard(owner.owner_id)
        self.finished[owner.owner_id] = why
        while len(self.finished) > self.FINISHED_MEMORY:
            self.finished.popitem(last=False)

    def _lru_victim(self, family, *, sparing: str | None = None, room_for: int = 1) -> Owner | None:
        """The least recently used live owner of `family` to evict so that `room_for` more fit under max_sessions
        (None when they fit, or the family is not LRU-evicted); `sparing` is never chosen (a fork's parent)."""
        if not family.evict_lru or self.max_sessions is None:
            return None
        live = [o for o in self.owners.values() if o.family is family and o.owner_id != sparing]
        if len(live) + room_for + (sparing is not None) <= self.max_sessions:
            return None
        if not live:
            what = f"a fork of {sparing!r}" if sparing is not None else f"a {family.noun}"
            raise RequestError(f"max_sessions={self.max_sessions} leaves no room for {what}; raise it")
        return live[0]

    # ---- lifecycle ------------------------------------------------------------------------------
    def admit(self, owner_id: str, spec: Any, rows: int | None = None, *,
              cross_kv: Sequence[torch.Tensor] | None = None, cache_salt: str | bytes | None = None,
              content_keys: Sequence[str | bytes] | None = None, prompt_tokens: Sequence[Any] | None = None,
              prompt_keys: Sequence[str | bytes] = ()) -> None:
        """Admit a session/request of `spec`'s family with `rows` rows (default: what the spec says).

        All rows or none; past `max_sessions` live owners of an LRU-evicting family, the least recently
        used one is evicted first. Admission reserves the most the owner holds up to its reset (the family's
        `reserve`, e.g. what a session's commits take), refused unless it fits beside what the live owners may
        hold: an admitted owner never waits for a block another one holds (`_check_reserved`). `cross_kv` (per
        layer `(2, rows, tokens, Hkv, D)`, e.g. a model's cross-attention K/V) becomes one shared write-once region
        per row (`regions.py`): a live region of the same `cache_salt` with the same content (`content_keys[row]` if
        given, else the bytes; the bytes are always compared before sharing) is shared by reference count, else the
        row's K/V is written once into blocks of its own. The regions and the rows' blocks are taken in one atomic
        allocation.

        `prompt_tokens` (per row, the prompt's token ids; with `cache_salt` and `prompt_keys`, what else determines
        their K/V) shares the request's leading full prompt blocks with earlier requests by a hash chain
        (`prefix_cache.py`, `_admit_prompt`); its own full prompt blocks are published once its prefill succeeded.
        """
        self._check_idle()
        fam = families.for_spec(spec)
        self._check_new_id(owner_id)
        rows = fam.rows(spec, rows)
        self._check_rows(rows)
        lens = check_prompt_admission(fam, spec, rows, cross_kv) if prompt_tokens is not None else None
        counts = fam.admission_blocks(spec, rows, self)
        reserved = max(sum(counts), fam.reserve(spec, rows, self))  # what the owner may hold up to its reset
        if lens is not None:
            if content_keys is not None:
                raise ConfigError("content_keys key a shared region (cross_kv); a cached prompt is keyed by "
                                  "prompt_tokens, cache_salt and prompt_keys")
            self._admit_prompt(owner_id, fam, spec, counts, lens, prompt_tokens, cache_salt, prompt_keys)
            return
        if prompt_keys:
            raise ConfigError("prompt_keys key a cached prompt prefix: pass them with prompt_tokens")
        if cross_kv is None and (cache_salt is not None or content_keys is not None):
            raise ConfigError("cache_salt and content_keys key a shared region: pass them with cross_kv (or "
                              "cache_salt with prompt_tokens)")
        requests = None if cross_kv is None else self.regions.requests(self.pool, cross_kv, rows, cache_salt,
                                                                       content_keys)
        victim = self._lru_victim(fam)
        if requests is None:
            self._check_reserved(f"admitting {owner_id!r}", reserved, victim)
            if victim is not None:
                self._release(victim, "evicted (LRU cap on live sessions)")
            taken = self.allocate_rows(counts)
        else:
            taken = self._admit_regions(owner_id, counts, reserved, requests, victim)
        self.owners[owner_id] = Owner(owner_id, fam, spec, taken, state=fam.new_state(spec, rows),
                                      serial=next(self._serials), reserved=reserved)

    def prompt_sharing(self, spec: Any, rows: int | None, prompt_tokens: Sequence[Any], cache_salt: Any = None,
                       prompt_keys: Sequence[Any] = ()) -> tuple[tuple[int, ...], ...]:
        """Per row, the cached blocks an admission with these prompt tokens would share now; changes nothing (a
        multi-rank runtime votes on it before admitting, `distributed/rank_runtime.py`)."""
        fam = families.for_spec(spec)
        rows = fam.rows(spec, rows)
        lens = check_prompt_admission(fam, spec, rows, None)
        found = self._prompt_matches(lens, prompt_tokens, cache_salt, prompt_keys)[0]
        return tuple(tuple(c.block for c in row) for row in found)

    def _prompt_matches(self, lens: list[int], prompt_tokens: Sequence[Any], cache_salt: Any,
                        prompt_keys: Sequence[Any]) -> tuple:
        """(per row the cached blocks to share, chains, salt, keys): the same number in every row (the fewest any row
        found confirmed)."""
        cache = self.prefix_cache
        chains, salt, keys = cache.chains(prompt_tokens, lens, self.block_size, cache_salt, prompt_keys)
        found = [cache.match(chain, salt, keys) for chain in chains]
        k = min(len(f) for f in found)
        return [f[:k] for f in found], chains, salt, keys

    def _admit_prompt(self, owner_id: str, fam, spec: Any, counts: list[int], lens: list[int],
                      prompt_tokens: Sequence[Any], cache_salt: Any, prompt_keys: Sequence[Any]) -> None:
        """Admission with a cached prompt prefix: every row shares the same number of leading cached blocks (the
        fewest any row found confirmed: the model runs one suffix for all rows), the rest taken fresh. The owner
        reserves only what it takes: a shared block is counted once, for the cache (`Reservations`)."""
        cache = self.prefix_cache
        shared, chains, salt, keys = self._prompt_matches(lens, prompt_tokens, cache_salt, prompt_keys)
        k = len(shared[0])
        own = [c - k for c in counts]
        reserved = max(sum(own), fam.reserve(spec, len(counts), self))
        revived = len({c.block for row in shared for c in row if c.block in cache.idle})  # idle now, held after
        self._check_reserved(f"admitting {owner_id!r}", reserved + revived, None)
        free = self.allocator.num_free + cache.idle_count - revived
        if sum(own) > free:  # refused before the shared blocks are pinned: nothing changes, the LRU order included
            raise CapacityError(
                f"needs {sum(own)} free blocks per layer beside the {k} cached prompt blocks per row it shares, {free} "
                "are free (idle cached blocks included); retry after other requests finish, or raise the pool budget")
        cache.hold(owner_id, chains, salt, keys, shared, self.allocator)  # pinned first: never evicted for `own`
        try:
            taken = self.allocate_rows(own)
        except BaseException:  # not expected after the check above; give the shares back
            self.free([c.block for row in shared for c in row])
            cache.release(owner_id)
            raise
        rows = [[c.block for c in sh] + t for sh, t in zip(shared, taken)]
        self.owners[owner_id] = Owner(owner_id, fam, spec, rows, state=fam.new_state(spec, len(rows)),
                                      serial=next(self._serials), reserved=reserved,
                                      prefix_ready=tuple([k * self.block_size] * len(rows)) if k else ())
        self.sharing.add(owner_id)

    def _admit_regions(self, owner_id: str, counts: list[int], reserved: int, requests, victim: Owner | None):
        """Admission with shared regions: the rows' blocks and the new regions' in one allocation, regions written
        (or shared) for `owner_id`; checked (with what an eviction would free) before evicting. The rows' blocks."""
        ending = self.regions.ending_with(victim.owner_id) if victim is not None else set()
        plan = self.regions.resolve(self.pool, requests, ending)
        need = counts + plan.new_block_counts(self.block_size)
        free = self.allocator.num_free + (self.reservations.freed_by(victim) if victim is not None else 0)
        if sum(need) > free:
            never = sum(need) > self.allocator.num_blocks
            raise CapacityError(
                f"needs {sum(need)} free blocks per layer (its rows and new shared regions), {free} are free"
                + (" even after evicting the least recently used session" if victim is not None else "")
                + (f"; the whole pool has {self.allocator.num_blocks}: it can never fit" if never else
                   "; retry after other sessions close")
                + ", or raise the pool budget (the family's runtime config sizes room for N regions: cross_regions=N)")
        self._check_reserved(f"admitting {owner_id!r}", reserved + sum(need[len(counts):]), victim)
        if victim is not None:
            self._release(victim, "evicted (LRU cap on live sessions)")
        taken = self.allocate_rows(need)
        try:
            self.regions.admit(owner_id, plan, taken[len(counts):], self.pool, self.allocator)
        except BaseException:
            for ids in taken:
                self.free(ids)
            self.regions.held.pop(owner_id, None)
            raise
        return taken[: len(counts)]

    def reset(self, owner_id: str) -> None:
        """Free every block of an owner's history; it stays admitted (e.g. a window reset)."""
        self._check_idle()
        owner = self._get(owner_id)
        hold = self.prefix_cache.holds.get(owner_id)
        if owner.prefix_ready or (hold is not None and hold.held):
            raise RequestError(
                f"{owner.owner_id!r} holds prompt blocks of the prefix cache (shared with other requests, or published "
                "for them): its reservation counts only the blocks no one shares, so a reset (whose next prefill takes "
                "them all again) is refused; release it and admit it again")
        for row in owner.rows:
            self.free(row)
        owner.rows = [[] for _ in owner.rows]
        owner.version += 1
        self.sharing.discard(owner_id)
        owner.family.history_dropped(owner)

    def fork(self, parent_id: str, child_id: str, **args: Any) -> None:
        """A new owner `child_id` that shares every block of `parent_id` by reference count (no KV is copied).

        Between forwards only, and only where the parent's family allows it now (`Family.fork_state`, e.g. a
        session at a chunk boundary). Parent and child then go their own ways: each next commit writes
        blocks its owner takes for itself, and a block returns to the pool when its last holder frees it.
        The child reserves what its parent does, or, with a budget (`args`, e.g. `commits=n`:
        `Family.fork_budget`), just the blocks it may take; a plan beyond the budget is refused.
        """
        self._check_idle()
        parent = self._get(parent_id)
        fam = parent.family
        state = fam.fork_state(parent, self, **args)
        budget = fam.fork_budget(parent, self, **args)
        self._check_new_id(child_id)
        private = fam.fork_private(parent, self)  # blocks a later forward writes: the child gets its own copies
        copies = sum(len(p) for p in private)
        rows = [list(r) for r in parent.rows]
        shared = [b for row, own in zip(rows, private) for i, b in enumerate(row) if i not in own]
        victim = self._lru_victim(fam, sparing=parent_id)
        # Without a budget the child's own commits need what the parent's do (history is shared until then).
        self._check_reserved(f"forking {parent_id!r} into {child_id!r}", parent.reserved, victim, shared=parent,
                             budget=None if budget is None else budget + copies)
        if victim is not None:
            self._release(victim, "evicted (LRU cap on live sessions)")
        if copies:
            taken = iter(self.allocate_rows([copies])[0])
            for row, source, own in zip(rows, parent.rows, private):
                for i in own:
                    row[i] = next(taken)
                    self._copy_block(source[i], row[i])
        self.allocator.share(shared)
        self.regions.fork(parent_id, child_id, self.allocator)
        self.prefix_cache.fork(parent_id, child_id)
        self.sharing.update((parent_id, child_id))
        self.owners[child_id] = Owner(child_id, parent.family, parent.spec, rows,
                                      phases_done=set(parent.phases_done), state=state, serial=next(self._serials),
                                      reserved=parent.reserved, take_budget=budget, prefix_ready=parent.prefix_ready)

    def _copy_block(self, src: int, dst: int) -> None:
        """Copy local block `src`'s K/V (and FP8 scales) into local block `dst`, in every layer."""
        for base in self.pool.layer_bases.tolist():  # slices and copy_: FP8 pools have no index_put on the CPU
            for held in (self.pool.tensor, self.pool.scales):
                if held is not None:
                    held[:, base + dst].copy_(held[:, base + src])

    def release(self, owner_id: str) -> None:
        """End a session/request normally; all its blocks are freed."""
        self._check_idle()
        self._release(self._get(owner_id), "released")

    def abort(self, owner_id: str) -> None:
        """Abort a request or session at any point between forwards: all its blocks are freed."""
        self._check_idle()
        self._release(self._get(owner_id), "aborted")

    # ---- forwards -------------------------------------------------------------------------------
    def plan(self, owner_id: str, kind: str, **args: Any) -> ForwardPlan:
        """Plan one forward of `kind` for an owner; its family lays out the rows. It is then in flight."""
        self._check_idle()
        owner = self._get(owner_id)
        plan = self._plan_part(owner, kind, args, first_row=0)
        self.owners.move_to_end(owner_id)
        self.in_flight = plan
        return plan

    def _plan_regions(self, plan: ForwardPlan) -> list[Region | None] | None:
        """The shared region each row of an owner's plan reads (its owner row's), or None if it holds none."""
        held = self.regions.held.get(plan.owner_id)
        if not held:
            return None
        rows = plan.owner_rows if plan.owner_rows is not None else range(len(plan.rows))
        return [held[r] for r in rows]

    def _check_writes(self, plan: ForwardPlan) -> None:
        """No forward writes a managed block that another owner also holds (a fork's shared history) or a block
        of a write-once region (written at admission only, whoever holds it)."""
        for r, row in enumerate(plan.rows):
            written = row_written_blocks(row, self.block_size)
            region = [b for b in written if b in self.regions.blocks]
            if region:
                raise RequestError(
                    f"row {r} of this {plan.kind} forward of {plan.owner_id!r} would write blocks {region} of a "
                    "shared write-once region (cross-attention K/V, written once at admission and only read): a "
                    "family must write only blocks it took for the forward. Nothing was planned"
                )
            shared = [b for b in written if self.allocator.refcount(b) > 1]
            if shared:
                raise RequestError(
                    f"row {r} of this {plan.kind} forward of {plan.owner_id!r} would write blocks {shared}, which "
                    "other owners share (a fork): a family must write only blocks it took for the forward. "
                    "Nothing was planned"
                )

    def _plan_part(self, owner: Owner, kind: str, args: dict, first_row: int) -> ForwardPlan:
        """One owner's plan by its family, its rows starting at forward row `first_row`, with the shared region each
        row reads; checked never to write a block another owner shares or a region's. A refused plan gives back
        what it took."""
        source = self if first_row == 0 and owner.take_budget is None else _PlanningFor(self, owner, first_row)
        plan = owner.family.plan(owner, source, kind, **args)
        if owner.owner_id in self.sharing or self.regions.blocks:  # 10-20 us per row on the host: only when shared
            try:
                self._check_writes(plan)
            except BaseException:
                for new in plan.new_blocks:
                    self.free(new)
                raise
        regions = self._plan_regions(plan)
        return plan if regions is None else dataclasses.replace(plan, regions=regions)  # a plan is never edited

    def plan_batch(self, items: Sequence[tuple]) -> ForwardPlan:
        """One forward carrying the rows of several owners at the same phase; it is then in flight.

        items: ``(owner_id, kind)`` or ``(owner_id, kind, args)`` per owner (args: what `plan` takes, e.g.
        ``{"branch": 0}``). Each owner is planned by its family as if alone, on the next free scratch rows;
        all must be of one family and kind with the same token count and context (one bucket of the summed
        rows). Finishing applies every owner's part; a failure rolls back every owner. All or nothing: a
        refused batch gives back what its planned parts took and changes nothing.
        """
        self._check_idle()
        parsed = self._batch_items(items)
        parts: list[ForwardPlan] = []
        try:
            for owner, kind, args in parsed:
                parts.append(self._plan_part(owner, kind, args, first_row=sum(len(p.rows) for p in parts)))
            shapes = {(p.tokens, p.context) for p in parts}
            if len(shapes) > 1:
                raise RequestError(
                    "the owners of a batched forward must compute the same tokens over the same context; got "
                    + ", ".join(f"{p.owner_id!r}: {p.tokens} tokens over {p.context}" for p in parts)
                    + ": batch owners at the same phase (same chunk geometry, prefix capacity and target length)"
                )
        except BaseException:
            for part in parts:
                for new in part.new_blocks:
                    self.free(new)
            raise
        plan = self._joined(parts)
        for owner, _, _ in parsed:
            self.owners.move_to_end(owner.owner_id)
        self.in_flight = plan
        return plan

    def _batch_items(self, items: Sequence[tuple]) -> list[tuple[Owner, str, dict]]:
        """(owner, kind, args) per batch item: distinct live owners of one family at one kind, or RequestError."""
        if not items:
            raise RequestError("a batched forward needs at least one (owner_id, kind) item")
        parsed = []
        for item in items:
            if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                raise RequestError(f"batch items are (owner_id, kind) or (owner_id, kind, args), got {item!r}")
            parsed.append((item[0], item[1], dict(item[2]) if len(item) == 3 else {}))
        ids = [oid for oid, _, _ in parsed]
        twice = sorted({oid for oid in ids if ids.count(oid) > 1})
        if twice:
            raise RequestError(f"{twice} appear more than once in one batched forward; a batch carries an owner once")
        owners = [self._get(oid) for oid in ids]
        if len({o.family.name for o in owners}) > 1 or len({kind for _, kind, _ in parsed}) > 1:
            raise RequestError(
                "a batched forward carries owners of one family at one phase; got "
                + ", ".join(f"{oid!r} ({o.family.name} {kind})" for (oid, kind, _), o in zip(parsed, owners))
                + ": plan the others in their own forward"
            )
        return [(owner, kind, args) for owner, (_, kind, args) in zip(owners, parsed)]

    def _joined(self, parts: list[ForwardPlan]) -> ForwardPlan:
        """One forward plan over the parts' rows in order; finishing or rolling it back applies every part."""
        regions = ([g for p in parts for g in (p.regions or [None] * len(p.rows))]
                   if any(p.regions for p in parts) else None)
        keys = tuple(p.key for p in parts)
        positions = [k for p in parts for k in p.key_positions] if all(p.key_positions for p in parts) else None
        first = parts[0]
        return ForwardPlan(
            "+".join(p.owner_id for p in parts), first.kind, [r for p in parts for r in p.rows], first.tokens,
            first.context, key=keys if all(keys) else (), keeps_kv=any(p.keeps_kv for p in parts),
            phase=first.phase, key_positions=positions, parts=parts, regions=regions,
        )

    def finish_forward(self, plan: ForwardPlan) -> None:
        """The forward ran: each owner's family applies its part (e.g. a commit becomes history)."""
        self.check_in_flight(plan)
        for part in plan.owner_plans():
            owner = self.owners[part.owner_id]
            owner.family.finish(owner, part, self)
            owner.phases_done.add(part.kind)
            if part.keeps_kv and owner.owner_id in self.prefix_cache.holds:  # its prompt K/V exist now: publish
                published = self.prefix_cache.publish(owner.owner_id, owner.rows, self.allocator)
                owner.reserved = max(owner.reserved - published, 0)  # the cache reserves them now (`pinned_count`)
                self.sharing.add(owner.owner_id)  # its published blocks are shared: its plans are write-checked
            if owner.take_budget is not None:
                owner.take_budget -= sum(len(new) for new in part.new_blocks)
        self.in_flight = None

    def abort_forward(self, plan: ForwardPlan) -> None:
        """The forward failed: give back what it took for every owner; history and prefixes are as before."""
        self.check_in_flight(plan)
        for part in plan.owner_plans():
            for new in part.new_blocks:
                self.free(new)
        self.in_flight = None

    def check_in_flight(self, plan: ForwardPlan) -> None:
        """Refuse a plan that is not the one in flight (finished twice, or stale)."""
        if self.in_flight is not plan:
            raise RequestError("this forward plan is not the one in flight (finished twice, or stale)")

    def owned_blocks(self) -> dict[str, list[list[int]]]:
        """Snapshot of ownership (for tests and the state-unchanged checks); regions: `regions_of`."""
        return {oid: [list(r) for r in o.rows] for oid, o in self.owners.items()}

    def regions_of(self, owner_id: str) -> list[Region]:
        """The shared write-once regions a live owner holds, one per row ([] if it brought none)."""
        self._get(owner_id)
        return self.regions.of(owner_id)
