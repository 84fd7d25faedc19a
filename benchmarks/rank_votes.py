"""What agreeing costs: the host time a RankRuntime adds to each forward and lifecycle call, on 2 gloo ranks.

Two spawned ranks (a gloo world through a file store) drive a DreamZero-14B session's runtime the way the pipeline
does (per chunk, per CFG branch: a commit and 16 denoising forwards, a window reset every 9 chunks) with no model:
the pool lives on the "meta" device, so only host work is timed (plan, metadata build, finish, and for the
RankRuntime its two votes per forward and its digests). Each rank times the plain `PagedKVRuntime` and the
`RankRuntime` over the same sequence, interleaved; rank 0 reports. Also the bare all-reduce a vote is, and
admit + release (a lifecycle call also saves the scheduler state to restore if another rank refuses).

    python benchmarks/rank_votes.py [--chunks N] [--digest-every N] [--json]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--digest-every", type=int, default=16)
    parser.add_argument("--json", action="store_true")
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
              f"compared every {args.digest_every} forwards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
