"""The runner's `execute_model_batch`: several DreamZero sessions' requests served in lockstep.

vllm-omni's engine hands a runner several requests at once (`execute_model_batch`) when `max_num_seqs > 1` and
the pipeline class declares `supports_request_batch`. Its `ARDiffusionModelRunner` refuses that path, and
DreamZero's pipeline runs one session per `forward`. Here each request's session is admitted (by what the pool
holds: the runner's session capacity, sized from pool bytes), bound, and its pipeline `forward` runs unchanged in
lockstep with the others (`vllm_omni_ar_lockstep`): every model call of the step carries all sessions' rows of
one branch (`DreamZeroPagedKV.run_batched`, one `runtime.forward_batch`).

Per request, exactly what `execute_model` gives: reset (`extra_args["reset"]`), LRU eviction of idle sessions,
fail-closed release of a session whose forward raised, `close_session`, output normalization. What differs: a
session that cannot be admitted (every resident session runs in this batch, or the pool has no room) gets an
error response and the others proceed; two requests of one session in one batch run in successive waves (a
session's steps depend on each other). The runner's own sessions are never evicted while they run.

The engine batches requests only for a pipeline class that declares `supports_request_batch`; DreamZero's does not
(it runs one session per `forward`). `LockstepDreamZeroPipeline` (`PIPELINE_PATH`, selected by
`custom_pipeline_args: {pipeline_class: ...}`) is DreamZero's pipeline unchanged, declaring it: with this runner
its `forward` still sees one request, the batching is the runner's.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..errors import CapacityError
from .vllm_omni_ar_diffusion import batch_signature
from .vllm_omni_ar_lockstep import Lockstep, lockstep_pipeline


PIPELINE_PATH = "paged_kv_compile.adapters.vllm_omni_ar_batch.LockstepDreamZeroPipeline"


def _lockstep_dreamzero_pipeline() -> type:
    from vllm_omni.diffusion.models.dreamzero.pipeline_dreamzero import DreamZeroPipeline

    class LockstepDreamZeroPipeline(DreamZeroPipeline):
        """`DreamZeroPipeline`, unchanged, declaring request batches so that vllm-omni's engine hands the runner
        several sessions' requests (`execute_model_batch`); `PagedKVARDiffusionModelRunner` serves them in
        lockstep, each `forward` still seeing one request. vllm-omni's own AR runner refuses this class."""

        supports_request_batch = True

    LockstepDreamZeroPipeline.__module__ = __name__
    return LockstepDreamZeroPipeline


def __getattr__(name: str):
    if name == "LockstepDreamZeroPipeline":  # resolved by qualname, as the engine resolves pipeline classes
        cls = _lockstep_dreamzero_pipeline()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def serve_batch(runner, reqs: list, od_config) -> Any:
    """`reqs` of several sessions through `runner` (a `PagedKVARDiffusionModelRunner`); one `RunnerOutput` per
    request, in order."""
    outputs: dict[int, Any] = {}
    for wave in _waves(runner, reqs):
        outputs.update(_serve_wave(runner, wave, od_config))
    return runner._runner_output_from_outputs(reqs, [outputs[i] for i in range(len(reqs))])


def _waves(runner, reqs: list) -> list[list[tuple[int, Any]]]:
    """Split the batch so a session appears once per wave, its requests in their order."""
    waves: list[tuple[set, list]] = []
    for index, req in enumerate(reqs):
        session_id = runner._request_session(req)[0]
        wave = next((w for w in waves if session_id not in w[0]), None)
        if wave is None:
            wave = (set(), [])
            waves.append(wave)
        wave[0].add(session_id)
        wave[1].append((index, req))
    return [members for _, members in waves]


def admit(runner, session_id: str, running: set[str]) -> None:
    """Make `session_id` resident: evict idle sessions (LRU, never one in `running`) down to the capacity, then
    admit it in the pool. Raises `CapacityError` naming why it cannot be, with nothing changed for it."""
    if session_id in runner._sessions:
        return
    while len(runner._sessions) >= runner._session_capacity:
        idle = next((s for s in runner._sessions if s not in running), None)
        if idle is None:
            raise CapacityError(
                f"session {session_id!r} cannot be admitted: the pool holds {runner._session_capacity} sessions "
                f"and all of them are running in this batch ({sorted(running)}); send it again once one "
                "finishes, or keep max_num_seqs at most the runner's session capacity"
            )
        runner._release_session(idle, reset_model=False, reason="lru_eviction")
    runner._sessions[session_id] = runner._new_session_state(session_id)


def _serve_wave(runner, wave: list[tuple[int, Any]], od_config) -> dict[int, Any]:
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.forward_context import set_forward_context
    from vllm_omni.diffusion.worker.diffusion_model_runner import _normalize_pipeline_outputs
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
    from vllm_omni.platforms import current_omni_platform

    outputs: dict[int, Any] = {}
    running: set[str] = set()
    served: list[tuple[int, Any, str, bool]] = []
    for index, req in wave:
        session_id, extra_args, tick = runner._request_session(req)
        reset = tick.reset if tick is not None else bool(extra_args.get("reset", False))
        close = tick.close_session if tick is not None else bool(extra_args.get("close_session", False))
        try:
            if reset:
                runner.reset_session(session_id)
            admit(runner, session_id, running)
        except CapacityError as exc:
            outputs[index] = DiffusionOutput(error=str(exc), error_type=type(exc).__name__)
            continue
        running.add(session_id)
        runner._prepare_request_for_forward(req, od_config=od_config)
        served.append((index, req, session_id, close))

    pipeline = runner.pipeline
    kv_cache = runner.kv_cache
    lock = Lockstep(lambda calls: kv_cache.run_batched(pipeline.transformer, calls), batch_signature)

    def body(req, session_id: str):
        def run():
            with runner._bound_ar_session(session_id, description="forward", synchronize=False):
                raw = pipeline.forward(DiffusionRequestBatch(requests=[req]))
            (out,) = _normalize_pipeline_outputs(raw, expected_count=1, allow_single_output=True,
                                                 pipeline_name=type(pipeline).__name__)
            return out
        return run

    use_hsdp = od_config.parallel_config.use_hsdp
    grad = torch.no_grad() if use_hsdp else torch.inference_mode()
    started = time.perf_counter()
    with grad, set_forward_context(vllm_config=runner.vllm_config, omni_diffusion_config=od_config), \
            lockstep_pipeline(pipeline, lock):
        results = lock.run([body(req, session_id) for _, req, session_id, _ in served])
    current_omni_platform.synchronize()
    elapsed = time.perf_counter() - started
    for (index, req, session_id, close), (ok, value) in zip(served, results):
        if not ok:
            outputs[index] = DiffusionOutput(error=f"{type(value).__name__}: {value}", error_type=type(value).__name__)
            continue
        outputs[index] = runner._prepare_output_for_transport(value, req.sampling_params)
        runner._perf_e2e_times.append(elapsed)
        if close:
            runner.close_session(session_id)
    runner.batched_model_calls += lock.batched_calls
    return outputs
