"""The `paged-kv` command, in-process through main([...]); one subprocess test for the console script."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from paged_kv_compile import __version__, cli, demo, families
from toy_decoder import TOY_DECODER

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


def test_model_choices_come_from_the_registry(monkeypatch):
    """The families with a demo scene, spelled with '-': a registered family appears once its `demo` has one."""
    built_in = [f.name.replace("_", "-") for f in families.FAMILIES]
    assert built_in == ["dreamzero", "hunyuan-image3", "conditioning-prefix"]
    assert cli.model_choices() == ["dreamzero", "hunyuan-image3"]  # conditioning-prefix drives models' own loops
    toy = families.register(TOY_DECODER)
    try:
        assert "toy-decoder" not in cli.model_choices()  # Family.demo's default: no scene
        monkeypatch.setattr(type(toy), "demo", lambda self, size, **kw: object())
        assert cli.model_choices()[-1] == "toy-decoder"
        assert cli.build_parser().parse_args(["demo", "--model", "toy-decoder"]).model == "toy-decoder"
        assert cli.build_parser().parse_args(["demo"]).model == "dreamzero"  # the first registered: the default
    finally:
        families.unregister(toy.name)


def test_demo_defaults_to_the_mid_size_model_with_inductor():
    args = cli.build_parser().parse_args(["demo"])
    assert args.size == "mid" and args.inner_compiler == "inductor"
    demo = families.get(args.model).demo(args.size, short=True, device="cpu")
    assert demo.make_model().cfg.dim == 512
    assert cli.build_parser().parse_args(["warmup"]).inner_compiler == "aot_eager"


def _tiny_bytes_per_frame_row() -> int:
    """DreamZero tiny: one frame (16 tokens) of one row, K and V, 4 heads x 16, fp32, 4 layers."""
    return 16 * 2 * 4 * 16 * 4 * 4


def test_demo_dreamzero_json(capsys):
    threads = torch.get_num_threads()
    code, out, err = _run(capsys, "demo", "--json", "--quiet", "--size", "tiny", "--inner-compiler", "aot_eager",
                          "--threads", "1")
    assert code == 0, err
    r = json.loads(out)
    assert r["model"] == "dreamzero" and r["inner_compiler"] == "aot_eager" and r["info"]["size"] == "tiny"
    assert r["threads"] == 1 and torch.get_num_threads() == threads  # set for the demo, restored after
    assert r["parity"]["ok"] and r["parity"]["max_abs_diff"] <= 1e-5 and "10 chunks x 3" in r["parity"]["loops"]
    assert r["parity"]["atol"] == demo.parity_bound(r["parity"]["compile_drift"]) == 1e-5  # aot_eager moves nothing
    owners = {o["owner_id"]: o for o in r["scene"]["owners"]}
    assert list(owners) == ["new", "half", "full", "full/0", "full/1", "full/2", "full/3"]
    assert r["scene"]["parity_ok"] and all(o["max_abs_diff"] <= 1e-5 for o in owners.values())
    assert [o["forwards"] for o in owners.values()] == [3, 7, 19, 4, 4, 4, 4]  # a fork: 1 commit + 3 denoising steps
    # bytes, measured: frames x rows x bytes per frame and row (window 6 frames, sink 2, chunk 2)
    f = _tiny_bytes_per_frame_row()
    assert [o["paged_bytes"] for o in owners.values()] == [0, 2 * 2 * f, 4 * 2 * f] + [4 * 2 * f] * 4
    assert [o["paged_shared_bytes"] for o in owners.values()] == [0, 0, 2 * 2 * f] + [2 * 2 * f] * 4  # the sink
    assert [o["dense_bytes"] for o in owners.values()] == [0, 2 * 2 * f, 6 * 2 * f] + [6 * 2 * f] * 4
    kv = r["kv_bytes"]
    assert kv["paged_held"] == (2 + 4 + 4 * 2) * 2 * f and kv["dense_held"] == (2 + 6 + 4 * 6) * 2 * f
    assert kv["paged_pool"] > kv["paged_held"]
    fork = r["scene"]["fork"]
    assert fork["blocks_taken"] == 0 and fork["kv_bytes_copied"] == 0 and fork["forks"] == 4 and fork["rows"] == 8
    free, total = r["scene"]["blocks_free_after"]
    # every block back; the pool: 3 sessions x 2 rows x 12 blocks (6 frames of 2 blocks), 4 candidates with a one-
    # commit budget x 2 rows x 4 blocks, and the 16 blocks of the forked session's history its forks keep
    assert free == total == 3 * 2 * 12 + 4 * 2 * 4 + 16
    # frames: paged one per bucket (rows 2 and 8), none while serving; dense one per cache length (0, 32, 64, 96
    # tokens) at 2 rows and one for the 8 rows of the forks
    frames = r["compiled_frames"]
    assert frames["paged"] == len(frames["buckets"]) == 2 and frames["paged_while_serving"] == 0
    assert frames["dense"] == 5
    assert r["compile_s"]["paged"] > 0 and r["compile_s"]["dense"] > 0
    times = {t["rows"]: t for t in r["time_per_forward"]}
    assert set(times) == {2, 8} and all(t["dense_ms"] > 0 and t["paged_ms"] > 0 for t in times.values())
    assert times[2]["forwards"] + times[8]["forwards"] == r["forwards"] - frames["dense"]  # compiling ones left out
    assert r["attention_sites"]["rewritten"] == 2 and r["attention_sites"]["refused"] == 0


def test_demo_hunyuan_text(capsys):
    code, out, err = _run(capsys, "demo", "--model", "hunyuan-image3", "--quiet", "--size", "tiny",
                          "--inner-compiler", "aot_eager")
    assert code == 0, err
    assert ("parity oracle, dense eager vs paged: 2 request(s) of [1, 2] row(s), 4 steps each: max |dense - paged| = "
            in out)
    table = {line.split()[0]: line for line in out.splitlines()
             if line.startswith("  ") and line.split()[0] in ("short", "cfg", "long")}
    assert "2 CFG rows, prompts 11 + 4 tokens: 2 of 4 steps done" in table["cfg"] and "(ok)" in table["cfg"]
    # 1 KiB per token (2 KV heads x 16, K and V, fp32, 4 layers); capacity 12, blocks of 4: the 3-token prompt holds
    # one block paged, the whole padded capacity dense
    assert re.search(r" 4\.0 KiB +12\.0 KiB ", table["short"]), table["short"]
    assert "compiled frames: paged 4 (one per bucket" in out and "0 while serving" in out
    # the 2-row request's two forwards each compiled a dense frame (prefill, step): no time to compare, said so
    assert "  rows 2: none to compare (each of these forwards compiled a dense frame)" in out
    assert "aot_eager compile: paged" in out and "time per forward, both compiled with aot_eager" in out
    assert "dense: each request's prefix caches, preallocated" in out
    assert "fixed per-call costs dominate" in out, "a tiny run says its times are not the comparison"
    assert "blocks free again once every owner is released: 18 of 18" in out


def test_demo_exits_nonzero_when_a_scene_owner_disagrees(capsys, monkeypatch):
    build = demo.build

    def broken(*args, **kwargs):
        setup = build(*args, **{**kwargs, "short": True})
        setup.demo.lanes, setup.demo.forks = setup.demo.lanes[:1], None
        setup.demo.compare_rows = lambda dense, paged: torch.ones(dense[0].shape[0])
        return setup

    monkeypatch.setattr(demo, "build", broken)
    code, out, _ = _run(capsys, "demo", "--quiet", "--size", "tiny", "--inner-compiler", "aot_eager")
    assert code == 1 and "1 (FAILED)" in out


def test_the_parity_bound_is_what_compiling_moved_times_a_factor_floored_and_capped():
    assert demo.parity_bound(0.0) == demo.PARITY_ATOL == 1e-5  # aot_eager: dense compiled is dense eager
    assert demo.parity_bound(9.8e-6) == pytest.approx(demo.DRIFT_FACTOR * 9.8e-6)  # Inductor's fp32 reordering
    assert demo.parity_bound(1.0) == demo.PARITY_CEILING == 1e-4  # a broken dense compile cannot loosen it more


def test_demo_fails_on_an_error_planted_in_the_paged_attention(capsys, monkeypatch):
    """The reference kernel's output moved by 1e-3 (a real error: far above the bound): the demo says FAILED and
    exits 1; the dense sides never run the op, so the drift that sets the bound stays what compiling moved."""
    from paged_kv_compile.ops import reference

    build, attend = demo.build, reference.attend

    def short(*args, **kwargs):
        setup = build(*args, **{**kwargs, "short": True})
        setup.demo.lanes, setup.demo.forks = setup.demo.lanes[:1], None
        return setup

    monkeypatch.setattr(demo, "build", short)
    monkeypatch.setattr(reference, "attend", lambda *a, **k: attend(*a, **k) + 1e-3)
    code, out, _ = _run(capsys, "demo", "--json", "--quiet", "--size", "tiny", "--inner-compiler", "aot_eager")
    r = json.loads(out)
    assert code == 1 and not r["parity"]["ok"] and not r["scene"]["parity_ok"]
    assert r["parity"]["max_abs_diff"] > r["parity"]["atol"] == 1e-5 and r["parity"]["compile_drift"] == 0.0


def test_the_verdict_needs_the_loops_and_every_owner():
    report = {"parity": {"ok": True}, "scene": {"parity_ok": True}}
    assert demo.ok(report)
    assert not demo.ok({**report, "parity": {"ok": False}})
    assert not demo.ok({**report, "scene": {"parity_ok": False}})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--model", "gpt"], "argument --model: invalid choice: 'gpt'"),
        (["demo", "--size", "huge"], "argument --size: invalid choice: 'huge'"),
        (["demo", "--threads", "-1"], "argument --threads: expected an integer >= 0, got '-1'"),
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
