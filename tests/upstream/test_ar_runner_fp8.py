"""vllm-omni's AR-Diffusion runner on an FP8 pool (`model_config.paged_kv.kv_dtype`, `kv_scales`).

The bound is the FP8 tests' (tests/test_fp8_runtime.py: mean error < 0.1 and max < 1.0 on outputs of mean |x|
about 1, a guard against a lost or doubled scale, which moves them by O(1)); the oracle is the fp32 dense runner.
"""

from __future__ import annotations

import pytest
import torch

from paged_kv_compile.adapters.vllm_omni_ar_runner import RUNNER_PATH
from paged_kv_compile.errors import ConfigError

from . import dreamzero_runner as dr
from .test_vs_vllm_omni_runner import GEOMETRY, OURS, _requests, _runner, _serve

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _errors(got: list[dict], want: list[dict]) -> tuple[float, float, float]:
    diffs = [(a[k] - b[k]).abs() for a, b in zip(got, want) for k in ("video", "actions")]
    scale = torch.cat([b[k].abs().flatten() for b in want for k in ("video", "actions")]).mean().item()
    return max(d.max().item() for d in diffs), torch.cat([d.flatten() for d in diffs]).mean().item(), scale


def test_fp8_runner_is_within_the_fp8_bound_of_the_fp32_dense_runner(omni):
    """Five requests (a reset, a window reset) on an e4m3 pool with scales set at startup: within the FP8 bound of
    the fp32 dense runner, and not equal to it (the pool really quantizes); its blocks cost under half the fp32
    pool's bytes per session; with cuda_graphs='block' the replays give the same outputs bit for bit."""
    plan = _requests("s0", dr.request_inputs(GEOMETRY, 5), reset_at=(2,))
    dense_runner, dense_od = _runner(omni, dr.DENSE_RUNNER)
    dense = _serve(omni, dense_runner, dense_od, plan)
    fp32_runner, _ = _runner(omni, RUNNER_PATH, model_config=OURS)
    torch._dynamo.reset()
    options = {**OURS["paged_kv"], "kv_dtype": "float8_e4m3fn", "kv_scales": {"k": 0.02, "v": 0.02}}
    runner, od = _runner(omni, RUNNER_PATH, model_config={"paged_kv": options})
    pool = runner.kv_cache.runtime.pool
    assert pool.tensor.dtype == torch.float8_e4m3fn and torch.all(pool.scales == 0.02)
    assert runner.kv_cache.budget.kv_bytes_per_session * 2 < fp32_runner.kv_cache.budget.kv_bytes_per_session
    fp8 = _serve(omni, runner, od, plan)
    max_err, mean_err, scale = _errors(fp8, dense)
    print(f"[figure] FP8 e4m3 runner vs fp32 dense runner: max {max_err:.3e}, mean {mean_err:.3e} "
          f"(dense mean |x| {scale:.3f})")
    assert mean_err < 0.1 and max_err < 1.0
    assert max_err > 0, "the FP8 pool must actually quantize"
    assert runner.kv_cache.runtime.owner_ids() == [runner._sessions["s0"]._owner]

    # captured at startup, the FP8 runner replays the same numbers (the scales are an input of the recorded calls)
    torch._dynamo.reset()
    captured, captured_od = _runner(omni, RUNNER_PATH, model_config={"paged_kv": {**options, "cuda_graphs": "block"}})
    replayed = _serve(omni, captured, captured_od, plan)
    assert captured.graphs.stats["replays"] > 0
    for got, want in zip(replayed, fp8):
        for key in ("video", "actions"):
            assert torch.equal(got[key], want[key]), key


def test_fp8_options_refused_with_the_reason(omni):
    """Scales without an FP8 pool, an unknown dtype, and a kernel that cannot read the pool: refused at startup."""
    with pytest.raises(ConfigError, match="kv_scales are the scales of an FP8 pool"):
        _runner(omni, RUNNER_PATH, model_config={"paged_kv": {**OURS["paged_kv"], "kv_scales": {"k": 1.0}}})
    with pytest.raises(ConfigError, match="kv_dtype='float9' is not a torch dtype"):
        _runner(omni, RUNNER_PATH, model_config={"paged_kv": {**OURS["paged_kv"], "kv_dtype": "float9"}})
    with pytest.raises(ConfigError, match="kernel='flash_attn' cannot serve this runner's torch.float8_e4m3fn pool"):
        _runner(omni, RUNNER_PATH, model_config={"paged_kv": {**OURS["paged_kv"], "kernel": "flash_attn",
                                                              "kv_dtype": "float8_e4m3fn"}})
