"""What `paged-kv demo` (and `warmup`, `dump`) run for one family: the scene a family may offer (`Family.demo`).

Not part of the cache contract: a family that serves models needs none of this; one that shows itself in the demo
returns a `Demo` from `Family.demo`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..config import PagedKVConfig


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
