"""vllm-omni's own `ARDiffusionModelRunner` serving DreamZero sessions from our runtime (and from its own pool).

The runner is the package's (`PagedKVARDiffusionModelRunner` subclasses it; selected by
`od_config.diffusion_model_runner_cls`), the pipeline is `DreamZeroPipeline`'s KV and denoising code over a
tiny `CausalWanModel` (tests/upstream/dreamzero_runner.py says what is stubbed). The oracle is the same runner
and pipeline with dense caches (the model's own dense path), eager, fp32.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from paged_kv_compile.adapters.vllm_omni_ar_runner import RUNNER_PATH

from . import dreamzero_runner as dr

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

ATOL = 1e-5
GEOMETRY = dr.TinyGeometry()
BUDGET = 8 << 30  # "free device memory": with DreamZero's 603 MiB of model state per session, one session
TWO_SESSIONS = 13 << 30  # 10% of it holds two sessions (the state dominates at this size)
OURS = {"paged_kv": {"inner_compiler": "aot_eager", "kernel": "reference"}}


def _runner(omni, runner_cls, *, available_bytes=BUDGET, model_config=None):
    od = dr.diffusion_config(runner_cls=runner_cls, model_config=dict(model_config or {}))
    with omni.model_context(od):
        pipeline = dr.build_pipeline(GEOMETRY, od)
        return dr.build_runner(pipeline, od, available_bytes=available_bytes), od


def _serve(omni, runner, od, requests):
    with omni.model_context(od):
        return dr.serve(runner, requests)


def _max_err(got: list[dict], want: list[dict]) -> float:
    assert len(got) == len(want)
    return max((a[k] - b[k]).abs().max().item() for a, b in zip(got, want) for k in ("video", "actions"))


def _requests(session: str, inputs, first: int = 0, *, reset_at: tuple[int, ...] = ()):
    return [dr.make_request(f"{session}-r{first + i}", session, extra, reset=first + i in reset_at)
            for i, extra in enumerate(inputs)]


def test_runner_serves_our_session_through_a_reset_and_requests(omni):
    """Two requests, an explicit reset (`extra_args["reset"]`), three more (the last crosses the window reset):
    every output equals the dense runner's; one compiled frame per phase serves every start frame."""
    inputs = dr.request_inputs(GEOMETRY, 5)
    plan = _requests("s0", inputs, reset_at=(2,))
    dense_runner, dense_od = _runner(omni, dr.DENSE_RUNNER)
    dense = _serve(omni, dense_runner, dense_od, plan)

    torch._dynamo.reset()
    counters.clear()
    runner, od = _runner(omni, RUNNER_PATH, model_config=OURS)
    runtime = runner.kv_cache.runtime
    paged = _serve(omni, runner, od, plan[:2])
    first_owner = runner._sessions["s0"]._owner
    assert runtime.owner_ids() == [first_owner] and runtime.active is None
    assert all(len(row) > 0 for row in runtime.owner(first_owner).rows), "both CFG branches hold history blocks"
    assert runtime.pool.tensor.abs().sum() > 0, "the K/V lives in our pool"
    paged += _serve(omni, runner, od, plan[2:])
    second_owner = runner._sessions["s0"]._owner
    assert second_owner != first_owner and runtime.owner_ids() == [second_owner], "the reset released the session"

    err = _max_err(paged, dense)
    print(f"[figure] our runtime behind vllm-omni's runner vs dense: max abs error {err:.2e} over 5 requests")
    assert err <= ATOL
    # first commit (1 frame), commit (nfpb frames), denoise (chunk + registers): three buckets, three frames
    assert counters["stats"]["unique_graphs"] == 3
    assert not counters["graph_break"]


def test_vllm_omni_own_paged_kv_matches_dense(omni):
    """Column 2: vllm-omni's `ARDiffusionKVCache` (vLLM's KVCacheManager, its CPU reference attention) through the
    same runner and requests, against the dense runner."""
    inputs = dr.request_inputs(GEOMETRY, 5)
    plan = _requests("s0", inputs, reset_at=(2,))
    dense_runner, dense_od = _runner(omni, dr.DENSE_RUNNER)
    theirs_runner, theirs_od = _runner(omni, None)
    assert type(theirs_runner.kv_cache).__name__ == "ARDiffusionKVCache"
    err = _max_err(_serve(omni, theirs_runner, theirs_od, plan), _serve(omni, dense_runner, dense_od, plan))
    print(f"[figure] vllm-omni's own paged KV vs dense: max abs error {err:.2e}")
    assert err <= ATOL


def test_runner_lru_warmup_and_fail_closed(omni):
    """The base runner's session policy over our runtime: warm-up requests leave the pool as they found it, the
    least recently used session is evicted at capacity (its blocks freed), a forward that raises releases its
    session and rolls the runtime back, and each later request matches the dense runner under the same policy."""
    runner, od = _runner(omni, RUNNER_PATH, available_bytes=TWO_SESSIONS, model_config=OURS)
    dense_runner, dense_od = _runner(omni, dr.DENSE_RUNNER)
    dense_runner._session_capacity = runner._session_capacity
    assert runner._session_capacity == 2
    runtime = runner.kv_cache.runtime
    free = runtime.scheduler.allocator.num_free

    served = []  # the runner's warm-up logs and swallows a failed request: count the ones that ran
    forward = runner.pipeline.forward
    runner.pipeline.forward = lambda req, **kw: served.append(forward(req, **kw)) or served[-1]
    with omni.model_context(od):
        runner._warmup_ar_rollout()  # the pipeline's warm-up requests, as load_model runs them
    del runner.pipeline.forward
    assert len(served) == 3, "one warm-up request per window-fill shape (1 + ceil((5 - 1) / 2))"
    assert runtime.owner_ids() == [] and runtime.scheduler.allocator.num_free == free and not runner._sessions

    inputs = {s: dr.request_inputs(GEOMETRY, 3, seed=n) for n, s in enumerate(("a", "b", "c"))}
    plan = [*_requests("a", inputs["a"][:1]), *_requests("b", inputs["b"][:1]), *_requests("c", inputs["c"][:1]),
            *_requests("a", inputs["a"][1:2], 1)]  # "a" was evicted by "c": it starts again
    paged = _serve(omni, runner, od, plan)
    assert list(runner._sessions) == ["c", "a"] and len(runtime.owner_ids()) == 2
    assert _max_err(paged, _serve(omni, dense_runner, dense_od, plan)) <= ATOL

    block = runner.pipeline.transformer.blocks[1]
    compiled = block.forward

    def fail_once(*args, **kwargs):
        block.forward = compiled
        raise RuntimeError("injected failure in block 1")

    block.forward = fail_once  # the next forward (the commit of "c"'s second request) fails in its last block
    with pytest.raises(RuntimeError, match="injected failure"):
        _serve(omni, runner, od, _requests("c", inputs["c"][1:2], 1))
    assert "c" not in runner._sessions and runtime.active is None and runtime.scheduler.in_flight is None
    a_owner = runner._sessions["a"]._owner
    assert runtime.owner_ids() == [a_owner], "the failed session was released"
    held = sum(len(row) for row in runtime.owner(a_owner).rows)
    assert runtime.scheduler.allocator.num_free == free - held, "its blocks (and the failed commit's) are free"
    again = _serve(omni, runner, od, _requests("c", inputs["c"][:1], 5))  # starts afresh, like a new session
    dense_runner.close_session("c")
    want = _serve(omni, dense_runner, dense_od, _requests("c", inputs["c"][:1], 5))
    assert _max_err(again, want) <= ATOL


def test_unknown_paged_kv_option_is_refused(omni):
    with pytest.raises(ValueError, match="unknown keys \\['kernal'\\]"):
        _runner(omni, RUNNER_PATH, model_config={"paged_kv": {"kernal": "triton"}})
