"""The `paged-kv` command, in-process through main([...]); one subprocess test for the console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from paged_kv_compile import __version__, cli

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version_and_help(capsys):
    code, out, _ = _run(capsys, "--version")
    assert code == 0 and out.strip() == f"paged-kv {__version__}"
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    for command in ("demo", "warmup", "dump", "bench"):
        assert command in out
    code, out, _ = _run(capsys, "demo", "--help")
    assert code == 0 and "--inner-compiler" in out and "hunyuan-image3" in out


def test_demo_dreamzero_json(capsys):
    code, out, err = _run(capsys, "demo", "--json", "--quiet", "--size", "tiny")
    assert code == 0, err
    report = json.loads(out)
    assert report["model"] == "dreamzero" and report["inner_compiler"] == "aot_eager" and report["size"] == "tiny"
    assert report["parity"]["ok"] and report["parity"]["max_abs_diff"] <= 1e-5
    assert report["buckets_used"] == [{"rows": 2, "tokens": 37, "context": 96}]
    assert report["compiled_frames"] == 1 and report["recompiles_beyond_one_per_bucket"] == 0
    assert report["compiles_while_serving"] == 0
    assert report["attention_sites"]["rewritten"] == 1 and report["attention_sites"]["refused"] == 0
    kv = report["kv_bytes"]
    assert kv["paged_pool"] == kv["paged_history_blocks"] + kv["paged_scratch_and_pad"]
    assert kv["dense_caches_peak"] == 4 * 2 * 2 * 96 * 4 * 16 * 4  # layers x K,V x rows x window x H x D x fp32
    t = report["time_per_forward_ms"]
    assert t["dense_compiled"] > 0 and t["paged_compiled"] > 0 and t["forwards"] == t["dense_forwards"] == 38
    # like with like: the timed dense loop ran compiled (one frame per cache length: 0, 32, 64, 96 tokens), with the
    # paged path's inner compiler, and neither path compiled while it was timed
    assert report["dense_compiled_frames"] == 4 and t["compiles_while_timed"] == 0
    assert "both paths compiled regionally with aot_eager" in t["measures"]


def test_demo_hunyuan_text(capsys):
    code, out, err = _run(capsys, "demo", "--model", "hunyuan-image3", "--quiet", "--size", "tiny")
    assert code == 0, err
    assert "parity: max |dense - paged|" in out and "(ok," in out
    assert "shape buckets used: 4 of 4" in out
    assert "compiled frames: 4 (recompiles beyond one per bucket: 0; while serving: 0)" in out
    assert "KV bytes reserved: paged pool" in out
    assert "time per forward, both compiled with aot_eager and warmed up: dense" in out and "x dense" in out
    assert "fixed per-call costs dominate" in out, "a tiny run says its times are not the comparison"


def test_demo_times_a_mid_size_model_by_default():
    args = cli.build_parser().parse_args(["demo"])
    assert args.size == "mid"
    setup = cli._setup("dreamzero", "reference", "aot_eager", "cpu", short=True, size=args.size)
    assert setup.model.cfg.dim == 512 and setup.dense_model.cfg == setup.model.cfg


def test_demo_exits_nonzero_when_parity_fails(capsys, monkeypatch):
    setup = cli._setup

    def broken(*args, **kwargs):
        s = setup(*args, **{**kwargs, "short": True})
        s.compare = lambda dense, paged: 1.0
        return s

    monkeypatch.setattr(cli, "_setup", broken)
    code, out, _ = _run(capsys, "demo", "--quiet", "--size", "tiny")
    assert code == 1 and "FAILED" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--model", "gpt"], "argument --model: invalid choice: 'gpt'"),
        (["demo", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["dump"], "the following arguments are required: --out"),
        (["demo", "--kernel", "flash_attn"], "flash"),
        (["demo", "--kernel", "npu"], "npu"),
    ],
)
def test_user_mistakes_are_one_line_with_status_2(capsys, argv, message):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and not out
    assert err.startswith("paged-kv: error: ") and message.lower() in err.lower()
    assert err.count("\n") == 1 and "Traceback" not in err


def test_warmup_prints_per_bucket_compile_times(capsys):
    code, out, err = _run(capsys, "warmup", "--model", "hunyuan-image3", "--json", "--quiet")
    assert code == 0, err
    report = json.loads(out)
    assert len(report["buckets"]) == 4 and not report["captured"]
    assert all(b["compile_s"] > 0 and b["graphs_compiled"] == 1 for b in report["buckets"])
    code, out, err = _run(capsys, "warmup")
    assert code == 0 and "rows=2 tokens=37 context=96: compile" in out
    assert "compiling rows=2 tokens=37 context=96" in err  # the progress bar names the bucket


def test_dump_lists_the_files(capsys, tmp_path):
    code, out, err = _run(capsys, "dump", "--out", str(tmp_path / "d"), "--json", "--quiet")
    assert code == 0, err
    report = json.loads(out)
    assert report["graphs"] == 1
    assert any(f.endswith(".before.py") for f in report["pass_files"])
    assert any(f.startswith("full_code_for_forward") for f in report["depyf_files"])
    assert sorted(report["files"]) == sorted(os.listdir(tmp_path / "d"))
    code, out, _ = _run(capsys, "dump", "--out", str(tmp_path / "e"), "--model", "hunyuan-image3")
    assert code == 0 and "paged_kv_summary.json" in out and "rewritten graph(s)" in out


def test_bench_without_scripts_says_so(capsys, tmp_path):
    code, out, err = _run(capsys, "bench", "--dir", str(tmp_path))
    assert code == 2 and not out
    assert err.count("\n") == 1 and "no benchmark scripts" in err


def test_bench_discovers_and_runs_main(capfd, tmp_path):
    """Each benchmark runs as `<folder>.<name>` imported from the folder's parent (no sys.path edits)."""
    (tmp_path / "alpha.py").write_text(
        "import sys\n"
        "def main(argv):\n"
        "    print('alpha', argv)\n"
        "    return 0\n"
    )
    (tmp_path / "beta.py").write_text("def main(argv):\n    print('beta')\n    return 3\n")
    (tmp_path / "_helper.py").write_text("def main(argv):\n    raise SystemExit('not a benchmark')\n")
    (tmp_path / "notes.py").write_text("X = 1\n")  # no main(argv): not a benchmark
    (tmp_path / "gamma.py").write_text("from . import alpha\ndef main(argv):\n    print(alpha.__name__)\n")
    code, out, _ = _run(capfd, "bench", "--dir", str(tmp_path), "--list")
    assert code == 0 and [line.split("\t")[0] for line in out.splitlines()] == ["alpha", "beta", "gamma"]
    code, out, _ = _run(capfd, "bench", "--dir", str(tmp_path), "alpha", "--", "--rows", "2")
    assert code == 0 and "alpha ['--rows', '2']" in out
    code, out, _ = _run(capfd, "bench", "--dir", str(tmp_path), "gamma")  # imported as a package module
    assert code == 0 and out.strip() == f"{tmp_path.name}.alpha"
    code, out, _ = _run(capfd, "bench", "--dir", str(tmp_path))  # every benchmark found
    assert code == 3 and "== alpha" in out and "beta" in out
    code, _, err = _run(capfd, "bench", "--dir", str(tmp_path), "delta")
    assert code == 2 and "unknown benchmark" in err


def test_console_script_entry_point():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["paged-kv"] == "paged_kv_compile.cli:main"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    installed = shutil.which("paged-kv")
    cmd = [installed] if installed else [sys.executable, "-m", "paged_kv_compile.cli"]
    done = subprocess.run(cmd + ["--version"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"paged-kv {__version__}", done.stderr
    done = subprocess.run(cmd + ["demo", "--kernel", "flash_attn"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("paged-kv: error:")
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1
