"""benchmarks/e2e_scale.py's dry run, as gpu_check runs it: whole forwards of both families, dense vs paged
captured per block and per forward, at tiny sizes on the CPU. Structure and invariants only, never a timing:
the paged outputs equal dense within the fp32 bound, one launch per forward in the forward mode and one per block
in the block mode, the dense side's graph counts, a window fill and a reset in the DreamZero schedule."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import e2e_scale, gpu_check  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """gpu_check --dry-run with only its e2e check: (gpu_check's report, e2e_scale's report)."""
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--skip-tests", "--skip-suite", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    return report, report["checks"]["e2e scale"]["report"]


def test_gpu_check_dry_run_includes_e2e_scale(dry):
    report, e2e = dry
    assert report["status"] == "PASS" and set(report["checks"]) == {"environment", "e2e scale"}
    check = report["checks"]["e2e scale"]
    assert check["status"] == "PASS" and check["argv"] == ["--dry-run"] and check["rows"]
    assert e2e["dry_run"] and e2e["dtype"] == "float32" and set(e2e["families"]) == {"dreamzero", "hunyuan"}


@pytest.mark.parametrize("family, kinds, layers", [("dreamzero", {"commit", "denoise", "chunk"}, 2),
                                                   ("hunyuan", {"prefill", "step"}, 2)])
def test_both_capture_modes_match_dense_with_their_launch_counts(dry, family, kinds, layers):
    fam = dry[1]["families"][family]
    assert fam["problems"] == [] and fam["tolerance_rel"] == e2e_scale.TOLERANCE[torch.float32]
    assert fam["config"]["layers"] == layers
    for variant, v in fam["variants"].items():
        assert {k[:-3] for k in v if k.endswith("_ms") and not k.endswith("host_ms")} == kinds
        assert all(v[f"{k}_ms"]["n"] == dry[1]["repeats"] for k in kinds)
        want = {"dense": 1, "paged/block": layers, "paged/forward": 1}[variant]
        assert v["launches_per_forward"] == want
        if variant != "dense":
            assert v["rel_diff_vs_dense"] <= fam["tolerance_rel"]
            assert set(v["ratio_vs_dense"]) == kinds and all(r["n"] == dry[1]["repeats"]
                                                             for r in v["ratio_vs_dense"].values())
    assert fam["variants"]["paged/forward"]["warmup"]["graphs_captured"] == (1 if family == "dreamzero" else 2)
    assert fam["variants"]["paged/block"]["warmup"]["graphs_captured"] == layers * (1 if family == "dreamzero" else 2)


def test_dense_compiles_one_graph_per_cache_length_and_the_schedule_fills_and_resets(dry):
    dz, hy = dry[1]["families"]["dreamzero"], dry[1]["families"]["hunyuan"]
    assert dz["dense_compile"]["dynamo_graphs"] == len(dz["dense_compile"]["cache_lengths_frames"]) >= 2
    assert dz["schedule"]["commits"] >= 1 and dz["schedule"]["resets"] == 1
    assert hy["dense_compile"]["dynamo_graphs"] == hy["dense_compile"]["captured_stack_graphs"] == 2  # prefill, step


def test_dreamzero_schedule_is_the_rollouts():
    """Commit of the previous chunk, then the steps; the window resets when the start frame reaches the reset."""
    cfg = e2e_scale.DRY_DREAMZERO  # 2-frame chunks, reset at 4 frames
    assert e2e_scale.dreamzero_schedule(cfg, 3, 2) == [
        ("denoise", 0, 0, False), ("denoise", 0, 0, False),
        ("commit", 1, 0, False), ("denoise", 1, 2, False), ("denoise", 1, 2, False),
        ("denoise", 2, 0, True), ("denoise", 2, 0, False)]


def test_the_dry_run_leaves_dynamo_config_as_it_was(dry):
    """It raises the recompile limit for its own run only: a leaked limit let other tests' frames recompile."""
    assert torch._dynamo.config.recompile_limit == torch._dynamo.config._config["recompile_limit"].default
