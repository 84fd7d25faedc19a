"""The `paged-kv` command: demo, warmup, dump, bench.

    paged-kv demo [--model dreamzero|hunyuan-image3] [--size mid|tiny] [--kernel K] [--inner-compiler C] [--json]
    paged-kv warmup [--model M] [--kernel K] [--inner-compiler C] [--json]
    paged-kv dump --out DIR [--model M] [--inner-compiler C] [--json]
    paged-kv bench [NAME ...] [--list] [--dir DIR] [-- ARGS]

User mistakes (unknown model or option, a PagedKVError such as an unavailable kernel) print one line
on stderr and exit with status 2; `demo` exits with 1 when the paged run does not match the dense one.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import __version__
from .config import INNER_COMPILERS, KERNELS
from .errors import PagedKVError

MODELS = ("dreamzero", "hunyuan-image3")
#: The demo's model sizes: "tiny" (dim 64: seconds, but fixed per-call costs dominate its times) and "mid"
#: (dim 512, 8 heads x 64: the size whose times say something; benchmarks/forward_time.py uses it too).
SIZES = ("mid", "tiny")
PARITY_ATOL = 1e-5
#: aot_eager: the demo's compile takes ~1 s on 2 CPU cores; Inductor's takes 5-20 s (cold C++ cache).
DEFAULT_INNER_COMPILER = "aot_eager"


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(f"{message} (see `{self.prog} --help`)")


# ---- what the subcommands run -----------------------------------------------------------------------


@dataclass
class Setup:
    """A tiny reference model of one family, its runtime and the two ways to run its loop."""

    family: str
    describe: str
    model: Any
    runtime: Any
    buckets: tuple
    run_dense: Callable[..., Any]  # (hooks, model=None: a fresh dense model) -> result
    run_paged: Callable[[Callable[[Any, str], Any]], Any]  # make_hooks(runtime, owner_id) -> result
    compare: Callable[[Any, Any], float]
    info: dict = field(default_factory=dict)
    dense_model: Any = None  # the dense model the demo compiles and times (like the paged one)


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


def _setup(model_name: str, kernel: str, inner: str, device: str, *, short: bool = False, size: str = "tiny") -> Setup:
    import dataclasses

    import torch

    from .driver import paged_run
    from .families.dreamzero import dreamzero_buckets, dreamzero_runtime_config
    from .families.hunyuan_image3 import hunyuan_buckets, hunyuan_runtime_config
    from .runtime import PagedKVRuntime

    if model_name == "dreamzero":
        from .models.dreamzero import DREAMZERO_MID, DreamZeroConfig, DreamZeroModel, dreamzero_rollout

        # chunks of 2 frames with a 2-frame sink: tiny: window 6 frames, slides after 3 commits, resets after 8
        # chunks; mid: window 8 frames (64 tokens each), slides after 4 commits, resets after 8 chunks.
        cfg = DreamZeroConfig(sink_size=2) if size == "tiny" else dataclasses.replace(DREAMZERO_MID, sink_size=2)
        chunks, steps = (2, 1) if short else (10, 3)
        buckets = dreamzero_buckets(cfg)
        model = DreamZeroModel(cfg, seed=1).to(device)
        runtime = PagedKVRuntime(dreamzero_runtime_config(
            cfg, block_size=8 if size == "tiny" else 16, kernel=kernel, inner_compiler=inner, buckets=buckets,
            device=device))

        def run_dense(hooks, dense_model=None):
            return dreamzero_rollout(dense_model or DreamZeroModel(cfg, seed=1).to(device), num_chunks=chunks,
                                     num_inference_steps=steps, seed=3, hooks=hooks)

        def run_paged(make_hooks):
            return paged_run(model, runtime, owner_id="demo", make_hooks=make_hooks,
                             num_chunks=chunks, num_inference_steps=steps, seed=3)

        def compare(dense, paged):
            return max((dense[k].float() - paged[k].float()).abs().max().item() for k in ("video", "actions"))

        describe = (f"dreamzero ({size}: dim {cfg.dim}, {cfg.num_heads} heads x {cfg.head_dim}, {cfg.frame_seqlen} "
                    f"tokens/frame): {cfg.num_layers} layers, {chunks} chunks x {steps} denoising steps, window "
                    f"{cfg.window_frames} frames with a {cfg.sink_size}-frame sink, reset every "
                    f"{cfg.chunks_per_window} chunks")
        return Setup("dreamzero", describe, model, runtime, buckets, run_dense, run_paged, compare,
                     info={"chunks": chunks, "steps": steps}, dense_model=DreamZeroModel(cfg, seed=1).to(device))

    from .models.hunyuan_image3 import HUNYUAN_IMAGE3_MID, HunyuanImage3Config, HunyuanImage3Model, hunyuan_generate

    cfg = HunyuanImage3Config() if size == "tiny" else HUNYUAN_IMAGE3_MID
    capacity, steps = (12 if size == "tiny" else 256), (2 if short else 4)
    gen = torch.Generator().manual_seed(0)
    # a 1-row request, then a 2-row (CFG) one
    lengths = [[9]] if short else ([[9], [11, 4]] if size == "tiny" else [[200], [200, 60]])
    requests = [[torch.randint(0, cfg.vocab, (n,), generator=gen) for n in lens] for lens in lengths]
    buckets = hunyuan_buckets(cfg, [capacity], rows=sorted({len(r) for r in requests}))
    model = HunyuanImage3Model(cfg, seed=2).to(device)
    runtime = PagedKVRuntime(hunyuan_runtime_config(
        cfg, max_prefix=capacity, block_size=4 if size == "tiny" else 16, kernel=kernel, inner_compiler=inner,
        buckets=buckets, device=device))

    def run_dense(hooks, dense_model=None):
        dense_model = dense_model or HunyuanImage3Model(cfg, seed=2).to(device)
        return [hunyuan_generate(dense_model, p, prefix_capacity=capacity, num_steps=steps, seed=5, hooks=hooks)
                for p in requests]

    def run_paged(make_hooks):
        return [paged_run(model, runtime, prompts=prompts, owner_id=f"request-{i}", make_hooks=make_hooks,
                          num_steps=steps, seed=5)
                for i, prompts in enumerate(requests)]

    def compare(dense, paged):
        return max((d.float() - p.float()).abs().max().item() for d, p in zip(dense, paged))

    describe = (f"hunyuan-image3 ({size}: hidden {cfg.hidden}, {cfg.num_heads}/{cfg.num_kv_heads} heads x "
                f"{cfg.head_dim}): {cfg.num_layers} layers, {len(requests)} request(s) of "
                f"{[len(r) for r in requests]} row(s), prefix capacity {capacity}, {steps} steps")
    return Setup("hunyuan_image3", describe, model, runtime, buckets, run_dense, run_paged, compare,
                 info={"requests": len(requests), "steps": steps}, dense_model=HunyuanImage3Model(cfg, seed=2).to(device))


def _check_kernel(setup: Setup, kernel: str) -> str:
    """The concrete kernel `kernel` resolves to here; an unavailable one is a KernelUnavailableError."""
    import torch

    from .ops import resolve_kernel

    pool = setup.runtime.pool.tensor
    query = torch.zeros(1, 1, pool.shape[3], pool.shape[4], dtype=pool.dtype, device=pool.device)
    return resolve_kernel(kernel, query, pool)


def _compile_blocks(setup: Setup, kernel: str, inner: str) -> list:
    from . import families

    blocks = families.for_model(setup.model).blocks(setup.model)
    setup.runtime.bind(blocks)
    for block in blocks:
        block.compile(backend="paged_kv", fullgraph=True, dynamic=False,
                      options={"kernel": kernel, "inner_compiler": inner})
    return blocks


class _Timer:
    """Wall time of each forward (the runtime's planning and commit included), device work waited for."""

    def __init__(self, device: str) -> None:
        self.times: list[float] = []
        self.cuda = device.startswith("cuda")

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    @contextlib.contextmanager
    def around(self, ctx):
        self._sync()
        start = time.perf_counter()
        with ctx:
            yield
            self._sync()
        self.times.append(time.perf_counter() - start)

    def mean_ms(self) -> float:
        return 1e3 * sum(self.times) / len(self.times) if self.times else 0.0


def _dense_hooks(setup: Setup, timer: _Timer, kv: dict):
    """Dense hooks that time each forward and measure the KV bytes the dense caches hold."""
    from .models.hooks import DenseHooks

    class Hooks(DenseHooks):
        kind = None

        def caches(self, model, batch, **geometry):
            caches = super().caches(model, batch, **geometry)
            if setup.family == "hunyuan_image3":  # preallocated: what it holds is what it reserves
                held = sum(c.cached_key.nbytes + c.cached_value.nbytes for c in caches)
                kv["peak"] = max(kv.get("peak", 0), held)
            elif not getattr(model, "_demo_kv_hooked", False):  # DreamZero's caches grow: measure after commits
                def record(module, _inputs, output):
                    if hooks.kind == "commit":  # the caches the loop keeps after a commit
                        kv.setdefault("per_layer", {})[id(module)] = output[1].nbytes
                        kv["peak"] = max(kv.get("peak", 0), sum(kv["per_layer"].values()))

                for block in model.blocks:
                    block.register_forward_hook(record)
                model._demo_kv_hooked = True
            return caches

        def forward(self, kind, **info):
            self.kind = kind
            return timer.around(super().forward(kind, **info))

    hooks = Hooks()
    return hooks


def _timed_dense_hooks(timer: _Timer):
    """Dense hooks that only time each forward (the compiled dense run)."""
    from .models.hooks import DenseHooks

    class Hooks(DenseHooks):
        def forward(self, kind, **info):
            return timer.around(super().forward(kind, **info))

    return Hooks()


def _compile_dense(setup: Setup, inner: str) -> None:
    """Compile the dense model's blocks exactly as the paged ones are (regional, fullgraph, static shapes), with the
    same inner compiler and no paging: the like-for-like baseline of the demo's times."""
    from . import families

    for block in families.for_model(setup.dense_model).blocks(setup.dense_model):
        block.compile(backend=inner, fullgraph=True, dynamic=False)


def _paged_hooks_factory(runtime, timer: _Timer, buckets_used: list):
    from .driver import PagedHooks

    class Hooks(PagedHooks):
        @contextlib.contextmanager
        def forward(self, kind, **info):
            with timer.around(super().forward(kind, **info)):
                if runtime.active is not None and runtime.active.bucket not in buckets_used:
                    buckets_used.append(runtime.active.bucket)
                yield

    return Hooks


def _bucket_dict(b) -> dict:
    return {"rows": b.rows, "tokens": b.tokens, "context": b.context}


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


# ---- subcommands --------------------------------------------------------------------------------------


def cmd_demo(args) -> int:
    import torch

    from .backend import record_passes
    from .capture import format_bucket, warm_up

    device = _device(args)
    setup = _setup(args.model, args.kernel, args.inner_compiler, device, size=args.size)
    resolved = _check_kernel(setup, args.kernel)

    # The oracle: the dense model, eager (also measures the KV its caches hold).
    kv = {}
    dense = setup.run_dense(_dense_hooks(setup, _Timer(device), kv))
    # The time baseline: the same dense model compiled like the paged one, warmed up (every cache length it sees
    # compiled), then timed over the same loop.
    torch._dynamo.reset()
    graphs0 = _unique_graphs()
    _compile_dense(setup, args.inner_compiler)
    setup.run_dense(_timed_dense_hooks(_Timer(device)), setup.dense_model)
    dense_frames = _unique_graphs() - graphs0
    dense_timer = _Timer(device)
    setup.run_dense(_timed_dense_hooks(dense_timer), setup.dense_model)
    dense_compiles_timed = _unique_graphs() - graphs0 - dense_frames

    torch._dynamo.reset()
    graphs0 = _unique_graphs()
    _compile_blocks(setup, args.kernel, args.inner_compiler)
    with record_passes() as passes:
        t0 = time.perf_counter()
        captured = warm_up(setup.model, setup.runtime, progress=not args.quiet)
        warmup_s = time.perf_counter() - t0
        paged_timer, buckets_used = _Timer(device), []
        graphs_warm = _unique_graphs()
        with captured.serving():
            paged = setup.run_paged(_paged_hooks_factory(setup.runtime, paged_timer, buckets_used))
    captured.uninstall()
    frames = _unique_graphs() - graphs0
    serving_compiles = _unique_graphs() - graphs_warm
    reports = [r for res in passes for r in res.reports]
    status = {s: sum(r.status == s for r in reports) for s in ("rewritten", "dense", "refused")}

    diff = setup.compare(dense, paged)
    pool = setup.runtime.pool
    history = pool.scratch_base * pool.block_size * pool.num_kv_heads * pool.head_dim * 2 * pool.tensor.element_size()
    result = {
        "model": args.model,
        "description": setup.describe,
        "device": device,
        "kernel": args.kernel,
        "kernel_resolved": resolved,
        "inner_compiler": args.inner_compiler,
        "parity": {"max_abs_diff": diff, "atol": PARITY_ATOL, "ok": diff <= PARITY_ATOL},
        "buckets_used": [_bucket_dict(b) for b in buckets_used],
        "buckets_configured": [_bucket_dict(b) for b in setup.buckets],
        "compiled_frames": frames,
        "recompiles_beyond_one_per_bucket": max(0, frames - len(setup.buckets)),
        "compiles_while_serving": serving_compiles,
        "attention_sites": {**status, "layers": setup.runtime.config.num_layers},
        "kv_bytes": {
            "paged_pool": pool.nbytes,
            "paged_history_blocks": history,
            "paged_scratch_and_pad": pool.nbytes - history,
            "dense_caches_peak": kv.get("peak", 0),
        },
        "size": args.size,
        "dense_compiled_frames": dense_frames,
        "time_per_forward_ms": {
            "dense_compiled": dense_timer.mean_ms(), "paged_compiled": paged_timer.mean_ms(),
            "paged_over_dense": paged_timer.mean_ms() / dense_timer.mean_ms(), "forwards": len(paged_timer.times),
            "dense_forwards": len(dense_timer.times), "compiles_while_timed": dense_compiles_timed + serving_compiles,
            "measures": f"wall time per forward over the whole loop, both paths compiled regionally with "
                        f"{args.inner_compiler} (fullgraph, static shapes) and warmed up; paged includes the runtime's "
                        f"planning, metadata and commit; {'CUDA graphs' if captured.capture else 'no CUDA graphs'}",
        },
        "warmup_s": warmup_s,
        "cuda_graphs": captured.capture,
    }
    if args.json:
        print(json.dumps(result))
    else:
        k = result["kv_bytes"]
        t = result["time_per_forward_ms"]
        sites = result["attention_sites"]
        verdict = "ok" if result["parity"]["ok"] else "FAILED"
        print(f"paged-kv demo: {setup.describe}")
        print(f"  device {device}, kernel {args.kernel} ({resolved}), inner compiler {args.inner_compiler}, "
              f"CUDA graphs {'on' if captured.capture else 'off (no GPU)'}")
        print(f"  parity: max |dense - paged| = {diff:.3g} ({verdict}, tolerance {PARITY_ATOL:g})")
        print(f"  shape buckets used: {len(buckets_used)} of {len(setup.buckets)} configured: "
              + "; ".join(format_bucket(b) for b in buckets_used))
        print(f"  compiled frames: {frames} (recompiles beyond one per bucket: "
              f"{result['recompiles_beyond_one_per_bucket']}; while serving: {serving_compiles})")
        print(f"  attention sites: {sites['rewritten']} rewritten, {sites['dense']} left dense (no KV cache), "
              f"{sites['refused']} refused; each compiled frame serves all {sites['layers']} layers")
        print(f"  KV bytes reserved: paged pool {k['paged_pool']:,} ({k['paged_history_blocks']:,} history blocks + "
              f"{k['paged_scratch_and_pad']:,} scratch/pad); dense caches at peak {k['dense_caches_peak']:,}")
        print(f"  parity oracle: the dense model run eagerly; dense compiled frames for the timing: {dense_frames} "
              "(one per cache length)")
        print(f"  time per forward, both compiled with {args.inner_compiler} and warmed up: dense {t['dense_compiled']:.2f} "
              f"ms, paged {t['paged_compiled']:.2f} ms = {t['paged_over_dense']:.2f}x dense (mean over the "
              f"{t['forwards']} forwards of the loop; paged includes planning + metadata; warm-up {warmup_s:.2f} s)")
        if args.size == "tiny":
            print("  (tiny model: fixed per-call costs dominate these times; --size mid compares at a size that means "
                  "something)")
    return 0 if result["parity"]["ok"] else 1


def cmd_warmup(args) -> int:
    import torch

    from .capture import warm_up

    device = _device(args)
    setup = _setup(args.model, args.kernel, args.inner_compiler, device)
    _check_kernel(setup, args.kernel)
    torch._dynamo.reset()
    _compile_blocks(setup, args.kernel, args.inner_compiler)
    captured = warm_up(setup.model, setup.runtime, progress=not args.quiet, install=False)
    report = captured.report
    if args.json:
        print(json.dumps({"model": args.model, "device": device, **report.as_dict()}))
    else:
        print(report.format())
    return 0


def cmd_dump(args) -> int:
    import torch

    from . import debug

    device = _device(args)
    setup = _setup(args.model, args.kernel, args.inner_compiler, device, short=True)
    _check_kernel(setup, args.kernel)
    torch._dynamo.reset()  # frames compiled earlier would not be compiled (nor dumped) again
    _compile_blocks(setup, args.kernel, args.inner_compiler)
    from .driver import PagedHooks

    with debug.dump(args.out) as session:
        setup.run_paged(PagedHooks)
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

    def common(p, *, default_kernel="reference"):
        p.add_argument("--model", choices=MODELS, default="dreamzero", help="reference model family (default dreamzero)")
        p.add_argument("--kernel", choices=KERNELS, default=default_kernel,
                       help=f"attention kernel (default {default_kernel}; auto picks the best available)")
        p.add_argument("--inner-compiler", choices=INNER_COMPILERS, default=DEFAULT_INNER_COMPILER,
                       help=f"compiler after the passes (default {DEFAULT_INNER_COMPILER}: fastest to compile on CPU)")
        p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
        p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
        p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")

    p = sub.add_parser("demo", help="dense vs paged, both compiled the same way, side by side, on a small model")
    common(p)
    p.add_argument("--size", choices=SIZES, default="mid",
                   help="model size (default mid: dim 512, 8 heads x 64, the size whose times mean something, minutes on a "
                        "2-core CPU; tiny: dim 64, quicker, but per-call costs dominate its times)")
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
