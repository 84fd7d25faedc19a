"""The benchmarks run (quick modes) and report what they promise; no timing thresholds anywhere.

Each CPU benchmark's `main(["--quick", "--json"])` runs once (module fixture); the docs generator, the
GPU suite's dry run and its refusal paths are checked on top of those results.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import compile_cost, forward_time, gpu_check, gpu_suite, memory, metadata_cost, run_all  # noqa: E402
from benchmarks._common import summarize  # noqa: E402
from benchmarks._models import DZ_TINY  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick():
    """Every CPU benchmark in quick mode, once, gathered as run_all gathers them."""
    import io
    from contextlib import redirect_stdout

    out = {"quick": True}
    for name, module, argv in (
        ("forward_time", forward_time, ["--quick", "--json"]),
        ("compile_cost", compile_cost, ["--quick", "--json"]),
        ("memory", memory, ["--quick", "--json"]),
    ):
        buf = io.StringIO()
        with redirect_stdout(buf):
            assert module.main(argv) == 0
        out[name] = json.loads(buf.getvalue().strip().splitlines()[-1])
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert metadata_cost.main(["--repeats", "2", "--json"]) == 0
    out["metadata_cost"] = {"benchmark": "metadata_cost", "repeats": 2,
                            "rows": json.loads(buf.getvalue().strip().splitlines()[-1])}
    return out


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_ratio(r: dict) -> None:
    assert set(r) >= {"median", "min", "max", "q1", "q3", "n"}
    for key in ("median", "min", "max", "q1", "q3"):
        assert _finite_positive(r[key]), r
    assert r["min"] <= r["q1"] <= r["median"] <= r["q3"] <= r["max"]


def test_forward_time_quick(quick):
    ft = quick["forward_time"]
    assert ft["settings"]["quick"] and ft["settings"]["inner_compiler"] == "aot_eager"
    assert {"cpu_count", "torch", "torch_threads", "loadavg_1_5_15"} <= set(ft["machine"])
    rows = ft["rows"]
    dz = [r for r in rows if r["family"] == "dreamzero"]
    hy = [r for r in rows if r["family"] == "hunyuan_image3"]
    assert [(r["forward"], r["fill"]) for r in dz] == [("denoise", "chunk 1"), ("denoise", "full window"),
                                                       ("commit", "full window")]
    assert [r["forward"] for r in hy] == ["prefill", "step"]
    for r in rows:
        _check_ratio(r["ratio"])
        assert _finite_positive(r["paged_ms"]) and _finite_positive(r["dense_ms"])
        if r["max_abs_diff"] is not None:  # both paths computed the same forward
            assert r["max_abs_diff"] <= 1e-4
    # Paged compiles once for every fill level; dense once per cache length it saw.
    assert all(r["graphs_paged"] == 1 for r in dz)
    assert all(r["graphs_dense"] == 2 for r in dz)
    assert [r["fill_fraction"] for r in dz[:2]] == [0.25, 1.0]
    assert forward_time.table_rows(ft)  # the table renders
    attention = ft["attention_rows"]  # the same forwards' attention alone
    assert [r["attention"] for r in attention] == ["dreamzero chunk 1", "dreamzero full window", "hunyuan prefill",
                                                   "hunyuan step"]
    for r in attention:
        _check_ratio(r["ratio"])
        assert r["max_abs_diff"] <= 1e-4
    assert forward_time.attention_table_rows(ft)


def test_compile_cost_quick(quick):
    cc = quick["compile_cost"]
    rows = cc["rows"]
    assert {(r["family"], r["layers"], r["path"]) for r in rows} == {
        (f, n, p) for f in ("dreamzero", "hunyuan_image3") for n in (2, 4) for p in ("dense", "paged")}
    lengths = compile_cost.dense_cache_lengths(DZ_TINY)
    for r in rows:
        assert r["recompiles_when_warm"] == 0
        assert r["cold_run_s"] > 0 and r["warm_run_s"] > 0 and r["backend_s"] >= 0
        if r["family"] == "dreamzero":
            assert r["graphs"] == (1 if r["path"] == "paged" else len(lengths))
        else:
            assert r["graphs"] == 2
    real = cc["dreamzero_14b"]
    assert real["dense_graphs_per_cycle"] == len(real["dense_cache_lengths_frames"]) > 1
    assert real["paged_graphs"] == 1


def test_memory_quick(quick):
    mem = quick["memory"]
    meas = mem["measured"]
    for path in ("dense", "paged"):
        p = meas["paths"][path]
        for key in ("kv_reserved_bytes", "kv_held_peak_bytes", "alloc_peak_during_run_bytes",
                    "peak_incl_reserved_bytes"):
            assert _finite_positive(p[key]), (path, key)
        # the measured bytes are what the arithmetic predicts
        assert p["kv_held_peak_bytes"] == meas[f"predicted_{path}_held_bytes"]
    assert set(meas["paths"]["paged"]["reserved_parts"]) == {"pool", "writable_standins", "metadata_buffers"}
    real = mem["real"]
    assert all(r["paged_runs_all"] for r in real["dreamzero"]["rows"] + real["hunyuan"]["rows"])
    assert set(real["fit"]) == {"dreamzero_dense_held", "dreamzero_dense_peak", "dreamzero_paged",
                                "hunyuan_dense", "hunyuan_paged"}
    sweep = real["sweep"]
    assert all(len(v) == len(sweep["budget_gib"]) for v in sweep.values())
    for key in ("dreamzero_paged", "hunyuan_paged", "hunyuan_dense"):
        assert sweep[key] == sorted(sweep[key])  # more budget never fits fewer
    assert memory.measured_rows(mem) and all(memory.real_rows(mem))


def test_dense_dreamzero_arithmetic():
    cyc = memory.dreamzero_dense_cycle(DZ_TINY)  # window 8 frames of 16 tokens, chunk 2 frames
    assert cyc == {"held_tokens_per_row": 128, "peak_tokens_per_row": 256}
    assert memory.dense_fit(100, 30) == 3 and memory.dense_fit(100, 30, 60) == 2 and memory.dense_fit(50, 30, 60) == 0


def test_metadata_cost_rows(quick):
    rows = quick["metadata_cost"]["rows"]
    assert {r["model"] for r in rows} == {"DreamZero-14B", "HunyuanImage-3"}
    assert all(r["h2d_copies_per_forward"] <= 1 for r in rows)


def test_run_all_regenerates_docs(quick, tmp_path):
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps(quick))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.md").write_text(f"# Benchmarks\n\nprose before\n\n{run_all.BEGIN}\nstale\n{run_all.END}\n\n"
                                        "prose after\n")
    assert run_all.main(["--from-json", str(saved), "--docs", str(docs)]) == 0
    text = (docs / "benchmarks.md").read_text()
    assert "prose before" in text and "prose after" in text and "stale" not in text
    assert text.count(run_all.BEGIN) == 1 and text.count(run_all.END) == 1
    for png in ("bench_forward_ratio.png", "bench_capacity.png"):
        assert f"]({png})" in text
        assert (docs / png).read_bytes()[:8] == PNG_MAGIC
    assert "paged/dense median" in text and "HunyuanImage-3" in text and "attention (all layers)" in text


def test_run_all_runs_benchmarks(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert run_all.main(["--quick", "--only", "metadata_cost", "--no-docs", "--json-out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["metadata_cost"]["rows"] and data["machine_start"]["cpu_count"]


def test_gpu_suite_dry_run(tmp_path, capsys):
    import torch

    out = tmp_path / "gpu.json"
    assert gpu_suite.main(["--dry-run", "--layers", "1", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["dry_run"] and report["device"] == "cpu"
    expected = ["reference"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    assert report["kernels"] == {"dreamzero": expected, "hunyuan": expected}
    names = [c["case"] for c in report["cases"]]
    assert names == ["dreamzero chunk 1", "dreamzero half window", "dreamzero full window", "hunyuan prefill",
                     "hunyuan step"]
    for case in report["cases"]:
        assert not case["errors"]
        want = {"dense"} | {f"paged:{k}" for k in expected} | ({"dense+stack"} if case["family"] == "dreamzero"
                                                              else set())
        assert set(case["variants"]) == want
        assert not case["mismatches"] and case["tolerance_rel"] == gpu_suite.TOLERANCE[torch.float32]
        for name, v in case["variants"].items():
            assert v["max_abs_diff_vs_dense"] <= 1e-4, (case["case"], name)
            assert _finite_positive(v["eager_ms"]) and _finite_positive(v["graph_ms"])
            _check_ratio(v["eager_ratio_vs_dense_eager"])
            assert v["transient_peak_bytes"] >= 0 and v["memory_source"]
    assert "DRY RUN" in capsys.readouterr().out


def test_gpu_suite_fails_a_kernel_that_is_off_by_more_than_the_tolerance(tmp_path, capsys, monkeypatch):
    """A paged kernel whose output is 5% off (every value scaled): the suite must exit 1 and name it."""
    from paged_kv_compile.ops import reference

    exact = reference.attend
    monkeypatch.setattr(reference, "attend", lambda *a, **k: exact(*a, **k) * 1.05)
    out = tmp_path / "gpu.json"
    rc = gpu_suite.main(["--dry-run", "--families", "hunyuan", "--kernels", "reference", "--layers", "1",
                         "--repeats", "1", "--out", str(out)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "paged output differs from dense" in err and "hunyuan step / paged:reference" in err
    report = json.loads(out.read_text())
    for case in report["cases"]:
        assert case["mismatches"] and case["variants"]["paged:reference"]["rel_diff_vs_dense"] > 1e-2


def test_gpu_suite_refuses_unavailable_kernels(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    rc = gpu_suite.main(["--dry-run", "--kernels", "reference,flash_attn", "--out", str(out)])
    assert rc == gpu_suite.EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert "kernel 'flash_attn' is unavailable" in err and "--kernels" in err
    assert not out.exists()  # nothing ran


def test_gpu_suite_needs_cuda_without_dry_run(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the real suite would run")
    assert gpu_suite.main([]) == gpu_suite.EXIT_UNAVAILABLE
    assert "--dry-run" in capsys.readouterr().err


def test_summarize():
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 4.0 and s["q1"] <= s["median"] <= s["q3"]
    assert summarize([2.0])["q1"] == 2.0


def test_gpu_check_dry_run(tmp_path, capsys):
    """The one GPU script runs its gpu-marked tests on a CPU (tiny, PAGED_KV_GPU_DRY_RUN) and reports them."""
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--skip-suite", "--skip-e2e", "--out", str(out)]) == 0  # e2e: test_e2e_scale
    report = json.loads(out.read_text())
    assert report["dry_run"] and report["status"] == "PASS" and not report["failed"]
    tests = report["checks"]["gpu tests"]
    passed = [c["test"] for c in tests["tests"] if c["status"] == "PASS"]
    assert any("captured_rollout" in t for t in passed) and any("triton_kernel" in t for t in passed)
    assert all(c["status"] == "PASS" or c["detail"] for c in tests["tests"]), "a skip must say why"
    fp32 = [f for f in tests["figures"] if "bfloat16" not in f["test"]]
    assert fp32 and all(f["max_abs_diff_vs_dense"] <= 1e-5 for f in fp32)
    assert "overall: PASS" in capsys.readouterr().out


def test_dry_runs_write_nowhere_in_the_working_directory(tmp_path, monkeypatch, capsys):
    """Without --out a dry run's JSON goes to a fresh temporary folder (CI runs dry runs from the repository
    root); a real run keeps writing `$OUT/<name>.json` or `<name>.json`."""
    from benchmarks._out import report_path

    work = tmp_path / "repo"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("OUT", raising=False)
    assert gpu_check.main(["--dry-run", "--skip-tests", "--skip-suite", "--skip-e2e"]) == 0
    assert list(work.iterdir()) == [], "a dry run wrote into the working directory"
    written = Path(capsys.readouterr().out.split("JSON: ")[-1].strip())
    assert written.name == "gpu_check_dry_run.json" and json.loads(written.read_text())["dry_run"]
    for name in ("gpu_check", "gpu_suite", "e2e_scale"):
        assert report_path(name, True, None).parent.parent != work
        assert report_path(name, False, None) == Path(f"{name}.json")
        assert report_path(name, True, str(work / "x.json")) == work / "x.json"
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert report_path("gpu_suite", False, None) == tmp_path / "out" / "gpu_suite.json"


def test_op_overhead_times_the_three_call_paths():
    """`forward_time --op-overhead`: the op through the lean dispatch, through custom_op's layers, and the
    kernel function alone; structure only, never a timing."""
    result = forward_time.op_overhead(repeats=2, calls=3)
    assert set(result) == {"op (lean dispatch)", "op (custom_op layers)", "kernel function alone"}
    assert all(r["min_us"] > 0 and r["median_us"] >= r["min_us"] for r in result.values())
