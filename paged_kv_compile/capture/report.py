"""What warming up cost, per bucket, and the progress display while it runs."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..config import Bucket


@dataclass
class BucketWarmup:
    """What warming up one bucket cost."""

    bucket: Bucket
    compile_s: float  # the first forward of the bucket over all blocks: dynamo + passes + inner compiler
    capture_s: float  # CUDA-graph capture of every block (0 without capture)
    graphs_compiled: int  # dynamo graphs compiled while warming this bucket (one serves every block)
    cuda_graphs: int

    def as_dict(self) -> dict:
        b = self.bucket
        return {"bucket": {"rows": b.rows, "tokens": b.tokens, "context": b.context},
                "compile_s": round(self.compile_s, 4), "capture_s": round(self.capture_s, 4),
                "graphs_compiled": self.graphs_compiled, "cuda_graphs": self.cuda_graphs}


@dataclass
class WarmupReport:
    buckets: list[BucketWarmup]
    captured: bool
    total_s: float
    graphs: str = "none"  # "cuda", "emulated", "compiled-only" or "none"

    def as_dict(self) -> dict:
        return {"captured": self.captured, "graphs": self.graphs, "total_s": round(self.total_s, 4),
                "buckets": [b.as_dict() for b in self.buckets]}

    def format(self) -> str:
        mode = {"cuda": "compiled and captured as CUDA graphs", "emulated": "compiled and captured (emulated graphs)",
                "compiled-only": "compiled and captured (replays run the compiled graphs only)",
                }.get(self.graphs, "compiled (no CUDA graphs on this device)")
        lines = [f"warm-up: {len(self.buckets)} bucket(s) {mode} in {self.total_s:.2f} s"]
        for b in self.buckets:
            lines.append(
                f"  {format_bucket(b.bucket)}: compile {b.compile_s:.2f} s, capture {b.capture_s:.2f} s, "
                f"{b.graphs_compiled} graph(s) compiled, {b.cuda_graphs} CUDA graph(s)"
            )
        return "\n".join(lines)


def format_bucket(bucket: Bucket) -> str:
    return f"rows={bucket.rows} tokens={bucket.tokens} context={bucket.context}"


def unique_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (its `unique_graphs` counter): the difference across a
    block of code is what that block compiled, whichever backend (a warm-up, a demo, a test)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def progress_bar(total: int, enabled: bool):
    """A tqdm bar on stderr when tqdm is installed (None otherwise: one printed line per bucket)."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional
        return None
    return tqdm(total=total, desc="paged-kv warm-up", unit="bucket", file=sys.stderr, leave=True)
