"""Every example runs (in-process, through its main()) and reports what it promises."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _main(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_every_example_is_tested():
    tested = {"dreamzero_rollout", "hunyuan_image3_request", "warmup", "graph_dump", "fork_candidates", "multirank"}
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested


def test_dreamzero_rollout(capsys):
    assert _main("dreamzero_rollout")([]) == 0
    out = capsys.readouterr().out
    assert "window resets after chunks [7]" in out and "max |dense - paged|" in out


def test_hunyuan_image3_request(capsys):
    assert _main("hunyuan_image3_request")([]) == 0
    out = capsys.readouterr().out
    assert "one-row: prompts [9]" in out and "cfg: prompts [13, 4]" in out
    assert "blocks free again: 8 of 8" in out


def test_fork_candidates(capsys):
    assert _main("fork_candidates")(["3"]) == 0
    out = capsys.readouterr().out
    assert "forked 6 sessions from 'world'" in out and "blocks taken 0, KV bytes copied 0" in out
    assert "3 candidates as rows of one forward (6 rows)" in out and "best candidate:" in out
    assert "blocks free again: 56 of 56" in out


def test_warmup(capsys):
    assert _main("warmup")([]) == 0
    captured = capsys.readouterr()
    assert "compiled while serving: 0; buffer addresses unchanged: True" in captured.out
    assert "rows=2 tokens=37 context=96: compile" in captured.out
    assert "compiling rows=2 tokens=37 context=96" in captured.err


def test_graph_dump(capsys, tmp_path):
    assert _main("graph_dump")([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "paged_kv_graph_" in out and "full_code_for_forward" in out
    assert "torch.ops.paged_kv.write_attend.default(" in out
    assert "rewritten (window" in out
    assert any(p.name.endswith(".after.py") for p in tmp_path.iterdir())


def test_an_example_runs_as_a_script(tmp_path):
    root = EXAMPLES.parent
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(EXAMPLES / "graph_dump.py"), str(tmp_path / "dump")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the rewritten attention call:" in done.stdout


def test_multirank_runs_two_ranks_as_a_script():
    """Two spawned gloo ranks (a spawned rank imports its target from the script, so it runs as one): both models,
    CFG-parallel, tensor parallel and Ulysses, parity on every rank, each rank's pool about half the one-rank pool
    (exactly half under TP and Ulysses; within one block per layer under CFG-parallel, docs/distributed.md)."""
    root = EXAMPLES.parent
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(EXAMPLES / "multirank.py")], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout
    assert "DreamZero, CFG-parallel 2" in out and "HunyuanImage-3, tensor parallel 2" in out and "Ulysses 2" in out
    assert out.count("max |paged - dense|") == 6 and "parity within 1e-5 on every rank" in out
    assert out.count("KV pool 92,160 bytes (one rank: 184,320)") == 2
    assert out.count("KV pool 94,208 bytes (one rank: 184,320)") == 2
    assert out.count("KV pool 18,432 bytes (one rank: 36,864)") == 2
