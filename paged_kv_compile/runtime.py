"""PagedKVRuntime: owns the pool, admits and releases work, and brackets every forward.

The API is the same for every model family (`families/`): ``runtime.admit(owner_id, spec)``, then per model
forward ``with runtime.forward(owner_id, kind, **args): model(...)`` (the owner's family plans it: which rows,
which blocks, what each query sees), ``runtime.reset(owner_id)`` between windows, ``runtime.release(owner_id)``
or ``runtime.abort(owner_id)`` at the end. A forward's plan is turned into the bucket's metadata for all layers
in one step, compiled sites read it while the block runs, and on exit the forward is committed, or rolled back
if the block raised.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from typing import Any, Iterator, Sequence

import torch

from . import binding, forward_context
from .allocator import make_allocator
from .config import Bucket, PagedKVConfig
from .errors import RequestError
from .families.base import ForwardPlan, Owner
from .forward_context import ForwardContext
from .metadata import MetadataBuilder
from .ops import write_attend as write_attend_op
from .pool import KVPool
from .scheduler import Scheduler

WARMUP_OWNER = "<warm-up>"


class PagedKVRuntime:
    """The pool, the block ownership, the per-forward metadata and the cache stand-ins of one model."""

    def __init__(
        self,
        config: PagedKVConfig,
        *,
        allocator: str = "builtin",
        max_sessions: int | None = None,
        min_tokens_per_layer: int = 0,
    ) -> None:
        self.config = config
        runtime = weakref.ref(self)  # the pool must not keep its runtime alive (bindings die with the runtime)
        self.pool = KVPool.from_config(config, min_tokens_per_layer=min_tokens_per_layer,
                                       blocks_held=lambda: 0 if runtime() is None else runtime().scheduler.held_blocks())
        self.scheduler = Scheduler(
            self.pool, make_allocator(allocator, self.pool.blocks_per_layer),
            max_rows=config.max_rows, max_sessions=max_sessions,
        )
        self.metadata = MetadataBuilder(self.pool, region_tokens=config.region_tokens, kv_gaps=config.kv_gaps)
        self.active: ForwardContext | None = None  # the forward in progress: what compiled sites talk to
        self.generation = 0
        self._standin_base = torch.zeros((), dtype=config.dtype, device=config.device)
        binding.register_standin_storage(self._standin_base)
        self._region_standin_base = torch.zeros((), dtype=config.dtype, device=config.device)
        binding.register_standin_storage(self._region_standin_base, region=True)
        self._writable_standins: dict[tuple[int, ...], torch.Tensor] = {}
        self.bucket_misses: collections.Counter[Bucket] = collections.Counter()  # shape -> forwards refused/let through
        self._allow_unconfigured = False  # see allow_unconfigured_buckets()
        self.bound = False  # a model's layers were bound: its forwards must run paged attention

    # ---- binding and stand-ins ----------------------------------------------------------------
    def bind(self, layers: Sequence[torch.nn.Module]) -> None:
        """Tie layer i of this runtime to `layers[i]` (by its parameters' addresses). From then on every forward
        must run paged attention (`_check_attention_ran`): a model is bound to be served through compiled sites."""
        binding.bind_layers(self, layers)
        self.bound = True

    def standin(self, *shape: int, writable: bool = False) -> torch.Tensor:
        """A dense-cache-shaped tensor that compiled graphs never read.

        The default holds no memory (a zero-stride view). A cache the model writes into in place
        (a prefix store written at the prefill) cannot be zero-stride: dynamo refuses in-place writes into
        overlapping memory. `writable=True` gives one real buffer per shape, shared by all layers; the
        passes remove the writes, so compiled graphs neither read nor write it.
        """
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if not writable:
            return self._standin_base.expand(*shape)
        buf = self._writable_standins.get(shape)
        if buf is None:
            buf = torch.zeros(shape, dtype=self.config.dtype, device=self.config.device)
            binding.register_standin_storage(buf)
            self._writable_standins[shape] = buf
        return buf

    def region_standin(self, *shape: int) -> torch.Tensor:
        """A zero-stride stand-in for K/V the model reads from a shared write-once region (cross-attention K/V,
        `(2, B, tokens, H, D)`): compiled graphs read the forward's regions with `paged_kv::attend`."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return self._region_standin_base.expand(*shape)

    def is_standin(self, tensor: torch.Tensor) -> bool:
        return binding.is_standin(tensor)

    # ---- buckets ------------------------------------------------------------------------------
    def allow_unconfigured_buckets(self, allowed: bool = True) -> None:
        """Let a forward whose shape is not a configured bucket run as its own bucket (recorded in
        `bucket_misses`) instead of raising; `capture.CapturedBlocks(fallback="eager")` turns it on."""
        self._allow_unconfigured = allowed

    def bucket_for(self, rows: int, tokens: int, context: int) -> Bucket:
        """The configured bucket of exactly this shape (rows and tokens are what the model computes)."""
        wanted = Bucket(rows, tokens, context)
        if not self.config.buckets:
            return wanted  # no bucket list configured: every shape is its own bucket
        if wanted in self.config.buckets:
            return wanted
        self.bucket_misses[wanted] += 1
        if self._allow_unconfigured:
            return wanted
        raise RequestError(
            f"no configured bucket for rows={rows}, tokens={tokens}, context={context}; configured: "
            f"{sorted(self.config.buckets)}. Pad the forward to a configured shape or add this bucket"
        )

    # ---- forwards -----------------------------------------------------------------------------
    def forward(self, owner_id: str, kind: str, **args: Any) -> contextlib.AbstractContextManager[ForwardContext]:
        """``with runtime.forward(owner_id, kind, **args): model(...)``: one model forward of an owner, planned by
        its family (the kinds and their args are the family's: see its module under `families/`), committed when
        the body returns, rolled back if it raises."""
        self._check_not_nested()  # before planning: a plan takes blocks
        return self.forward_plan(self.scheduler.plan(owner_id, kind, **args))

    def plan(self, owner_id: str, kind: str, **args: Any) -> ForwardPlan:
        """Plan a forward without running it (it is in flight until `forward_plan(plan)` runs it or
        `scheduler.abort_forward(plan)` gives it back): for callers that inspect the plan first."""
        return self.scheduler.plan(owner_id, kind, **args)

    @contextlib.contextmanager
    def forward_plan(self, plan: ForwardPlan, *, expect_attention: bool = True) -> Iterator[ForwardContext]:
        """Build the plan's metadata once, run the body with it active, then commit or roll back.

        expect_attention=False: the body deliberately runs no paged attention (a test or a benchmark of the
        runtime's own host work); otherwise a forward in which none ran is refused (`_check_attention_ran`)."""
        # Refusals that concern another forward come first: a forward while one is active (nesting; a plan made
        # inside a warm-up is handed back, the active forward's own plan is left alone), or a plan already
        # finished/aborted (stale; its blocks may belong to someone else by now, so it must never run).
        if self.active is not None:
            if self.scheduler.in_flight is plan and plan is not self.active.plan:  # planned inside a warm-up
                self.scheduler.abort_forward(plan)
            self._check_not_nested()
        self.scheduler.check_in_flight(plan)
        try:
            bucket = self.bucket_for(len(plan.rows), plan.tokens, plan.context)
            meta = self.metadata.build(bucket, plan.rows, plan.key, regions=plan.regions)
        except BaseException:
            self.scheduler.abort_forward(plan)
            raise
        self.generation += 1
        self.active = ForwardContext(plan, bucket, meta, self.generation, owner_of=self.owner,
                                     expect_attention=expect_attention)
        try:
            with write_attend_op.observe_calls(self.active.note_call):
                yield self.active
            self.verify_forward(self.active)
        except BaseException:
            self.active = None
            meta.last_key = ()  # the aborted plan's build is never repeated: a retry may plan another layout
            self.scheduler.abort_forward(plan)
            raise
        self.active = None
        self.scheduler.finish_forward(plan)

    def _check_not_nested(self) -> None:
        if self.active is not None:
            raise RequestError("a forward is already active on this runtime; forwards do not nest (nor run inside "
                               "a warm-up): run it after the with block")

    def verify_forward(self, active: ForwardContext) -> None:
        """Every check that can refuse a forward after its body ran (commit or roll back is decided after them;
        a multi-rank runtime runs them on every rank before the ranks vote on it). Repeatable: reads only."""
        self._check_attention_ran(active)
        self._check_all_layers_wrote(active)

    def _check_attention_ran(self, active: ForwardContext) -> None:
        """A forward of a bound runtime whose body ran no paged attention at all (no compiled site, no call of the
        op) did not use the pool: either its blocks read the cache stand-ins (which hold no data) in plain PyTorch,
        or they ran compiled by backend="paged_kv" with nothing to page (no site read or wrote a stand-in), so the
        forward neither read its history nor kept its K/V. The message names which of the two happened. (A runtime
        no model was bound to is driven by hand: its forwards are not checked.)"""
        if not (self.bound and active.expect_attention and active.plan.rows) or active.attention_ran:
            return
        head = f"no paged attention ran in this {active.plan.kind} forward of {active.plan.owner_id!r}: "
        tail = (" The forward was rolled back. A forward that deliberately runs no attention: "
                "runtime.forward_plan(plan, expect_attention=False)")
        if active.unpaged_calls:
            raise RequestError(
                head + "its blocks ran compiled with backend='paged_kv', but the graphs they ran had nothing to page: "
                f"{active.nothing_to_page}. So the forward neither read the session's history from the pool nor kept "
                "its K/V there. Hand the model cache stand-ins its attention reads (for a model whose first chunk "
                "skips the cache, a stand-in cache that presents the steady state, so that every chunk's graph reads "
                "history and the runtime supplies an empty one)." + tail
            )
        raise RequestError(
            head + "the model read its cache stand-ins (which hold no data) outside a compiled graph, so its output "
            "is wrong. Compile its blocks with backend='paged_kv' (fullgraph=True, dynamic=False) and keep "
            "torch._dynamo.config.recompile_limit above the bucket count (past it dynamo runs a block eagerly)." + tail
        )

    def _check_all_layers_wrote(self, active: ForwardContext) -> None:
        """A forward that keeps its K/V (commit, prefill) must have run every layer's site.

        Otherwise the skipped layers' new history would be whatever those blocks held before.
        Forwards that drive the op directly (no compiled site) are not tracked.
        """
        if not active.plan.keeps_kv or not active.layers_seen:
            return
        missing = sorted(set(range(self.config.num_layers)) - active.layers_seen)
        if missing:
            raise RequestError(
                f"this {active.plan.kind} forward skipped layers {missing}: their K/V would not become history. "
                "The forward was rolled back; run every block in forwards that commit or prefill"
            )

    @contextlib.contextmanager
    def warmup_forward(self, bucket: Bucket) -> Iterator[ForwardContext]:
        """Make `bucket` the active forward with all-padding metadata, for warm-up and CUDA-graph capture.

        Nothing is written and nothing is visible (every slot -1, every length 0), so a padded query gives
        zeros; the scheduler is not touched and no request is admitted. The bucket's buffers keep their
        addresses; the next real forward of this bucket rebuilds its metadata.
        """
        if self.active is not None:
            raise RequestError("a forward is already active on this runtime; warm up between forwards")
        if self.config.buckets and bucket not in self.config.buckets and not self._allow_unconfigured:
            raise RequestError(f"cannot warm up bucket {bucket}: not configured; configured: {sorted(self.config.buckets)}")
        meta = self.metadata.buffers(bucket)
        meta.fill_with_padding()  # also forgets the last build's key: the next build is never skipped
        self.generation += 1
        self.active = ForwardContext(ForwardPlan(WARMUP_OWNER, "warmup", [], bucket.tokens, bucket.context), bucket,
                                     meta, self.generation, owner_of=self.owner)
        try:
            yield self.active
        finally:
            self.active = None

    def forward_batch(self, items: Sequence[tuple]) -> contextlib.AbstractContextManager[ForwardContext]:
        """One forward over the rows of several owners at the same phase, in item order (`Scheduler.plan_batch`:
        items are (owner_id, kind) or (owner_id, kind, args)); metadata is built once for all of them, and a
        failure rolls back every owner."""
        self._check_not_nested()
        return self.forward_plan(self.scheduler.plan_batch(items))

    def require_active(self) -> ForwardContext:
        """The forward in progress (what a compiled site checks, records and reads), or a clear error."""
        return forward_context.require(self.active)

    # ---- lifecycle ----------------------------------------------------------------------------
    def admit(self, owner_id: str, spec: Any, rows: int | None = None, *,
              cross_kv: Sequence[torch.Tensor] | None = None, cache_salt: str | bytes | None = None,
              content_keys: Sequence[str | bytes] | None = None, prompt_tokens: Sequence[Any] | None = None,
              prompt_keys: Sequence[str | bytes] = ()) -> None:
        """Admit a session/request of `spec`'s family (rows: CFG rows; default: what the family says), all rows
        or none.

        cross_kv: per layer `(2, rows, tokens, Hkv, D)` write-once K/V (e.g. a model's cross-attention K/V,
        computed once per session), kept in the pool as one shared region per row: owners of the same
        `cache_salt` (tenant/user id) with the same content share its blocks by reference count; content is
        keyed by `content_keys` (one per row, e.g. a hash of the prompt's token ids) or by the K/V bytes, and
        confirmed byte for byte before anything is shared (`regions.py`).

        prompt_tokens: per row the prompt's token ids (a family whose `cacheable_prefix` names its prompt): its leading
        full prompt blocks are shared with earlier requests of the same `cache_salt` and `prompt_keys` (what else
        determines the prompt's K/V: model, adapter, image identity, generator state, grid) whose prefill succeeded,
        confirmed token for token (`prefix_cache.py`); `owner(owner_id).prefix_ready` then says how many tokens its
        prefill skips.
        """
        self.scheduler.admit(owner_id, spec, rows, cross_kv=cross_kv, cache_salt=cache_salt,
                             content_keys=content_keys, prompt_tokens=prompt_tokens, prompt_keys=prompt_keys)

    def reset(self, owner_id: str) -> None:
        """Drop an owner's history (e.g. a window reset): its blocks return to the pool, its shared
        regions stay, and it stays admitted."""
        self.scheduler.reset(owner_id)

    def release(self, owner_id: str) -> None:
        """End a session/request normally: every block it alone holds returns to the pool; the id is used up."""
        self.scheduler.release(owner_id)

    def fork(self, parent_id: str, child_id: str, **args: Any) -> None:
        """A zero-copy fork of an owner between forwards, where its family allows it (`Family.fork_state`, e.g.
        at a chunk boundary): the child shares every history block by reference count, so no KV is copied; its
        next commits go to its own blocks (`Scheduler.fork`). args: the family's, e.g. a budget (`commits=n`: a
        fork that reserves only what n commits take, `Family.fork_budget`)."""
        if self.active is not None:
            raise RequestError(
                f"cannot fork {parent_id!r} while a forward is active; fork between forwards (after the with block)"
            )
        self.scheduler.fork(parent_id, child_id, **args)

    def abort(self, owner_id: str) -> None:
        """End a session/request at any point between forwards: every block it alone holds returns to the pool."""
        self.scheduler.abort(owner_id)

    def close(self) -> None:
        binding.unbind_runtime(self)

    # ---- introspection ------------------------------------------------------------------------
    def owner(self, owner_id: str) -> Owner | None:
        """The live session or request `owner_id` (spec, rows of block ids), or None: read it, do not change it."""
        return self.scheduler.owners.get(owner_id)

    def regions_of(self, owner_id: str) -> list:
        """The shared write-once regions (`regions.Region`: blocks, tokens, holders) a live owner holds, per row."""
        return self.scheduler.regions_of(owner_id)

    def owner_ids(self) -> list[str]:
        """Ids of the live sessions and requests, least recently used first."""
        return list(self.scheduler.owners)

    def state(self) -> dict:
        """A comparable snapshot of everything admission and forwards may change."""
        alloc = self.scheduler.allocator
        return {
            "owners": self.scheduler.owned_blocks(),
            "num_free": alloc.num_free,
            "finished": dict(self.scheduler.finished),
            "versions": {oid: o.version for oid, o in self.scheduler.owners.items()},
            "regions": self.scheduler.regions.snapshot(),
            "prefix_cache": self.scheduler.prefix_cache.snapshot(),
            "in_flight": self.scheduler.in_flight is not None,
            "active": self.active is not None,
        }
