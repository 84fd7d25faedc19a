"""Several DreamZero sessions in one forward, through vllm-omni's runner and below it.

Through the runner (`execute_model_batch`, `max_num_seqs > 1`): the engine's batch of several sessions' requests
runs their pipeline loops in lockstep, one batched model call per step (`adapters/vllm_omni_ar_batch.py`); each
session's output equals its output served alone, a session that cannot be admitted or that fails is an error
response while the others proceed. Below it: vllm-omni's `CausalWanModel`, handed our stand-ins as a batch of two
sessions (one `runtime.forward_batch` per CFG branch and phase), gives each session what it gives that session
alone (`benchmarks.vs_vllm_omni.dreamzero_batched_sessions`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.vs_vllm_omni import dreamzero_batched_sessions  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_two_sessions_in_one_model_call_each_equal_to_alone(omni):
    (row,) = dreamzero_batched_sessions((2,), repeats=1)
    assert row["model_calls_batched"] * 2 == row["model_calls_sequential"] == 16, "one call per branch and phase"
    assert row["max_abs_err_vs_alone"] <= 1e-5, row


# ---- through the runner: execute_model_batch, sessions in lockstep ---------------------------------------------

from paged_kv_compile.adapters.vllm_omni_ar_runner import RUNNER_PATH  # noqa: E402

from . import dreamzero_runner as dr  # noqa: E402
from .test_vs_vllm_omni_runner import OURS, TWO_SESSIONS  # noqa: E402

CALLS = 3  # per session: its first request (a 1-frame commit), then two 2-frame chunks; each with its denoising


def _batch_sizes(transformer) -> tuple[list[int], object]:
    seen: list[int] = []
    handle = transformer.register_forward_hook(lambda m, args, kwargs, out: seen.append(kwargs["x"].shape[0]),
                                               with_kwargs=True)
    return seen, handle


def test_two_sessions_batched_through_the_runner_each_equal_to_alone_third_refused(omni):
    """vllm-omni's path for several requests (its `RequestScheduler` schedules one wave, the runner's
    `execute_model_batch` serves it; max_num_seqs=3) over a pool that holds two sessions: per engine batch, sessions a and b run in lockstep (every model call carries both rows), each
    output equal to that session served alone through the same runner; session c cannot be admitted (both
    resident sessions are running) and is answered with an error while a and b proceed; afterwards the pool is
    back at its baseline."""
    od = dr.diffusion_config(runner_cls=RUNNER_PATH, model_config=dict(OURS), max_num_seqs=3)
    geometry = dr.TinyGeometry()
    with omni.model_context(od):
        runner = dr.build_runner(dr.build_pipeline(geometry, od), od, available_bytes=TWO_SESSIONS)
    assert runner._session_capacity == 2
    allocator = runner.kv_cache.runtime.scheduler.allocator
    baseline = allocator.num_free
    inputs = {s: dr.request_inputs(geometry, CALLS, seed=10 + n) for n, s in enumerate("abc")}
    sizes, handle = _batch_sizes(runner.pipeline.transformer)
    with omni.model_context(od):
        alone = {}
        for s in "ab":
            alone[s] = dr.serve(runner, [dr.make_request(f"alone-{s}{i}", f"alone-{s}", x, reset=i == 0)
                                         for i, x in enumerate(inputs[s])])
            runner.close_session(f"alone-{s}")
        calls_alone = len(sizes)
        assert set(sizes) == {1}
        sizes.clear()
        together = {"a": [], "b": []}
        for i in range(CALLS):
            outs = dr.serve_batch(runner, [dr.make_request(f"{s}{i}", s, inputs[s][i], reset=i == 0) for s in "abc"])
            for s, out in zip("ab", outs):
                assert out.error is None, out.error
                together[s].append(out.output)
            assert outs[2].error and "cannot be admitted" in outs[2].error, outs[2].error
            assert "c" not in runner._sessions
    handle.remove()
    assert sizes == [2] * (calls_alone // 2), "every model call carried both sessions' rows, one call per step"
    assert runner.batched_model_calls == len(sizes)
    assert (alone["a"][-1]["actions"] - alone["b"][-1]["actions"]).abs().max() > 1e-3, "the sessions differ"
    for s in "ab":
        for got, want in zip(together[s], alone[s], strict=True):
            for key in ("actions", "video"):
                err = (got[key] - want[key]).abs().max().item()
                assert err <= 1e-5, (s, key, err)
    for s in "ab":
        runner.close_session(s)
    assert allocator.num_free == baseline and runner.kv_cache.runtime.owner_ids() == []


def test_a_session_failing_in_a_batch_is_an_error_response_the_other_unaffected(omni):
    """In one engine batch, session b's request carries state features of the wrong width: its model call cannot
    share a's (another row shape), runs alone and raises; b gets an error response and is released fail-closed
    (no session, no blocks), while a's output equals a served alone."""
    od = dr.diffusion_config(runner_cls=RUNNER_PATH, model_config=dict(OURS), max_num_seqs=2)
    geometry = dr.TinyGeometry()
    with omni.model_context(od):
        runner = dr.build_runner(dr.build_pipeline(geometry, od), od, available_bytes=TWO_SESSIONS)
    allocator = runner.kv_cache.runtime.scheduler.allocator
    baseline = allocator.num_free
    good = dr.request_inputs(geometry, 1, seed=3)[0]
    bad = {**dr.request_inputs(geometry, 1, seed=4)[0]}
    bad["state_features"] = bad["state_features"][..., :-1]
    with omni.model_context(od):
        (want,) = dr.serve(runner, [dr.make_request("alone", "alone", good, reset=True)])
        runner.close_session("alone")
        out_a, out_b = dr.serve_batch(runner, [dr.make_request("a0", "a", good, reset=True),
                                               dr.make_request("b0", "b", bad, reset=True)])
    assert out_b.error and out_a.error is None, (out_a.error, out_b.error)
    assert "b" not in runner._sessions and "a" in runner._sessions
    for key in ("actions", "video"):
        assert (out_a.output[key] - want[key]).abs().max().item() <= 1e-5
    runner.close_session("a")
    assert allocator.num_free == baseline and runner.kv_cache.runtime.owner_ids() == []


def test_batching_with_cuda_graphs_is_refused_at_startup(omni):
    """The captured graphs cover the warm-up requests' batch-1 shapes only: max_num_seqs > 1 with
    cuda_graphs='block' is refused when the pools are built, naming both settings."""
    from paged_kv_compile.errors import ConfigError

    model_config = {"paged_kv": {**OURS["paged_kv"], "cuda_graphs": "block"}}
    od = dr.diffusion_config(runner_cls=RUNNER_PATH, model_config=model_config, max_num_seqs=2)
    with omni.model_context(od), pytest.raises(ConfigError, match="max_num_seqs=2"):
        dr.build_runner(dr.build_pipeline(dr.TinyGeometry(), od), od, available_bytes=TWO_SESSIONS)


def test_the_engine_batches_requests_for_the_lockstep_pipeline_class(omni):
    """vllm-omni's engine decides request batching from the pipeline class (`supports_request_batch`): DreamZero's
    own class gets max_num_seqs > 1 refused, `LockstepDreamZeroPipeline` chosen by `custom_pipeline_args` gets
    request batches (then `execute_model_batch` on the runner)."""
    from vllm_omni.diffusion.diffusion_engine import supports_request_batch
    from vllm_omni.diffusion.models.dreamzero.pipeline_dreamzero import DreamZeroPipeline

    from paged_kv_compile.adapters.vllm_omni_ar_batch import PIPELINE_PATH

    def config(pipeline_class: str):
        return dr.diffusion_config(runner_cls=RUNNER_PATH, max_num_seqs=2,
                                   custom_pipeline_args={"pipeline_class": pipeline_class})

    plain = config(f"{DreamZeroPipeline.__module__}.DreamZeroPipeline")
    ours = config(PIPELINE_PATH)
    assert not supports_request_batch(plain)
    assert supports_request_batch(ours)


def test_sessions_at_different_start_frames_in_one_batch_each_equal_to_alone(omni):
    """Session a sends its second request (a 2-frame chunk at start frame 1) in the same engine batch as session
    b's first (a 1-frame commit at start frame 0): their model calls differ in start frame and length, so each
    step runs them as separate calls (batch 1 each), and each output equals that session's alone."""
    od = dr.diffusion_config(runner_cls=RUNNER_PATH, model_config=dict(OURS), max_num_seqs=2)
    geometry = dr.TinyGeometry()
    with omni.model_context(od):
        runner = dr.build_runner(dr.build_pipeline(geometry, od), od, available_bytes=TWO_SESSIONS)
    inputs = {s: dr.request_inputs(geometry, 2, seed=30 + n) for n, s in enumerate("ab")}
    with omni.model_context(od):
        alone = {s: dr.serve(runner, [dr.make_request(f"alone-{s}{i}", f"alone-{s}", x, reset=i == 0)
                                      for i, x in enumerate(inputs[s])]) for s in "ab"}
        for s in "ab":
            runner.close_session(f"alone-{s}")
        (first_a,) = dr.serve(runner, [dr.make_request("a0", "a", inputs["a"][0], reset=True)])
        sizes, handle = _batch_sizes(runner.pipeline.transformer)
        out_a, out_b = dr.serve_batch(runner, [dr.make_request("a1", "a", inputs["a"][1]),
                                               dr.make_request("b0", "b", inputs["b"][0], reset=True)])
        handle.remove()
    assert out_a.error is None and out_b.error is None, (out_a.error, out_b.error)
    assert sizes and set(sizes) == {1}, sizes
    for got, want in ((first_a, alone["a"][0]), (out_a.output, alone["a"][1]), (out_b.output, alone["b"][0])):
        for key in ("actions", "video"):
            assert (got[key] - want[key]).abs().max().item() <= 1e-5


def test_lockstep_batches_calls_of_one_signature_and_fails_a_bad_call_alone():
    """The lockstep driver alone: per step, the parked calls of one signature are one batched call in body order;
    a call whose signature cannot be computed fails that body only; bodies of different lengths all finish."""
    from paged_kv_compile.adapters.vllm_omni_ar_lockstep import Lockstep

    batches = []

    def batched(calls):
        batches.append(list(calls))
        return [10 * c for c in calls]

    def signature(call):
        if call < 0:
            raise ValueError("no signature")
        return call % 2

    lock = Lockstep(batched, signature)
    results = lock.run([lambda: [lock.call(v) for v in (1, 3)], lambda: [lock.call(v) for v in (5, -1, 7)],
                        lambda: [lock.call(2)]])
    assert results[0] == (True, [10, 30]) and results[2] == (True, [20])
    assert results[1][0] is False and isinstance(results[1][1], ValueError)
    assert batches == [[1, 5], [2], [3]] and lock.batched_calls == 3
