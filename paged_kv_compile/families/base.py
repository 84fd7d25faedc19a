"""What a model family tells the generic runtime, and the records both sides share.

The scheduler (`scheduler.py`) keeps what every family has in common: ids, admission, block
ownership, LRU eviction, the one forward in flight and its rollback. Everything that depends on how
a family lays out its tokens lives in one module per family (`families/dreamzero.py`,
`families/hunyuan_image3.py`) behind the `Family` protocol below: how a request is admitted, how a
forward's rows are planned and finished, what a compiled site expects of the plan, the shape buckets,
the warm-up inputs of one block and the cache stand-ins handed to the dense model. The split follows
vLLM v1, whose `KVCacheManager` delegates the per-attention-type decisions to
`SingleTypeKVCacheManager` subclasses (`FullAttentionManager`, `SlidingWindowManager`).

A new family is one new module implementing `Family` (plus its reference model), registered in
`families/__init__.py`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from ..config import Bucket, PagedKVConfig
from ..errors import RequestError
from ..layout import RowLayout


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def pool_config(*, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, owners: int, rows: int,
                tokens_per_row: int, scratch_tokens_per_row: int, overrides: dict) -> PagedKVConfig:
    """A pool for `owners` sessions/requests of `rows` rows, each row holding up to `tokens_per_row` tokens.

    `overrides` replace any of the derived fields (even num_kv_heads: tests build mismatched pools)."""
    fields = dict(
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        blocks_per_layer=owners * rows * ceil_div(tokens_per_row, block_size), max_rows=rows,
        scratch_tokens_per_row=scratch_tokens_per_row,
    )
    fields.update(overrides)
    return PagedKVConfig(**fields)


@dataclass
class Owner:
    """A live session or request: one list of managed block ids per row (CFG row)."""

    owner_id: str
    family: Family  # the family that plans, finishes and checks its forwards
    spec: Any  # the family's spec (e.g. DreamZeroSpec)
    rows: list[list[int]]
    version: int = 0  # bumped whenever the blocks or the family's layout records change: keys the caches
    phases_done: set[str] = field(default_factory=set)  # forward kinds that finished (e.g. "prefill")
    state: dict[str, Any] = field(default_factory=dict)  # the family's own per-owner records (e.g. a layout)
    layout_cache: tuple | None = None  # (key, value) of the last repeatable plan's layouts (`reuse_layouts`)
    #: unique for the runtime's life (an admission counter, never reused, unlike ids): cache keys name the owner
    #: by it, so a key can never match another owner's build (issue 23: an id reused after the finished-id memory
    #: was served its predecessor's metadata)
    serial: int = -1
    #: managed blocks per layer admission reserved for it: the most it holds at once up to its reset (`reserve`)
    reserved: int = 0
    #: a fork with a budget (`Family.fork_budget`, e.g. DreamZero's `commits=n`): how many more managed blocks per
    #: layer it may take; None: no budget (it holds at most `reserved`)
    take_budget: int | None = None

    @property
    def num_rows(self) -> int:
        return len(self.rows)


@dataclass(frozen=True, eq=False)
class ForwardPlan:
    """What one forward does: per-row layouts, blocks taken for it, and the metadata cache key.

    Complete when made, never edited after (frozen; a plan is compared by identity: `Scheduler.in_flight`)."""

    owner_id: str
    kind: str
    rows: list[RowLayout]
    tokens: int
    context: int
    new_blocks: list[list[int]] = field(default_factory=list)
    key: tuple = ()
    keeps_kv: bool = False  # its K/V is kept (a commit, a prefill): every layer must run, or it is rolled back
    phase: dict = field(default_factory=dict)  # the family's per-forward geometry (DreamZero: chunk/action tokens)
    #: per row, the logical position each dense key column of the model's mask holds (-1: padding); None: the
    #: columns are [cached prefix | new tokens] (`ForwardContext.check_dense_mask`)
    key_positions: list[torch.Tensor] | None = None
    state: dict[str, Any] = field(default_factory=dict)  # what the family's `finish` records on the owner
    #: a batched forward (`Scheduler.plan_batch`): the plan of each owner whose rows it carries, in row order
    parts: list["ForwardPlan"] = field(default_factory=list)
    #: which of the owner's rows each forward row is (None: rows 0..n-1), e.g. a DreamZero branch plan's [b]
    owner_rows: list[int] | None = None
    #: per forward row, the shared write-once region (`regions.Region`) it reads, or None (the scheduler makes the
    #: family's plan with them: `Scheduler._plan_part`)
    regions: list[Any] | None = None

    def owner_plans(self) -> list["ForwardPlan"]:
        """The per-owner plans this forward finishes or rolls back: its parts, or itself."""
        return self.parts or [self]


class BlockSource(Protocol):
    """What a family may ask of the scheduler while admitting, planning or finishing (`scheduler.py`)."""

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def scratch_blocks_per_row(self) -> int: ...

    def allocate_rows(self, counts: list[int]) -> list[list[int]]: ...

    def free(self, blocks: list[int]) -> None: ...

    def scratch(self, row: int, first_logical_block: int, last_logical_block: int) -> list[int]: ...

    def check_scratch(self, blocks: int) -> None: ...

    @property
    def first_scratch_row(self) -> int:
        """The forward row this owner's row 0 is (0 alone; later in a batched forward): `scratch` depends on it."""
        ...


def reuse_layouts(owner: Owner, key: tuple, make: Callable[[], Any]) -> Any:
    """The row layouts (and whatever else `make` returns) of the owner's last plan with this `key`, or `make()`'s,
    then remembered.

    A denoising loop plans the same layout at every step, and making it again costs tens of microseconds per row
    (a row's block list becomes a numpy array at about 40 ns per block). The key must hold what the layout depends
    on: the kind, `owner.version` (bumped whenever the blocks or the family's layout records change, as for the
    metadata's repeat key), the forward's first scratch row and the family's own arguments."""
    if owner.layout_cache is not None and owner.layout_cache[0] == key:
        return owner.layout_cache[1]
    value = make()
    owner.layout_cache = (key, value)
    return value


@runtime_checkable
class Expectation(Protocol):
    """What a compiled attention site assumes about the forward it runs in (a frozen dataclass per idiom).

    Built by an idiom's matcher from the graph (`passes/idioms/`), checked against the live plan at every call
    (`ForwardContext.check_expectation`): the owner's family must accept `idiom`, then checks the rest.
    `context` is the dense cache length the site was compiled for.
    """

    idiom: str

    @property
    def context(self) -> int: ...


class Family(abc.ABC):
    """One model family's KV-cache knowledge; see the module docstring.

    Subclasses set the four class attributes and implement every abstract method; `families.register` refuses
    a family that leaves any out, naming them. The methods with a body are optional: their default refuses (forks,
    shared regions) or does nothing (a history reset).
    """

    name: str  # registry key
    noun: str  # "session" or "request", for messages
    spec_type: type
    evict_lru: bool  # whether the runtime's max_sessions LRU cap applies to this family's owners
    #: the idioms (`passes.idioms.Idiom`) whose sites this family's owners may run; `passes/match.py` matches them
    idioms: tuple = ()

    REQUIRED_ATTRIBUTES = ("name", "noun", "spec_type", "evict_lru", "idioms")

    def __deepcopy__(self, memo: dict) -> "Family":
        """A family is a stateless singleton that records (`Owner.family`) point at: a copied record (a saved
        scheduler state) points at the same family."""
        return self

    def __copy__(self) -> "Family":
        return self

    def accepts(self, expect: Expectation) -> bool:
        """Whether this family's owners may run a site compiled with `expect` (its idiom is one listed here)."""
        return any(idiom.name == expect.idiom for idiom in self.idioms)

    # ---- admission and forwards (called by the scheduler) ----
    @abc.abstractmethod
    def rows(self, spec: Any, requested: int | None) -> int:
        """How many rows (CFG rows) an owner of `spec` has; `requested` is what the caller asked for."""

    @abc.abstractmethod
    def admission_blocks(self, spec: Any, rows: int, blocks: BlockSource) -> list[int]:
        """Validate a new owner; managed blocks per row to take at admission (all rows or none)."""

    @abc.abstractmethod
    def plan(self, owner: Owner, blocks: BlockSource, kind: str, **args: Any) -> ForwardPlan:
        """Plan one forward of `kind`; blocks taken here are given back by the scheduler on failure
        only if recorded in `ForwardPlan.new_blocks` (a plan that raises must free what it took)."""

    @abc.abstractmethod
    def finish(self, owner: Owner, plan: ForwardPlan, blocks: BlockSource) -> None:
        """The forward ran: update the owner's rows (e.g. a commit becomes history)."""

    @abc.abstractmethod
    def check_expectation(self, expect: Expectation, owner: Owner, plan: ForwardPlan) -> None:
        """Raise RequestError when a compiled site's expectation disagrees with the owner's spec or the plan.
        Called only for sites of an idiom this family accepts."""

    def reserve(self, spec: Any, rows: int, blocks: BlockSource) -> int:
        """The most managed blocks per layer an owner of `spec` holds at once up to its reset (commits included):
        admission reserves it (`Reservations.check`), so an admitted owner never waits for blocks another
        holds. Default 0: the owner reserves just what `admission_blocks` takes."""
        return 0

    def fork_state(self, owner: Owner, blocks: BlockSource, **args: Any) -> dict[str, Any]:
        """The child's `Owner.state` for a fork of `owner`, or RequestError when it cannot be forked now (`args`:
        what `runtime.fork` was given beyond the ids, e.g. a budget).

        The child shares every block of `owner` by reference count, so the family must never write a block it
        did not take for the forward being planned (the scheduler checks this for every plan). Default: no forks.
        """
        raise RequestError(
            f"{owner.owner_id!r} is a {self.name} {self.noun}, which cannot be forked: its family does not "
            "implement fork_state"
        )

    def fork_budget(self, owner: Owner, blocks: BlockSource, **args: Any) -> int | None:
        """How many managed blocks per layer a fork of `owner` made with `args` may take in all (None: no budget;
        the child then reserves what `owner` does). A budget lets a short-lived fork (a candidate that commits once)
        reserve what it takes instead of a whole session's need; the scheduler refuses a plan beyond it."""
        return None

    def history_dropped(self, owner: Owner) -> None:
        """The scheduler freed every block of `owner` (`reset`): forget what `owner.state` says of them."""

    # ---- the model side (driver, warm-up) ----
    @abc.abstractmethod
    def owns_model(self, model: torch.nn.Module) -> bool:
        """Whether `model` is one of this family's reference models."""

    @abc.abstractmethod
    def blocks(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The model's list of compiled blocks (layer i of the runtime is element i)."""

    @abc.abstractmethod
    def spec_for(self, model: torch.nn.Module, **loop: Any) -> Any:
        """The spec of one session/request of `model` run with the loop arguments `loop` (e.g. its prompts)."""

    @abc.abstractmethod
    def steps(self, model: torch.nn.Module, hooks: Any, **loop: Any) -> Any:
        """The model's generation loop as a step generator (`models/hooks.py`: yields a `Forward` per forward)."""

    def dense_caches_after(self, caches: Any, kind: str, result: Any) -> Any:
        """The dense caches the model's loop holds after a forward of `kind` returned `result`, `caches` before.
        Default: the same (caches written in place); a family whose model returns grown caches says which."""
        return caches

    def loop_arguments(self, runtime: Any, spec: Any, loop: dict[str, Any]) -> dict[str, Any]:
        """The loop arguments a paged run uses on `runtime` (e.g. a padded capacity its buckets serve); called
        before admission, so a request no bucket can serve is refused while it holds nothing."""
        return loop

    @abc.abstractmethod
    def default_buckets(self, model_cfg: Any) -> Sequence[Bucket] | None:
        """Buckets warm-up uses when none are configured (None: the family needs them configured)."""

    @abc.abstractmethod
    def example_inputs(self, model: torch.nn.Module, runtime: Any, bucket: Bucket) -> tuple[tuple, dict]:
        """(args, kwargs) of one block call of `bucket`, as the model's own forward passes them."""

    @abc.abstractmethod
    def standin_caches(self, runtime: Any, model: torch.nn.Module, batch: int, **geometry: Any) -> list:
        """Per layer what the dense model gets instead of its cache (`runtime.standin`)."""

    def region_standins(self, runtime: Any, model: torch.nn.Module, batch: int) -> list:
        """Per layer what the model gets instead of K/V it reads from shared write-once regions. Default: none."""
        raise RequestError(f"{self.name} models read no shared write-once regions")

    def demo(self, size: str, *, short: bool, device: str, **runtime_options: Any) -> "Demo | None":
        """The `paged-kv demo` scene of this family (`Demo`), or None when it has none."""
        return None


def missing_members(family: Any) -> list[str]:
    """What `family` lacks to be a `Family`: unset class attributes and unimplemented abstract methods."""
    missing = [a for a in Family.REQUIRED_ATTRIBUTES if not hasattr(family, a)]
    cls = family if isinstance(family, type) else type(family)
    abstract = getattr(cls, "__abstractmethods__", None)
    if abstract is None or not issubclass(cls, Family):
        abstract = {n for n in Family.__abstractmethods__ if not callable(getattr(cls, n, None))}
    return missing + sorted(abstract)


@dataclass
class DemoLane:
    """One owner of the demo's scene: its family's loop (`Family.steps(model, hooks, **loop)`) run for `forwards`
    forwards, then left where it stands (holding what it holds) while the others run."""

    owner_id: str
    what: str  # where it stands then, in words ("half-full window: 4 of 8 frames")
    loop: dict
    forwards: int


@dataclass
class DemoForks:
    """Forks of one lane's owner (`runtime.fork`) whose rows run together as ONE forward per step.

    `steps(model, hooks)` is the forks' loop as a step generator over all their rows (fork i: rows
    `i * rows_per_fork ...`); it asks `hooks.caches(model, rows)` once: the paged side hands it stand-ins, the
    dense side `copy_dense_caches(parent_caches, len(children))`, the copies a dense system makes to fork."""

    parent: str
    children: list[str]
    what: str
    steps: Callable[[torch.nn.Module, Any], Any]
    copy_dense_caches: Callable[[Any, int], Any]
    fork_args: dict = field(default_factory=dict)  # `runtime.fork`'s family arguments (e.g. a budget: commits=1)


@dataclass
class Demo:
    """What `paged-kv demo` (and `warmup`, `dump`) run for one family: a reference model, its runtime config, the
    parity loops and a scene of several owners that shows where paging pays.

    loops: keyword arguments of whole loops (`driver.paged_run` / `Family.steps`), one owner each: the parity
    oracle, dense eager vs paged; `compare(dense_result, paged_result)` is their max abs difference.
    `compare_rows(dense, paged)` is the same per row for one forward's result (what the loop reads of it).
    `dense_kv_bytes(caches)` is what a dense loop's caches (`Family.dense_caches_after`) reserve, per row.
    """

    describe: str  # the model, in words
    make_model: Callable[[], torch.nn.Module]  # the same weights at every call
    runtime_config: PagedKVConfig
    loops: list[dict]
    loops_describe: str  # the parity loops, in words
    dense_baseline: str  # what the dense caches of the scene are, in one line (what a dense system reserves)
    compare: Callable[[Any, Any], float]
    compare_rows: Callable[[Any, Any], torch.Tensor]
    dense_kv_bytes: Callable[[Any], list[int]]
    lanes: list[DemoLane] = field(default_factory=list)
    forks: DemoForks | None = None
    info: dict = field(default_factory=dict)
