"""K forked DreamZero candidates: one batched forward vs K sequential forwards, fork vs dense clone bytes,
and how many candidates fit at DREAMZERO_14B sizes.

Timing: a parent session with a full window is forked K times; the K children's denoising forwards run as
the rows of ONE forward (`runtime.forward_batch`) or one child at a time, alternately (`interleaved`), on the
compiled model (regional compile, paged_kv backend, aot_eager inside, reference kernel). Ratio =
sequential / batched per repeat (> 1: the batch is faster). Bytes: what a fork copies (measured: the pool
is compared before and after, and the allocator's free count) vs what a dense fork clones (the dense model's
caches at the same point, measured), and what a fork keeps in host memory (its `Owner`, block lists, region
references, refcounts: measured with tracemalloc, `fork_host_bytes`). Capacity at DREAMZERO_14B sizes is
computed from the pool geometry (`KVPool.bytes_per_block_all_layers`), not measured.

`--regions`: memory of N sessions sharing one prompt's cross-attention K/V as shared write-once regions
(`regions.py`) vs each session holding its own, N = 1, 2, 4, 8: measured on a small CPU config (blocks the
allocator hands out x bytes per block, and the dense `prepare_cross_kv` tensors' bytes), and computed at
DREAMZERO_14B geometry from the pool geometry (a pool of that size is not allocated).

    python -m benchmarks.fork_candidates [--quick] [--json] [--regions]
"""

from __future__ import annotations

import argparse
import json
import sys
import tracemalloc
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import bench_settings, interleaved, machine_info, markdown_table, summarize  # noqa: E402
from benchmarks._models import DZ_MID, DZ_TINY  # noqa: E402
from paged_kv_compile import CapacityError, families  # noqa: E402
from paged_kv_compile.allocator import BuiltinAllocator  # noqa: E402
from paged_kv_compile.families.base import ceil_div  # noqa: E402
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config, session_blocks_per_row  # noqa: E402
from paged_kv_compile.models.dreamzero import DREAMZERO_14B, DreamZeroConfig, DreamZeroModel  # noqa: E402
from paged_kv_compile.pool import KVPool  # noqa: E402
from paged_kv_compile.runtime import PagedKVRuntime  # noqa: E402
from paged_kv_compile.scheduler import Scheduler  # noqa: E402

GIB = 2**30


def _inputs(cfg: DreamZeroConfig, seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, cfg.chunk_tokens, cfg.in_channels, generator=g).expand(rows, -1, -1)
    a = torch.randn(1, cfg.action_register_length, cfg.action_dim, generator=g).expand(rows, -1, -1)
    return x, a


def fork_host_bytes(rt: PagedKVRuntime, parent: str, children: list[str]) -> int:
    """Host memory the forks of `parent` into `children` keep, per fork: bytes still allocated after the forks
    (tracemalloc: only what they allocate counts), divided by their number. Device bytes: none (the pool is not
    touched; `timing` checks it)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for child in children:
            rt.fork(parent, child)
        return (tracemalloc.get_traced_memory()[0] - before) // len(children)
    finally:
        tracemalloc.stop()


def timing(cfg: DreamZeroConfig, ks: list[int], repeats: int) -> tuple[list[dict], dict]:
    """Per K: median ms of one batched forward of K children and of K one-child forwards, and the ratio."""
    kmax = max(ks)
    model = DreamZeroModel(cfg, seed=0)
    rt = PagedKVRuntime(dreamzero_runtime_config(cfg, sessions=kmax + 1, max_rows=2 * kmax, kernel="reference",
                                                 inner_compiler="aot_eager"))
    rt.bind(model.blocks)
    for block in model.blocks:
        block.compile(backend="paged_kv", fullgraph=True, dynamic=False, options={"inner_compiler": "aot_eager"})
    g = torch.Generator().manual_seed(1)
    text = torch.randn(1, cfg.text_len, cfg.text_dim, generator=g)
    cross = model.prepare_cross_kv(torch.cat([text, torch.zeros_like(text)]))

    def forward(sessions: list[str], commit: bool, start: int) -> None:
        rows = 2 * len(sessions)
        x, a = _inputs(cfg, start, rows)
        caches = families.for_model(model).standin_caches(rt, model, rows)
        with rt.forward_batch([(s, "commit" if commit else "denoise") for s in sessions]):
            model(x, a, torch.full((rows,), 500.0), start, caches, [c.repeat(1, len(sessions), 1, 1, 1) for c in cross],
                  update_kv_cache=commit)

    rt.admit("parent", DreamZeroSpec.from_model_config(cfg), rows=2)
    chunks = cfg.window_frames // cfg.num_frame_per_block
    for chunk in range(chunks):  # a full window of history
        forward(["parent"], True, chunk * cfg.num_frame_per_block)
    start = chunks * cfg.num_frame_per_block

    pool_before, free_before = rt.pool.tensor.clone(), rt.scheduler.allocator.num_free
    host = fork_host_bytes(rt, "parent", [f"c{k}" for k in range(kmax)])
    copied = 0 if torch.equal(rt.pool.tensor, pool_before) else rt.pool.nbytes
    bytes_row = {"fork_blocks_taken": free_before - rt.scheduler.allocator.num_free, "fork_bytes_copied": copied,
                 "fork_metadata_bytes": host}
    dense = DreamZeroModel(cfg, seed=0)
    caches = dense.dense_caches(2)
    for chunk in range(chunks):
        x, a = _inputs(cfg, chunk * cfg.num_frame_per_block, 2)
        _, _, caches = dense(x, a, torch.zeros(2), chunk * cfg.num_frame_per_block, caches, cross,
                             update_kv_cache=True)
    bytes_row["dense_clone_bytes"] = sum(c.clone().numel() * c.element_size() for c in caches)

    rows = []
    for K in ks:
        kids = [f"c{k}" for k in range(K)]
        times = interleaved({"batched": lambda: forward(kids, False, start),
                             "sequential": lambda: [forward([c], False, start) for c in kids]}, repeats)
        ratios = [s / b for s, b in zip(times["sequential"], times["batched"])]
        med = lambda v: round(sorted(v)[len(v) // 2] * 1e3, 2)  # noqa: E731
        rows.append({"K": K, "rows": 2 * K, "batched_ms": med(times["batched"]),
                     "sequential_ms": med(times["sequential"]), "ratio": summarize(ratios, 2)["median"],
                     "ratio_iqr": f"{summarize(ratios, 2)['q1']}-{summarize(ratios, 2)['q3']}"})
    for sid in rt.owner_ids():
        rt.release(sid)
    return rows, bytes_row


def capacity(cfg: DreamZeroConfig = DREAMZERO_14B, budget_gib: float = 80.0) -> dict:
    """Candidates that fit in `budget_gib` of KV next to the parent's full window, bf16, computed.

    Fork: a candidate holds only what it commits (one chunk per CFG row, whole blocks) plus the scratch of
    its 2 rows in the batched forward; the parent's window is shared (`forks_fit`). Clone: a candidate holds a
    whole dense window of both rows (`DreamZeroConfig.kv_cache_bytes`), as vllm-omni's fork does.
    Admission reserves what a session holds up to its reset, and a fork reserves as much as its parent, since
    its own commits may come to replace the whole shared window (reservations): each reserving
    `per_fork_reserved_gib`. A fork with a budget (`runtime.fork(..., commits=1)`) reserves what one commit takes.
    `forks_admitted` / `forks_admitted_commits_1`: how many the real scheduler admits next to a parent at its
    fullest history, counted by forking until admission refuses (`admitted_forks`).
    """
    pcfg = dreamzero_runtime_config(cfg, dtype=torch.bfloat16)
    block_all_layers = KVPool.bytes_per_block_all_layers(pcfg)
    block_one_layer = block_all_layers // cfg.num_layers
    budget = budget_gib * GIB
    window = cfg.kv_cache_bytes(batch=2, dtype=torch.bfloat16)  # the parent's (or a clone's) full window
    chunk_blocks = 2 * ceil_div(cfg.chunk_tokens, pcfg.block_size)
    scratch = 2 * pcfg.scratch_blocks_per_row * block_one_layer
    per_fork = chunk_blocks * block_all_layers + scratch
    per_clone = window + scratch
    reserved = 2 * session_blocks_per_row(DreamZeroSpec.from_model_config(cfg), pcfg.block_size) * block_all_layers
    return {
        "block_size": pcfg.block_size, "block_bytes_all_layers": block_all_layers,
        "window_gib": round(window / GIB, 2), "per_fork_gib": round(per_fork / GIB, 2),
        "per_clone_gib": round(per_clone / GIB, 2),
        "forks_fit": int((budget - window) // per_fork), "clones_fit": int((budget - window) // per_clone),
        "per_fork_reserved_gib": round((reserved + scratch) / GIB, 2),
        "forks_admitted": admitted_forks(cfg, budget_gib, commits=None),
        "forks_admitted_commits_1": admitted_forks(cfg, budget_gib, commits=1), "budget_gib": budget_gib,
    }


def admitted_forks(cfg: DreamZeroConfig, budget_gib: float, *, commits: int | None, limit: int = 256) -> int:
    """Forks the scheduler admits next to one session of `cfg` in a pool of `budget_gib` (bf16, on the "meta"
    device: no memory), the parent at its fullest history (every commit of its window cycle done), each fork made
    with `commits` (None: no budget). Counted by forking until admission refuses."""
    pcfg = dreamzero_runtime_config(cfg, dtype=torch.bfloat16, budget_bytes=int(budget_gib * GIB), device="meta",
                                    blocks_per_layer=None)
    sched = Scheduler(KVPool.from_config(pcfg), BuiltinAllocator(KVPool.from_config(pcfg).blocks_per_layer),
                      max_rows=2)
    spec = DreamZeroSpec.from_model_config(cfg)
    sched.admit("parent", spec, rows=2)
    frame = 0
    while spec.reset_frames is None or frame + spec.chunk_frames < spec.reset_frames:
        sched.finish_forward(sched.plan("parent", "commit"))
        frame += spec.chunk_frames
        if spec.reset_frames is None and frame >= spec.window_frames:
            break
    for k in range(limit):
        try:
            sched.fork("parent", f"fork{k}", commits=commits)
        except CapacityError:
            return k
    return limit


REGION_NS = (1, 2, 4, 8)


def regions_measured(cfg: DreamZeroConfig = DZ_TINY, ns: tuple[int, ...] = REGION_NS) -> list[dict]:
    """Per N: KV bytes N sessions of one prompt take for their cross-attention (2 CFG rows: prompt, negative),
    measured from the allocator (blocks taken x bytes per block) with shared regions (one tenant) and unshared
    (a tenant each: nothing may be shared), and the dense `prepare_cross_kv` tensors' bytes."""
    model = DreamZeroModel(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    text = torch.randn(1, cfg.text_len, cfg.text_dim, generator=g)
    image = torch.randn(1, cfg.image_len, cfg.image_dim, generator=g).expand(2, -1, -1) if cfg.image_len else None
    cross = model.prepare_cross_kv(torch.cat([text, torch.zeros_like(text)]), image)
    dense_one = sum(t.numel() * t.element_size() for t in cross)
    spec = DreamZeroSpec.from_model_config(cfg)
    out = []
    for n in ns:
        row = {"N": n, "dense_bytes": n * dense_one}
        for name, salt in (("shared", lambda i: "tenant"), ("unshared", lambda i: f"tenant-{i}")):
            pcfg = dreamzero_runtime_config(cfg, sessions=n, cross_regions=2 * n)
            rt = PagedKVRuntime(pcfg)
            free = rt.scheduler.allocator.num_free
            for i in range(n):
                rt.admit(f"s{i}", spec, cross_kv=cross, cache_salt=salt(i))
            row[f"{name}_bytes"] = (free - rt.scheduler.allocator.num_free) * KVPool.bytes_per_block_all_layers(pcfg)
            row[f"{name}_writes"] = len({id(r) for i in range(n) for r in rt.regions_of(f"s{i}")})
        out.append(row)
    return out


def regions_14b(cfg: DreamZeroConfig = DREAMZERO_14B, ns: tuple[int, ...] = REGION_NS) -> dict:
    """The same at DREAMZERO_14B geometry (text 512 + image 257 tokens, bf16), computed from the pool geometry:
    a region takes ceil(cross_len / block_size) blocks of every layer, one per distinct row content."""
    pcfg = dreamzero_runtime_config(cfg, dtype=torch.bfloat16)
    block = KVPool.bytes_per_block_all_layers(pcfg)
    region = ceil_div(cfg.cross_len, pcfg.block_size) * block
    dense_one = 2 * 2 * cfg.cross_len * cfg.num_heads * cfg.head_dim * 2 * cfg.num_layers  # K/V, 2 rows, bf16
    rows = [{"N": n, "dense_gib": round(n * dense_one / GIB, 2), "unshared_gib": round(2 * n * region / GIB, 2),
             "shared_gib": round(2 * region / GIB, 2), "shared_negative_only_gib": round((n + 1) * region / GIB, 2)}
            for n in ns]
    return {"cross_tokens": cfg.cross_len, "block_size": pcfg.block_size, "region_bytes": region,
            "blocks_per_region": ceil_div(cfg.cross_len, pcfg.block_size), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, K = 1, 2, few repeats")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: a shared machine)")
    parser.add_argument("--regions", action="store_true",
                        help="only the shared cross-attention regions' memory (N sessions of one prompt)")
    args = parser.parse_args(argv)
    if args.regions:
        measured, big = regions_measured(), regions_14b()
        if args.json:
            print(json.dumps({"config": "DZ_TINY", "measured": measured, "dreamzero_14b": big}, indent=1))
            return 0
        print(markdown_table(measured, [("N", "N"), ("dense bytes", "dense_bytes"), ("unshared bytes", "unshared_bytes"),
                                        ("shared bytes", "shared_bytes"), ("regions written shared", "shared_writes"),
                                        ("regions written unshared", "unshared_writes")]))
        print(f"\nDREAMZERO_14B (bf16, {big['cross_tokens']} cross tokens in {big['blocks_per_region']} block(s) of "
              f"{big['block_size']} tokens per row, computed):")
        print(markdown_table(big["rows"], [("N", "N"), ("dense GiB", "dense_gib"), ("unshared GiB", "unshared_gib"),
                                           ("shared GiB", "shared_gib"),
                                           ("N prompts, shared negative GiB", "shared_negative_only_gib")]))
        return 0
    cfg, ks, repeats = (DZ_TINY, [1, 2], 2) if args.quick else (DZ_MID, [1, 2, 4, 8], 7)
    with bench_settings(threads=args.threads):
        rows, bytes_row = timing(cfg, ks, repeats)
    cap = capacity()
    result = {"machine": machine_info(threads=args.threads), "config": "DZ_TINY" if args.quick else "DZ_MID", "timing": rows,
              "bytes": bytes_row, "capacity_14b": cap}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(markdown_table(rows, [("K", "K"), ("rows", "rows"), ("batched ms", "batched_ms"),
                                ("K sequential ms", "sequential_ms"), ("sequential / batched", "ratio"),
                                ("ratio IQR", "ratio_iqr")]))
    print(f"\nfork: {bytes_row['fork_blocks_taken']} blocks taken, {bytes_row['fork_bytes_copied']} KV bytes copied, "
          f"{bytes_row['fork_metadata_bytes']} host bytes kept per fork; dense clone of the same state: "
          f"{bytes_row['dense_clone_bytes']} bytes (fp32)")
    print(f"\nDREAMZERO_14B (bf16, block {cap['block_size']} tokens): full window of 2 CFG rows {cap['window_gib']} GiB; "
          f"per candidate: fork {cap['per_fork_gib']} GiB, clone {cap['per_clone_gib']} GiB; next to the parent in "
          f"{cap['budget_gib']:.0f} GiB: {cap['forks_fit']} forks vs {cap['clones_fit']} clones; admission reserves "
          f"{cap['per_fork_reserved_gib']} GiB per fork (its commits up to its reset): {cap['forks_admitted']} forks "
          f"admitted; forks with a budget of one commit (runtime.fork(..., commits=1)): "
          f"{cap['forks_admitted_commits_1']} admitted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
