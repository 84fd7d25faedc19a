"""What a lifecycle call may change on one rank, saved so that it can be put back IN PLACE.

A `RankRuntime` applies a lifecycle call (admit, reset, release, abort, fork) locally, then votes; if any rank
refused or faulted, every rank puts back what it had. Two rules shape this snapshot:

  * restore into the same objects, never swap in copies: other code holds references to the scheduler's parts
    (the allocator, the owners, the region registry, the pool); a swapped-in copy leaves them reading dead state
    (a guard over a replaced allocator saw 0 blocks held while the live one held 2);
  * cost what the call touches, not what the pool holds: the allocator keeps an undo log of its own calls
    (`allocator.py`: exact, the free list's order included, O(blocks touched)), so pools of tens of thousands of
    blocks per layer cost what small ones do (a deep copy of vLLM's linked free list overflowed the stack at about
    200 blocks). The rest is small: owners' block lists, their family records, the region registry, the finished
    ids; and the pool bytes of the blocks the call may overwrite while an owner it may evict holds them.
"""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict
from typing import Sequence

import torch

from ..runtime import PagedKVRuntime


class LifecycleSnapshot:
    """Taken just before a lifecycle call; then exactly one of `restore()` (put everything back) or `keep()`."""

    def __init__(self, runtime: PagedKVRuntime, protect: Sequence[int] = (), *, scales: bool = False) -> None:
        """protect: local blocks whose pool bytes to save (every layer); scales: save the FP8 scales too (a
        `set_scales` call: they span the whole pool, so only the call that writes them saves them)."""
        sched = runtime.scheduler
        self.runtime = runtime
        self.owners = [(o, self._owner_vars(o)) for o in sched.owners.values()]
        self.finished = list(sched.finished.items())
        self.sharing = set(sched.sharing)
        self.in_flight = sched.in_flight
        self.serial = next(sched._serials)  # what the next serial is (the counter cannot be read without a step)
        sched._serials = itertools.count(self.serial)
        regions = sched.regions
        self.by_digest = {d: list(rs) for d, rs in regions._by_digest.items()}
        self.held = {oid: list(rs) for oid, rs in regions.held.items()}
        self.region_blocks = set(regions.blocks)
        self.holders = [(r, r.holders) for rs in regions._by_digest.values() for r in rs]
        self.prefix_cache = sched.prefix_cache.save()
        self.index = runtime.pool.layer_block_ids(list(protect))
        self.data = runtime.pool.tensor[:, self.index].clone() if len(self.index) else None
        pool_scales = runtime.pool.scales
        self.scales = pool_scales.clone() if scales and pool_scales is not None else None
        sched.allocator.begin_undo()

    @staticmethod
    def _owner_vars(owner) -> dict:
        saved = dict(vars(owner))
        saved["rows"] = [list(r) for r in owner.rows]
        saved["phases_done"] = set(owner.phases_done)
        saved["state"] = copy.deepcopy(owner.state)  # the family's records (a layout, chunk counts): small
        return saved

    def keep(self) -> None:
        self.runtime.scheduler.allocator.end_undo()

    def restore(self) -> None:
        """Every part back as it was, in the objects that held it."""
        sched = self.runtime.scheduler
        sched.allocator.undo()
        sched.owners.clear()
        for owner, saved in self.owners:
            vars(owner).clear()
            vars(owner).update(saved)
            sched.owners[owner.owner_id] = owner
        sched.finished.clear()
        sched.finished.update(OrderedDict(self.finished))
        sched.sharing.clear()
        sched.sharing.update(self.sharing)
        sched.in_flight = self.in_flight
        sched._serials = itertools.count(self.serial)
        regions = sched.regions
        regions._by_digest.clear()
        regions._by_digest.update(self.by_digest)
        regions.held.clear()
        regions.held.update(self.held)
        regions.blocks.clear()
        regions.blocks.update(self.region_blocks)
        for region, holders in self.holders:
            region.holders = holders
        sched.prefix_cache.restore(self.prefix_cache)
        if self.data is not None:
            self.runtime.pool.tensor[:, self.index] = self.data
        if self.scales is not None:
            self.runtime.pool.scales.copy_(self.scales)
