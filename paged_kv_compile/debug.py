"""Graph dumps: what the passes saw and what they rewrote."""

from __future__ import annotations

import dataclasses
import json
import os

from .passes.rewrite import PassResult

_counter = {"n": 0}


def maybe_dump(dump_dir: str | None, before: str, result: PassResult) -> None:
    """Write the FX graph before and after the passes and the pass report under `dump_dir`."""
    if not dump_dir:
        return
    os.makedirs(dump_dir, exist_ok=True)
    _counter["n"] += 1
    stem = os.path.join(dump_dir, f"paged_kv_graph_{_counter['n']:03d}")
    with open(stem + ".before.py", "w") as f:
        f.write(before)
    with open(stem + ".after.py", "w") as f:
        f.write(result.graph_module.print_readable(print_output=False))
    with open(stem + ".report.json", "w") as f:
        json.dump(
            {
                "sites": [dataclasses.asdict(r) for r in result.reports],
                "shape": result.shape,
                "expect": result.expect,
            },
            f,
            indent=2,
        )
