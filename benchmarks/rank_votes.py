"""What agreeing costs: the host time a RankRuntime adds to each forward and lifecycle call, on 2 gloo ranks.

Two spawned ranks (a gloo world through a file store) drive a DreamZero-14B session's runtime the way the pipeline
does (per chunk, per CFG branch: a commit and 16 denoising forwards, a window reset every 9 chunks) with no model:
the pool lives on the "meta" device, so only host work is timed (plan, metadata build, finish, and for the
RankRuntime its two votes per forward and its digests). Each rank times the plain `PagedKVRuntime` and the
`RankRuntime` over the same sequence, interleaved; rank 0 reports. Also the bare all-reduce a vote is, and
admit + release (a lifecycle call also saves the scheduler state to restore if another rank refuses).

The forward's vote covers its canonical arguments and the plan's bucket and geometry (digested at every forward);
`--snapshot` also times, in this process, what a lifecycle call saves and restores (`distributed/snapshot.py`) at
the pool sizes of docs/distributed.md (DreamZero-14B: 36 blocks per layer; HunyuanImage-3: 512) and at 50000
blocks per layer, with both allocators, with 8 sessions holding history.

    python benchmarks/rank_votes.py [--chunks N] [--digest-every N] [--snapshot] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _sequence(runtime, sid: str, chunks: int) -> list[float]:
    """Seconds per forward of `chunks` chunks of one session (both branches as batch-1 forwards); the window resets
    after 9 commits (18 frames: what DreamZero-14B's loop holds before its reset at frame 20)."""
    times = []
    for chunk in range(chunks):
        if chunk and chunk % 9 == 0:
            runtime.reset(sid)
        for kind, repeats in (("commit", 1), ("denoise", 16)):
            for _ in range(repeats):
                for branch in (0, 1):
                    start = time.perf_counter()
                    with runtime.forward(sid, kind, branch=branch):
                        pass
                    times.append(time.perf_counter() - start)
    return times


def _rank(rank: int, init_file: str, args: argparse.Namespace, results) -> None:
    try:
        results.put((rank, _measure(rank, init_file, args)))
    except BaseException:
        import traceback

        results.put((rank, {"error": traceback.format_exc()}))
        raise


def _measure(rank: int, init_file: str, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    from paged_kv_compile import PagedKVRuntime
    from paged_kv_compile.distributed import ParallelConfig, RankRuntime
    from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
    from paged_kv_compile.models.dreamzero import DREAMZERO_14B

    parallel = ParallelConfig(tensor_parallel=2, tp_rank=rank)
    cfg = parallel.rank_config(dreamzero_runtime_config(DREAMZERO_14B, rows=2, device="meta",
                                                        buckets=DreamZeroSpec.from_model_config(DREAMZERO_14B)
                                                        .buckets(rows=1)))
    spec = DreamZeroSpec.from_model_config(DREAMZERO_14B)
    plain = PagedKVRuntime(cfg)
    ranked = RankRuntime(PagedKVRuntime(cfg), parallel, group=dist.group.WORLD, digest_every=args.digest_every)
    out = {"plain": [], "ranked": [], "admit_release_plain": [], "admit_release_ranked": [], "all_reduce": []}
    for i in range(3):  # interleaved: both see the same machine load
        for name, runtime in (("plain", plain), ("ranked", ranked)):
            sid = f"s{i}"
            start = time.perf_counter()
            runtime.admit(sid, spec, rows=2)
            runtime.release(sid)
            out[f"admit_release_{name}"].append(time.perf_counter() - start)
            runtime.admit(sid + "b", spec, rows=2)
            out[name] += _sequence(runtime, sid + "b", args.chunks)
            runtime.release(sid + "b")
    t = torch.zeros(9, dtype=torch.int64)
    for _ in range(200):
        start = time.perf_counter()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out["all_reduce"].append(time.perf_counter() - start)
    out["votes"] = ranked.agreement.votes
    out["second_rounds"] = ranked.agreement.second_rounds
    dist.destroy_process_group()
    return out


def digest_costs(repeats: int = 300) -> dict:
    """Median microseconds of what the forward's vote digests beyond the old call hash, in this process (no
    collective: on a loaded machine the votes' all-reduces vary by milliseconds and hide it): the canonical
    arguments and the plan's bucket and geometry, for a DreamZero-14B commit and denoise of one branch."""
    from paged_kv_compile import PagedKVRuntime
    from paged_kv_compile.distributed.rank_runtime import canonical, plan_geometry
    from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
    from paged_kv_compile.models.dreamzero import DREAMZERO_14B

    spec = DreamZeroSpec.from_model_config(DREAMZERO_14B)
    rt = PagedKVRuntime(dreamzero_runtime_config(DREAMZERO_14B, rows=2, device="meta", buckets=spec.buckets(rows=1)))
    rt.admit("s", spec, rows=2)
    out = {}
    for kind in ("commit", "denoise"):
        times = []
        with rt.forward("s", kind, branch=0) as active:
            for _ in range(repeats):
                start = time.perf_counter()
                digest = (canonical({"branch": 0}), plan_geometry(active.plan, active.bucket))
                times.append(time.perf_counter() - start)
        out[f"{kind}_digest_us"] = statistics.median(times) * 1e6
        del digest
    return out


def snapshot_costs(blocks_per_layer=(36, 512, 50000), repeats: int = 30) -> list[dict]:
    """Median microseconds of a lifecycle call's snapshot: taken then kept (every rank agreed), and taken, an
    admission applied, then restored (another rank refused), per allocator and pool size."""
    from paged_kv_compile import PagedKVRuntime
    from paged_kv_compile.distributed.snapshot import LifecycleSnapshot
    from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
    from paged_kv_compile.models.dreamzero import DREAMZERO_14B

    spec = DreamZeroSpec.from_model_config(DREAMZERO_14B)
    rows = []
    for kind in ("builtin", "vllm"):
        for blocks in blocks_per_layer:
            sessions = max(1, min(8, blocks // 72))
            cfg = dreamzero_runtime_config(DREAMZERO_14B, rows=2, sessions=sessions, device="meta",
                                           buckets=spec.buckets(rows=1))
            import dataclasses

            cfg = dataclasses.replace(cfg, blocks_per_layer=max(blocks, cfg.blocks_per_layer))
            rt = PagedKVRuntime(cfg, allocator=kind)
            for i in range(sessions - 1):  # sessions with history; room left for one more admission
                rt.admit(f"s{i}", spec, rows=2)
                for _ in range(3):
                    for branch in (0, 1):
                        with rt.forward(f"s{i}", "commit", branch=branch):
                            pass
            keep, restore = [], []
            for r in range(repeats):
                start = time.perf_counter()
                LifecycleSnapshot(rt).keep()
                keep.append(time.perf_counter() - start)
                start = time.perf_counter()
                saved = LifecycleSnapshot(rt)
                rt.admit(f"x{r}", spec, rows=2)
                saved.restore()
                restore.append(time.perf_counter() - start)
                rt.scheduler.finished.pop(f"x{r}", None)
            start = time.perf_counter()
            for r in range(repeats):
                rt.admit(f"y{r}", spec, rows=2)
                rt.release(f"y{r}")
            admit_release = (time.perf_counter() - start) / repeats
            rows.append({"allocator": kind, "blocks_per_layer": cfg.blocks_per_layer, "owners": sessions - 1,
                         "snapshot_keep_us": statistics.median(keep) * 1e6,
                         "snapshot_admit_restore_us": statistics.median(restore) * 1e6,
                         "plain_admit_release_us": admit_release * 1e6})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--digest-every", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--snapshot", action="store_true", help="also time the lifecycle snapshot (one process)")
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(tmp, "store"), args, results)) for r in range(2)]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    failed = {r: out["error"] for r, out in got.items() if "error" in out}
    if failed:
        print("\n".join(f"rank {r} failed:\n{tb}" for r, tb in failed.items()), file=sys.stderr)
        return 1
    r0 = got[0]
    us = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
    report = {
        "forward_plain_us": us(r0["plain"]), "forward_ranked_us": us(r0["ranked"]),
        "added_per_forward_us": us(r0["ranked"]) - us(r0["plain"]), "all_reduce_us": us(r0["all_reduce"]),
        "admit_release_plain_us": us(r0["admit_release_plain"]), "admit_release_ranked_us": us(r0["admit_release_ranked"]),
        "forwards_timed": len(r0["ranked"]), "votes": r0["votes"], "second_rounds": r0["second_rounds"],
        "digest_every": args.digest_every,
    }
    report.update(digest_costs())
    if args.snapshot:
        report["snapshot"] = snapshot_costs()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"DreamZero-14B geometry, TP 2, {report['forwards_timed']} forwards per runtime, medians (rank 0):")
        print(f"  forward (plan + metadata + finish): plain {report['forward_plain_us']:.0f} us, RankRuntime "
              f"{report['forward_ranked_us']:.0f} us: +{report['added_per_forward_us']:.0f} us "
              f"(2 votes; one bare all-reduce: {report['all_reduce_us']:.0f} us)")
        print(f"  admit + release: plain {report['admit_release_plain_us']:.0f} us, RankRuntime "
              f"{report['admit_release_ranked_us']:.0f} us")
        print(f"  votes {report['votes']}, second rounds (something wrong) {report['second_rounds']}; block tables "
              f"compared every {args.digest_every} forwards; arguments, bucket and plan geometry at every forward")
        print(f"  of which the vote's argument + plan digests (in-process): commit {report['commit_digest_us']:.0f} us, "
              f"denoise {report['denoise_digest_us']:.0f} us")
        for row in report.get("snapshot", []):
            print(f"  lifecycle snapshot, {row['allocator']}, {row['blocks_per_layer']} blocks/layer, "
                  f"{row['owners']} owners with history: take+keep {row['snapshot_keep_us']:.0f} us, "
                  f"take+admit+restore {row['snapshot_admit_restore_us']:.0f} us (plain admit+release "
                  f"{row['plain_admit_release_us']:.0f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
