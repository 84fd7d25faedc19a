"""vllm-omni's AR-Diffusion runner with our runtime and captured graphs (`model_config.paged_kv.cuda_graphs`).

The runner warms up on the pipeline's own warm-up requests and captures at startup, before the first request
(`adapters/vllm_omni_ar_capture.py`); on this CPU the replay is `CompiledOnlyGraphs`', which runs only the
recorded compiled graphs, as a CUDA graph would. The oracle is the dense runner (tests/upstream/dreamzero_runner.py).
"""

from __future__ import annotations

import pytest
import torch

from paged_kv_compile.adapters.vllm_omni_ar_runner import RUNNER_PATH
from paged_kv_compile.capture import CompiledOnlyGraphs, unique_graphs
from paged_kv_compile.errors import ConfigError, RequestError
from paged_kv_compile.forward_context import ForwardContext

from . import dreamzero_runner as dr
from .test_vs_vllm_omni_runner import GEOMETRY, OURS, TWO_SESSIONS, _requests, _runner, _serve

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

GRAPHS = {"paged_kv": {**OURS["paged_kv"], "cuda_graphs": "block"}}


def test_captured_runner_serves_five_requests_bit_exact_against_the_dense_runner(omni):
    """Capture at startup (the warm-up requests compile, then every start frame's buckets are captured); five
    requests (a reset, a window reset) are then served by replays only: no frame compiled, every replay preceded
    by its host checks, the outputs bit-exact to the dense runner's (and to the uncaptured paged runner's)."""
    inputs = dr.request_inputs(GEOMETRY, 5)
    plan = _requests("s0", inputs, reset_at=(2,))
    dense_runner, dense_od = _runner(omni, dr.DENSE_RUNNER)
    dense = _serve(omni, dense_runner, dense_od, plan)
    torch._dynamo.reset()
    plain_runner, plain_od = _runner(omni, RUNNER_PATH, model_config=OURS)
    plain = _serve(omni, plain_runner, plain_od, plan)

    torch._dynamo.reset()
    frames_at_start = unique_graphs()
    runner, od = _runner(omni, RUNNER_PATH, model_config=GRAPHS)
    graphs = runner.graphs
    assert graphs is not None and runner.startup["captured"] == len(graphs.buckets) >= 3
    assert all(isinstance(c.graphs, CompiledOnlyGraphs) for c in graphs.by_frame.values())
    assert sorted(graphs.by_frame) == [0, 1, 3], "every start frame of a window: 0 (first commit), 1, 1 + nfpb"
    runtime = runner.kv_cache.runtime
    assert runtime.owner_ids() == [] and runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer, \
        "the warm-up session was released before serving"
    frames_before, stats_before = unique_graphs(), dict(graphs.stats)
    assert frames_before - frames_at_start == 3, "one compiled frame per bucket: the capture compiled nothing more"

    paged = _serve(omni, runner, od, plan)
    assert unique_graphs() == frames_before, "serving compiled nothing"
    replays = graphs.stats["replays"] - stats_before["replays"]
    checks = graphs.stats["checks"] - stats_before["checks"]
    assert graphs.stats["direct_calls"] == stats_before["direct_calls"] and graphs.stats["fallback_calls"] == 0
    # per request: commit(s) and 2 steps x 2 CFG branches of denoising, each over both blocks
    assert replays > 0 and checks >= replays, "every replay ran its compiled call's host checks first"
    for want in (plain, dense):
        for got, ref in zip(paged, want):
            for key in ("video", "actions"):
                assert torch.equal(got[key], ref[key]), key
    print(f"[figure] captured runner (no-Python replay) vs dense runner: bit-exact over 5 requests, "
          f"{replays} replays; startup {runner.startup}")


def test_forward_graphs_are_refused_with_the_reason(omni):
    """One graph per forward cannot serve DreamZero's per-layer cross-attention K/V: refused at startup."""
    with pytest.raises(ConfigError, match="crossattn_cache\\[block_index\\].*cuda_graphs='block'"):
        _runner(omni, RUNNER_PATH, model_config={"paged_kv": {**OURS["paged_kv"], "cuda_graphs": "forward"}})
    with pytest.raises(ConfigError, match="choose one of none, block, forward"):
        _runner(omni, RUNNER_PATH, model_config={"paged_kv": {**OURS["paged_kv"], "cuda_graphs": "yes"}})


def test_a_host_check_refusing_before_a_replay_fails_the_request_closed(omni, monkeypatch):
    """The per-call checks run before each replay: one that refuses (injected once into the forward context's expectation check,
    which every compiled DreamZero call makes) stops the forward before its graph runs; the runner releases the
    session, the runtime rolls back with the pool's bytes untouched, and the next request is served bit-exact."""
    runner, od = _runner(omni, RUNNER_PATH, model_config=GRAPHS, available_bytes=TWO_SESSIONS)
    runtime, graphs = runner.kv_cache.runtime, runner.graphs
    assert runner._session_capacity == 2  # "a" stays while "b" comes and goes
    inputs = dr.request_inputs(GEOMETRY, 1, seed=3)
    _serve(omni, runner, od, _requests("a", inputs))
    def live():  # the runtime's state less its record of used-up ids (b's admission is one)
        return {k: v for k, v in runtime.state().items() if k != "finished"}

    pool, state, replays = runtime.pool.tensor.clone(), live(), graphs.stats["replays"]
    check, refused = ForwardContext.check_expectation, []

    def refuse_once(self, expect, idiom):
        if refused:
            return check(self, expect, idiom)
        refused.append(expect)
        raise RequestError("injected: the session's layout does not match the compiled site")

    monkeypatch.setattr(ForwardContext, "check_expectation", refuse_once)
    with pytest.raises(RequestError, match="injected"):
        _serve(omni, runner, od, _requests("b", inputs))
    assert graphs.stats["replays"] == replays, "the refusing call's graph never ran"
    assert "b" not in runner._sessions and runtime.active is None and live() == state
    assert torch.equal(runtime.pool.tensor, pool), "nothing was written"
    again = _serve(omni, runner, od, _requests("b", inputs, 1))
    dense_runner, dense_od = _runner(omni, dr.DENSE_RUNNER)
    want = _serve(omni, dense_runner, dense_od, _requests("b", inputs))
    for key in ("video", "actions"):
        assert torch.equal(again[0][key], want[0][key]), key
