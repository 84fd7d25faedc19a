"""Shared pieces of the CPU benchmarks, whatever the model family: compiled setups, a driver of one
session/request of a model's own loop, allocation tracking, statistics, machine description and tables.

`OwnerRun` runs a model's loop (`Family.steps`, the loop `driver.paged_run` runs) one forward at a time, so that
paged and dense forwards can be interleaved and timed one by one. The same driver serves both paths: only the
hooks differ (`DenseHooks`: real caches; `PagedHooks`: stand-ins and a runtime plan per forward). This module
names no family (tests/test_import_graph.py checks it): the families' configs, setups and loop arguments are in
`_models.py`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from paged_kv_compile import families
from paged_kv_compile.config import PagedKVConfig
from paged_kv_compile.counting import CountingBackend
from paged_kv_compile.driver import PagedHooks, admit_loop
from paged_kv_compile.models.hooks import DenseHooks, Loop
from paged_kv_compile.ops import reference as _reference_module
from paged_kv_compile.ops import write_attend as _write_attend_module
from paged_kv_compile.runtime import PagedKVRuntime

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"

# ---- process settings ------------------------------------------------------------------------------


@contextlib.contextmanager
def bench_settings(threads: int | None = None, view_runs: bool = True) -> Iterator[None]:
    """No autograd, no host-side value checks in the op, a recompile limit that dense fill levels never hit.

    `write_attend.CHECK_VALUES` reads metadata on the host at every call on CPU tensors (a debug aid that
    has no GPU counterpart); it is off while benchmarking and restored afterwards. `threads` sets torch's
    intra-op threads for the duration (None: leave them). `view_runs=False` makes the CPU reference kernel
    gather and scatter even ascending runs (`ops/reference.py: VIEW_RUNS`): what a fragmented table costs.
    """
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    old_check = _write_attend_module.CHECK_VALUES
    old_view_runs = _reference_module.VIEW_RUNS
    old_limit = torch._dynamo.config.recompile_limit
    old_grad = torch.is_grad_enabled()
    _write_attend_module.CHECK_VALUES = False
    _reference_module.VIEW_RUNS = view_runs
    torch._dynamo.config.recompile_limit = 64
    torch.set_grad_enabled(False)
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()
        torch.set_grad_enabled(old_grad)
        torch._dynamo.config.recompile_limit = old_limit
        _write_attend_module.CHECK_VALUES = old_check
        _reference_module.VIEW_RUNS = old_view_runs
        torch.set_num_threads(old_threads)


def machine_info(**extra: Any) -> dict:
    """What the numbers were measured on: host, torch, threads, memory and load."""
    mem_gib = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "loadavg_1_5_15": [round(x, 2) for x in load] if load else None,
        **extra,
    }


# ---- compiling -------------------------------------------------------------------------------------


def compile_regional(blocks: Iterable[torch.nn.Module], backend: Callable) -> None:
    """Regional compilation, the usual way DiTs are compiled: every block on its own, fullgraph, static shapes."""
    for block in blocks:
        block.compile(backend=backend, fullgraph=True, dynamic=False)


def warm_inductor() -> None:
    """Import and run Inductor once so the first measured compile does not pay for its imports."""
    fn = torch.compile(lambda x: torch.relu(x) * 2 + 1, backend="inductor", fullgraph=True, dynamic=False)
    fn(torch.randn(8))
    torch._dynamo.reset()


# ---- setups and the loop driver --------------------------------------------------------------------


@dataclass
class Setup:
    """A model compiled for one path ("dense", "paged" or "eager": uncompiled) and, if paged, its runtime."""

    path: str
    model: torch.nn.Module
    runtime: PagedKVRuntime | None
    backend: CountingBackend | None

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()


def make_setup(model: torch.nn.Module, path: str, inner: str, runtime_config: Callable[[], PagedKVConfig]) -> Setup:
    """`model`'s blocks (its family's `Family.blocks`) compiled regionally with a counting backend: the paged_kv
    backend on a runtime of `runtime_config()` bound to them ("paged"), the inner compiler `inner` alone
    ("dense"), or not at all ("eager")."""
    if path not in ("dense", "paged", "eager"):
        raise ValueError(f"unknown path {path!r}; use dense, paged or eager")
    blocks = families.for_model(model).blocks(model)
    runtime = backend = None
    if path == "paged":
        runtime = PagedKVRuntime(runtime_config())
        runtime.bind(blocks)
    if path != "eager":
        backend = CountingBackend({"inner_compiler": inner}, dense=path == "dense")
        compile_regional(blocks, backend)
    return Setup(path, model, runtime, backend)


class OwnerRun:
    """One session/request of a model's own loop (`Family.steps`) on a `Setup`, driven forward by forward through
    `self.loop` (`models.hooks.Loop`: run one forward, one loop index, while a condition holds, or repeat the
    pending one).

    Paged: admitted on the setup's runtime first, as `driver.paged_run` does (`Family.spec_for`, then
    `Family.loop_arguments`), with `PagedHooks` unless `hooks` are given; `close` releases it. Dense and eager:
    `DenseHooks` unless given. `loop`: the loop's keyword arguments (`_models.py` makes them per family).
    """

    def __init__(self, setup: Setup, owner_id: str = "owner", *, hooks: DenseHooks | None = None, **loop: Any) -> None:
        model, runtime = setup.model, setup.runtime
        family = families.for_model(model)
        self.runtime, self.owner_id = runtime, owner_id
        if runtime is not None:
            family, _, loop = admit_loop(model, runtime, owner_id, **loop)
        self.hooks = hooks or (PagedHooks(runtime, owner_id) if runtime is not None else DenseHooks())
        try:
            self.loop = Loop(family.steps(model, self.hooks, **loop), self.hooks)  # runs the loop's setup
        except BaseException:
            if runtime is not None:
                runtime.abort(owner_id)
            raise

    def close(self) -> None:
        """End the loop where it is and release the owner (paged)."""
        self.loop.steps.close()
        if self.runtime is not None and self.runtime.owner(self.owner_id) is not None:
            self.runtime.release(self.owner_id)


# ---- allocations -----------------------------------------------------------------------------------


class AllocationTracker:
    """Peak of torch's CPU allocations made inside the `with` block, net of the frees made there.

    Read from the profiler's memory events (`profile_memory=True`): every allocation and free of torch's
    CPU allocator, compiled code included, in time order. Memory allocated before the block (weights, a
    pool reserved up front) is not counted, nor are its frees. This is the CPU stand-in for
    `torch.cuda.max_memory_allocated() - memory_allocated()` at entry; it is not RSS.
    """

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.final_bytes = 0
        self.events = 0
        self._prof = None

    def __enter__(self) -> "AllocationTracker":
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from torch._C._profiler import _EventType

        self._prof.__exit__(*exc)
        deltas = []
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                deltas.append((node.start_time_ns, node.extra_fields.alloc_size))
            stack.extend(node.children)
        live = peak = 0
        for _, size in sorted(deltas):
            live += size
            peak = max(peak, live)
        self.peak_bytes, self.final_bytes, self.events = peak, live, len(deltas)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in `obj`: itself, or those in a list/tuple, or an object's tensor attributes (a cache object),
    recursively."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensors_in(item)]
    return [t for value in getattr(obj, "__dict__", {}).values() for t in tensors_in(value)]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views and repeats of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


# ---- statistics and output -------------------------------------------------------------------------


def summarize(values: Sequence[float], digits: int = 4) -> dict:
    """median, min, max and the interquartile range of `values`."""
    vals = sorted(values)
    if len(vals) >= 2:
        q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    else:
        q1 = q3 = vals[0]
    r = lambda v: round(float(v), digits)  # noqa: E731
    return {"median": r(statistics.median(vals)), "min": r(vals[0]), "max": r(vals[-1]), "q1": r(q1), "q3": r(q3),
            "n": len(vals)}


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int, inner_loops: int = 1,
                warmup: int = 2, clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Per-repeat seconds of each callable, run alternately (the order rotates every repeat).

    Each sample is the mean of `inner_loops` back-to-back calls. Machine noise that lasts longer than
    one repeat hits every callable; ratios are taken per repeat. `clock=time.thread_time` measures the
    calling thread's CPU time instead of wall time (what other processes' preemption does not inflate; all
    the work with one intra-op thread).
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    out: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            fn = fns[name]
            t0 = clock()
            for _ in range(inner_loops):
                fn()
            out[name].append((clock() - t0) / inner_loops)
    return out


def ratio_entry(times: dict[str, list[float]], num: str = "paged", den: str = "dense") -> dict:
    """Median times (ms) of both and the per-repeat ratio num/den summarized."""
    ratios = [a / b for a, b in zip(times[num], times[den])]
    return {
        f"{num}_ms": round(statistics.median(times[num]) * 1e3, 3),
        f"{den}_ms": round(statistics.median(times[den]) * 1e3, 3),
        "ratio": summarize(ratios),
    }


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    """A plain aligned text table; `columns` are (header, key) pairs, values formatted with str()."""
    cells = [[h for h, _ in columns]] + [[_fmt(r.get(k, "")) for _, k in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    esc = lambda text: text.replace("|", "\\|")  # noqa: E731  (a literal | would split the cell)
    head = "| " + " | ".join(esc(h) for h, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(esc(_fmt(r.get(k, ""))) for _, k in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-3 and v != 0 else (f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}")
    return str(v)


def gib(nbytes: float) -> float:
    return nbytes / 2**30
