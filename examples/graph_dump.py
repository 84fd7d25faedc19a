"""See what the paged_kv passes rewrote: dump the FX graphs before/after the passes, the pass report,
and depyf's view of the compilation (decompiled dynamo code, AOT graphs, Inductor kernels).

    python examples/graph_dump.py [OUT_DIR]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from paged_kv_compile import debug
from paged_kv_compile.driver import paged_run
from paged_kv_compile.families.dreamzero import dreamzero_runtime_config
from paged_kv_compile.models import DreamZeroConfig, DreamZeroModel
from paged_kv_compile.runtime import PagedKVRuntime


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="paged_kv_dump_"))
    cfg = DreamZeroConfig(sink_size=2)
    model = DreamZeroModel(cfg, seed=1)
    runtime = PagedKVRuntime(dreamzero_runtime_config(cfg, block_size=8))
    runtime.bind(model.blocks)
    for block in model.blocks:
        block.compile(backend="paged_kv", fullgraph=True, dynamic=False, options={"inner_compiler": "aot_eager"})

    torch._dynamo.reset()  # compilation must happen inside the dump to be dumped
    with debug.dump(out) as dump:  # wrap the first forwards: that is when compilation happens
        paged_run(model, runtime, num_chunks=2, num_inference_steps=1)

    print(f"{len(dump.files())} files in {out}:")
    for name in dump.files():
        print(f"  {name}")
    graph = dump.graphs[0]
    after = (out / graph["after"]).read_text()
    print("\nthe rewritten attention call:")
    print("  " + next(line.strip() for line in after.splitlines() if "paged_kv.write_attend" in line))
    print("\npass report:")
    for site in json.loads((out / graph["report"]).read_text())["sites"]:
        print(f"  {site['node']}: {site['status']} ({site['pattern']}) {site['reason']}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
