"""One GPU check: the gpu-marked tests, both families' loops captured and replayed, the GPU suite, and whole
models at real size (e2e_scale).

Run on a CUDA machine from the repository root (the project need not be installed; the tests pass the
paged_kv backend callable to torch.compile themselves, so no entry point is needed):

    PYTHONPATH=. python3 benchmarks/gpu_check.py [--out gpu_check.json]

Checks, in order, each PASS / FAIL / SKIP with its reason and figures:
  environment  torch, triton, device, which flash-attn build would run (or why none)
  gpu tests    `pytest -m gpu tests/test_gpu.py tests/test_capture.py` (TRITON_INTERPRET=0): the Triton
               kernel on the device (fp32/bf16, strided metadata), DreamZero rollouts and HunyuanImage-3
               generations compiled with Inductor + the Triton kernel (and the reference kernel's device
               path) captured as CUDA graphs and replayed against dense eager, flash-attn captured (skipped
               with the reason where no build is importable), the metadata staging buffer with a host
               that runs ahead of the stream; per-test outcome and figures
  gpu suite    benchmarks/gpu_suite.py at the real head geometries (2 layers, 5 repeats): paged vs dense,
               eager and graph replay, failing above its per-dtype tolerance
  e2e scale    benchmarks/e2e_scale.py: DreamZero-14B and HunyuanImage-3 (real attention geometry) whole
               forwards, dense vs paged captured per block and per forward (ms per chunk / prefill / step,
               ratios per repeat, host share, launches per forward, peak memory, max |paged - dense|)
Exit status 0 only when every check passed (SKIPs with a reason are allowed); 1 on any failure or a
check that did not finish. One JSON with everything goes to --out (default $OUT/gpu_check.json when $OUT
is set, else gpu_check.json; a dry run's goes to a temporary folder). Budget (about 8 minutes on one H200): the tests get --tests-timeout seconds
(default 270), the suite and e2e_scale run after.

    python3 benchmarks/gpu_check.py --dry-run   # on a CPU: the same checks, tiny (see tests/test_gpu.py,
                                                # tests/test_e2e_scale.py)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._out import report_path  # noqa: E402  (after the path: the project need not be installed)

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
GPU_TEST_FILES = ("tests/test_gpu.py", "tests/test_capture.py")


def check_environment(dry: bool) -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as e:
        info["triton"] = f"not importable: {e}"
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        info["torch_cuda"] = torch.version.cuda
    from paged_kv_compile.ops import flash_attn as fa

    info["flash_attn_block_16"] = fa.describe(16)
    info["flash_attn_block_256"] = fa.describe(256)
    import paged_kv_compile  # noqa: F401  (the package imports and registers its ops on this torch)

    ok = dry or (torch.cuda.is_available() and not info["triton"].startswith("not importable"))
    why = "" if ok else "needs CUDA and triton (or --dry-run)"
    return {"status": PASS if ok else FAIL, "detail": why, "figures": info}


def _junit_cases(path: Path) -> list[dict]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        outcome, why = PASS, ""
        for tag, status in (("failure", FAIL), ("error", FAIL), ("skipped", SKIP)):
            node = case.find(tag)
            if node is not None:
                outcome, why = status, (node.get("message") or "")[:400]
                break
        cases.append({"test": name, "status": outcome, "detail": why, "seconds": float(case.get("time", 0))})
    return cases


def check_gpu_tests(dry: bool, work: Path, timeout: float) -> dict:
    figures_path, junit = work / "gpu_figures.jsonl", work / "gpu_tests.xml"
    for p in (figures_path, junit):
        p.unlink(missing_ok=True)
    env = dict(os.environ, PAGED_KV_GPU_FIGURES=str(figures_path), PYTHONPATH=str(ROOT))
    if dry:
        env.update(PAGED_KV_GPU_DRY_RUN="1", TRITON_INTERPRET="1")
    else:
        env["TRITON_INTERPRET"] = "0"  # compiled Triton on the GPU (tests/conftest.py only sets a default)
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rs",
           f"--junitxml={junit}", *GPU_TEST_FILES]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = None, f"timed out after {timeout:.0f} s\n" + ((e.stdout or b"")[-3000:].decode(errors="replace")
                                                              if isinstance(e.stdout, bytes) else str(e.stdout or ""))
    seconds = round(time.perf_counter() - t0, 1)
    cases = _junit_cases(junit) if junit.exists() else []
    figures = [json.loads(line) for line in figures_path.read_text().splitlines()] if figures_path.exists() else []
    failed = [c["test"] for c in cases if c["status"] == FAIL]
    passed = [c["test"] for c in cases if c["status"] == PASS]
    if rc is None:
        status, detail = FAIL, f"pytest did not finish within {timeout:.0f} s"
    elif rc != 0 or failed:
        status, detail = FAIL, f"pytest exit {rc}; failed: {failed or 'see output'}"
    elif not passed:
        status, detail = FAIL, "no gpu test ran (all skipped?)"
    else:
        status, detail = PASS, f"{len(passed)} passed, {sum(c['status'] == SKIP for c in cases)} skipped"
    return {"status": status, "detail": detail, "seconds": seconds, "command": " ".join(cmd), "tests": cases,
            "figures": figures, "output_tail": tail if status == FAIL else tail[-800:]}


def _run_benchmark(main: Callable[[list[str]], int], argv: list[str], out: Path) -> tuple[int | None, str, float, dict]:
    """(exit code or None, the exception it raised, seconds, its JSON report) of one benchmark's `main`."""
    t0 = time.perf_counter()
    try:
        rc, error = main([*argv, "--out", str(out)]), ""
    except Exception as e:  # noqa: BLE001 - reported as this check's failure
        rc, error = None, f"{type(e).__name__}: {e}"
    seconds = round(time.perf_counter() - t0, 1)
    return rc, error, seconds, json.loads(out.read_text()) if out.exists() else {}


def check_gpu_suite(dry: bool, work: Path) -> dict:
    import torch

    from benchmarks import gpu_suite
    from paged_kv_compile.ops import flash_attn as fa

    capability = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else None

    out = work / "gpu_suite.json"
    if dry:
        argv = ["--dry-run", "--layers", "1", "--repeats", "1"]
    else:
        argv = ["--layers", "2", "--repeats", "5"]
        if isinstance(fa.select(16, capability=capability), str):  # the suite's block size; none: reference, triton
            argv += ["--kernels", "reference,triton"]
    rc, error, seconds, report = _run_benchmark(gpu_suite.main, argv, out)
    variants = [{"case": c["case"], "variant": name, "max_abs_diff_vs_dense": v.get("max_abs_diff_vs_dense"),
                 "rel_diff_vs_dense": v.get("rel_diff_vs_dense"), "eager_ms": v.get("eager_ms"),
                 "graph_ms": v.get("graph_ms")}
                for c in report.get("cases", []) for name, v in c.get("variants", {}).items()]
    status = PASS if rc == 0 else FAIL
    detail = error or ("" if rc == 0 else f"gpu_suite exit {rc}: mismatches or errors, see report")
    picked = fa.select(16, capability=capability)
    flash_note = "" if not isinstance(picked, str) else f"flash_attn not run: {picked}"
    return {"status": status, "detail": detail or flash_note, "seconds": seconds, "argv": argv,
            "variants": variants, "report": report}


def check_e2e(dry: bool, work: Path) -> dict:
    """benchmarks/e2e_scale.py (its dry run on a CPU); PASS when it exits 0 (parity and launch counts held)."""
    from benchmarks import e2e_scale

    out = work / "e2e_scale.json"
    out.unlink(missing_ok=True)
    argv = ["--dry-run"] if dry else []
    rc, error, seconds, report = _run_benchmark(e2e_scale.main, argv, out)
    problems = [p for fam in report.get("families", {}).values() for p in fam.get("problems", [])]
    status = PASS if rc == 0 else FAIL
    detail = error or ("; ".join(problems) if problems else "" if rc == 0 else f"e2e_scale exit {rc}")
    return {"status": status, "detail": detail, "seconds": seconds, "argv": argv,
            "rows": e2e_scale.table_rows(report) if report else [], "report": report}


def _print_summary(result: dict) -> None:
    print(f"\ngpu_check on {result['checks']['environment']['figures'].get('device', 'cpu')}"
          f"{' (DRY RUN)' if result['dry_run'] else ''}, {result['seconds']} s")
    for name, check in result["checks"].items():
        print(f"  {check['status']:4}  {name:12} {check.get('detail', '')}")
        for case in check.get("tests", []):
            why = f"  ({case['detail'][:120]})" if case["status"] != PASS and case["detail"] else ""
            print(f"          {case['status']:4}  {case['test']}{why}")
        for fig in check.get("figures", []) if name == "gpu tests" else []:
            keys = {k: v for k, v in fig.items() if k not in ("test", "device")}
            print(f"          figures  {fig['test']}: {json.dumps(keys)}")
        for v in check.get("variants", []):
            if v["variant"].startswith("paged"):
                print(f"          {v['case']:24} {v['variant']:18} max|diff| {v['max_abs_diff_vs_dense']:.2e}  "
                      f"rel {v['rel_diff_vs_dense']:.2e}  eager {v['eager_ms']} ms  graph {v['graph_ms']} ms")
        for row in check.get("rows", []):
            print(f"          {row['family']:9} {row['variant']:13} {row['kind']:7} {row['ms']:>9} ms  "
                  f"/ dense {row['ratio']:24} host {row['host']} ms ({row['share']})  launches {row['launches']}")
    print(f"overall: {result['status']}   JSON: {result['out']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="run the same checks on a CPU, tiny")
    parser.add_argument("--out", default=None, help="JSON report (default $OUT/gpu_check.json or gpu_check.json; a dry run: a temporary folder)")
    parser.add_argument("--tests-timeout", type=float, default=270.0, help="seconds for the gpu tests")
    parser.add_argument("--skip-tests", action="store_true", help="leave out the gpu tests")
    parser.add_argument("--skip-suite", action="store_true", help="leave out the GPU suite")
    parser.add_argument("--skip-e2e", action="store_true", help="leave out e2e_scale")
    args = parser.parse_args(argv)
    out = report_path("gpu_check", args.dry_run, args.out)
    work = out.parent
    t0 = time.perf_counter()
    checks = {"environment": check_environment(args.dry_run)}
    if checks["environment"]["status"] == PASS:
        if not args.skip_tests:
            checks["gpu tests"] = check_gpu_tests(args.dry_run, work, args.tests_timeout)
        if not args.skip_suite:
            checks["gpu suite"] = check_gpu_suite(args.dry_run, work)
        if not args.skip_e2e:
            checks["e2e scale"] = check_e2e(args.dry_run, work)
    failed = [name for name, c in checks.items() if c["status"] == FAIL]
    result = {"benchmark": "gpu_check", "dry_run": args.dry_run, "status": FAIL if failed else PASS,
              "failed": failed, "seconds": round(time.perf_counter() - t0, 1), "out": str(out), "checks": checks}
    out.write_text(json.dumps(result, indent=1, default=str))
    _print_summary(result)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
