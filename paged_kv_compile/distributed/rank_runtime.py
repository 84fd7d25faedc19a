"""RankRuntime: one rank's PagedKVRuntime whose every state change the whole model-parallel group agrees on.

Why agreement by vote rather than one rank deciding and broadcasting: the decisions (admission, LRU eviction,
forks, window resets, a HunyuanImage-3 prefill's layout read, a commit's blocks) are deterministic functions of
the call sequence and of each rank's own state, so ranks that make the same calls reach the same state by
construction; TP and Ulysses ranks even reach the same block ids. What can differ is what a rank checks against
its OWN data: a CFG-parallel rank holds its own branch's rows (HunyuanImage-3 rows of different prompt lengths
need different block counts, so one rank can run out of blocks while another does not) and reads its own mask;
a rank can fail inside its forward. Broadcasting one rank's decisions would ship block ids that mean nothing to
a rank with other rows, and would not see the other ranks' failures at all. So each rank decides locally and
the ranks vote (agreement.py, one small all-reduce):

  * a lifecycle call (admit, reset, release, abort, fork, set_scales) is applied locally -- the runtime validates
    before it mutates, so a refusal changes nothing -- then voted on; if any rank refused or faulted, every rank
    restores, in place, what it saved just before (snapshot.py: nothing keeps a reference to replaced state), so
    every rank ends exactly where it started and raises;
  * a forward is planned and its metadata built (every refusal a forward can meet before compute), then voted
    on BEFORE the model runs: a rank never enters the model's own collectives (TP all-reduces) alone; after the
    body, every check that can refuse the forward (`PagedKVRuntime.verify_forward`) runs, then a second vote
    decides commit or roll back on every rank, so a fault or refusal on one rank rolls back all of them;
  * every vote carries a digest of the decision state (owners, versions, phases: equal on every rank) and one of
    what each rank is about to compute (equal within the TP x Ulysses ranks of one CFG rank): the call's arguments
    by value (`canonical`), a forward's bucket and plan geometry (`plan_geometry`) and, on lifecycle calls and every
    `digest_every`-th forward, the block tables: a rank that diverged raises DivergenceError on every rank before
    anything is computed.

A fault BETWEEN the model's own collectives on one TP rank (say, an exception in layer 0's attention on rank 1
only) leaves the other ranks waiting in the model's all-reduce, not in ours: that is the engine's collective, and
vLLM behaves the same. The runtime's own checks inside compiled sites depend only on the plan and the compiled
expectation, which symmetric ranks share, so they fail on all of them or none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from .. import families
from ..errors import ConfigError, PagedKVError
from ..runtime import PagedKVRuntime
from .agreement import Agreement, Ballot, digest
from .parallel_config import ParallelConfig
from .snapshot import LifecycleSnapshot

#: PagedKVRuntime members a RankRuntime passes through: they read state, or bind and hand out stand-ins
#: (identical on every rank). Compiled sites talk to the agreed forward itself (`active`, a ForwardContext).
_PASS_THROUGH = frozenset({
    "config", "pool", "scheduler", "metadata", "active", "generation", "bucket_misses", "bind", "standin",
    "region_standin", "is_standin", "bucket_for", "allow_unconfigured_buckets", "warmup_forward", "owner",
    "owner_ids", "regions_of", "state", "close",
})
#: state-changing members that would bypass the vote
_REFUSED = frozenset({"plan", "forward_plan"})


def model_parallel_cpu_group() -> Any:
    """The gloo group of the ranks that serve one request together, from vllm-omni: its world's CPU group when
    there is no data parallelism (each data-parallel replica serves other requests and needs a group of its own)."""
    ps = sys.modules.get("vllm_omni.diffusion.distributed.parallel_state")
    if ps is None or not ps.model_parallel_is_initialized():
        raise ConfigError(
            "vllm-omni's parallel groups are not initialised in this process: pass RankRuntime(group=...) a gloo "
            "process group of the ranks that serve one request together (e.g. torch.distributed.group.WORLD)"
        )
    if ps.get_data_parallel_world_size() != 1:
        raise ConfigError(
            f"data parallel size {ps.get_data_parallel_world_size()}: replicas serve different requests, so each needs "
            "its own agreement group; pass RankRuntime(group=...) the gloo group of this replica's ranks"
        )
    return ps.get_world_group().cpu_group


def canonical(value: Any) -> Any:
    """A call argument as a comparable value: specs and other dataclasses field by field (by value, not by type
    name), tensors by shape, dtype and -- on the host -- a digest of their bytes; on an accelerator by shape and
    dtype only (reading them would sync the device on every forward: what the rank computes from them is in the
    plan, whose geometry the forward's vote compares)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.is_sparse:
            return ("tensor", tuple(value.shape), str(value.dtype), str(value.device.type))
        data = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        return ("tensor", tuple(value.shape), str(value.dtype), digest(data.tobytes()))
    if isinstance(value, np.ndarray):
        return ("ndarray", value.shape, str(value.dtype), digest(np.ascontiguousarray(value).tobytes()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__,
                tuple((f.name, canonical(getattr(value, f.name))) for f in dataclasses.fields(value)))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(canonical(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(k), canonical(v)) for k, v in value.items())))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(canonical(v)) for v in value)))
    if isinstance(value, (int, float, str, bytes, bool, type(None))):
        return value
    raise ConfigError(
        f"a RankRuntime call argument of type {type(value).__name__} cannot be compared between ranks: pass ints, "
        "strings, tensors, tuples/lists/dicts of them or dataclasses (the family's spec)"
    )


def plan_geometry(plan: Any, bucket: Any) -> int:
    """What a planned forward will compute on this rank: its bucket, kind, and every row's block table, managed
    mask, query positions and visible ends, the blocks it took, the regions it reads (equal within one symmetric
    group, whose ranks hold identical block geometry)."""
    rows = b"".join(b"".join(np.ascontiguousarray(a).tobytes() for a in row.arrays) + b"\x1e" for row in plan.rows)
    regions = [None if r is None else tuple(r.blocks) for r in (plan.regions or ())]
    return digest((bucket.rows, bucket.tokens, bucket.context), plan.kind, plan.keeps_kv, rows, plan.new_blocks, regions, plan.phase)


class RankRuntime:
    """A `PagedKVRuntime` for one rank, with the generic runtime API; every state change is voted on.

    runtime: this rank's runtime, sized by `ParallelConfig.rank_config`; parallel: explicit configuration, checked
    against vllm-omni's parallel_state when that is initialised (`ParallelConfig.resolve`); group: the gloo group of
    the model-parallel ranks (default: `model_parallel_cpu_group()`); digest_every: compare block tables every N
    forwards (decision digests are compared at every vote; block tables at every lifecycle call too).
    """

    def __init__(self, runtime: PagedKVRuntime, parallel: ParallelConfig | None = None, *, group: Any = None,
                 digest_every: int = 16) -> None:
        if digest_every < 1:
            raise ConfigError(f"digest_every must be >= 1, got {digest_every}")
        self.runtime = runtime
        self.parallel = ParallelConfig.resolve(parallel)
        self.digest_every = digest_every
        self.agreement = Agreement(group if group is not None else model_parallel_cpu_group(),
                                   symmetric_group=self.parallel.cfg_rank, num_symmetric=self.parallel.cfg_parallel)
        if self.agreement.size != self.parallel.model_parallel_size:
            raise ConfigError(
                f"the agreement group has {self.agreement.size} ranks but {self.parallel.describe()} needs "
                f"{self.parallel.model_parallel_size}: pass the gloo group of exactly the ranks serving one request"
            )
        self.calls = 0  # agreed calls so far (every rank counts the same ones)
        self.forwards = 0  # agreed forwards so far

    def __getattr__(self, name: str) -> Any:
        if name in _PASS_THROUGH:
            return getattr(self.runtime, name)
        if name in _REFUSED:
            raise AttributeError(
                f"RankRuntime.{name} is not available: a plan made outside the vote could differ between ranks; use "
                "`with rank_runtime.forward(owner_id, kind, **args):` (or forward_batch) so that every rank agrees"
            )
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    # ---- digests --------------------------------------------------------------------------------
    def _decisions(self, call: tuple) -> int:
        """What every rank must share: the call counter, owners in LRU order with family, rows, version, phases and
        admission serial."""
        sched = self.runtime.scheduler
        owners = tuple((o.owner_id, o.family.name, o.num_rows, o.version, tuple(sorted(o.phases_done)), o.serial)
                       for o in sched.owners.values())
        return digest(self.calls, owners, sched.in_flight is not None)

    def _tables(self) -> int:
        """What the ranks of one symmetric group must share between calls: every owner's block ids and block
        reservations, free blocks, regions (reservations are block counts: CFG ranks' rows may differ)."""
        sched = self.runtime.scheduler
        # prefix_ready: what a CFG rank's own rows found cached (branches' prompts differ, so it is compared here)
        tables = [np.asarray([len(o.rows), o.reserved, -1 if o.take_budget is None else o.take_budget,
                              len(o.prefix_ready), *o.prefix_ready]
                             + [b for row in o.rows for b in (len(row), *row)], dtype=np.int64).tobytes()
                  for o in sched.owners.values()]
        # regions by blocks and holders, not by registry key: a rank keys a region by the bytes IT stores, and a TP
        # rank stores its own heads (keys differ between TP ranks that hold the same blocks)
        regions = {oid: [(tuple(r.blocks), r.tokens, r.holders) for r in regs] for oid, regs in sched.regions.held.items()}
        # cached prompt blocks are keyed by token ids and the caller's keys (equal on every rank), not by K/V bytes
        return digest(sched.allocator.num_free, b"".join(tables), regions, sched.prefix_cache.snapshot())

    def _ballot(self, call: tuple, args: Any) -> Ballot:
        """The call's arguments (canonical: by value) and the block tables, compared within the symmetric group (a
        CFG rank passes its own branch's spec and rows); an argument that cannot be compared is this rank's
        refusal (voted on: the others never wait alone)."""
        ballot = Ballot(call=call, decisions=self._decisions(call))
        try:
            ballot.geometry = digest(canonical(args), self._tables())
        except Exception as e:  # noqa: BLE001 - voted on, then re-raised
            ballot.error = e
        return ballot

    # ---- lifecycle: apply, vote, restore if any rank refused ------------------------------------------------
    def _lifecycle(self, operation: str, owner_id: str | None, args: Any, apply: Callable[[], None],
                   protect: Sequence[int] = (), *, scales: bool = False) -> None:
        """protect: local blocks whose pool bytes the call may overwrite while they belong to an owner it may evict
        (an LRU victim of an admission that writes shared regions): saved too, restored with the scheduler.

        Every rank restores when the vote fails, the rank whose own call raised too: a refusal changes nothing
        (the runtime validates first), but a fault part-way through the call may have changed something."""
        call = (operation, owner_id, None, self.calls)
        ballot = self._ballot(call, args)
        saved = None
        try:
            saved = LifecycleSnapshot(self.runtime, protect, scales=scales)
            if ballot.error is None:
                apply()
        except Exception as e:  # noqa: BLE001 - voted on, then re-raised
            ballot.error = e
        except BaseException:  # an interrupt: no vote follows; leave this rank as it was, the undo log closed
            if saved is not None:
                saved.restore()
            self.calls += 1
            raise
        try:
            self.agreement.vote(ballot)
        except BaseException:
            if saved is not None:
                saved.restore()
            raise
        else:
            saved.keep()  # the vote passed: no rank's call raised, so the snapshot was taken
        finally:
            self.calls += 1

    def agreed(self, operation: str, owner_id: str | None, args: Any, apply: Callable[[], None],
               protect: Sequence[int] = ()) -> None:
        """A lifecycle call of another module (e.g. `kv_import`: reserve, import) on every rank or none: `apply`
        changes this rank's runtime, validating before it mutates; `args` (compared within the symmetric group)
        say what the call does; `protect`: local blocks whose bytes it may write, put back if any rank refused."""
        self._lifecycle(operation, owner_id, args, apply, protect)

    def _blocks_an_admission_may_overwrite(self, spec: Any) -> list[int]:
        """An admission that writes shared regions may evict the least recently used owner first and write into
        the blocks it freed: if another rank then refuses, the restored victim must find its K/V as it was."""
        sched = self.runtime.scheduler
        try:
            victim = sched._lru_victim(families.for_spec(spec))
        except PagedKVError:
            return []  # the admission will be refused before it evicts anything
        if victim is None:
            return []
        return sorted({b for row in victim.rows for b in row}
                      | {b for r in sched.regions.of(victim.owner_id) for b in r.blocks})

    def admit(self, owner_id: str, spec: Any, rows: int | None = None, *,
              cross_kv: Sequence[torch.Tensor] | None = None, cache_salt: str | bytes | None = None,
              content_keys: Sequence[str | bytes] | None = None, prompt_tokens: Sequence[Any] | None = None,
              prompt_keys: Sequence[str | bytes] = ()) -> None:
        """`PagedKVRuntime.admit` on every rank or none. Under CFG-parallel each rank admits its own rows (its
        branch's spec and `rows`): the ranks agree on the decision, not on block counts. With `prompt_tokens`, the
        cached blocks each rank would share (`Scheduler.prompt_sharing`) are part of the vote: the ranks of a
        symmetric group share the same prompt blocks or none admits."""
        # cross_kv by shape only: a TP rank holds its own heads' K/V (content differs between the ranks)
        shapes = None if cross_kv is None else [(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor)
                                                else type(t).__name__ for t in cross_kv]
        args = {"rows": rows, "spec": spec, "cross_kv": shapes, "cache_salt": cache_salt,
                "content_keys": content_keys}
        if prompt_tokens is not None:
            try:  # a bad argument is refused by the admission itself, on this rank, and voted on
                sharing = self.runtime.scheduler.prompt_sharing(spec, rows, prompt_tokens, cache_salt, prompt_keys)
            except PagedKVError:
                sharing = None
            args.update(prompt_tokens=prompt_tokens, prompt_keys=prompt_keys, prompt_sharing=sharing)
        protect = self._blocks_an_admission_may_overwrite(spec) if cross_kv is not None else []
        self._lifecycle("admit", owner_id, args, lambda: self.runtime.admit(
            owner_id, spec, rows, cross_kv=cross_kv, cache_salt=cache_salt, content_keys=content_keys,
            prompt_tokens=prompt_tokens, prompt_keys=prompt_keys), protect)

    def reset(self, owner_id: str) -> None:
        self._lifecycle("reset", owner_id, None, lambda: self.runtime.reset(owner_id))

    def release(self, owner_id: str) -> None:
        self._lifecycle("release", owner_id, None, lambda: self.runtime.release(owner_id))

    def abort(self, owner_id: str) -> None:
        self._lifecycle("abort", owner_id, None, lambda: self.runtime.abort(owner_id))

    def fork(self, parent_id: str, child_id: str, **args: Any) -> None:
        """`PagedKVRuntime.fork` on every rank or none (args: the family's, e.g. DreamZero's `commits=` budget)."""
        self._lifecycle("fork", parent_id, (child_id, args), lambda: self.runtime.fork(parent_id, child_id, **args))

    def set_scales(self, k_scale: torch.Tensor | float, v_scale: torch.Tensor | float) -> None:
        """`KVPool.set_scales` on every rank or none (refused on every rank while any rank holds a block). The
        scales are compared by shape: a TP rank passes its own kv heads' scales."""
        shapes = [tuple(torch.as_tensor(s).shape) for s in (k_scale, v_scale)]
        self._lifecycle("set_scales", None, shapes, lambda: self.runtime.pool.set_scales(k_scale, v_scale),
                        scales=True)

    # ---- forwards ------------------------------------------------------------------------------------
    def forward(self, owner_id: str, kind: str, **args: Any) -> contextlib.AbstractContextManager:
        """`PagedKVRuntime.forward` on every rank: planned, voted on before the model runs, committed or rolled
        back on every rank together."""
        return self._forward(("forward", owner_id, kind), args,
                             lambda: self.runtime.scheduler.plan(owner_id, kind, **args))

    def forward_batch(self, items: Sequence[tuple]) -> contextlib.AbstractContextManager:
        """`PagedKVRuntime.forward_batch` on every rank (items: (owner_id, kind) or (owner_id, kind, args))."""
        ids = "+".join(str(item[0]) for item in items)
        kinds = "+".join(str(item[1]) for item in items)
        return self._forward(("forward_batch", ids, kinds), list(items),
                             lambda: self.runtime.scheduler.plan_batch(items))

    @contextlib.contextmanager
    def _forward(self, what: tuple, args: Any, plan: Callable[[], Any]) -> Iterator[Any]:
        """Plan, vote on what each rank is about to compute (the call, its arguments, the plan's bucket and
        geometry), run the body, run every check that can refuse the forward, vote, then all commit or all roll
        back."""
        call = (*what, self.calls)
        tables = self._tables() if self.forwards % self.digest_every == 0 else None
        ballot = Ballot(call=call, decisions=self._decisions(call))
        self.calls += 1
        self.forwards += 1
        with contextlib.ExitStack() as stack:
            active = arguments = None
            try:
                arguments = canonical(args)
                active = stack.enter_context(self.runtime.forward_plan(plan()))
            except Exception as e:  # noqa: BLE001 - voted on, then re-raised (the runtime gave back what it took)
                ballot.error = e
            geometry = None if active is None else plan_geometry(active.plan, active.bucket)
            ballot.geometry = digest(arguments, tables, geometry)
            self.agreement.vote(ballot)  # raises on every rank if any refused: the ExitStack rolls this rank back
            end = Ballot(call=("end", *what[1:], call[-1]))
            try:
                yield active
                self.runtime.verify_forward(active)  # every check that can refuse the forward, before the vote
            except BaseException as e:
                end.error = e
                self.agreement.vote(end)  # tells the others; re-raises e: this rank rolls back
                raise  # pragma: no cover - vote() raised already
            self.agreement.vote(end)  # raises if another rank failed: this rank rolls back too
