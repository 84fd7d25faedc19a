"""The claims docs/vs_vllm_omni.md makes about vllm-omni 0.30.0's own paged KV, checked against its code here.

Each is a measurement of benchmarks/vs_vllm_omni.py at a size that runs in seconds: where vllm-omni's HunyuanImage-3
paged path stops on a CPU, how many frames its DreamZero blocks compile as the window grows, and how many
DreamZero-14B sessions each system's sizing admits in one budget.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import vs_vllm_omni as bench  # noqa: E402

from . import hunyuan_diffusion_kv  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_vllm_omni_hunyuan_paged_kv_stops_at_vllm_gpu_block_tables(omni):
    """Registration, native KV and the scheduler's reservation run; vLLM's GPU-runner BlockTables does not."""
    pinned = hunyuan_diffusion_kv.probe(uva=True)
    assert pinned["stopped_at"] == "set_kv_cache_config (native KV + BlockTables)"
    assert "pin_memory" in pinned["error"]
    assert "native backend CPU_ATTN" in pinned["reached"][-1]
    fallback = hunyuan_diffusion_kv.probe(uva=False)
    assert fallback["reached"][-1] == "scheduler reserve_request (two CFG rows)"
    assert fallback["stopped_at"] == "install_diffusion_kv_metadata"
    assert fallback["vllm_has_triton"] is False  # BlockTables' Triton kernels are placeholders here
    assert "not subscriptable" in fallback["error"]


def test_start_frames_recompile_vllm_omni_blocks_not_ours(omni):
    """An 11-frame window: at setup_compile's settings vllm-omni's blocks compile a frame per start frame and hit
    dynamo's default recompile limit; ours serve both window cycles with one frame per phase."""
    rows = {r["column"]: r for r in bench.frames_by_window((5,))}
    theirs, ours = rows["vllm-omni"], rows["paged_kv"]
    assert "FailOnRecompileLimitHit" in theirs["error"] and theirs["served"] < theirs["requests"]
    assert theirs["frames"] == 8  # torch._dynamo.config.recompile_limit
    assert ours["error"] == "" and ours["served"] == ours["requests"] == 12
    assert ours["frames"] == 3 and ours["graph_breaks"] == 0


def test_dreamzero_14b_sessions_per_budget(omni):
    """Same budget rule, same KV per session in bf16 (both hold every local branch's whole window); an FP8 pool
    halves it and admits twice the sessions where KV, not model state, is the limit."""
    rows = bench.dreamzero_memory(80, (0.9,))
    by = {(r["system"], r["pool"]): r for r in rows}
    theirs, ours, fp8 = by[("vllm-omni", "bf16")], by[("paged_kv", "bf16")], by[("paged_kv", "fp8")]
    assert ours["kv_gib_per_session"] == theirs["kv_gib_per_session"]
    assert ours["sessions"] == theirs["sessions"] == 2
    assert fp8["kv_gib_per_session"] == pytest.approx(ours["kv_gib_per_session"] / 2, rel=0.01)
    assert fp8["sessions"] == 4
