"""Two-rank differential fuzzer: random lifecycle and forward sequences on two gloo ranks' `RankRuntime`s, every
rank's outputs compared with one rank's, every refusal checked to change nothing on any rank.

Each rank holds a `RankRuntime` of its layout -- tensor parallel 2 (its half of the KV heads), CFG-parallel 2 (its
own CFG branch's row) or Ulysses 2 (its heads after the all-to-all: what the pool holds is the TP layout's) -- and
beside it a ONE-RANK `PagedKVRuntime` of the whole workload (every head, both rows), fed the same operations. A
seeded generator (the same on both ranks) draws from what is live: admit, fork, forwards alone or batched (commit,
denoise), reset, release, abort, set_scales; and the calls that must be refused on every rank: a fault raised in
one rank's forward body after its first layer, one rank's forward running no paged attention (its blocks ran
eagerly), a bad argument on one rank, one rank passing another branch or another spec (divergence), and under
CFG-parallel one rank's smaller pool. The forward body is the paged op itself (`ops.write_attend`, reference
kernel) on seeded Q/K/V: each rank computes its slice of the one-rank tensors (heads or rows).

After every operation, on every rank:
  * every rank succeeded or every rank raised (the others' error names the failing rank);
  * a forward's outputs equal the one-rank runtime's (its heads or its row) within 1e-5; that oracle is the
    one-rank paged runtime, whose forwards the single-rank fuzzer (`python -m fuzz`, `fuzz/differential.py`) compares with dense
    eager attention;
  * a refused call left the rank's `state()`, the pool bytes of every block a live owner holds and the FP8 scales
    exactly as they were; the scale guard reads the live allocator;
  * the ranks agree: their states are equal (TP, Ulysses: block ids too) or, under CFG, agree on everything but
    the rows' block ids; and agree with the one-rank runtime's owners and versions.

    python -m fuzz.ranks --steps 300 --seeds 3 [--layout all|tp|cfg|ulysses] [--pool fp32|fp8|both] [--mutant 1|2|3]

`--mutant N` puts back the multi-rank defect N of `MUTANTS` (one mutation each) and the run must then FAIL (a caught mutant).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import random
import sys
import tempfile
import traceback
from collections import Counter
from typing import Any, Iterator

import torch
import torch.distributed as dist

from paged_kv_compile import PagedKVRuntime
from paged_kv_compile.distributed import ParallelConfig, RankRuntime
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config, history_tokens
from paged_kv_compile.models.dreamzero import DreamZeroConfig
from paged_kv_compile.ops.write_attend import write_attend

CFG = DreamZeroConfig(num_layers=2, frame_seqlen=4, num_frame_per_block=1, local_attn_size=3, window_reset_frames=64,
                      action_register_length=2, text_len=6)
SPEC = DreamZeroSpec.from_model_config(CFG)
#: (frame tokens, chunk frames, sink frames, block size) a seed may draw with --page-sizes (`draw_geometry`): blocks
#: that divide neither the frame nor the chunk, sinks that end inside a block
GEOMETRIES = ((4, 1, 0, 3), (5, 1, 1, 2), (5, 2, 1, 3), (3, 2, 0, 4), (4, 1, 1, 5), (3, 1, 1, 2), (5, 1, 0, 4))


def draw_geometry(seed: int) -> tuple[int, int, int, int]:
    """The geometry seed `seed` runs with --page-sizes: `random.Random(seed)` over GEOMETRIES."""
    return random.Random(seed).choice(GEOMETRIES)
LAYOUTS = ("tp", "cfg", "ulysses")
ATOL = 1e-5
MUTANTS = {
    1: "the vote compares neither the call's arguments (branch, spec, rows) nor the plan: ranks passing different "
       "ones both compute",
    2: "a restore swaps in a copy of the allocator instead of restoring it in place: the scale guard reads a dead one",
    3: "only the all-layers-wrote check runs before the end vote (no-paged-attention is checked after it)",
}


class InjectedFault(RuntimeError):
    """Raised inside one rank's forward body."""


def _parallel(layout: str, rank: int) -> ParallelConfig:
    if layout == "cfg":
        return ParallelConfig(cfg_parallel=2, cfg_rank=rank)
    if layout == "ulysses":
        return ParallelConfig(ulysses=2, ulysses_rank=rank)
    return ParallelConfig(tensor_parallel=2, tp_rank=rank)


def _group_and_parallel(layout: str) -> tuple[Any, ParallelConfig]:
    """vllm-omni's groups when initialised (the CI test sets them up through its parallel_state), else WORLD."""
    ps = sys.modules.get("vllm_omni.diffusion.distributed.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        from paged_kv_compile.distributed.rank_runtime import model_parallel_cpu_group

        return model_parallel_cpu_group(), ParallelConfig.from_vllm_omni()
    return dist.group.WORLD, _parallel(layout, dist.get_rank())


# ---- mutants: one mutation each, put back for the run ---------------------------------------------------------


@contextlib.contextmanager
def mutant(defect: int | None) -> Iterator[None]:
    from paged_kv_compile.distributed import rank_runtime, snapshot

    if defect is None:
        yield
        return
    saved = []
    if defect == 1:
        saved += [(rank_runtime, "canonical", rank_runtime.canonical),
                  (rank_runtime, "plan_geometry", rank_runtime.plan_geometry)]
        rank_runtime.canonical = lambda value: "args"  # the vote held the call, not what each rank computes
        rank_runtime.plan_geometry = lambda plan, bucket: 0
    elif defect == 2:
        restore = snapshot.LifecycleSnapshot.restore

        def swapped(self):
            restore(self)
            sched = self.runtime.scheduler
            sched.allocator = copy.deepcopy(sched.allocator)  # the old restore: state swapped in, not restored

        saved.append((snapshot.LifecycleSnapshot, "restore", restore))
        snapshot.LifecycleSnapshot.restore = swapped
    elif defect == 3:
        from paged_kv_compile.runtime import PagedKVRuntime as R

        saved.append((R, "verify_forward", R.verify_forward))
        R.verify_forward = lambda self, active: self._check_all_layers_wrote(active)
    else:
        raise SystemExit(f"--mutant {defect}: known {sorted(MUTANTS)}")
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


# ---- one rank's world ---------------------------------------------------------------------------------------


class RankWorld:
    """This rank's RankRuntime and the one-rank runtime beside it, the live owners, and the checks."""

    def __init__(self, layout: str, seed: int, small_pool: bool, fp8: bool = False,
                 geometry: tuple[int, int, int, int] | None = None) -> None:
        """geometry: (frame tokens, chunk frames, sink frames, block size), e.g. `draw_geometry(seed)`; None: CFG
        in blocks of one frame."""
        self.layout, self.rank = layout, dist.get_rank()
        group, self.parallel = _group_and_parallel(layout)
        frame, chunk, sink, block = geometry or (CFG.frame_seqlen, CFG.num_frame_per_block, CFG.sink_size, None)
        self.cfg = dataclasses.replace(CFG, frame_seqlen=frame, num_frame_per_block=chunk, sink_size=sink)
        self.spec = DreamZeroSpec.from_model_config(self.cfg)
        self.other_spec = dataclasses.replace(self.spec, commit_action_tokens=0)  # a divergent admission
        one = dreamzero_runtime_config(self.cfg, block_size=block, sessions=3, dtype=torch.float32,
                                       max_rows=4,  # batches of 2 owners
                                       kv_dtype=torch.float8_e4m3fn if fp8 else None, cross_regions=4)
        cfg = self.parallel.rank_config(one)
        if small_pool and layout == "cfg" and self.rank == 1:  # less free memory on that GPU: room for 2 sessions
            cfg = dataclasses.replace(cfg, blocks_per_layer=cfg.blocks_per_layer * 2 // 3)
        self.rt = RankRuntime(PagedKVRuntime(cfg), self.parallel, group=group, digest_every=1)
        self.one = PagedKVRuntime(one)
        for runtime in (self.rt.runtime, self.one):
            runtime.bound = True  # a model is served: a forward that ran no paged attention is refused
        self.rng = random.Random(seed)  # the same draws on both ranks
        self.seed = seed
        self.live: list[str] = []
        self.next_id = 0
        self.counts: Counter = Counter()
        self.heads = slice(self.rank * (self.cfg.num_heads // 2), (self.rank + 1) * (self.cfg.num_heads // 2))

    # ---- the forward body: the paged op on seeded Q/K/V, this rank's slice -----------------------------------
    def _qkv(self, op: int, layer: int, rows: list[tuple[int, int]], tokens: int) -> tuple[torch.Tensor, ...]:
        """Q, K, V of forward `op`'s `rows` ((owner index in the forward, CFG branch) each), every head: each row's
        tensors are seeded by its own coordinates, so any runtime's rows are slices of the one-rank forward's."""
        out = []
        for i, branch in rows:
            g = torch.Generator().manual_seed(((self.seed * 1009 + op) * 17 + layer) * 31 + i * 2 + branch)
            out.append(torch.randn(3, 1, tokens, self.cfg.num_heads, self.cfg.head_dim, generator=g))
        return tuple(torch.cat(out, dim=1))

    def _body(self, runtime: PagedKVRuntime, active, op: int, rows: list[tuple[int, int]], *,
              heads: slice | None, fault: bool = False, attend: bool = True) -> torch.Tensor:
        """Every layer's paged attention of forward `op` (rows: see `_qkv`; heads: this rank's, or all)."""
        meta, outs = active.meta, []
        for layer in range(self.cfg.num_layers if attend else 0):
            q, k, v = self._qkv(op, layer, rows, meta.bucket.tokens)
            if heads is not None:
                q, k, v = q[:, :, heads], k[:, :, heads], v[:, :, heads]
            site = meta.layers[layer]
            outs.append(write_attend(q.contiguous(), k.contiguous(), v.contiguous(), runtime.pool.tensor,
                                     site.slot_mapping, site.block_table, meta.seq_lens, meta.kv_visible_end,
                                     self.cfg.head_dim ** -0.5, "reference", "general", runtime.pool.scales,
                                     kv_gap=meta.kv_gap))
            if fault and layer == 0:
                raise InjectedFault(f"injected on rank {self.rank} after layer 0")
        if attend:
            runtime.active.record_layers(range(self.cfg.num_layers))
        return torch.stack(outs) if outs else torch.empty(0)

    # ---- operations -----------------------------------------------------------------------------------------
    def draw(self) -> tuple:
        r, live = self.rng, self.live
        choices = ["admit"] * 2 + ["forward"] * 6 + ["batch"] * 2 + ["fork", "reset", "release", "abort",
                                                                    "set_scales", "fault", "no_attention",
                                                                    "bad_argument"]
        if self.layout != "cfg":  # a CFG rank passes its own branch's spec and runs its own row: not divergent
            choices += ["diverge_branch", "diverge_spec"]
        what = r.choice(choices if live else ["admit", "set_scales", "bad_argument"])
        owner = r.choice(live) if live else None
        return (what, owner, r.choice(("commit", "denoise")), r.randrange(2), r.choice(live) if live else None)

    def apply(self, op: int, drawn: tuple) -> dict:
        """Run one drawn operation on this rank and on the one-rank runtime; what the checks need."""
        what, owner, kind, branch, other = drawn
        before = self._snapshot()
        outcome, expect_ok, compared, live_now, pending = "ok", True, 0, None, None
        try:
            if what in ("admit", "diverge_spec", "bad_argument"):
                oid = f"o{self.next_id}"
                self.next_id += 1
                spec = self.other_spec if what == "diverge_spec" and self.rank == 1 else self.spec
                rows = 5 if what == "bad_argument" and self.rank == 1 else self._rows()
                expect_ok = what == "admit"
                regions = self._regions() if self.rng.random() < 0.5 else None  # shared cross-attention K/V
                if expect_ok:
                    expect_ok = self._one(lambda: self.one.admit(oid, self.spec, rows=2, **self._full(regions)))
                pending = oid
                self.rt.admit(oid, spec, rows=rows, **self._mine(regions, rows))
                live_now = oid
            elif what == "fork":
                oid = f"o{self.next_id}"
                self.next_id += 1
                expect_ok = self._one(lambda: self.one.fork(owner, oid))
                pending = oid
                self.rt.fork(owner, oid)
                live_now = oid
            elif what in ("reset", "release", "abort"):
                expect_ok = self._one(lambda: getattr(self.one, what)(owner))
                getattr(self.rt, what)(owner)
                live_now = None
            elif what == "set_scales":
                scale = self.rng.choice((0.5, 0.25, 1.0))
                expect_ok = self._one(lambda: self.one.pool.set_scales(scale, scale))
                self.rt.set_scales(scale, scale)
                live_now = None
            else:
                live_now = None
                compared = self._forward(op, what, owner, kind, branch, other)
        except Exception as e:  # noqa: BLE001 - the outcome is what the checks compare
            outcome = f"{type(e).__name__}: {e}"
            if pending is not None and expect_ok:  # the one-rank runtime took it, the ranks did not (CFG pool)
                self.one.abort(pending)
            live_now = None
        if what not in ("admit", "diverge_spec", "bad_argument", "fork", "reset", "release", "abort",
                        "set_scales"):
            expect_ok = self.oracle_ok
        if outcome == "ok":
            if what in ("release", "abort") and owner in self.live:
                self.live.remove(owner)
            if live_now is not None:
                self.live.append(live_now)
        self.counts[what] += 1
        return {"what": what, "outcome": outcome, "expect_ok": expect_ok, "before": before,
                "after": self._snapshot(), "compared": compared}

    def _regions(self) -> tuple[int, str]:
        """(content, salt) of an admission's regions: 3 contents, 2 tenants, so regions are shared and not."""
        return self.rng.randrange(3), self.rng.choice(("tenant-a", "tenant-b"))

    def _cross(self, content: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 7919 + content)
        shape = (2, 2, self.cfg.cross_len, self.cfg.num_heads, self.cfg.head_dim)
        return [torch.randn(shape, generator=g) for _ in range(self.cfg.num_layers)]

    def _full(self, regions) -> dict:
        return {} if regions is None else {"cross_kv": self._cross(regions[0]), "cache_salt": regions[1]}

    def _mine(self, regions, rows: int) -> dict:
        """This rank's slice of the regions' K/V: its heads (TP, Ulysses) or its row (CFG)."""
        if regions is None:
            return {}
        cross = self._cross(regions[0])
        if self.layout == "cfg":
            cross = [t[:, self.rank:self.rank + 1] for t in cross]
        else:
            cross = [t[..., self.heads, :] for t in cross]
        if rows != cross[0].shape[1]:  # a bad `rows`: the K/V keeps the right shape, the runtime refuses the rows
            cross = [t[:, :1].expand(-1, rows, -1, -1, -1) for t in cross]
        return {"cross_kv": cross, "cache_salt": regions[1]}

    def _rows(self) -> int:
        return 1 if self.layout == "cfg" else 2

    def _one(self, call) -> bool:
        """Apply a call to the one-rank runtime; whether it succeeded (a refusal changes nothing there)."""
        try:
            call()
        except Exception:  # noqa: BLE001 - the ranks must then refuse too
            return False
        return True

    def _forward(self, op: int, what: str, owner: str, kind: str, branch: int, other: str | None) -> int:
        """A forward (or batch) on the ranks and, where it is clean, on the one-rank runtime first (its outcome is
        what the ranks must do: `self.oracle_ok`); outputs compared."""
        cfg = self.layout == "cfg"
        owners = [owner] + ([other] if what == "batch" and other not in (None, owner) else [])
        my_branch = 1 - branch if what == "diverge_branch" and self.rank == 1 else branch
        expected, self.oracle_ok = None, False
        if what in ("forward", "batch"):  # the one-rank oracle: under CFG both branches (this rank's is its row)
            try:
                outs = {}
                for b in ((0, 1) if cfg else (branch,)):
                    with self.one.forward_batch([(o, kind, {"branch": b}) for o in owners]) as active:
                        outs[b] = self._body(self.one, active, op, [(i, b) for i in range(len(owners))], heads=None)
                expected = outs[self.rank] if cfg else outs[branch][..., self.heads, :]
                self.oracle_ok = True
            except Exception:  # noqa: BLE001 - refused there: the ranks must refuse it too
                expected = None
        mine = self.rank if cfg else my_branch
        items = [(o, kind) for o in owners] if cfg else [(o, kind, {"branch": my_branch}) for o in owners]
        with self.rt.forward_batch(items) as active:
            out = self._body(self.rt.runtime, active, op, [(i, mine) for i in range(len(owners))],
                             heads=None if cfg else self.heads, fault=what == "fault" and self.rank == 1,
                             attend=not (what == "no_attention" and self.rank == 1))
        if expected is None:
            raise AssertionError(f"op {op}: the ranks ran a {what} the one-rank runtime refused or was not given")
        err = float((out - expected).abs().max()) if out.numel() else 0.0
        if err > ATOL:
            raise AssertionError(f"op {op}: rank {self.rank}'s {what} output is {err:.2e} off the one-rank runtime's")
        return 1

    # ---- what the checks compare ------------------------------------------------------------------------------
    def _regions_match(self) -> bool:
        """Every live owner's regions hold, on this rank, its slice of what the one-rank runtime's hold."""
        pool, one = self.rt.runtime.pool, self.one.pool
        for oid in self.rt.owner_ids():
            if oid not in self.one.owner_ids():
                return False
            mine, full = self.rt.runtime.regions_of(oid), self.one.regions_of(oid)
            rows = [self.rank] if self.layout == "cfg" else list(range(len(full)))
            if len(mine) != (len(rows) if full else 0):
                return False
            for region, r in zip(mine, rows):
                want = one.read_region(full[r].blocks, full[r].tokens)
                want = want if self.layout == "cfg" else want[..., self.heads, :]
                if not torch.equal(pool.read_region(region.blocks, region.tokens), want):
                    return False
        return True

    def _snapshot(self) -> dict:
        inner = self.rt.runtime
        state = inner.state()
        held = sorted({b for rows in state["owners"].values() for row in rows for b in row}
                      | {b for regs in state["regions"]["held"].values() for _, blocks in regs for b in blocks})
        index = torch.tensor([base + b for base in inner.pool.layer_bases.tolist() for b in held], dtype=torch.long)
        alloc = inner.scheduler.allocator
        data = inner.pool.tensor[:, index].clone()
        # a row's partly filled last block: any forward writes its tail (read by no one until the next commit
        # writes it again), so a refused or faulted one may have: its tail is not compared
        B, where = inner.pool.block_size, {b: i for i, b in enumerate(held)}
        for owner in inner.scheduler.owners.values():
            for row, commits in zip(owner.rows, owner.state.commits):
                used = history_tokens(owner.spec, commits) % B
                if row and used:
                    data[:, where[row[-1]]::len(held), used:] = 0
        return {"state": state, "bytes": data, "regions_match": self._regions_match(),
                "scales": None if inner.pool.scales is None else inner.pool.scales.clone(),
                "guard": inner.pool.blocks_held() == alloc.num_blocks - alloc.num_free,
                "one": {"owners": sorted(self.one.owner_ids()), "versions": self.one.state()["versions"]}}



def _keyless(state: dict) -> dict:
    """`state()` without the regions' registry keys: a rank keys a region by the bytes IT stores (its heads under TP)."""
    regions = state["regions"]
    return {**state, "regions": ({o: [b for _, b in regs] for o, regs in regions["held"].items()},
                                 sorted((b, n) for _, b, n in regions["registry"]))}


def _agree(a: dict, b: dict, layout: str) -> bool:
    if layout != "cfg":
        return _keyless(a["state"]) == _keyless(b["state"])
    keys = ("finished", "versions", "in_flight", "active")
    return all(a["state"][k] == b["state"][k] for k in keys) and a["state"]["owners"].keys() == b["state"]["owners"].keys()


def rank_task(layout: str, seed: int, steps: int, defect: int | None = None, small_pool: bool = True,
              fp8: bool = False, geometry: tuple | None = None) -> dict:
    """Run one seeded sequence on this rank (every rank of the group calls it); the figures, or the first wrong.
    fp8: FP8 pools (set_scales is accepted while nothing is held, and the outputs read the scales)."""
    with mutant(defect):
        world = RankWorld(layout, seed, small_pool, fp8, geometry)
        figures: Counter = Counter()
        for op in range(steps):
            drawn = world.draw()
            result = world.apply(op, drawn)
            mine = {"what": result["what"], "ok": result["outcome"] == "ok", "outcome": result["outcome"],
                    "state": result["after"]["state"]}
            stories: list = [None] * dist.get_world_size()
            dist.all_gather_object(stories, mine)  # the fuzzer's own collective, outside the runtimes' votes
            wrong = _wrong(world, op, drawn, result, stories)
            if wrong:
                return {"wrong": wrong, "op": op, "drawn": drawn, "layout": layout, "seed": seed,
                        "figures": dict(figures), "rank": world.rank}
            figures["operations"] += 1
            figures["forwards_compared"] += result["compared"]
            figures["set_scales_accepted"] += mine["ok"] and result["what"] == "set_scales"
            if not mine["ok"]:
                name = result["outcome"].split(":")[0]
                figures["refused_" + ("divergent" if name == "DivergenceError" else
                                      "fault" if result["what"] == "fault" else "other")] += 1
        return {"wrong": None, "layout": layout, "seed": seed, "figures": dict(figures), "rank": world.rank}


def _wrong(world: RankWorld, op: int, drawn: tuple, result: dict, stories: list) -> str | None:
    what, before, after = result["what"], result["before"], result["after"]
    oks = {s["ok"] for s in stories}
    if len(oks) > 1:
        return f"op {op} {what}: some ranks succeeded, others raised: {[s['outcome'][:200] for s in stories]}"
    if "AssertionError" in result["outcome"]:
        return result["outcome"][:400]
    if not after["regions_match"]:
        return f"op {op} {what}: a live owner's shared regions differ from the one-rank runtime's (its slice)"
    if not after["guard"]:
        return f"op {op} {what}: the FP8 scale guard reads other state than the live allocator"
    ok = result["outcome"] == "ok"
    if ok and not result["expect_ok"]:
        return f"op {op} {what}: the ranks ran a call they must refuse (the one-rank runtime refused it, or it was bad)"
    if not ok and result["expect_ok"] and not (world.layout == "cfg" and what in ("admit", "fork")):
        return f"op {op} {what}: the ranks refused a call the one-rank runtime ran: {result['outcome'][:300]}"
    if not ok:
        if before["state"] != after["state"]:
            return f"op {op} {what}: refused ({result['outcome'][:160]}) but the state changed"
        if not torch.equal(before["bytes"], after["bytes"]):
            return f"op {op} {what}: refused but a live owner's pool bytes changed"
        if before["scales"] is not None and not torch.equal(before["scales"], after["scales"]):
            return f"op {op} {what}: refused but the FP8 scales changed"
    if not _agree(stories[0], stories[1], world.layout):
        return f"op {op} {what}: the ranks' states differ: {stories[0]['state']} vs {stories[1]['state']}"
    mine = after["state"]
    if sorted(mine["owners"]) != after["one"]["owners"]:
        return f"op {op} {what}: the ranks' owners differ from the one-rank runtime's"
    if world.layout != "cfg" and mine["versions"] != after["one"]["versions"]:  # CFG: one forward per branch there
        return f"op {op} {what}: the ranks' owner versions differ from the one-rank runtime's"
    return None


# ---- the command: two spawned gloo ranks ----------------------------------------------------------------------


def _spawned(rank: int, init_file: str, jobs: list, results) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        results.put((rank, [rank_task(*job) for job in jobs]))
    except BaseException:  # noqa: BLE001 - reported
        results.put((rank, traceback.format_exc()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", default="all", choices=("all", *LAYOUTS))
    parser.add_argument("--mutant", type=int, default=None, choices=sorted(MUTANTS))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--pool", default="fp32", choices=("fp32", "fp8", "both"))
    parser.add_argument("--page-sizes", action="store_true",
                        help="each seed draws its frame length, chunk, sink and block size (`draw_geometry`)")
    args = parser.parse_args(argv)
    layouts = LAYOUTS if args.layout == "all" else (args.layout,)
    pools = {"fp32": (False,), "fp8": (True,), "both": (False, True)}[args.pool]
    jobs = [(layout, args.seed + s, args.steps, args.mutant, True, fp8,
             draw_geometry(args.seed + s) if args.page_sizes else None)
            for fp8 in pools for layout in layouts for s in range(args.seeds)]
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_spawned, args=(r, os.path.join(tmp, "store"), jobs, results)) for r in range(2)]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=7200) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    if any(isinstance(v, str) for v in got.values()):
        print("\n".join(v for v in got.values() if isinstance(v, str)), file=sys.stderr)
        return 2
    runs = got[0]
    wrong = [r for rank in (0, 1) for r in got[rank] if r["wrong"]]
    total = Counter()
    for r in runs:
        total.update(r["figures"])
    report = {"runs": len(runs), "layouts": list(layouts), "steps": args.steps, "mutant": args.mutant,
              "figures_rank0": dict(total),
              "wrong": [f"{w['layout']} seed {w['seed']} rank {w['rank']}: {w['wrong']}" for w in wrong][:4]}
    print(json.dumps(report, indent=2) if args.json else report)
    if args.mutant is not None:
        print(f"mutant {args.mutant} ({MUTANTS[args.mutant]}): {'CAUGHT' if wrong else 'NOT caught'}")
        return 0 if wrong else 1
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
