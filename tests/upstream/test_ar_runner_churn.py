"""Session churn through vllm-omni's AR-Diffusion runner over our runtime: the pool comes back to its baseline.

vllm-omni's users saw the pool fill as session ids churned while the server kept answering (vllm-omni #5295).
Here 200 session ids go through the runner, ended every way the runner ends a session (explicit close, LRU
eviction, a reset, a forward that fails), with sessions that cannot be admitted (the pool's bytes held by
another tenant) in between: each of those is refused with the reason and the next request is served. At the end
the pool is where it started, and a session run after the churn gives bit for bit what it gave before.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paged_kv_compile.adapters.vllm_omni_ar_runner import RUNNER_PATH
from paged_kv_compile.errors import CapacityError

from . import dreamzero_runner as dr
from .test_vs_vllm_omni_runner import OURS, TWO_SESSIONS

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

FAST = dataclasses.replace(dr.TinyGeometry(), steps=1)  # one denoising step: the churn is in the sessions
SESSIONS = 200


def _request(rid: str, session: str, extra: dict, **flags):
    req = dr.make_request(rid, session, extra, reset=flags.pop("reset", False))
    req.sampling_params.extra_args.update(flags)
    return req


def test_200_session_ids_leave_the_pool_at_its_baseline(omni):
    od = dr.diffusion_config(runner_cls=RUNNER_PATH, model_config=dict(OURS))
    with omni.model_context(od):
        runner = dr.build_runner(dr.build_pipeline(FAST, od), od, available_bytes=TWO_SESSIONS)
    kv, runtime = runner.kv_cache, runner.kv_cache.runtime
    allocator = runtime.scheduler.allocator
    assert runner._session_capacity == 2
    baseline = (allocator.num_free, runtime.owner_ids())
    inputs = dr.request_inputs(FAST, 2, seed=7)

    def serve(req):
        return dr.serve(runner, [req])[0]

    block = runner.pipeline.transformer.blocks[1]
    compiled = block.forward

    def fail_once(*args, **kwargs):
        block.forward = compiled
        raise RuntimeError("injected failure in block 1")

    ended = {"closed": 0, "evicted": 0, "reset": 0, "failed": 0, "refused": 0}
    with omni.model_context(od):
        probe_before = serve(_request("probe-0", "probe", inputs[0]))
        runner.close_session("probe")
        for n in range(SESSIONS):
            sid, way = f"churn-{n}", n % 5
            if way == 0:  # explicit close, as the request's flag
                serve(_request(f"{sid}-a", sid, inputs[0], close_session=True))
                ended["closed"] += 1
            elif way == 1:  # two requests, then left to the LRU
                serve(_request(f"{sid}-a", sid, inputs[0]))
                serve(_request(f"{sid}-b", sid, inputs[1]))
                ended["evicted"] += 1
            elif way == 2:  # a reset request on a live session
                serve(_request(f"{sid}-a", sid, inputs[0]))
                serve(_request(f"{sid}-b", sid, inputs[0], reset=True))
                ended["reset"] += 1
            elif way == 3:  # the forward fails in its last block: fail closed
                block.forward = fail_once
                with pytest.raises(RuntimeError, match="injected failure"):
                    serve(_request(f"{sid}-a", sid, inputs[0]))
                assert sid not in runner._sessions and runtime.active is None
                ended["failed"] += 1
            else:  # another tenant holds the pool's bytes: this session cannot be admitted
                while len(runner._sessions) > 1:
                    runner.close_session(next(iter(runner._sessions)))
                runtime.admit(f"tenant-{n}", kv.spec, rows=kv.rows)
                state = runtime.state()
                with pytest.raises(CapacityError, match="free to reserve"):
                    serve(_request(f"{sid}-a", sid, inputs[0]))
                assert sid not in runner._sessions and runtime.state() == state, "nothing half-admitted"
                runtime.release(f"tenant-{n}")
                ended["refused"] += 1
                # the next request is served at once
                serve(_request(f"{sid}-next", f"{sid}-next", inputs[0], close_session=True))
            assert len(runner._sessions) <= runner._session_capacity
            assert len(runtime.owner_ids()) == len(runner._sessions), "every runtime owner is a live session"
        for sid in list(runner._sessions):
            runner.close_session(sid)
        assert (allocator.num_free, runtime.owner_ids()) == baseline, "the pool is back at its baseline"
        probe_after = serve(_request("probe-1", "probe", inputs[0]))
    print(f"[figure] session churn: {SESSIONS} session ids {ended}, pool back to {baseline[0]} free blocks")
    for key in ("video", "actions"):
        assert torch.equal(probe_before[key], probe_after[key]), "reused blocks carry nothing of earlier sessions"
