"""The `paged-kv` command: demo, warmup, dump, bench. It parses arguments and prints; `demo.py` runs the scenes.

    paged-kv demo [--model M] [--size mid|tiny] [--kernel K] [--inner-compiler C] [--json]
    paged-kv warmup [--model M] [--kernel K] [--inner-compiler C] [--json]
    paged-kv dump --out DIR [--model M] [--inner-compiler C] [--json]
    paged-kv bench [NAME ...] [--list] [--dir DIR] [-- ARGS]

The models are the registered families with a demo scene (`families.FAMILIES`, `Family.demo`), spelled with '-'.
User mistakes (unknown model or option, a PagedKVError such as an unavailable kernel) print one line
on stderr and exit with status 2; `demo` exits with 1 when a paged run does not match the dense one.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import __version__
from .config import INNER_COMPILERS, KERNELS
from .errors import PagedKVError

#: The demo's model sizes: "mid" (dim 512, 8 heads x 64: the size whose times say something) and "tiny" (dim 64:
#: seconds, but fixed per-call costs dominate its times).
SIZES = ("mid", "tiny")
#: The demo's inner compiler: Inductor, whose times are the ones that matter (its compile time is printed);
#: warmup and dump default to aot_eager, which compiles in seconds on 2 CPU cores.
DEMO_INNER_COMPILER = "inductor"
DEFAULT_INNER_COMPILER = "aot_eager"


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def model_choices() -> list[str]:
    """The registered families that have a demo scene, as the command line spells them ('_' -> '-')."""
    from . import families

    return [f.name.replace("_", "-") for f in families.FAMILIES
            if f.demo("tiny", short=True, device="cpu") is not None]


def _count(text: str) -> int:
    """An argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _device(args) -> str:
    """The device to run on; `--kernel triton` on CPU switches Triton's interpreter on (slow, but runs)."""
    import torch

    name = args.device
    if name:
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available here")
    else:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if getattr(args, "kernel", None) == "triton" and name == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"
        print("paged-kv: kernel triton on CPU runs under TRITON_INTERPRET=1 (interpreted: about a minute)",
              file=sys.stderr)
    return name


def _build(args, **kwargs):
    from . import demo

    return demo.build(args.model, kernel=args.kernel, inner_compiler=args.inner_compiler, device=_device(args),
                      **kwargs)


# ---- demo ---------------------------------------------------------------------------------------------


def cmd_demo(args) -> int:
    from . import demo

    start = time.perf_counter()
    setup = _build(args, size=args.size)
    say = None if args.quiet else (lambda message: print(f"paged-kv demo: {message}", file=sys.stderr, flush=True))
    report = demo.run(setup, threads=args.threads or None, progress=say, progress_bar=not args.quiet)
    report["wall_s"] = time.perf_counter() - start
    if args.json:
        print(json.dumps(report))
    else:
        for line in _demo_lines(report):
            print(line)
    return 0 if demo.ok(report) else 1


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    n /= 1024
    return f"{n:.1f} KiB" if n < 1024 else f"{n / 1024:.1f} MiB"


def _verdict(diff: float | None, atol: float) -> str:
    if diff is None:
        return "-"
    return f"{diff:.2g} ({'ok' if diff <= atol else 'FAILED'})"


def _demo_lines(r: dict) -> list[str]:
    return [*_header_lines(r), *_scene_lines(r), *_cost_lines(r)]


def _header_lines(r: dict) -> list[str]:
    sites, parity = r["attention_sites"], r["parity"]
    return [
        f"paged-kv demo: {r['description']}",
        f"  device {r['device']} ({r['threads']} torch thread{'s' if r['threads'] != 1 else ''}), kernel {r['kernel']} "
        f"({r['kernel_resolved']}), "
        f"inner compiler {r['inner_compiler']}, "
        f"CUDA graphs {'on' if r['cuda_graphs'] else 'off (no GPU)'}; attention sites in the {sites['graphs']} "
        f"compiled graph(s): {sites['rewritten']} rewritten, {sites['dense']} left dense (no KV cache), "
        f"{sites['refused']} refused; each compiled graph serves all {sites['layers']} layers",
        f"parity oracle, dense eager vs paged: {parity['loops']}: max |dense - paged| = "
        f"{_verdict(parity['max_abs_diff'], parity['atol'])}, tolerance {parity['atol']:.2g} (compiling the dense "
        f"model alone moved it {parity['compile_drift']:.2g}; the bound: {parity['drift_factor']}x that, within "
        f"[{parity['floor']:g}, {parity['ceiling']:g}])",
    ]


def _scene_lines(r: dict) -> list[str]:
    scene, atol = r["scene"], r["parity"]["atol"]
    owners = scene["owners"]
    width = max(len(o["what"]) for o in owners)
    lines = [
        f"where paging pays: {len(owners)} owners on one pool, every forward run paged and dense (eager: the oracle "
        "of each owner's rows; compiled the same way: the baseline)",
        f"  {'owner':<8} {'where it stands':<{width}}  {'forwards':>8}  {'KV held paged (of it shared)':>28}  "
        f"{'dense':>9}  max |dense - paged|",
    ]
    for o in owners:
        held = _size(o["paged_bytes"]) + (f" ({_size(o['paged_shared_bytes'])})" if o["paged_shared_bytes"] else "")
        lines.append(f"  {o['owner_id']:<8} {o['what']:<{width}}  {o['forwards']:>8}  {held:>28}  "
                     f"{_size(o['dense_bytes']):>9}  {_verdict(o['max_abs_diff'], atol)}")
    fork = scene["fork"]
    if fork:
        lines.append(f"  forks: {fork['forks']} made in {fork['fork_ms']:.2f} ms, {fork['blocks_taken']} blocks taken, "
                     f"{fork['kv_bytes_copied']} KV bytes copied; they ran as the rows of ONE forward per step "
                     f"({fork['rows']} rows)")
    return lines


def _cost_lines(r: dict) -> list[str]:
    kv, frames, compile_s, inner = r["kv_bytes"], r["compiled_frames"], r["compile_s"], r["inner_compiler"]
    free, total = r["scene"]["blocks_free_after"]
    lines = [
        f"KV bytes for this scene: paged {_size(kv['paged_held'])} held by the owners, in a pool of "
        f"{_size(kv['paged_pool'])} (room for the most each owner may hold, which admission reserves); dense "
        f"{_size(kv['dense_held'])}"
        + (f": paged holds {kv['paged_held'] / kv['dense_held']:.2f}x dense" if kv["dense_held"] else ""),
        f"  dense: {r['dense_baseline']}",
        f"compiled frames: paged {frames['paged']} (one per bucket, shared by every owner of the scene; "
        f"{frames['paged_while_serving']} while serving), dense {frames['dense']} (one per cache shape and row count "
        "its forwards saw)",
        f"{inner} compile: paged {compile_s['paged']:.1f} s ({frames['paged']} frames at warm-up, the process's "
        f"first compiles: cold caches), dense {compile_s['dense']:.1f} s (the forwards that compiled its "
        f"{frames['dense']} frames, later)",
        f"time per forward, both compiled with {inner} (median over the forwards in which neither side compiled; "
        "paged includes the runtime's planning and metadata):",
    ]
    for t in r["time_per_forward"]:
        if not t["forwards"]:
            lines.append(f"  rows {t['rows']}: none to compare (each of these forwards compiled a dense frame)")
            continue
        lines.append(f"  rows {t['rows']}: dense {t['dense_ms']:.2f} ms, paged {t['paged_ms']:.2f} ms = "
                     f"{t['paged_over_dense']:.2f}x dense ({t['forwards']} forwards)")
    if r["info"].get("size") == "tiny":
        lines.append("  (tiny model: fixed per-call costs dominate these times; --size mid compares at a size that "
                     "means something)")
    lines.append(f"blocks free again once every owner is released: {free} of {total}; demo wall time "
                 f"{r['wall_s']:.0f} s")
    return lines


# ---- warmup, dump -------------------------------------------------------------------------------------


def cmd_warmup(args) -> int:
    from .capture import warm_up

    setup = _build(args, size="tiny", twins=False)
    captured = warm_up(setup.model, setup.runtime, progress=not args.quiet, install=False)
    report = captured.report
    if args.json:
        print(json.dumps({"model": args.model, "device": setup.device, **report.as_dict()}))
    else:
        print(report.format())
    return 0


def cmd_dump(args) -> int:
    from . import debug
    from .driver import paged_run

    setup = _build(args, size="tiny", short=True, twins=False)
    with debug.dump(args.out) as session:
        for i, loop in enumerate(setup.demo.loops):
            paged_run(setup.model, setup.runtime, owner_id=f"loop-{i}", **loop)
    files = session.files()
    if args.json:
        print(json.dumps({"out": session.directory, "files": files, "graphs": len(session.graphs),
                          "pass_files": session.pass_files(), "depyf_files": session.depyf_files()}))
    else:
        print(f"paged-kv dump: {len(files)} files in {session.directory} "
              f"({len(session.graphs)} rewritten graph(s); paged_kv_* are the pass files, the rest are depyf's)")
        for name in files:
            print(f"  {name}")
    return 0


# ---- bench --------------------------------------------------------------------------------------------


def _bench_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    cwd = Path.cwd() / "benchmarks"
    if cwd.is_dir():
        return cwd
    return Path(__file__).resolve().parent.parent / "benchmarks"


def discover_benchmarks(directory: Path) -> dict[str, Path]:
    """`<name>.py` files of `directory` that define a top-level `main(argv)` (read, not imported)."""
    found = {}
    if not directory.is_dir():
        return found
    for path in sorted(directory.glob("*.py")):
        if path.name.startswith("_"):
            continue
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except (SyntaxError, UnicodeDecodeError):
            continue
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            found[path.stem] = path
    return found


#: Runs `<package>.<name>.main(argv)` in a fresh interpreter started in the package's parent folder.
_BENCH_RUNNER = "import importlib, sys; sys.exit(importlib.import_module(sys.argv[1]).main(sys.argv[2:]))"


def _run_benchmark(directory: Path, name: str, argv: list[str]) -> int:
    """`python -m`-style: the benchmarks folder is a package imported from its parent; no sys.path edits."""
    directory = directory.resolve()
    module = f"{directory.name}.{name}"
    return subprocess.run([sys.executable, "-c", _BENCH_RUNNER, module, *argv], cwd=directory.parent).returncode


def cmd_bench(args) -> int:
    directory = _bench_dir(args.dir)
    found = discover_benchmarks(directory)
    if not found:
        print(f"paged-kv bench: no benchmark scripts in {directory} (a benchmark is benchmarks/<name>.py "
              "defining main(argv))", file=sys.stderr)
        return 2
    if args.list:
        for name, path in found.items():
            print(f"{name}\t{path}")
        return 0
    # Default: run_all (every CPU benchmark once, docs regenerated), not each script plus run_all plus
    # the GPU suite (which needs a GPU and exits 2 without one).
    names = args.names or (["run_all"] if "run_all" in found else list(found))
    unknown = [n for n in names if n not in found]
    if unknown:
        raise UsageError(f"unknown benchmark(s) {unknown}; available: {', '.join(found)}")
    status = 0
    for name in names:
        if len(names) > 1:
            print(f"== {name}", flush=True)
        code = _run_benchmark(directory, name, list(args.bench_args))
        status = status or (int(code) if code else 0)
    return status


# ---- parser and entry point ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="paged-kv", description="Paged KV cache for diffusion transformers that stays compiled.")
    parser.add_argument("--version", action="version", version=f"paged-kv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    models = model_choices()

    def common(p, *, default_kernel="reference", inner=DEFAULT_INNER_COMPILER):
        p.add_argument("--model", choices=models, default=models[0],
                       help=f"reference model family (default {models[0]})")
        p.add_argument("--kernel", choices=KERNELS, default=default_kernel,
                       help=f"attention kernel (default {default_kernel}; auto picks the best available)")
        p.add_argument("--inner-compiler", choices=INNER_COMPILERS, default=inner,
                       help=f"compiler after the passes (default {inner})")
        p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
        p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
        p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")

    p = sub.add_parser("demo", help="dense vs paged on a small model: parity, then several owners and forks on one "
                                    "pool (bytes, frames, compile time, time per forward)")
    common(p, inner=DEMO_INNER_COMPILER)
    p.add_argument("--size", choices=SIZES, default="mid",
                   help="model size (default mid: dim 512, 8 heads x 64, the size whose times mean something, minutes "
                        "on a 2-core CPU; tiny: dim 64, quicker, but per-call costs dominate its times)")
    p.add_argument("--threads", type=_count, default=1,
                   help="torch intra-op threads, the same for both sides (default 1: on a shared machine more threads "
                        "mostly wait for each other; 0: torch's default)")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("warmup", help="compile (and on CUDA capture) every shape bucket; per-bucket times")
    common(p)
    p.set_defaults(func=cmd_warmup)
    p = sub.add_parser("dump", help="run a short loop under debug.dump and list the files written")
    common(p)
    p.add_argument("--out", required=True, help="directory for the dumps")
    p.set_defaults(func=cmd_dump)
    p = sub.add_parser("bench", help="run benchmarks/<name>.py scripts (their main(argv)); args after --")
    p.add_argument("names", nargs="*", help="benchmarks to run (default: run_all, every CPU benchmark)")
    p.add_argument("--list", action="store_true", help="list the benchmarks found")
    p.add_argument("--dir", default=None, help="benchmark directory (default: ./benchmarks, else the source tree's)")
    p.set_defaults(func=cmd_bench, bench_args=[])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args: list[str] = []
    if argv[:1] == ["bench"] and "--" in argv:
        cut = argv.index("--")
        argv, bench_args = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        if args.command == "bench":
            args.bench_args = bench_args
        return args.func(args)
    except SystemExit as exit_:  # --help / --version
        return exit_.code if isinstance(exit_.code, int) else 0
    except (UsageError, PagedKVError) as err:
        print(f"paged-kv: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:  # a PagedKVError raised while compiling reaches us wrapped by dynamo
        inner = getattr(err, "inner_exception", None) or err.__cause__
        if isinstance(inner, PagedKVError):
            print(f"paged-kv: error: {_one_line(inner)}", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        return 130


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


if __name__ == "__main__":  # python -m paged_kv_compile.cli
    sys.exit(main())
