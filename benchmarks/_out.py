"""Where a benchmark writes its JSON report: a dry run never writes into the repository.

A real run writes `--out`, else `$OUT/<name>.json` when `$OUT` is set (the device machine's return folder), else
`<name>.json` in the working directory. A dry run (tiny, on a CPU: CI and the tests run it) writes `--out`, else
`<name>_dry_run.json` in a fresh temporary folder, whose path the benchmark prints.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def report_path(name: str, dry: bool, out: str | None) -> Path:
    """The JSON path of benchmark `name` (see the module docstring); its folder exists."""
    if out:
        path = Path(out)
    elif dry:
        path = Path(tempfile.mkdtemp(prefix=f"{name}_dry_run_")) / f"{name}_dry_run.json"
    elif os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / f"{name}.json"
    else:
        path = Path(f"{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
