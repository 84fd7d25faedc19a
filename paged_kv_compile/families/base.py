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
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch

from ..config import Bucket, PagedKVConfig
from ..errors import RequestError
from ..layout import RowLayout
from ..passes.idioms import Expectation, Idiom

if TYPE_CHECKING:
    from .demo import Demo


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
    #: the family's own per-owner record (a dataclass the family defines: `Family.new_state`), e.g. a layout
    state: Any = None
    layout_cache: tuple | None = None  # (key, value) of the last repeatable plan's layouts (`reuse_layouts`)
    #: unique for the runtime's life (an admission counter, never reused, unlike ids): cache keys name the owner
    #: by it, so a key can never match another owner's build (once, an id reused after the finished-id memory
    #: was served its predecessor's metadata)
    serial: int = -1
    #: managed blocks per layer admission reserved for it: the most it holds at once up to its reset (`reserve`)
    reserved: int = 0
    #: a fork with a budget (`Family.fork_budget`, e.g. DreamZero's `commits=n`): how many more managed blocks per
    #: layer it may take; None: no budget (it holds at most `reserved`)
    take_budget: int | None = None
    #: per row, how many leading logical tokens' K/V its blocks hold before its first forward (a prompt prefix shared
    #: from the prefix cache, `prefix_cache.py`; pages another producer imported): that forward computes only the
    #: rest, over them as history. (): none, the first forward computes every token
    prefix_ready: tuple[int, ...] = ()

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
    state: Any = None  # what the family's `finish` records on the owner (its own record type), None: nothing
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


class ModelRuntime(Protocol):
    """What a family's model side reads of the runtime it runs on (`PagedKVRuntime` is one; typed here so that a
    family imports no runtime): its config, and the cache stand-ins it hands the dense model."""

    @property
    def config(self) -> PagedKVConfig: ...

    def standin(self, *shape: int, writable: bool = False) -> torch.Tensor: ...

    def region_standin(self, *shape: int) -> torch.Tensor: ...


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

    def accepts(self, idiom: Idiom | None) -> bool:
        """Whether this family's owners may run a site of `idiom` (one of the very objects listed here)."""
        return any(mine is idiom for mine in self.idioms)

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

    def new_state(self, spec: Any, rows: int) -> Any:
        """The record an owner of `spec` starts with (`Owner.state`): a dataclass this family defines for what it
        keeps beyond the blocks (e.g. a layout read once). Default None: it keeps nothing."""
        return None

    def cacheable_prefix(self, spec: Any) -> list[int] | None:
        """Per row, how many leading tokens are the prompt whose K/V depends only on the tokens before them (and the
        caller's keys): the part the prefix cache may share across owners (`prefix_cache.py`). Default None: this
        family's owners share no prompt prefixes."""
        return None

    def reserve(self, spec: Any, rows: int, blocks: BlockSource) -> int:
        """The most managed blocks per layer an owner of `spec` holds at once up to its reset (commits included):
        admission reserves it (`Reservations.check`), so an admitted owner never waits for blocks another
        holds. Default 0: the owner reserves just what `admission_blocks` takes."""
        return 0

    def fork_state(self, owner: Owner, blocks: BlockSource, **args: Any) -> Any:
        """The child's `Owner.state` for a fork of `owner`, or RequestError when it cannot be forked now (`args`:
        what `runtime.fork` was given beyond the ids, e.g. a budget).

        The child shares every block of `owner` by reference count, so the family must never write a block it
        did not take for the forward being planned (the scheduler checks this for every plan). Default: no forks.
        """
        raise RequestError(
            f"{owner.owner_id!r} is a {self.name} {self.noun}, which cannot be forked: its family does not "
            "implement fork_state"
        )

    def fork_private(self, owner: Owner, blocks: BlockSource) -> list[list[int]]:
        """Per row, which of `owner.rows[r]` (indices) a fork's child must get its own copy of instead of sharing:
        blocks a later forward of the parent or the child writes (e.g. a partly filled last block). The scheduler
        takes a block per index, copies the K/V into it at the fork and counts it in the child's reservation.
        Default: none (every block is shared)."""
        return [[] for _ in owner.rows]

    def fork_budget(self, owner: Owner, blocks: BlockSource, **args: Any) -> int | None:
        """How many managed blocks per layer a fork of `owner` made with `args` may take in all (None: no budget;
        the child then reserves what `owner` does). A budget lets a short-lived fork (a candidate that commits once)
        reserve what it takes instead of a whole session's need; the scheduler refuses a plan beyond it."""
        return None

    def import_state(self, owner: Owner, blocks: BlockSource, generation: int, **layout: Any) -> tuple[Any, list]:
        """(the owner's new `state`, blocks taken) for K/V another stage writes into its pages (`kv_import.py`):
        its layout, no page ready yet, of `generation`. Default: this family imports nothing."""
        raise RequestError(
            f"{owner.owner_id!r} is a {self.name} {self.noun}, whose K/V cannot be imported: its family does not "
            "implement import_state (HunyuanImage-3 requests can)"
        )

    def import_destinations(self, owner: Owner) -> list[int]:
        """Per row, how many tokens an import writes into the row's pages (`owner.rows[r]`, from token 0)."""
        raise RequestError(f"{self.name} {self.noun}s import no K/V")

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

    def loop_arguments(self, runtime: ModelRuntime, spec: Any, loop: dict[str, Any]) -> dict[str, Any]:
        """The loop arguments a paged run uses on `runtime` (e.g. a padded capacity its buckets serve); called
        before admission, so a request no bucket can serve is refused while it holds nothing."""
        return loop

    @abc.abstractmethod
    def default_buckets(self, model_cfg: Any) -> Sequence[Bucket] | None:
        """Buckets warm-up uses when none are configured (None: the family needs them configured)."""

    @abc.abstractmethod
    def example_inputs(self, model: torch.nn.Module, runtime: ModelRuntime, bucket: Bucket) -> tuple[tuple, dict]:
        """(args, kwargs) of one block call of `bucket`, as the model's own forward passes them."""

    @abc.abstractmethod
    def standin_caches(self, runtime: ModelRuntime, model: torch.nn.Module, batch: int, **geometry: Any) -> list:
        """Per layer what the dense model gets instead of its cache (`runtime.standin`)."""

    def region_standins(self, runtime: ModelRuntime, model: torch.nn.Module, batch: int) -> list:
        """Per layer what the model gets instead of K/V it reads from shared write-once regions. Default: none."""
        raise RequestError(f"{self.name} models read no shared write-once regions")

    def demo(self, size: str, *, short: bool, device: str, **runtime_options: Any) -> Demo | None:
        """The `paged-kv demo` scene of this family (`families.demo.Demo`), or None when it has none."""
        return None


def missing_members(family: Any) -> list[str]:
    """What `family` lacks to be a `Family`: unset class attributes and unimplemented abstract methods."""
    missing = [a for a in Family.REQUIRED_ATTRIBUTES if not hasattr(family, a)]
    cls = family if isinstance(family, type) else type(family)
    abstract = getattr(cls, "__abstractmethods__", None)
    if abstract is None or not issubclass(cls, Family):
        abstract = {n for n in Family.__abstractmethods__ if not callable(getattr(cls, n, None))}
    return missing + sorted(abstract)
