"""Admission arithmetic: how many blocks per layer the live owners and shared regions may come to hold at once.

Admission and forks reserve the most an owner holds up to its reset (`Owner.reserved`, `Family.reserve`), so an
admitted owner never waits for a block another holds. This module answers the questions that needs, on the
scheduler's live state (read when asked, never kept: a multi-rank restore replaces the allocator and the owners):
what releasing an owner would free, what the live owners may hold whatever they do next, and whether one more
reservation fits beside them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping

from .errors import CapacityError

if TYPE_CHECKING:
    from .allocator import BlockAllocator
    from .families.base import Owner
    from .prefix_cache import PrefixCache
    from .regions import SharedRegions


class Reservations:
    """The reservation arithmetic over one scheduler's allocator, owners and shared regions (as they are now)."""

    def __init__(self, allocator: BlockAllocator, owners: Mapping[str, Owner], regions: SharedRegions,
                 prefix: PrefixCache | None = None) -> None:
        self.allocator = allocator
        self.owners = owners
        self.regions = regions
        self.prefix = prefix

    def held(self) -> int:
        """Managed blocks per layer held now (by owners' rows and by shared regions); an idle cached prompt block
        (`prefix_cache.py`: no owner holds it) counts as free, an allocation evicts it when it needs the room."""
        idle = self.prefix.idle_count if self.prefix is not None else 0
        return self.allocator.num_blocks - self.allocator.num_free - idle

    def alone_held(self, owner: Owner, *, with_regions: bool = False) -> int:
        """Managed blocks of `owner`'s rows (and, `with_regions`, of its regions) that no other holder shares: those
        whose reference count is the owner's own holds. With its regions: what releasing it would free."""
        lists: Iterable[list[int]] = owner.rows
        if with_regions:
            lists = [*owner.rows, *(r.blocks for r in self.regions.of(owner.owner_id))]
        mine: dict[int, int] = {}
        for blocks in lists:
            for b in blocks:
                mine[b] = mine.get(b, 0) + 1
        index = self.prefix.index_refs if self.prefix is not None else (lambda b: 0)
        # the prefix cache's own reference is no holder: a block it caches that only `owner` holds turns idle (free)
        return sum(1 for b, n in mine.items() if self.allocator.refcount(b) - index(b) == n)

    def freed_by(self, owner: Owner) -> int:
        """How many blocks releasing `owner` would free: those it alone holds (rows and regions)."""
        return self.alone_held(owner, with_regions=True)

    def committed(self, without: Owner | None = None, shared: Owner | None = None,
                  new: tuple[int, int] = (0, 0)) -> int:
        """Blocks per layer the pool may have to hold at once for the live owners and regions, whatever they do
        next (forwards take blocks only within the owners' reservations and budgets). `without`: as if that owner
        were released (an LRU eviction); `shared`: as if every block of that owner were shared (it is being forked);
        `new`: (reservation, growth) of an owner about to join.

        The smaller of two upper bounds, both always valid:
        - the sum of the reservations and the region blocks: each owner holds at most its reservation (a fork
          reserves its parent's: it may come to hold a window of its own), a shared block counted once;
        - what is held now plus what each owner may still add: a fork with a budget takes at most its budget; any
          other owner at most its reservation beyond the blocks it alone holds (a block it shares stays held by the
          others even if it drops it). This one is what lets K forks that commit once fit beside their parent.
        """
        owners = [o for o in self.owners.values() if o is not without]
        ending = self.regions.ending_with(without.owner_id) if without is not None else set()
        freed = {b for r in self.regions.of(without.owner_id) if id(r) in ending for b in r.blocks} if ending else ()
        # cached prompt blocks an owner holds are counted once, for the cache (a sharer reserves only its own blocks)
        pinned = self.prefix.pinned_count if self.prefix is not None else 0
        reservations = sum(o.reserved for o in owners) + len(self.regions.blocks) - len(freed) + pinned + new[0]
        used = self.held() - (self.freed_by(without) if without else 0)
        growth = sum(o.take_budget if o.take_budget is not None else
                     max(o.reserved - (0 if o is shared else self.alone_held(o)), 0) for o in owners) + new[1]
        return min(reservations, used + growth)

    def check(self, what: str, need: int, victim: Owner | None, *, shared: Owner | None = None,
              budget: int | None = None) -> None:
        """Refuse an admission or fork of reservation `need` (a fork: its parent's; `budget`: what a fork with a
        budget may take) that does not fit beside what the live owners may hold (`committed`; `shared`: the owner
        being forked; `victim`: the owner an LRU eviction would release first).

        While the committed total fits in the pool, no admitted owner ever waits for a block."""
        pool = self.allocator.num_blocks
        takes = need if budget is None else budget
        committed = self.committed(victim, shared, (need, takes))
        if committed > pool:
            before = committed - takes  # what the others may hold beside it (with a fork: its parent's blocks shared)
            raise CapacityError(
                f"{what} reserves {takes} blocks per layer (the most it takes up to its reset, and its new shared "
                f"regions) but only {max(pool - before, 0)} of the pool's {pool} are free to reserve (live "
                f"sessions, requests and regions may hold {before}"
                + (" even after evicting the least recently used session)" if victim is not None else ")")
                + (": it can never fit; raise the pool budget" if takes > pool else
                   ": retry after another one ends, or raise the pool budget (the family's runtime config reserves "
                   "room for exactly N owners: sessions=N, requests=N)"))
