"""What `paged-kv demo` runs: a family's reference model dense and paged, side by side, and where paging pays.

The family says what to run (`Family.demo` returns a `families.base.Demo`); this module runs it for any family
and measures, the command line (`cli.py`) prints. One runtime serves both parts, its compiled blocks warmed up
first (every bucket compiled) and then serving, where a compile is an error:

- the parity oracle: whole loops of the model (`Demo.loops`), dense eager vs paged;
- the scene: several owners stopped at different points of their loop, all on one pool (`Demo.lanes`), and
  forks of one of them whose rows run as ONE forward per step (`Demo.forks`). Each forward runs three ways in
  lockstep: paged, dense eager (the oracle of every owner's rows) and dense compiled exactly as the paged
  blocks are (regional, fullgraph, static shapes, the same inner compiler: the baseline of times and frames).

Parity's bound comes from what compilation itself changes: the scene measures dense eager vs dense compiled
(`compile_drift`, the same inner compiler as the paged blocks: Inductor's fp32 reordering is about 1e-5 on its
own), and paged may differ from dense eager by `parity_bound(drift)`: `DRIFT_FACTOR` times that, never below
`PARITY_ATOL` nor above `PARITY_CEILING` (a real error, a wrong key or a lost write, is far larger).

Every figure in the report is measured in the run: bytes from the allocator and the dense caches themselves,
frames from dynamo's counter, times from the clock around each forward.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from . import families
from .capture import warm_up
from .capture.report import unique_graphs
from .config import Bucket
from .driver import PagedHooks, admit_loop, paged_run
from .errors import ConfigError
from .families.base import Family
from .families.demo import Demo, DemoForks, DemoLane
from .models.hooks import DenseHooks, drive
from .pool import KVPool
from .runtime import PagedKVRuntime

PARITY_ATOL = 1e-5  # the floor of the parity bound (and the bound itself when compiling changes nothing)
PARITY_CEILING = 1e-4  # the bound never exceeds this, whatever the dense compile moved
DRIFT_FACTOR = 4  # how many times what compiling the dense model moved it may paging move it
#: dynamo's per-code-object recompile limit while the demo runs: the dense baseline compiles one frame per cache
#: length and row count, next to the paged frames of the same block code; past the default 8 dynamo would fall
#: back to eager and the dense times would silently stop being compiled ones.
RECOMPILE_LIMIT = 64

Progress = Callable[[str], None]


@dataclass
class Setup:
    """A family's demo built: the paged model (compiled, bound to `runtime`) and its two dense twins."""

    family: Family
    demo: Demo
    model: torch.nn.Module
    runtime: PagedKVRuntime
    kernel: str
    inner_compiler: str
    device: str
    kernel_resolved: str = ""
    oracle: torch.nn.Module | None = None  # dense, eager: the parity oracle
    dense: torch.nn.Module | None = None  # dense, compiled like the paged blocks with no paging


def build(model: str, *, size: str, kernel: str, inner_compiler: str, device: str, short: bool = False,
          twins: bool = True) -> Setup:
    """The family's demo with its paged model compiled (and, with `twins`, its dense eager and compiled twins)."""
    family = families.get(model)
    demo = family.demo(size, short=short, device=device, kernel=kernel, inner_compiler=inner_compiler)
    if demo is None:
        raise ConfigError(f"model family {family.name!r} has no demo scene (its Family.demo returns None)")
    setup = Setup(family, demo, demo.make_model(), PagedKVRuntime(demo.runtime_config), kernel, inner_compiler,
                  device)
    setup.kernel_resolved = resolved_kernel(setup)  # an unavailable kernel fails here, before any compile
    _compile_paged(setup)
    if twins:
        setup.oracle = demo.make_model()
        setup.dense = demo.make_model()
        for block in family.blocks(setup.dense):
            block.compile(backend=inner_compiler, fullgraph=True, dynamic=False)
    return setup


def resolved_kernel(setup: Setup) -> str:
    """The concrete kernel `setup.kernel` resolves to here; an unavailable one is a KernelUnavailableError."""
    from .ops import resolve_kernel

    pool = setup.runtime.pool.tensor
    query = torch.zeros(1, 1, pool.shape[3], pool.shape[4], dtype=pool.dtype, device=pool.device)
    return resolve_kernel(setup.kernel, query, pool)


def _compile_paged(setup: Setup) -> None:
    blocks = setup.family.blocks(setup.model)
    setup.runtime.bind(blocks)
    for block in blocks:
        block.compile(backend="paged_kv", fullgraph=True, dynamic=False,
                      options={"kernel": setup.kernel, "inner_compiler": setup.inner_compiler})


# ---- measuring one forward ----------------------------------------------------------------------------


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@dataclass
class TimedForward:
    """One forward of the scene on both compiled sides."""

    rows: int
    paged_s: float
    dense_s: float
    dense_compiled: bool  # the dense side compiled a frame in it: compile time, kept out of the time comparison


@dataclass
class OwnerFigures:
    """One owner of the scene: where it stands, what it holds paged and dense, and its parity."""

    owner_id: str
    what: str
    rows: int
    forwards: int = 0
    max_abs_diff: float | None = None  # over every forward of its rows (None: it ran none)
    paged_bytes: int = 0  # the blocks it holds, all layers
    paged_shared_bytes: int = 0  # of those, the blocks it holds with another owner (a fork's parent's history)
    dense_bytes: int = 0  # what its dense caches hold (a fork: the copy of its parent's caches it works on)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class _DenseRecorder(DenseHooks):
    """Dense hooks that keep the caches the loop holds (followed through its forwards by
    `Family.dense_caches_after`).

    copy_from: a fork's twin: the caches it is handed are a copy of its parent's, made here."""

    def __init__(self, copy_from: Callable[[int], Any] | None = None) -> None:
        self.held: Any = None
        self.copy_from = copy_from

    def caches(self, model: torch.nn.Module, batch: int, **geometry: Any) -> list:
        self.held = self.copy_from(batch) if self.copy_from else super().caches(model, batch, **geometry)
        return self.held


class _BatchHooks(PagedHooks):
    """Paged hooks of several owners whose rows run as ONE forward (`runtime.forward_batch`), in their order."""

    def __init__(self, runtime: PagedKVRuntime, owner_ids: list[str]) -> None:
        super().__init__(runtime, owner_ids[0])
        self.owner_ids = list(owner_ids)

    def forward(self, kind: str, **info: Any) -> contextlib.AbstractContextManager:
        args = {**self.geometry, **info}
        return self.runtime.forward_batch([(owner_id, kind, args) for owner_id in self.owner_ids])


# ---- the scene ------------------------------------------------------------------------------------------


@dataclass
class SceneResult:
    owners: list[OwnerFigures]
    forwards: list[TimedForward]
    dense_frames: int  # dynamo frames the dense compiled twin compiled over the scene
    paged_compiles: int  # frames the paged side compiled over the scene (serving: must be 0)
    fork: dict = field(default_factory=dict)  # what forking cost: blocks taken, KV bytes copied
    pool_bytes: int = 0
    held_bytes: int = 0  # distinct blocks the scene's owners hold, all layers
    blocks_free_after: tuple[int, int] = (0, 0)  # (free, total) once every owner is released
    compile_drift: float = 0.0  # the worst max |dense eager - dense compiled| over the scene's forwards


class Scene:
    """Runs `Demo.lanes` then `Demo.forks` on a warmed-up setup, three ways in lockstep (see the module doc)."""

    def __init__(self, setup: Setup, progress: Progress | None = None) -> None:
        self.setup = setup
        self.demo = setup.demo
        self.runtime = setup.runtime
        self.progress = progress or (lambda message: None)
        self.owners: dict[str, OwnerFigures] = {}
        self.forwards: list[TimedForward] = []
        self.dense_frames = 0
        self.paged_compiles = 0
        self.compile_drift = 0.0
        self._recorders: dict[str, tuple[_DenseRecorder, _DenseRecorder]] = {}  # lane -> (oracle, dense compiled)

    def run(self) -> SceneResult:
        for lane in self.demo.lanes:
            self.progress(f"scene: {lane.owner_id} ({lane.what}): {lane.forwards} forward(s)")
            self.lane(lane)
        fork = {}
        if self.demo.forks is not None:
            forks = self.demo.forks
            self.progress(f"scene: {len(forks.children)} forks of {forks.parent}, one forward per step")
            fork = self.forks(forks)
        return self._result(fork)

    def lane(self, lane: DemoLane) -> None:
        runtime = self.runtime
        family, _, loop = admit_loop(self.setup.model, runtime, lane.owner_id, **lane.loop)
        recorders = (_DenseRecorder(), _DenseRecorder())
        self._recorders[lane.owner_id] = recorders
        self.owners[lane.owner_id] = OwnerFigures(lane.owner_id, lane.what, runtime.owner(lane.owner_id).num_rows)
        self._lockstep([lane.owner_id], (PagedHooks(runtime, lane.owner_id), *recorders),
                       lambda model, hooks: family.steps(model, hooks, **loop), lane.forwards)

    def forks(self, forks: DemoForks) -> dict:
        """Fork the parent (measured: blocks taken, bytes copied), then run the forks' loop as one forward per step."""
        runtime, allocator = self.runtime, self.runtime.scheduler.allocator
        pool_before, free_before = runtime.pool.tensor.clone(), allocator.num_free
        start = time.perf_counter()
        for child in forks.children:
            runtime.fork(forks.parent, child, **forks.fork_args)
        fork_s = time.perf_counter() - start
        taken = free_before - allocator.num_free
        copied = 0 if torch.equal(runtime.pool.tensor, pool_before) else runtime.pool.nbytes
        del pool_before
        n = len(forks.children)
        parents = self._recorders[forks.parent]
        recorders = tuple(_DenseRecorder(lambda batch, parent=parent: forks.copy_dense_caches(parent.held, n))
                          for parent in parents)
        for child in forks.children:
            self.owners[child] = OwnerFigures(child, forks.what, runtime.owner(child).num_rows)
        self._lockstep(forks.children, (_BatchHooks(runtime, forks.children), *recorders), forks.steps, None)
        return {"forks": n, "rows": sum(self.owners[c].rows for c in forks.children), "blocks_taken": taken,
                "kv_bytes_copied": copied, "fork_ms": fork_s * 1e3}

    def _lockstep(self, owner_ids: list[str], hooks: tuple, make_steps: Callable[[torch.nn.Module, Any], Any],
                  limit: int | None) -> None:
        """Advance the paged, oracle and dense compiled runs of one loop forward by forward (`limit`: then stop)."""
        paged_hooks, oracle_hooks, dense_hooks = hooks
        models = (self.setup.model, self.setup.oracle, self.setup.dense)
        runs = [make_steps(model, h) for model, h in zip(models, hooks)]
        results: list[Any] = [None, None, None]
        done = 0
        with torch.no_grad():
            while limit is None or done < limit:
                try:
                    paged_fw, oracle_fw, dense_fw = [run.send(r) for run, r in zip(runs, results)]
                except StopIteration:
                    break
                results[0], rows, paged_s = self._paged(paged_hooks, paged_fw)
                results[2], dense_s, compiled = self._dense(dense_fw)
                results[1] = oracle_fw.call()
                for recorder, fw, result in zip((oracle_hooks, dense_hooks), (oracle_fw, dense_fw), results[1:]):
                    recorder.held = self.setup.family.dense_caches_after(recorder.held, fw.kind, result)
                self._record_parity(owner_ids, self.demo.compare_rows(results[1], results[0]))
                drift = self.demo.compare_rows(results[1], results[2]).max().item()
                self.compile_drift = max(self.compile_drift, drift)
                self.forwards.append(TimedForward(rows, paged_s, dense_s, compiled))
                done += 1
        for owner_id, row_bytes in zip(owner_ids, self._split(owner_ids, self.demo.dense_kv_bytes(oracle_hooks.held))):
            self.owners[owner_id].dense_bytes = sum(row_bytes)

    def _paged(self, hooks: PagedHooks, fw) -> tuple[Any, int, float]:
        graphs = unique_graphs()
        _synchronize(self.setup.device)
        start = time.perf_counter()
        with hooks.forward(fw.kind, **fw.info) as active:
            rows = active.bucket.rows
            result = fw.call()
            _synchronize(self.setup.device)
        elapsed = time.perf_counter() - start
        self.paged_compiles += unique_graphs() - graphs
        return result, rows, elapsed

    def _dense(self, fw) -> tuple[Any, float, bool]:
        graphs = unique_graphs()
        with torch.compiler.set_stance("default"):  # the paged side serves under "fail_on_recompile"
            _synchronize(self.setup.device)
            start = time.perf_counter()
            result = fw.call()
            _synchronize(self.setup.device)
            elapsed = time.perf_counter() - start
        compiled = unique_graphs() - graphs
        self.dense_frames += compiled
        return result, elapsed, bool(compiled)

    def _split(self, owner_ids: list[str], per_row: Any) -> list[list]:
        """A forward's rows (or per-row figures), owner by owner: each owner's rows in `owner_ids` order."""
        out, start = [], 0
        for owner_id in owner_ids:
            n = self.owners[owner_id].rows
            out.append(list(per_row[start:start + n]))
            start += n
        return out

    def _record_parity(self, owner_ids: list[str], per_row: torch.Tensor) -> None:
        for owner_id, diffs in zip(owner_ids, self._split(owner_ids, per_row.tolist())):
            figures = self.owners[owner_id]
            figures.forwards += 1
            figures.max_abs_diff = max(figures.max_abs_diff or 0.0, *diffs)

    def _result(self, fork: dict) -> SceneResult:
        runtime = self.runtime
        block_bytes = KVPool.bytes_per_block_all_layers(runtime.config)
        holders: dict[int, int] = {}
        for owner_id in self.owners:
            for block in {b for row in runtime.owner(owner_id).rows for b in row}:
                holders[block] = holders.get(block, 0) + 1
        for owner_id, figures in self.owners.items():
            blocks = {b for row in runtime.owner(owner_id).rows for b in row}
            figures.paged_bytes = len(blocks) * block_bytes
            figures.paged_shared_bytes = sum(holders[b] > 1 for b in blocks) * block_bytes
        allocator = runtime.scheduler.allocator
        held = (runtime.pool.blocks_per_layer - allocator.num_free) * block_bytes
        for owner_id in list(self.owners):
            runtime.release(owner_id)
        return SceneResult(list(self.owners.values()), self.forwards, self.dense_frames, self.paged_compiles, fork,
                           runtime.pool.nbytes, held, (allocator.num_free, runtime.pool.blocks_per_layer),
                           self.compile_drift)


# ---- the whole demo -------------------------------------------------------------------------------------


def parity_bound(compile_drift: float) -> float:
    """How far paged may be from dense eager, given how far compiling the dense model moved it (module doc)."""
    return min(PARITY_CEILING, max(PARITY_ATOL, DRIFT_FACTOR * compile_drift))


def _parity(setup: Setup) -> float:
    """Whole loops, dense eager vs paged (on the serving runtime): the worst max abs difference."""
    family, worst = setup.family, 0.0
    for i, loop in enumerate(setup.demo.loops):
        _, _, loop = admit_loop(setup.model, setup.runtime, f"loop-{i}", admit=False, **loop)
        with torch.no_grad():
            hooks = DenseHooks()
            dense = drive(family.steps(setup.oracle, hooks, **loop), hooks)
        paged = paged_run(setup.model, setup.runtime, owner_id=f"loop-{i}", **loop)
        worst = max(worst, setup.demo.compare(dense, paged))
    return worst


def _warm_up(setup: Setup, progress: bool):
    from .backend import record_passes

    graphs = unique_graphs()
    with record_passes() as passes:
        start = time.perf_counter()
        captured = warm_up(setup.model, setup.runtime, progress=progress)
        elapsed = time.perf_counter() - start
    reports = [r for result in passes for r in result.reports]
    sites = {s: sum(r.status == s for r in reports) for s in ("rewritten", "dense", "refused")}
    return captured, {"s": elapsed, "frames": unique_graphs() - graphs, "sites": sites, "graphs": len(passes)}


def _times(forwards: list[TimedForward]) -> list[dict]:
    """Per row count: median time per forward of each side over the forwards in which the dense side compiled
    nothing (the paged side compiled everything at warm-up)."""
    out = []
    for rows in sorted({f.rows for f in forwards}):
        timed = [f for f in forwards if f.rows == rows and not f.dense_compiled]
        if not timed:  # every forward of this shape compiled a dense frame: nothing to compare
            out.append({"rows": rows, "forwards": 0, "dense_ms": None, "paged_ms": None, "paged_over_dense": None})
            continue
        paged = statistics.median(f.paged_s for f in timed) * 1e3
        dense = statistics.median(f.dense_s for f in timed) * 1e3
        out.append({"rows": rows, "forwards": len(timed), "dense_ms": dense, "paged_ms": paged,
                    "paged_over_dense": paged / dense})
    return out


def _bucket_dict(b: Bucket) -> dict:
    return {"rows": b.rows, "tokens": b.tokens, "context": b.context}


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[int]:
    """torch's intra-op threads set to `threads` (None: left as they are) for the block, restored after."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(old)


def run(setup: Setup, *, threads: int | None = None, progress: Progress | None = None,
        progress_bar: bool = True) -> dict:
    """The whole demo on a built `setup`: warm-up, the parity loops, the scene. Returns the report (plain data).

    threads: torch's intra-op threads while it runs (None: as they are); both sides run with the same."""
    say = progress or (lambda message: None)
    with _torch_threads(threads) as threads, torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        say(f"compiling the paged blocks ({setup.inner_compiler}), one frame per bucket")
        captured, warm = _warm_up(setup, progress_bar)
        try:
            with captured.serving():
                say("parity oracle: " + setup.demo.loops_describe)
                diff = _parity(setup)
                scene = Scene(setup, say).run()
        finally:
            captured.uninstall()
    dense_compile_s = sum(f.dense_s for f in scene.forwards if f.dense_compiled)
    atol = parity_bound(scene.compile_drift)
    return {
        "model": setup.family.name.replace("_", "-"),
        "description": setup.demo.describe,
        "device": setup.device,
        "threads": threads,
        "kernel": setup.kernel,
        "kernel_resolved": setup.kernel_resolved,
        "inner_compiler": setup.inner_compiler,
        "cuda_graphs": captured.capture,
        "attention_sites": {**warm["sites"], "graphs": warm["graphs"], "layers": setup.runtime.config.num_layers},
        "parity": {"loops": setup.demo.loops_describe, "max_abs_diff": diff, "atol": atol,
                   "compile_drift": scene.compile_drift, "drift_factor": DRIFT_FACTOR, "floor": PARITY_ATOL,
                   "ceiling": PARITY_CEILING, "ok": diff <= atol},
        "scene": {
            "owners": [o.as_dict() for o in scene.owners],
            "parity_ok": all(o.max_abs_diff is None or o.max_abs_diff <= atol for o in scene.owners),
            "fork": scene.fork,
            "blocks_free_after": list(scene.blocks_free_after),
        },
        "kv_bytes": {
            "paged_pool": scene.pool_bytes,
            "paged_held": scene.held_bytes,
            "dense_held": sum(o.dense_bytes for o in scene.owners),
        },
        "dense_baseline": setup.demo.dense_baseline,
        "compiled_frames": {
            "paged": warm["frames"], "paged_while_serving": scene.paged_compiles, "dense": scene.dense_frames,
            "buckets": [_bucket_dict(b) for b in setup.runtime.config.buckets],
        },
        "compile_s": {"paged": warm["s"], "dense": dense_compile_s},
        "time_per_forward": _times(scene.forwards),
        "forwards": len(scene.forwards),
        "info": setup.demo.info,
    }


def ok(report: dict) -> bool:
    """The demo's verdict: the parity loops and every owner of the scene match dense within the parity bound."""
    return report["parity"]["ok"] and report["scene"]["parity_ok"]
