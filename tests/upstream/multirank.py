"""Several gloo ranks on the CPU, initialised through vllm-omni's own `parallel_state`, driven from a test.

`RankPool(world_size)` spawns that many `torch.multiprocessing` workers once. Each worker installs the CPU
shims of `vllm_omni_cpu.py`, joins a gloo world with `parallel_state.init_distributed_environment(...)` and
then serves tasks: `pool.setup(tensor_parallel_size=2)` (or `cfg_parallel_size=2`, ...) tears down and
re-creates vllm-omni's model-parallel groups with `initialize_model_parallel(..., backend="gloo")`, and
`pool.run(fn, *args)` calls the module-level function `fn` on every rank and returns the per-rank results
(rank order). One spawn serves many scenarios: starting a rank (importing torch, vLLM and vllm-omni) costs
seconds on a loaded 2-core machine, switching the parallel layout a fraction of one.

Failures come back as `RankError` carrying each failing rank's traceback. Every call has a hard timeout:
a rank that does not answer (a hung collective) gets SIGUSR1, which makes it dump every thread's stack
(`faulthandler`), and the error quotes that dump; the pool is then stopped (its collectives can no longer be
trusted) and the next `run` starts a fresh one. The world is joined through a `file://` store in a private
temporary directory, so no TCP port is chosen ahead of time: gloo binds its own sockets, and two test
processes on one machine never race for a port.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import queue
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

#: how long a worker may take to start (spawn + imports + joining the world). These limits only bound a HUNG call
#: (a passing call never waits for them), so they are far above what a 2-core machine shared by several 2-rank
#: jobs needs: 240 s / 180 s were exceeded under load, failing tests that pass on a quiet machine
START_TIMEOUT_S = 900.0
#: default limit of one `run` (every rank); a test passes a smaller one only to provoke a hang on purpose
RUN_TIMEOUT_S = 900.0
#: how long a hung rank's stack dump (SIGUSR1 -> faulthandler) may take to be written on a loaded machine
DUMP_TIMEOUT_S = 60.0


class RankError(RuntimeError):
    """A rank raised, died or hung; the message carries each failing rank's traceback or stack dump."""


@dataclass
class _Task:
    task_id: int
    module: str
    name: str
    args: tuple
    kwargs: dict


def _resolve(module: str, name: str) -> Callable[..., Any]:
    return getattr(importlib.import_module(module), name)


def _worker(rank: int, world_size: int, init_file: str, tasks, results, stack_path: str, engine: bool) -> None:
    """One rank: join the world, then run tasks until told to stop (None)."""
    stacks = open(stack_path, "w")  # noqa: SIM115 - kept open for faulthandler for the process's life
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    torch.set_num_threads(1)  # 2 ranks on 2 cores: one intra-op thread each
    try:
        if engine:
            from . import vllm_omni_cpu

            vllm_omni_cpu.init_distributed(rank=rank, world_size=world_size, init_method=f"file://{init_file}")
        else:
            torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                                 world_size=world_size)
        results.put((rank, -1, "ok", os.getpid()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, -1, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        try:
            out = _resolve(task.module, task.name)(*task.args, **task.kwargs)
            results.put((rank, task.task_id, "ok", out))
        except BaseException:  # noqa: BLE001 - reported to the parent
            results.put((rank, task.task_id, "error", traceback.format_exc()))


class RankPool:
    """`world_size` gloo ranks in worker processes (see the module docstring). engine=False: a plain gloo world,
    without vllm-omni (its imports are most of a rank's start-up)."""

    def __init__(self, world_size: int = 2, *, engine: bool = True) -> None:
        self.world_size = world_size
        self.engine = engine
        self.procs: list = []
        self.parallel: dict[str, int] | None = None  # the model-parallel sizes last set up
        self._next_id = 0
        self.start_s = 0.0  # seconds the last start took

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self.procs:
            return
        t0 = time.perf_counter()
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="multirank-")
        init_file = os.path.join(self._dir.name, "store")
        self._stacks = [os.path.join(self._dir.name, f"stacks-{r}.txt") for r in range(self.world_size)]
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        for r in range(self.world_size):  # spawn hands the workers this process's sys.path
            p = ctx.Process(target=_worker, name=f"rank{r}", daemon=True,
                            args=(r, self.world_size, init_file, self._tasks[r], self._results, self._stacks[r],
                                  self.engine))
            p.start()
            self.procs.append(p)
        self.parallel = None
        self._collect(-1, START_TIMEOUT_S, "start (spawn, imports, init_distributed_environment)")
        self.start_s = time.perf_counter() - t0

    def close(self, *, force: bool = False) -> None:
        """Stop the workers (politely, then by force; at once with `force`: a rank stuck in a collective never
        reads its queue) and remove the store."""
        for q in getattr(self, "_tasks", []):
            try:
                q.put(None)
            except Exception:  # noqa: BLE001 - the queue may be broken already
                pass
        for p in self.procs:
            p.join(timeout=0 if force else 10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []
        self.parallel = None
        if hasattr(self, "_dir"):
            self._dir.cleanup()

    def __enter__(self) -> "RankPool":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- tasks ----------------------------------------------------------------------------------
    def setup(self, **sizes: int) -> None:
        """vllm-omni's model-parallel groups for `sizes` (initialize_model_parallel's keywords, e.g.
        tensor_parallel_size=2); re-created only when they change."""
        if self.parallel == sizes and self.procs:
            return
        self.run(setup_model_parallel, **sizes)
        self.parallel = dict(sizes)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = RUN_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """`fn(*args, **kwargs)` on every rank; the results in rank order. `fn` must be importable by name."""
        self.start()
        module = fn.__module__
        if module == "__main__":
            raise ValueError("run() needs a function importable from a module, not one defined in __main__")
        self._next_id += 1
        task = _Task(self._next_id, module, fn.__qualname__, args, kwargs)
        for q in self._tasks:
            q.put(task)
        return self._collect(task.task_id, timeout, f"{module}.{fn.__qualname__}")

    def _collect(self, task_id: int, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        got: dict[int, tuple[str, Any]] = {}
        while len(got) < self.world_size:
            try:
                rank, tid, status, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in got]
                if dead:
                    codes = {r: self.procs[r].exitcode for r in dead}
                    self._fail(f"{what}: rank(s) {dead} died (exit codes {codes}) without answering", got)
                if time.monotonic() > deadline:
                    self._fail_hung(what, timeout, got)
                continue
            if tid != task_id:
                continue  # a late answer to a call that already failed
            got[rank] = (status, payload)
        errors = {r: p for r, (s, p) in got.items() if s == "error"}
        if errors:
            if task_id == -1:
                self.close()
            raise RankError(
                f"{what} failed on rank(s) {sorted(errors)}:\n"
                + "\n".join(f"---- rank {r} ----\n{tb}" for r, tb in sorted(errors.items()))
            )
        return [got[r][1] for r in range(self.world_size)]

    def _fail_hung(self, what: str, timeout: float, got: dict) -> None:
        hung = [r for r in range(self.world_size) if r not in got]
        for r in hung:
            try:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
        dumps = [f"---- rank {r} stacks ----\n{self._stack_dump(r)[-6000:]}" for r in hung]
        self._fail(f"{what}: rank(s) {hung} did not answer within {timeout:.0f} s (a hung collective?)\n"
                   + "\n".join(dumps), got)

    def _stack_dump(self, rank: int) -> str:
        """Rank `rank`'s stack dump once it is written completely (non-empty and unchanged for half a second; no
        fixed sleep: a loaded machine may take seconds to schedule the signalled process), or a note."""
        deadline, last = time.monotonic() + DUMP_TIMEOUT_S, ""
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                with open(self._stacks[rank]) as f:
                    text = f.read()
            except OSError:
                text = ""
            if text and text == last:
                return text
            last = text
        return last or f"(no stack dump within {DUMP_TIMEOUT_S:.0f} s)"

    def _fail(self, message: str, got: dict) -> None:
        errors = "".join(f"\n---- rank {r} ----\n{p}" for r, (s, p) in sorted(got.items()) if s == "error")
        self.close(force=True)
        raise RankError(message + errors)


# ---- tasks every rank runs ----------------------------------------------------------------------


def setup_model_parallel(**sizes: int) -> dict[str, int]:
    """Re-create vllm-omni's model-parallel groups (gloo) with `sizes`; returns this rank's view of them."""
    from vllm_omni.diffusion.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(backend="gloo", **sizes)
    return rank_info()


def rank_info() -> dict[str, int]:
    """This rank's place in vllm-omni's groups, read from its getters."""
    from vllm.distributed import parallel_state as vps
    from vllm_omni.diffusion.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {"rank": torch.distributed.get_rank()}
    return {
        "rank": torch.distributed.get_rank(),
        "tp": vps.get_tensor_model_parallel_world_size(), "tp_rank": vps.get_tensor_model_parallel_rank(),
        "cfg": ps.get_classifier_free_guidance_world_size(), "cfg_rank": ps.get_classifier_free_guidance_rank(),
        "sp": ps.get_sequence_parallel_world_size(), "ulysses": ps.get_ulysses_parallel_world_size(),
    }


def load_full_weights(module: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Load a one-rank state dict into a module built at this rank's tensor-parallel size.

    Every parameter goes through its own `weight_loader` (vLLM's `QKVParallelLinear`, `MergedColumnParallelLinear`,
    `RowParallelLinear`, vllm-omni's `DistributedRMSNorm`), which takes the rank's shard, exactly as loading a
    checkpoint does; fused parameters get the whole fused tensor (shard id None: the loader splits it)."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(full))
    if missing:
        raise KeyError(f"the one-rank state dict has no {missing}")
    with torch.no_grad():
        for name, param in params.items():
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, full[name].to(param.dtype))


def sync_check(value: float) -> list[float]:
    """A gloo all-gather on the world group (tests the pool itself)."""
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    """(exception class name, message) of fn(), or ("ok", ""): what a rank task returns so that the test can compare
    every rank's refusal."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the outcome is what the tests compare
        return type(e).__name__, str(e)
    return "ok", ""


def hang_on_rank(rank: int) -> None:
    """`rank` waits in a collective the others never join (tests the timeout path)."""
    if torch.distributed.get_rank() == rank:
        torch.distributed.barrier()


def raise_on_rank(rank: int, message: str) -> int:
    if torch.distributed.get_rank() == rank:
        raise ValueError(message)
    return torch.distributed.get_rank()
