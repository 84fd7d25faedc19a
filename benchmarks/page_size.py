"""Page size: what pages sized for the kernel cost in pool bytes and in CPU forward time.

1. Arithmetic at the real geometries (no model runs): a DreamZero-14B session (40 layers, 40 heads x 128, bf16 K/V,
   chunk 2 frames, window 21 frames reset at frame 20) at 880-token frames (its own resolution) and at 1560-token
   frames (832x480), with pages of one frame and of 64, 128 and 256 tokens. Per row: the blocks admission reserves
   (`session_blocks_per_row`: the most the loop ever holds), the tokens they hold, and what that exceeds the loop's
   real need (the same count at a page of 1 token: partial blocks at the window's start, the sink's end and the
   history's tail are the waste), in tokens and bytes per session (2 CFG rows).
2. The CPU forward at a small size: a denoising forward at full window of a small DreamZero (DREAMZERO_MID's
   dim 512 = 8 heads x 64 and 33 registers, 2 layers, frames of 176 tokens = 880 / 5, chunk 2 frames, window 6
   frames with a 1-frame sink) compiled dense and paged at page 128 (which divides neither the frame nor the chunk,
   so rows carry a kv_gap) and at page = frame, the three timed in alternation on the calling thread's CPU clock
   (one intra-op thread: what other processes' preemption does not inflate); the ratio paged / dense per repeat
   (median and spread), and max |paged - dense|.

    python -m benchmarks.page_size [--quick] [--json] [--inner aot_eager|inductor] [--repeats N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from benchmarks._common import (
    OwnerRun,
    bench_settings,
    format_table,
    interleaved,
    machine_info,
    make_setup,
    ratio_entry,
)
from benchmarks._models import dreamzero_loop
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config, session_blocks_per_row
from paged_kv_compile.models.dreamzero import DREAMZERO_14B, DREAMZERO_MID, DreamZeroModel

#: (label, tokens per frame) of the two DreamZero-14B resolutions
GEOMETRIES = (("DreamZero-14B", 880), ("832x480", 1560))
PAGES = (64, 128, 256)
#: the forward timed on the CPU: DREAMZERO_MID's widths, 2 layers, 176-token frames, window 6 frames, a 1-frame sink
SMALL = dataclasses.replace(DREAMZERO_MID, num_layers=2, frame_seqlen=176, local_attn_size=6, sink_size=1,
                            window_reset_frames=12)
SMALL_PAGE = 128


def pool_waste(cfg=DREAMZERO_14B, geometries=GEOMETRIES, pages=PAGES) -> list[dict]:
    """Per geometry and page size: what admission reserves per row and what it holds beyond the loop's need."""
    token_bytes = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 2  # K and V, every layer, bf16
    rows = []
    for label, frame in geometries:
        spec = DreamZeroSpec.from_model_config(dataclasses.replace(cfg, frame_seqlen=frame))
        need = session_blocks_per_row(spec, 1)  # tokens: pages of one token hold exactly what the loop keeps
        for page in (frame, *pages):
            blocks = session_blocks_per_row(spec, page)
            extra = blocks * page - need
            rows.append({
                "geometry": label, "frame_tokens": frame, "page": page, "page_is_frame": page == frame,
                "multiple_of_16": page % 16 == 0, "blocks_per_row": blocks, "tokens_per_row": blocks * page,
                "needed_tokens_per_row": need, "wasted_tokens_per_row": extra,
                "wasted_pct": round(100 * extra / need, 2),
                "wasted_mib_per_session": round(2 * extra * token_bytes / 2**20, 1),
                "reserved_gib_per_session": round(2 * blocks * page * token_bytes / 2**30, 2),
            })
    return rows


def _paged_setup(cfg, block_size: int, inner: str):
    return make_setup(DreamZeroModel(cfg, seed=1).eval(), "paged", inner,
                      lambda: dreamzero_runtime_config(cfg, block_size=block_size, kernel="reference",
                                                       inner_compiler=inner))


def forward_ratio(cfg=SMALL, page: int = SMALL_PAGE, inner: str = "aot_eager", repeats: int = 8) -> dict:
    """A full-window denoising forward, dense vs paged at `page` vs paged at page = frame, timed alternately."""
    setups = {"dense": make_setup(DreamZeroModel(cfg, seed=1).eval(), "dense", inner, lambda: None),
              f"paged_{page}": _paged_setup(cfg, page, inner),
              "paged_frame": _paged_setup(cfg, cfg.frame_seqlen, inner)}
    committed = cfg.window_frames // cfg.num_frame_per_block
    loop = dreamzero_loop(num_chunks=committed + 2, steps=1, seed=0)
    runs = {}
    try:
        for name, setup in setups.items():
            run = runs[name] = OwnerRun(setup, **loop)
            with (torch.compiler.set_stance("force_eager") if name == "dense" else _nothing()):
                run.loop.run_while(lambda f: f.kind != "denoise" or f.index < committed)
        outs = {name: run.loop.call_pending()[:2] for name, run in runs.items()}
        diff = {name: max(float((a - b).abs().max()) for a, b in zip(outs[name], outs["dense"]))
                for name in outs if name != "dense"}
        times = interleaved({name: run.loop.call_pending for name, run in runs.items()}, repeats, warmup=1,
                            clock=time.thread_time)
        gaps = [row.kv_gap for row in runs[f"paged_{page}"].runtime.plan("owner", "denoise").rows]
        runs[f"paged_{page}"].runtime.scheduler.in_flight = None  # that plan was only read
        return {
            "config": {"dim": cfg.dim, "layers": cfg.num_layers, "heads": cfg.num_heads, "head_dim": cfg.head_dim,
                       "frame_tokens": cfg.frame_seqlen, "chunk_frames": cfg.num_frame_per_block,
                       "window_frames": cfg.window_frames, "sink_frames": cfg.sink_size,
                       "keys_per_query": cfg.max_attention_size + cfg.action_register_length},
            "inner": inner, "repeats": repeats, "kv_gap_at_page": gaps,
            f"page_{page}": {**ratio_entry(times, f"paged_{page}", "dense"), "max_abs_diff": diff[f"paged_{page}"]},
            "page_frame": {**ratio_entry(times, "paged_frame", "dense"), "max_abs_diff": diff["paged_frame"]},
            "graphs": {name: s.backend.frames for name, s in setups.items()},
        }
    finally:
        for run in runs.values():
            run.close()
        for setup in setups.values():
            setup.close()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.page_size", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 repeats (a smoke run)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--inner", default="aot_eager", choices=("aot_eager", "inductor"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    waste = pool_waste()
    with bench_settings():
        timing = forward_ratio(inner=args.inner, repeats=args.repeats or (3 if args.quick else 8))
    out = {"machine": machine_info(), "pool_waste": waste, "forward": timing}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(format_table(waste, [("geometry", "geometry"), ("page", "page"), ("x16", "multiple_of_16"),
                               ("blocks/row", "blocks_per_row"), ("tokens/row", "tokens_per_row"),
                               ("needed", "needed_tokens_per_row"), ("wasted", "wasted_tokens_per_row"),
                               ("wasted %", "wasted_pct"), ("wasted MiB/session", "wasted_mib_per_session"),
                               ("reserved GiB/session", "reserved_gib_per_session")]))
    print()
    page = f"page_{SMALL_PAGE}"
    for key in (page, "page_frame"):
        r = timing[key]
        print(f"{key}: paged {r[[k for k in r if k.startswith('paged_')][0]]} ms, dense {r['dense_ms']} ms, "
              f"ratio median {r['ratio']['median']} (min {r['ratio']['min']}, max {r['ratio']['max']}), "
              f"max |paged - dense| {r['max_abs_diff']:.2g}")
    print(f"config {timing['config']}, inner {timing['inner']}, {timing['repeats']} repeats, kv_gap at page "
          f"{SMALL_PAGE}: {timing['kv_gap_at_page']}, graphs {timing['graphs']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
