"""Differential fuzzer: random operation sequences on both families, every forward compared with dense.

A seeded generator draws operations against a small runtime of each family, one at a time, from what is live:
admit (with and without shared cross-attention regions, salted or not, content-keyed or forged, from a spec that
matches the model or not), fork, forwards alone or batched (several owners, forks or branches at one phase),
DreamZero commits and denoising steps, HunyuanImage-3 prefills (padding in the middle, left or right; masks in every
encoding `world.ENCODINGS` lists, the ones the runtime must refuse included), steps and re-prefills, resets,
aborts, faults raised inside a block mid-forward and their retries, releases, reuse of finished ids (the finished-id
memory is kept at `FINISHED_MEMORY` so reuse past it happens in short runs) and, on an FP8 pool, set_scales.

Every operation runs on two runtimes fed the same operations, one per serving path:
  compiled: the blocks compiled with backend="paged_kv" (aot_eager, reference kernel), called directly;
  captured: the same blocks warmed up and captured per bucket (`capture.CapturedBlocks`) with a replay that runs no
            Python (`capture.CompiledOnlyGraphs`, what a CUDA graph does), so only the captured path's own host
            checks stand between a bad forward and the pool.
Two runtimes rather than one serving alternately: each path then has its own pool and bookkeeping, a defect in one
cannot be masked or repaired by the other, and the two must make the same decisions (their `state()` is compared
after every operation, and a call one refuses the other must refuse).

Each forward's outputs are compared with a dense eager twin per owner (`fuzz/world.py`: its own dense caches, the
reference model, fp32; FP8 twins round K/V with the scales in force when they were written) at 1e-5 (batched
forwards: 1e-5 plus the batch-invariance bound, 1e-6). Every refusal (a `PagedKVError`) and every faulted forward
must leave `runtime.state()`, the pool bytes of every block a live owner holds and the FP8 scales exactly as they
were. After every operation: each block's refcount equals its holders (rows and regions), nothing is in flight,
live owners are the twins, serials are unique; every metadata repeat key names one owner for the runtime's life;
no forward of admitted owners waits for capacity (admission reserves what their forwards take: DreamZero's commits,
a HunyuanImage-3 prefill after a reset).

    python -m fuzz --steps 2000 [--seed 0] [--seeds 1] [--family all] [--pool all] [--shrink]
    python -m fuzz --mutant 5 --family dreamzero --pool fp32 --seeds 10   # defect 5 put back

A failure prints the seed, the failing operation (its index) and the operation list (bisected to a shorter list
that still fails with --shrink); `--replay FILE` runs a saved operation list.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from fuzz.mutants import DESCRIPTIONS, mutant  # noqa: E402
from fuzz.paths import (  # noqa: E402
    DZ_CONTENTS,
    FAMILIES,
    FINISHED_MEMORY,
    FP8,
    HY_BLOCK,
    HY_CAPACITY,
    HY_CFG,
    PATHS,
    InjectedFault,
    ServingPath,
    Snapshot,
    draw_geometry,
    dz_config,
    harness,
    held_blocks,
)
from fuzz.world import (  # noqa: E402
    ENCODINGS,
    STYLES,
    VALID_ENCODINGS,
    Fp8Scales,
    HunyuanTwin,
    batch_masks,
    dense_request,
    encode_mask,
)
from paged_kv_compile import CapacityError, PagedKVError  # noqa: E402
from paged_kv_compile.families.dreamzero import DreamZeroSpec, history_tokens  # noqa: E402
from paged_kv_compile.families.hunyuan_image3 import HunyuanSpec  # noqa: E402
from paged_kv_compile.models.hunyuan_image3 import HunyuanKVCache  # noqa: E402
from paged_kv_compile.runtime import PagedKVRuntime  # noqa: E402

ATOL = 1e-5
BATCH_INVARIANCE = 1e-6  # tests/test_batched.py: an owner's output in a batch equals its output alone
#: FP8 pools: K/V computed in another batch shape (the dense twin runs one owner, or one row, at a time) differ from
#: the paged path's in the last float bits, and a value that close to an FP8 rounding tie rounds to the other
#: neighbour (one e4m3 step, 1/16 to 1/8 of the value): the outputs then differ by about 1e-3. Wrong scales (defect
#: 4: 100x) or another owner's K/V move them by O(1). Measured worst over the long runs: docs/reliability.md.
FP8_ATOL = 1e-2


class FuzzFailure(AssertionError):
    """What the fuzzer found: kind is "wrong answer", "leaked state", "deadlock", "divergence" or "crash"."""

    def __init__(self, kind: str, index: int, op: dict, detail: str) -> None:
        self.kind, self.index, self.op, self.detail = kind, index, op, detail
        super().__init__(f"{kind} at operation {index} {json.dumps(op)}: {detail}")


@dataclass
class Stats:
    steps: int = 0
    forwards: int = 0  # forwards that ran (on every path)
    compared: int = 0  # outputs compared with the dense twin: per path, owner row and output (DreamZero: video, actions)
    refusals: int = 0  # refused operations, each checked on every path to have changed nothing
    faults: int = 0  # forwards that faulted inside a block, each checked on every path to have been rolled back
    retries: int = 0
    batched: int = 0
    forks: int = 0
    evictions: int = 0
    id_reuse: int = 0
    set_scales: int = 0
    worst: float = 0.0  # largest |paged - dense| seen
    kinds: Counter = field(default_factory=Counter)  # operations drawn, by kind
    refused_by: Counter = field(default_factory=Counter)  # refusals by error type

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["kinds"] = dict(self.kinds)
        d["refused_by"] = dict(self.refused_by)
        return d


# ---- the fuzzer ---------------------------------------------------------------------------------------------


class Fuzzer:
    """One seeded run of one family on every path (see the module docstring)."""

    def __init__(self, family: str, seed: int = 0, *, fp8: bool = False, paths: tuple[str, ...] | None = None,
                 weights: dict | None = None, key_check: bool = True,
                 geometry: tuple[int, int, int] | None = None) -> None:
        """weights: operation name -> relative weight, overriding the generator's; key_check=False leaves out the
        repeat-key invariant (then only what the outputs and the state show counts). geometry: DreamZero's (frame
        tokens, chunk frames, block size), e.g. `draw_geometry(seed)`; None: DZ_CFG in blocks of DZ_BLOCK."""
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
        self.family, self.seed, self.fp8 = family, seed, fp8
        self.geometry = geometry if family == "dreamzero" else None
        self.h = harness(family, fp8, None if self.geometry is None else dz_config(*self.geometry[:2]))
        self.block_size = None if self.geometry is None else self.geometry[2]
        self.path_names = tuple(paths or PATHS)
        self.weights = weights or {}
        self.key_check = key_check
        self.rng = random.Random(seed)
        self.ops: list[dict] = []
        self.stats = Stats()
        self.index = -1
        self.twins: dict[str, Any] = {}
        self.finished: list[str] = []  # ids that ended, oldest first
        self.keys: dict[tuple, int] = {}  # metadata repeat key -> the incarnation it named
        self.incarnations = 0
        self.last_fault: dict | None = None
        self.counter = 0
        self.paths: list[ServingPath] = []
        #: (path, bucket, argument kind) of every forward that reached the model: the graphs a run may compile
        self.signatures: set[tuple] = set()
        self.oracle = self.h.oracle
        if family == "dreamzero":  # the cross-attention K/V of each prompt, per layer (2, 1, Lt, H, D)
            with torch.no_grad():
                self._cross = {c: self.h.dense.prepare_cross_kv(torch.randn(
                    1, self.h.cfg.text_len, self.h.cfg.text_dim, generator=torch.Generator().manual_seed(1000 + c)))
                    for c in range(DZ_CONTENTS)}
        cfg = self.h.cfg
        kv_heads = cfg.num_heads if family == "dreamzero" else cfg.num_kv_heads
        self.scales = Fp8Scales.ones(FP8, cfg.num_layers, kv_heads) if fp8 else None

    # ---- running ------------------------------------------------------------------------------------------
    def __enter__(self) -> "Fuzzer":
        # Every (bucket, argument kind) of both paths' models, of every harness of the process, is one graph of the
        # blocks' one code object: past dynamo's default limit of 8 it would run them eagerly (on empty stand-ins).
        self._limits = torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096)
        self._limits.__enter__()
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny models: one intra-op thread is as fast, and far steadier on a shared machine
        self.paths = [PATHS[name](self.h, self.block_size) for name in self.path_names]
        for path in self.paths:
            self.signatures.update(path.warmed())
        return self

    def __exit__(self, *exc) -> None:
        for path in self.paths:
            path.close()
        torch.set_num_threads(self._threads)
        self._limits.__exit__(*exc)

    def run(self, steps: int) -> Stats:
        """Draw and execute `steps` operations; raises FuzzFailure at the first one that fails."""
        with self:
            for _ in range(steps):
                op = self.draw()
                self.execute(op)
        return self.stats

    def replay(self, ops: list[dict]) -> Stats:
        with self:
            for op in ops:
                self.execute(op)
        return self.stats

    def execute(self, op: dict) -> None:
        self.ops.append(op)
        self.index = len(self.ops) - 1
        self.stats.steps += 1
        self.stats.kinds[op["op"]] += 1
        handler = getattr(self, f"_do_{op['op']}")
        with torch.no_grad():
            handler(op)
        self._invariants(op)

    def fail(self, kind: str, detail: str) -> FuzzFailure:
        return FuzzFailure(kind, self.index, self.ops[self.index], detail)

    # ---- calls on every path ------------------------------------------------------------------------------
    def on_paths(self, call: Callable[[ServingPath], Any], *, forward: bool = False, fault: bool = False,
                 rewrites: Callable[[PagedKVRuntime], dict[int, int]] | None = None) -> list | None:
        """Run `call(path)` on every path. A refusal (PagedKVError) or an injected fault must leave the path's
        state, held pool bytes and scales unchanged (except the slots `rewrites(runtime)` names, `Snapshot.of`: what
        the forward writes in place, checked by the forwards' comparisons with dense instead); every path must end
        the same way; a `forward` of admitted owners refused for capacity is a deadlock. Returns each path's result,
        or None when the call was refused or faulted (on every path)."""
        results, endings, details = [], [], []
        for path in self.paths:
            before = Snapshot.of(path.runtime, rewrites(path.runtime) if rewrites else None)
            try:
                results.append(call(path))
                endings.append("ok")
                details.append("ran")
            except InjectedFault:
                if not fault:
                    raise
                why = before.changed(path.runtime)
                if why:
                    raise self.fail("leaked state", f"{path.name}: a forward that faulted inside a block was not "
                                                    f"rolled back: {why}") from None
                endings.append("fault")
                details.append("faulted")
            except PagedKVError as e:
                if forward and isinstance(e, CapacityError):
                    raise self.fail("deadlock", f"{path.name}: a forward of admitted owners waited for capacity "
                                                f"({e}); admission must reserve what they take") from None
                why = before.changed(path.runtime)
                if why:
                    raise self.fail("leaked state", f"{path.name}: a refused call ({type(e).__name__}: {e}) "
                                                    f"changed the runtime: {why}") from None
                endings.append(f"refused {type(e).__name__}")
                details.append(f"refused ({type(e).__name__}: {e})")
            except FuzzFailure:
                raise
            except Exception as e:  # noqa: BLE001 - anything else is a defect, reported with the operation
                raise self.fail("crash", f"{path.name}: {type(e).__name__}: {e}") from e
            finally:
                path.fault = None
        if len(set(endings)) > 1:
            raise self.fail("divergence", "the paths ended differently: " + "; ".join(
                f"{p.name} {d}" for p, d in zip(self.paths, details)))
        if endings[0] == "fault":
            self.stats.faults += 1
        elif endings[0] != "ok":
            self.stats.refusals += 1
            self.stats.refused_by[endings[0].removeprefix("refused ")] += 1
        return results if endings[0] == "ok" else None

    def compare(self, path: ServingPath, what: str, got: torch.Tensor, want: torch.Tensor, batched: bool) -> None:
        tol = (FP8_ATOL if self.fp8 else ATOL) + (BATCH_INVARIANCE if batched else 0.0)
        if got.shape != want.shape:
            raise self.fail("wrong answer", f"{path.name}: {what}: shape {tuple(got.shape)} vs dense "
                                            f"{tuple(want.shape)}")
        diff = (got - want).abs()
        worst = float(diff.max()) if diff.numel() else 0.0
        if not bool(torch.isfinite(got).all() == torch.isfinite(want).all()) or not worst <= tol:
            raise self.fail("wrong answer", f"{path.name}: {what}: max |paged - dense| = {worst:.3g} > {tol:g}")
        self.stats.worst = max(self.stats.worst, worst)
        self.stats.compared += 1

    def check_keys(self, plans_by_owner: list[tuple[Any, Any]]) -> None:
        """Every metadata repeat key names one owner (incarnation) for the runtime's life."""
        if not self.key_check:
            return
        for plan, twin in plans_by_owner:
            if not plan.key:
                continue
            seen = self.keys.setdefault(plan.key, twin.incarnation)
            if seen != twin.incarnation:
                raise self.fail("leaked state", f"metadata repeat key {plan.key!r} of {plan.owner_id!r} already "
                                                "named another owner (an earlier owner of this id): its build could "
                                                "be served to this one")

    def _invariants(self, op: dict) -> None:
        states = []
        for path in self.paths:
            rt = path.runtime
            sched, alloc = rt.scheduler, rt.scheduler.allocator
            held = held_blocks(rt)
            for b in range(alloc.num_blocks):
                if alloc.refcount(b) != held.get(b, 0):
                    raise self.fail("leaked state", f"{path.name}: block {b} has refcount {alloc.refcount(b)} but "
                                                    f"{held.get(b, 0)} holders")
            if alloc.num_free != alloc.num_blocks - len(held):
                raise self.fail("leaked state", f"{path.name}: {alloc.num_free} free blocks, "
                                                f"{alloc.num_blocks - len(held)} unheld")
            if sched.in_flight is not None or rt.active is not None:
                raise self.fail("leaked state", f"{path.name}: a forward is still in flight or active")
            if set(sched.owners) != set(self.twins):
                raise self.fail("leaked state", f"{path.name}: live owners {sorted(sched.owners)} but the dense side "
                                                f"has {sorted(self.twins)}")
            serials = [o.serial for o in sched.owners.values()]
            if len(set(serials)) != len(serials):
                raise self.fail("leaked state", f"{path.name}: two live owners share a serial: {serials}")
            states.append(rt.state())
        if any(s != states[0] for s in states[1:]):
            raise self.fail("divergence", "the paths' runtimes differ after this operation: "
                            + "; ".join(f"{p.name}: {s}" for p, s in zip(self.paths, states)))

    # ---- ids ----------------------------------------------------------------------------------------------
    def new_id(self) -> str:
        """A fresh id; sometimes a finished one (reused past the finished-id memory, or refused within it)."""
        if self.finished and self.rng.random() < self.weights.get("reuse", 0.2):
            return self.rng.choice(self.finished[-2 * FINISHED_MEMORY:])
        self.counter += 1
        return f"{'s' if self.family == 'dreamzero' else 'r'}{self.counter}"

    def _ended(self, oid: str) -> None:
        self.twins.pop(oid, None)
        if oid in self.finished:
            self.finished.remove(oid)
        self.finished.append(oid)

    def _track_evictions(self) -> None:
        live = set(self.paths[0].runtime.scheduler.owners)
        for oid in [o for o in self.twins if o not in live]:
            why = self.paths[0].runtime.scheduler.finished.get(oid, "")
            if not why.startswith("evicted"):
                raise self.fail("leaked state", f"{oid!r} disappeared from the runtime ({why!r}) without an end")
            self.stats.evictions += 1
            self._ended(oid)

    def _incarnation(self) -> int:
        self.incarnations += 1
        return self.incarnations

    # ---- generation ---------------------------------------------------------------------------------------
    def draw(self) -> dict:
        self.index = len(self.ops)
        return self._draw_dreamzero() if self.family == "dreamzero" else self._draw_hunyuan()

    def _pick(self, table: list[tuple[str, float]]) -> str:
        names = [n for n, _ in table]
        weights = [self.weights.get(n, w) for n, w in table]
        return self.rng.choices(names, weights)[0]

    def _retry(self) -> dict | None:
        """The failed forward again (same owners, kind and inputs), sometimes with another mask."""
        if self.last_fault is None or self.rng.random() > 0.8:
            return None
        op = json.loads(json.dumps(self.last_fault))
        self.last_fault = None
        op["fault"] = None
        op["retry"] = True
        for item in op["items"]:
            if isinstance(item[2], dict) and "style" in item[2] and self.rng.random() < 0.6:
                item[2]["style"] = self.rng.choice(STYLES)
                item[2]["enc"] = self.rng.choice(VALID_ENCODINGS)
        return op

    def _fault(self) -> int | None:
        layers = self.h.cfg.num_layers
        return self.rng.randrange(layers) if self.rng.random() < self.weights.get("fault", 0.06) else None

    def _live(self) -> list[str]:
        return sorted(self.twins)

    def _some_id(self) -> str:
        """A live id mostly; sometimes a finished or unknown one (the runtime must refuse it)."""
        r = self.rng.random()
        if self.twins and r < 0.93:
            return self.rng.choice(self._live())
        if self.finished and r < 0.97:
            return self.rng.choice(self.finished)
        return "nobody"

    def _scales_op(self) -> dict:
        cfg = self.h.cfg
        kv_heads = cfg.num_heads if self.family == "dreamzero" else cfg.num_kv_heads
        draw = lambda: [[round(self.rng.uniform(0.004, 0.05), 5) for _ in range(kv_heads)]  # noqa: E731
                        for _ in range(cfg.num_layers)]
        return {"op": "set_scales", "k": draw(), "v": draw()}

    def _draw_dreamzero(self) -> dict:
        retry = self._retry()
        if retry is not None:
            return retry
        self.last_fault = None
        if not self.twins:
            what = "admit"
        else:
            what = self._pick([("admit", 12), ("fork", 6), ("forward", 42), ("batch", 14), ("reset", 5),
                               ("release", 5), ("abort", 4), ("set_scales", 3 if self.fp8 else 0),
                               ("bad_forward", 3)])
        rng = self.rng
        if what == "admit":
            rows = rng.choice((1, 2))
            regions = rng.random() < 0.6
            op = {"op": "admit", "id": self.new_id() if rng.random() > 0.03 or not self.twins else
                  rng.choice(self._live()), "rows": rows,
                  "spec": "model" if rng.random() > 0.04 else "wrong-sink",
                  "contents": [rng.randrange(DZ_CONTENTS) for _ in range(rows)], "regions": regions}
            if regions:
                op["salt"] = rng.choice([None, "", "t1", "t2"])
                op["keys"] = (None if rng.random() < 0.5 else
                              [f"p{(c + (rng.random() < 0.2)) % DZ_CONTENTS}" for c in op["contents"]])
            return op
        if what == "fork":  # with a budget of n commits sometimes (it reserves only what they take)
            return {"op": "fork", "parent": self._some_id(), "child": self.new_id(),
                    "commits": rng.choice((None, None, 1, 2))}
        if what in ("reset", "release", "abort"):
            return {"op": what, "id": self._some_id()}
        if what == "set_scales":
            return self._scales_op()
        kind = "commit" if rng.random() < 0.4 else "denoise"
        if what == "batch":  # several owners (sessions, forks) at one phase, now and then one CFG branch of one
            owners = rng.sample(self._live(), min(len(self.twins), rng.choice((2, 2, 3))))
            items = [[oid, kind, rng.randrange(2) if len(self.twins[oid].rows) == 2 and rng.random() < 0.15 else None]
                     for oid in owners]
        else:
            oid = self._some_id() if what == "forward" else rng.choice(self._live())
            twin = self.twins.get(oid)
            branch = rng.randrange(len(twin.rows)) if twin is not None and len(twin.rows) == 2 and \
                rng.random() < 0.25 else None
            items = [[oid, kind, branch]]
        twins = [self.twins.get(i[0]) for i in items]
        all_regions = all(t is not None and all(r.region is not None for r in t.rows) for t in twins)
        cross = "region" if (all_regions and rng.random() < 0.85) or what == "bad_forward" else "dense"
        op = {"op": "forward", "items": items, "cross": cross, "seed": rng.randrange(10**6),
              "start_frame": rng.randrange(4), "fault": self._fault()}
        if op["fault"] is not None:
            self.last_fault = op
        return op

    def _draw_hunyuan(self) -> dict:
        retry = self._retry()
        if retry is not None:
            return retry
        self.last_fault = None
        prefilled = [oid for oid, t in self.twins.items() if t.request is not None]
        if not self.twins:
            what = "admit"
        else:
            what = self._pick([("admit", 15), ("prefill", 22), ("step", 30 if prefilled else 3),
                               ("batch", 8), ("reset", 4), ("release", 6),
                               ("abort", 4), ("fork", 2), ("set_scales", 3 if self.fp8 else 0)])
        rng = self.rng
        if what == "admit":
            rows = rng.choice((1, 2))
            lens = [HY_CAPACITY if rng.random() < 0.4 else rng.randint(1, HY_CAPACITY) for _ in range(rows)]
            spec = "direct" if rng.random() < 0.6 else \
                ["mask", rng.choice(STYLES), rng.choice(VALID_ENCODINGS if rng.random() < 0.85 else tuple(ENCODINGS))]
            return {"op": "admit", "id": self.new_id(), "lens": lens, "seed": rng.randrange(10**6), "spec": spec}
        if what == "fork":
            return {"op": "fork", "parent": self._some_id(), "child": self.new_id()}
        if what in ("reset", "release", "abort"):
            return {"op": what, "id": self._some_id()}
        if what == "set_scales":
            return self._scales_op()

        def item(oid: str, kind: str) -> list:
            any_enc = rng.choice(VALID_ENCODINGS if rng.random() < 0.9 else tuple(ENCODINGS))
            if kind == "prefill":
                return [oid, kind, {"style": rng.choice(STYLES), "enc": any_enc}]
            # A step's mask is read by the runtime once per prefill, when passed (docs/status.md, known limits); otherwise
            # the pipeline promises it follows the prefill's layout: only such a step may carry a refused encoding.
            give = rng.random() < 0.5
            twin = self.twins.get(oid)
            checked = twin is None or twin.extra.get("step_checked", False)
            return [oid, kind, {"enc": any_enc if give and not checked else rng.choice(VALID_ENCODINGS),
                                "give_mask": give}]

        if what == "batch":
            kind = "step" if len(prefilled) >= 2 and rng.random() < 0.5 else "prefill"
            pool = prefilled if kind == "step" else self._live()
            owners = rng.sample(pool, min(len(pool), 2))
            items = [item(oid, kind) for oid in owners]
        elif what == "step":
            oid = rng.choice(prefilled) if prefilled and rng.random() < 0.95 else self._some_id()
            items = [item(oid, "step")]
        else:
            items = [item(self._some_id(), "prefill")]
        op = {"op": "forward", "items": items, "seed": rng.randrange(10**6), "fault": self._fault()}
        if op["fault"] is not None:
            self.last_fault = op
        return op

    # ---- lifecycle operations -----------------------------------------------------------------------------
    def _do_admit(self, op: dict) -> None:
        if op["id"] in self.finished:
            self.stats.id_reuse += 1
        (self._admit_dreamzero if self.family == "dreamzero" else self._admit_hunyuan)(op)

    def _admit_dreamzero(self, op: dict) -> None:
        oid = op["id"]
        spec = DreamZeroSpec.from_model_config(self.h.cfg)
        if op["spec"] == "wrong-sink":
            spec = dataclasses.replace(spec, sink_frames=0)
        cross_rows = [list(self._cross[c]) for c in op["contents"]]  # per row: per layer (2, 1, Lt, H, D)
        kwargs = {}
        if op["regions"]:
            cross = [torch.cat([row[layer] for row in cross_rows], dim=1) for layer in range(self.h.cfg.num_layers)]
            kwargs = dict(cross_kv=cross, cache_salt=op["salt"], content_keys=op["keys"])
        if self.on_paths(lambda p: p.runtime.admit(oid, spec, rows=op["rows"], **kwargs)) is None:
            return
        self._track_evictions()
        self.twins[oid] = self.oracle.new_twin(cross_rows, op["regions"], self.scales, self._incarnation())

    def _admit_hunyuan(self, op: dict) -> None:
        oid, lens, T = op["id"], op["lens"], HY_CFG.target_len
        g = torch.Generator().manual_seed(op["seed"])
        prompts = [torch.randint(0, HY_CFG.vocab, (n,), generator=g) for n in lens]
        if op["spec"] == "direct":
            def make_spec() -> HunyuanSpec:
                return HunyuanSpec(tuple(lens), T, ((1, 1 + HY_CFG.image_tokens),))
        else:
            _, style, enc = op["spec"]
            req = dense_request(self.h.dense, prompts, HY_CAPACITY, style, torch.zeros(len(prompts), T, HY_CFG.hidden))
            mask = encode_mask(req.mask, enc)

            def make_spec() -> HunyuanSpec:  # the documented path for Tencent's model: the spec read from the mask
                return HunyuanSpec.from_prefill_mask(mask, lens, T)
        if self.on_paths(lambda p: p.runtime.admit(oid, make_spec())) is None:
            return
        self.twins[oid] = HunyuanTwin(prompts, HY_CAPACITY, self._incarnation())

    def _do_fork(self, op: dict) -> None:
        parent, child = op["parent"], op["child"]
        if child in self.finished:
            self.stats.id_reuse += 1
        budget = {} if op.get("commits") is None else {"commits": op["commits"]}
        if self.on_paths(lambda p: p.runtime.fork(parent, child, **budget)) is None:
            return
        self._track_evictions()
        self.twins[child] = self.twins[parent].fork(self._incarnation())
        self.stats.forks += 1

    def _do_reset(self, op: dict) -> None:
        oid = op["id"]
        if self.on_paths(lambda p: p.runtime.reset(oid)) is None:
            return
        twin = self.twins[oid]
        if self.family == "dreamzero":
            twin.reset(self.h.dense)
        else:  # the request's prefix is dropped: it must be prefilled again
            twin.request = twin.caches = None

    def _do_release(self, op: dict) -> None:
        self._end(op, "release")

    def _do_abort(self, op: dict) -> None:
        self._end(op, "abort")

    def _end(self, op: dict, how: str) -> None:
        oid = op["id"]
        if self.on_paths(lambda p: getattr(p.runtime, how)(oid)) is None:
            return
        self._ended(oid)

    def _do_set_scales(self, op: dict) -> None:
        k, v = torch.tensor(op["k"]), torch.tensor(op["v"])
        self.stats.set_scales += 1
        if self.on_paths(lambda p: p.runtime.pool.set_scales(k, v)) is None:
            return
        self.scales = Fp8Scales(FP8, k, v)

    # ---- forwards -----------------------------------------------------------------------------------------
    def _do_forward(self, op: dict) -> None:
        if op.get("retry"):
            self.stats.retries += 1
        if len(op["items"]) > 1:
            self.stats.batched += 1
        if self.family == "dreamzero":
            self._dreamzero_forward(op)
        else:
            self._hunyuan_forward(op)

    def _context(self, path: ServingPath, items: list) -> contextlib.AbstractContextManager:
        rt = path.runtime
        if len(items) == 1:
            oid, kind, args = items[0]
            return rt.forward(oid, kind, **args)
        return rt.forward_batch([(oid, kind, args) for oid, kind, args in items])

    def _dreamzero_forward(self, op: dict) -> None:
        cfg = self.h.cfg
        kind = op["items"][0][1]
        commit = kind == "commit"
        items = [(oid, k, {} if b is None else {"branch": b}) for oid, k, b in op["items"]]
        # the rows each item carries, in forward order (as the dense side sees them)
        layout = []
        for oid, _, b in op["items"]:
            twin = self.twins.get(oid)
            n = 0 if twin is None else (1 if b is not None else len(twin.rows))
            layout.append((oid, b, n))
        rows = sum(n for _, _, n in layout) or 1
        g = torch.Generator().manual_seed(op["seed"])
        x = torch.randn(rows, cfg.chunk_tokens, cfg.in_channels, generator=g)
        a = torch.randn(rows, cfg.action_register_length, cfg.action_dim, generator=g)
        t = torch.rand(rows, generator=g) * 1000
        dense_cross = []  # per layer (2, rows, Lt, H, D): each row's own context
        row_refs = [(self.twins[oid].rows[r], oid) for oid, b, n in layout if n
                    for r in ([b] if b is not None else range(n))]
        for layer in range(cfg.num_layers):
            parts = [row.cross[layer] for row, _ in row_refs] or [self._cross[0][layer]]
            dense_cross.append(torch.cat(parts, dim=1))

        def call(path: ServingPath):
            rt = path.runtime
            path.variant = op["cross"]
            path.fault = op["fault"]
            standin = rt.standin(2, rows, cfg.max_attention_size, cfg.num_heads, cfg.head_dim)
            cross = ([rt.region_standin(2, rows, cfg.cross_len, cfg.num_heads, cfg.head_dim)] * cfg.num_layers
                     if op["cross"] == "region" else dense_cross)
            with self._context(path, items) as active:
                self.signatures.add((path.name, active.bucket, path.variant))
                plans = active.plan.owner_plans()
                if len(active.plan.rows) != rows:
                    raise self.fail("divergence", f"{path.name}: the runtime planned {len(active.plan.rows)} rows, "
                                                  f"the dense side has {rows}")
                video, action, _ = path.model(x, a, t, op["start_frame"], [standin] * cfg.num_layers, cross,
                                                       update_kv_cache=commit)
            return video, action, plans

        def rewrites(rt: PagedKVRuntime) -> dict[int, int]:
            """A row's partly filled last block: any forward writes its tail (beyond the history, which no one
            reads until the next commit writes it again), so a refused or faulted one may have written it."""
            out = {}
            B = rt.pool.block_size
            for oid, _, branch in op["items"]:
                owner = rt.scheduler.owners.get(oid)
                if owner is None or owner.state is None:
                    continue
                for r in ([branch] if branch is not None else range(owner.num_rows)):
                    if r < owner.num_rows and owner.rows[r]:
                        used = history_tokens(owner.spec, owner.state.commits[r]) % B
                        if used:
                            out[owner.rows[r][-1]] = used
            return out

        results = self.on_paths(call, forward=True, fault=op["fault"] is not None, rewrites=rewrites)
        if results is None:
            return
        self.stats.forwards += 1
        self.check_keys([(plan, self.twins[plan.owner_id]) for plan in results[0][2]])
        batched = len(op["items"]) > 1
        i = 0
        for oid, b, n in layout:
            twin = self.twins[oid]
            for r in ([b] if b is not None else range(n)):
                row = twin.rows[r]
                use_region = op["cross"] == "region" and row.region is not None
                want_v, want_a = self.oracle.forward_row(row, x[i:i + 1], a[i:i + 1], t[i:i + 1], op["start_frame"],
                                                         commit, use_region, self.scales)
                for path, (video, action, _) in zip(self.paths, results):
                    self.compare(path, f"{oid!r} row {r} video", video[i:i + 1], want_v, batched)
                    self.compare(path, f"{oid!r} row {r} actions", action[i:i + 1], want_a, batched)
                i += 1

    def _hunyuan_forward(self, op: dict) -> None:
        cfg, P, T = HY_CFG, HY_CAPACITY, HY_CFG.target_len
        kind = op["items"][0][1]
        g = torch.Generator().manual_seed(op["seed"])
        parts = []  # per item: (oid, twin or None, dense request, model mask, runtime mask, target)
        for oid, k, args in op["items"]:
            twin = self.twins.get(oid)
            prompts = twin.prompts if twin is not None else [torch.zeros(1, dtype=torch.int64)]
            target = torch.randn(len(prompts), T, cfg.hidden, generator=g)
            if k == "prefill":
                req = dense_request(self.h.dense, prompts, P, args["style"], target)
                mask = encode_mask(req.mask, args["enc"])
                parts.append((oid, twin, req, mask, mask, target))
            else:
                req = twin.request if twin is not None and twin.request is not None else \
                    dense_request(self.h.dense, prompts, P, "middle", target)
                mask = encode_mask(req.step_mask, args["enc"])
                parts.append((oid, twin, req, mask, mask if args["give_mask"] else None, target))
        items = []
        for (oid, k, args), (_, _, _, _, given, _) in zip(op["items"], parts):
            forward_args = {"prefix_capacity": P}
            if k == "prefill" or given is not None:
                forward_args["attention_mask"] = given
            items.append((oid, k, forward_args))
        model_mask = batch_masks([m for _, _, _, m, _, _ in parts])
        rows = model_mask.shape[0]
        if kind == "prefill":
            inputs = (torch.cat([r.embeds for _, _, r, _, _, _ in parts]), torch.cat([r.cos for _, _, r, _, _, _ in parts]),
                      torch.cat([r.sin for _, _, r, _, _, _ in parts]))
        else:
            inputs = (torch.cat([t for *_, t in parts]), torch.cat([r.step_cos for _, _, r, _, _, _ in parts]),
                      torch.cat([r.step_sin for _, _, r, _, _, _ in parts]))
        prefix_valid = torch.cat([r.prefix_valid for _, _, r, _, _, _ in parts])

        def call(path: ServingPath):
            rt = path.runtime
            path.variant = "bool" if model_mask.dtype == torch.bool else "float"
            path.fault = op["fault"]
            standin = rt.standin(rows, P, cfg.num_kv_heads, cfg.head_dim, writable=True)
            caches = [HunyuanKVCache(standin, standin) for _ in range(cfg.num_layers)]
            with self._context(path, items) as active:
                self.signatures.add((path.name, active.bucket, path.variant))
                plans = active.plan.owner_plans()
                out = path.model(*inputs, model_mask, caches, prefix_valid, kind)
            return out, plans

        def rewrites(rt: PagedKVRuntime) -> dict[int, int]:
            """A request's prompt blocks: a prefill rewrites them, a step its target positions after the prompt."""
            out = {}
            for oid, k, _ in op["items"]:
                owner, twin = rt.scheduler.owners.get(oid), self.twins.get(oid)
                if owner is None or twin is None:
                    continue
                for row, prompt in zip(owner.rows, twin.prompts):
                    for i, b in enumerate(row):
                        out[b] = 0 if k == "prefill" else max(0, min(HY_BLOCK, len(prompt) - i * HY_BLOCK))
            return out

        results = self.on_paths(call, forward=True, fault=op["fault"] is not None, rewrites=rewrites)
        if results is None:
            return
        self.stats.forwards += 1
        self.check_keys([(plan, self.twins[plan.owner_id]) for plan in results[0][1]])
        batched = len(op["items"]) > 1
        i = 0
        for (oid, k, args), (_, twin, req, _, _, target) in zip(op["items"], parts):
            n = twin.rows
            if k == "prefill":
                twin.extra["step_checked"] = False
                want = self.oracle.prefill(twin, req, args["enc"], self.scales)
                for path, (out, _) in zip(self.paths, results):
                    for r in range(n):
                        real = req.real[r]
                        self.compare(path, f"{oid!r} prefill ({args['style']}, {args['enc']}) row {r}",
                                     out[i + r][real], want[r][real], batched)
            else:
                twin.extra["step_checked"] = twin.extra.get("step_checked", False) or args["give_mask"]
                want = self.oracle.step(twin, target, args["enc"], self.scales)
                for path, (out, _) in zip(self.paths, results):
                    self.compare(path, f"{oid!r} step ({args['enc']})", out[i:i + n], want, batched)
            i += n


# ---- shrinking and the command line ----------------------------------------------------------------------------


def fails(family: str, ops: list[dict], fp8: bool, kind: str | None) -> FuzzFailure | None:
    """The failure replaying `ops` gives (of `kind`, if given), or None."""
    try:
        Fuzzer(family, fp8=fp8).replay(ops)
    except FuzzFailure as e:
        return e if kind is None or e.kind == kind else None
    return None


def shrink(family: str, ops: list[dict], fp8: bool, kind: str, budget: int = 80) -> list[dict]:
    """A shorter operation list that still fails the same way: ddmin-style bisection (drop chunks of halving
    size while the failure stays), at most `budget` replays."""
    ops = list(ops)
    chunk = max(1, len(ops) // 2)
    tries = 0
    while chunk >= 1 and tries < budget:
        i, changed = 0, False
        while i < len(ops) and tries < budget:
            candidate = ops[:i] + ops[i + chunk:]
            tries += 1
            e = fails(family, candidate, fp8, kind) if candidate else None
            if e is not None:
                ops = candidate[: e.index + 1]
                changed = True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    return ops


def _label(family: str, fp8: bool) -> str:
    return family + (" fp8" if fp8 else "")


def _summary(row: dict) -> str:
    where = "" if row.get("geometry") is None else " frame={} chunk={} block={}".format(*row["geometry"])
    return (f"{_label(row['family'], row['fp8'])} seed={row['seed']}{where}: steps={row['steps']} forwards={row['forwards']} "
            f"compared={row['compared']} refusals={row['refusals']} faults={row['faults']} retries={row['retries']} "
            f"batched={row['batched']} forks={row['forks']} evictions={row['evictions']} id_reuse={row['id_reuse']} "
            f"set_scales={row['set_scales']} worst={row['worst']:.2g} wrong=0 time={row['seconds']} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000, help="operations per family, pool dtype and seed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=1, help="run seeds seed .. seed+N-1")
    ap.add_argument("--family", choices=[*FAMILIES, "all"], default="all")
    ap.add_argument("--pool", choices=["fp32", "fp8", "all"], default="all",
                    help="the pool's storage: fp32, FP8 e4m3 (set_scales drawn too), or both (each family twice)")
    ap.add_argument("--shrink", action="store_true", help="bisect a failing operation list before printing it")
    ap.add_argument("--replay", type=Path, help="a JSON file {family, fp8, ops[, mutant]} to run instead of drawing")
    ap.add_argument("--mutant", type=int, choices=range(1, 7), metavar="1..6",
                    help="put defect N back (fuzz/mutants.py; docs/reliability.md): report after how many "
                         "operations each seed finds it")
    ap.add_argument("--no-key-check", action="store_true",
                    help="leave out the repeat-key invariant (only outputs and state count)")
    ap.add_argument("--page-sizes", action="store_true",
                    help="DreamZero: each seed draws its frame length, chunk and block size (`paths.draw_geometry`)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    put_back = (lambda: mutant(args.mutant)) if args.mutant else contextlib.nullcontext
    if args.replay:
        saved = json.loads(args.replay.read_text())
        with mutant(saved["mutant"]) if saved.get("mutant") else contextlib.nullcontext():
            Fuzzer(saved["family"], fp8=saved["fp8"]).replay(saved["ops"])
        print("replay: no failure")
        return 0
    if args.mutant:
        print(f"mutant {args.mutant}: {DESCRIPTIONS[args.mutant]}", flush=True)
    families = FAMILIES if args.family == "all" else (args.family,)
    pools = {"fp32": (False,), "fp8": (True,), "all": (False, True)}[args.pool]
    runs = [(f, fp8) for fp8 in pools for f in families]
    results, failed = [], False
    for family, fp8 in runs:
        for seed in range(args.seed, args.seed + args.seeds):
            geometry = draw_geometry(seed) if args.page_sizes and family == "dreamzero" else None
            fuzzer = Fuzzer(family, seed, fp8=fp8, key_check=not args.no_key_check, geometry=geometry)
            t0 = time.perf_counter()
            try:
                with put_back():
                    fuzzer.run(args.steps)
            except FuzzFailure as e:
                seconds = round(time.perf_counter() - t0, 1)
                ops = fuzzer.ops[: e.index + 1]
                row = {"family": family, "fp8": fp8, "seed": seed, "found_after": e.index + 1, "kind": e.kind,
                       "op": e.op["op"], "seconds": seconds}
                results.append(row)
                if args.mutant:
                    print(f"mutant {args.mutant}: {_label(family, fp8)} seed={seed}: found after {e.index + 1} "
                          f"operations ({seconds} s): {e.kind} at a {e.op['op']}", flush=True)
                    continue
                failed = True
                print(f"FAIL {_label(family, fp8)} seed={seed} after {e.index + 1} operations ({seconds} s): {e}")
                if args.shrink:
                    ops = shrink(family, ops, fp8, e.kind)
                    print(f"shrunk to {len(ops)} operations")
                print(json.dumps({"family": family, "fp8": fp8, "ops": ops}), flush=True)
                continue
            row = fuzzer.stats.as_dict()
            row.update(family=family, fp8=fp8, seed=seed, seconds=round(time.perf_counter() - t0, 1), wrong=0,
                       geometry=geometry)
            results.append(row)
            if args.mutant:
                print(f"mutant {args.mutant}: {_label(family, fp8)} seed={seed}: NOT found in {args.steps} operations",
                      flush=True)
            elif not args.json:
                print(_summary(row), flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
