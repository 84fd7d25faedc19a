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

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from ..config import Bucket, PagedKVConfig
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
    family: str  # the family's registry name
    spec: Any  # the family's spec (e.g. DreamZeroSpec)
    rows: list[list[int]]
    version: int = 0  # bumped whenever the blocks or the family's layout records change: keys the caches
    phases_done: set[str] = field(default_factory=set)  # forward kinds that finished (e.g. "prefill")
    state: dict[str, Any] = field(default_factory=dict)  # the family's own per-owner records (e.g. a layout)
    layout_cache: tuple | None = None  # (key, value) of the last repeatable plan's layouts (`reuse_layouts`)

    @property
    def num_rows(self) -> int:
        return len(self.rows)


@dataclass
class ForwardPlan:
    """What one forward does: per-row layouts, blocks taken for it, and the metadata cache key."""

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
    #: columns are [cached prefix | new tokens] (check_dense_mask)
    key_positions: list[torch.Tensor] | None = None
    state: dict[str, Any] = field(default_factory=dict)  # what the family's `finish` records on the owner
    #: a batched forward (`Scheduler.plan_batch`): the plan of each owner whose rows it carries, in row order
    parts: list["ForwardPlan"] = field(default_factory=list)
    #: which of the owner's rows each forward row is (None: rows 0..n-1), e.g. a DreamZero branch plan's [b]
    owner_rows: list[int] | None = None
    #: per forward row, the shared write-once region (`regions.Region`) it reads, or None (set by the scheduler)
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
    """What a compiled attention site assumes about the forward it runs in (a frozen dataclass per family).

    Built by the idiom matcher from the graph (`passes/`), checked against the live plan at every call
    (`PagedKVRuntime.check_layout`). `context` is the dense cache length the site was compiled for.
    """

    family: str

    @property
    def context(self) -> int: ...


class Family(Protocol):
    """One model family's KV-cache knowledge; see the module docstring."""

    name: str  # registry key, also `Owner.family` and `Expectation.family`
    noun: str  # "session" or "request", for messages
    spec_type: type
    evict_lru: bool  # whether the runtime's max_sessions LRU cap applies to this family's owners

    # ---- admission and forwards (called by the scheduler) ----
    def rows(self, spec: Any, requested: int | None) -> int:
        """How many rows (CFG rows) an owner of `spec` has; `requested` is what the caller asked for."""

    def admission_blocks(self, spec: Any, rows: int, blocks: BlockSource) -> list[int]:
        """Validate a new owner; managed blocks per row to take at admission (all rows or none)."""

    def plan(self, owner: Owner, blocks: BlockSource, kind: str, **info: Any) -> ForwardPlan:
        """Plan one forward of `kind`; blocks taken here are given back by the scheduler on failure
        only if recorded in `ForwardPlan.new_blocks` (a plan that raises must free what it took)."""

    def finish(self, owner: Owner, plan: ForwardPlan, blocks: BlockSource) -> None:
        """The forward ran: update the owner's rows (e.g. a commit becomes history)."""

    def check_expectation(self, expect: Expectation, owner: Owner, plan: ForwardPlan) -> None:
        """Raise RequestError when a compiled site's expectation disagrees with the owner's spec or the plan."""

    # ---- forks (optional: a family without `fork_state` refuses forks) ----
    # def fork_state(self, owner: Owner, blocks: BlockSource) -> dict[str, Any]:
    #     """Raise RequestError when `owner` cannot be forked now; else the child's `Owner.state`. The child
    #     shares every block of `owner` by reference count, so the family must never write a block it did
    #     not take for the forward being planned (the scheduler checks this for every plan)."""
    # def history_dropped(self, owner: Owner) -> None:
    #     """The scheduler freed every block of `owner` (a window reset): forget what `state` says of them."""

    # ---- the idiom matcher (called by `passes/rewrite.py` for every attention site of a compiled graph) ----
    def match(self, site: Any) -> Any:
        """A `passes.site.Match` (pattern name + this family's `Expectation`) when the `passes.site.Site`'s
        structure is this family's KV-cache idiom, else a string saying why not (it goes into the pass report)."""

    # ---- the model side (driver, warm-up) ----
    def owns_model(self, model: torch.nn.Module) -> bool: ...

    def blocks(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The model's list of compiled blocks (layer i of the runtime is element i)."""

    def spec_for(self, model: torch.nn.Module, **request: Any) -> Any:
        """The spec of one request/session of `model` (request: the family's request inputs)."""

    def default_buckets(self, model_cfg: Any) -> Sequence[Bucket] | None:
        """Buckets warm-up uses when none are configured (None: the family needs them configured)."""

    def example_inputs(self, model: torch.nn.Module, runtime: Any, bucket: Bucket) -> tuple[tuple, dict]:
        """(args, kwargs) of one block call of `bucket`, as the model's own forward passes them."""

    def standin_caches(self, runtime: Any, model: torch.nn.Module, batch: int, **geometry: Any) -> list:
        """Per layer what the dense model gets instead of its cache (`runtime.standin`)."""
