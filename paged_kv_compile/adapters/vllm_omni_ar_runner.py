"""vllm-omni's AR-Diffusion runner with our pool and our compiled paged attention, chosen by configuration.

    od_config = OmniDiffusionConfig(
        engine_backend="vllm_omni.experimental.ar_diffusion.engine.ARDiffusionEngine",   # unchanged
        diffusion_model_runner_cls="paged_kv_compile.adapters.vllm_omni_ar_runner.PagedKVARDiffusionModelRunner",
        model_config={..., "paged_kv": {"kernel": "auto", "inner_compiler": "inductor", "block_size": None,
                                        "cuda_graphs": "none", "kv_dtype": None, "kv_scales": None}},
    )

Several sessions per forward: `max_num_seqs > 1` with `custom_pipeline_args={"pipeline_class":
vllm_omni_ar_batch.PIPELINE_PATH}` (so that the engine batches requests); `execute_model_batch` then serves the
engine's batch in lockstep, one batched model call per step (`vllm_omni_ar_batch`; not with `cuda_graphs`).

Options (`model_config["paged_kv"]`, every key optional): `kernel`, `inner_compiler` and `block_size` as in
`PagedKVConfig`; `cuda_graphs` "none" (compiled blocks, host-launched) or "block" (warm up on the pipeline's
warm-up requests and capture one graph per block and shape before the first request is accepted, then serve by
replay and never compile: `vllm_omni_ar_capture`; on a CPU the replay runs only the compiled graphs); `kv_dtype`
None (the pool stores `od_config.dtype`) or "float8_e4m3fn" / "float8_e5m2" (an FP8 pool with static scales per
layer and kv head); `kv_scales` {"k": ..., "v": ...}, each a float or a [num_layers][num_kv_heads] list (1.0 when
absent), set before any session is admitted.

Models: the session state is chosen by the pipeline's transformer (`vllm_omni_ar_lingbot.paged_kv_class`):
LingBot-World's `CausalLingBotWorldTransformer3DModel` gets `LingBotPagedKV` (its cursor stand-ins, its sink checked
before every forward; `max_num_seqs` 1 and `cuda_graphs` "none" only, since its pipeline neither batches requests nor
declares warm-up requests), anything else DreamZero's `DreamZeroPagedKV`. Each names the block arguments dynamo
must treat as values (`dynamic_sources`), which `execute_model` sets.

Why this seam: vllm-omni's worker already resolves `od_config.diffusion_model_runner_cls` before the runner the
engine declares (`diffusion/worker/diffusion_worker.py`, "explicit od_config.diffusion_model_runner_cls (user
override)"), so a deployment selects this runner with one config line and vllm-omni stays unchanged. The
`ar_diffusion_kv_config` dict is parsed into `ARDiffusionKVConfig(**raw)`, which rejects unknown keys, and a
vLLM plugin entry point runs in every process for every model; neither is needed.

Everything the base runner does stays: sessions that persist across requests, `extra_args["reset"]`, LRU
eviction at `_session_capacity`, `close_session`, the fail-closed release of a session whose forward raised, the
pipeline's warm-up requests (`_warmup_ar_rollout`). What changes: `_preallocate_kv_cache` sizes our runtime
with vllm-omni's budget rule instead of building `ARDiffusionKVCache`, binds it to the transformer's blocks and
compiles them with `backend="paged_kv"` at the settings of DreamZero's `setup_compile` (`fullgraph=True,
dynamic=False`, replacing its Inductor compile of the same blocks); `_new_session_state` hands the pipeline our
session state; `_bound_ar_session` closes the last forward of an invocation; `execute_model` marks
`current_start_frame` a value for dynamo (one compiled frame per bucket at every start frame);
`execute_model_batch`, which the base runner refuses, serves several sessions per forward.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

from ..backend import paged_kv_backend
from ..errors import ConfigError
from .vllm_omni_ar_batch import serve_batch
from .vllm_omni_ar_capture import FrameCaptures, check_granularity, record_block_calls
from .vllm_omni_ar_diffusion import DreamZeroPagedKV, PagedKVSessionState, parse_kv_dtype
from .vllm_omni_ar_lingbot import LingBotPagedKV, paged_kv_class

from vllm_omni.diffusion.models.interface import supports_step_execution  # noqa: E402  (vllm-omni users only)
from vllm_omni.experimental.ar_diffusion.capability import SupportsARDiffusionWarmup  # noqa: E402
from vllm_omni.experimental.ar_diffusion.runner import ARDiffusionModelRunner  # noqa: E402

RUNNER_PATH = "paged_kv_compile.adapters.vllm_omni_ar_runner.PagedKVARDiffusionModelRunner"


OPTIONS = ("kernel", "inner_compiler", "block_size", "cuda_graphs", "kv_dtype", "kv_scales")


def _options(od_config) -> dict:
    raw = (getattr(od_config, "model_config", None) or {}).get("paged_kv") or {}
    unknown = set(raw) - set(OPTIONS)
    if unknown:
        raise ValueError(f"model_config['paged_kv'] has unknown keys {sorted(unknown)}; known: {', '.join(OPTIONS)}")
    return raw


def _dynamic_sources(existing: str, sources: tuple[str, ...]) -> str:
    parts = [s for s in (existing or "").split(",") if s]
    return ",".join([*parts, *(s for s in sources if s not in parts)])


class PagedKVARDiffusionModelRunner(ARDiffusionModelRunner):
    """`ARDiffusionModelRunner` whose sessions live in a `PagedKVRuntime` (see the module docstring)."""

    kv_cache: DreamZeroPagedKV | None
    graphs: FrameCaptures | None = None  # the captured blocks (cuda_graphs="block"), installed in the model
    startup: dict | None = None  # what the capture at startup took (seconds), when it ran
    batched_model_calls: int = 0  # model calls `execute_model_batch` made (each carrying several sessions' rows)

    def _preallocate_kv_cache(self, *, available_bytes: int | None = None) -> None:
        # The base runner's admission rules, unchanged (runner.py: `_preallocate_kv_cache`).
        if bool(getattr(self.od_config, "step_execution", False)) and not supports_step_execution(self.pipeline):
            raise ValueError("ARDiffusionModelRunner currently supports request-mode execution only; "
                             "step_execution=True would bypass per-request AR session binding.")
        # Several sessions per forward (max_num_seqs > 1) are served by `execute_model_batch` (lockstep), which
        # binds every session it runs: the base runner's refusals of max_num_seqs > 1 and of request-batch
        # pipelines do not apply.
        max_num_seqs = int(getattr(self.od_config, "max_num_seqs", 1) or 1)
        capability = self._require_capability(self.pipeline)
        spec = capability.ar_diffusion_kv_cache_spec()
        options = _options(self.od_config)
        inner = options.get("inner_compiler") or ("eager" if self.od_config.enforce_eager else "inductor")
        transformer = self.pipeline.transformer
        cuda_graphs = check_granularity(options.get("cuda_graphs") or "none")
        if max_num_seqs > 1 and cuda_graphs != "none":
            raise ConfigError(f"cuda_graphs={cuda_graphs!r} captures the warm-up requests' batch-1 shapes; with "
                              f"max_num_seqs={max_num_seqs} the batched forwards have shapes it never captured: "
                              "use cuda_graphs='none' with max_num_seqs > 1, or max_num_seqs=1")
        if cuda_graphs != "none" and not isinstance(self.pipeline, SupportsARDiffusionWarmup):
            raise ConfigError("cuda_graphs needs the pipeline's warm-up requests (ar_diffusion_warmup_requests) to "
                              "know every shape it serves before the first request; this pipeline has none: use "
                              "cuda_graphs='none'")
        kv_class = paged_kv_class(transformer)
        if kv_class is LingBotPagedKV and max_num_seqs > 1:
            raise ConfigError(f"max_num_seqs={max_num_seqs}: LingBot-World's pipeline serves one request per forward "
                              "(its _parse_request refuses request batches); use max_num_seqs=1")
        self.kv_cache = kv_class.build(
            transformer, spec,
            available_bytes=self._available_memory_bytes() if available_bytes is None else available_bytes,
            memory_fraction=self.ar_diffusion_kv_config.gpu_memory_fraction, dtype=self.od_config.dtype,
            device=self.device, block_size=options.get("block_size"), kernel=options.get("kernel", "auto"),
            inner_compiler=inner, kv_dtype=parse_kv_dtype(options.get("kv_dtype")),
            kv_scales=options.get("kv_scales"), sessions_per_forward=max_num_seqs,
        )
        self._ar_diffusion_capability = capability
        self._ar_diffusion_kv_cache_spec = spec
        self._session_capacity = self.kv_cache.session_capacity
        for block in transformer.blocks:
            # A stand-in holds no data: the blocks must run the rewritten graph, never eagerly (even under
            # enforce_eager, where the rewritten graph runs without Inductor).
            block.forward = torch.compile(type(block).forward.__get__(block), backend=paged_kv_backend,
                                          fullgraph=True, dynamic=False)
        self.graphs = None
        if cuda_graphs != "none":
            self._capture_at_startup()

    def _capture_at_startup(self) -> None:
        """Serve the pipeline's warm-up requests (compiling every bucket at every start frame they reach, their
        block calls recorded), release their session, then capture those calls and install the captures: from
        here on a forward replays and never compiles."""
        transformer, runtime = self.pipeline.transformer, self.kv_cache.runtime
        sid = self._WARMUP_SID
        t0 = time.perf_counter()
        with record_block_calls(transformer.blocks, runtime) as examples:
            try:
                for request in self.pipeline.ar_diffusion_warmup_requests(sid):
                    out = self.execute_model(request)
                    if getattr(out, "error", None):
                        raise RuntimeError(f"warm-up request {request.request_id} failed: {out.error}")
            finally:
                self._release_session(sid, reset_model=False, reason="warmup_complete", suppress_errors=True)
                self._perf_e2e_times.clear()
        t1 = time.perf_counter()
        graphs = FrameCaptures(transformer.blocks, runtime, examples)
        # The capture runs the frames the warm-up requests compiled (record_block_calls); serving replays and calls
        # dynamo no more.
        sources = _dynamic_sources(torch.compiler.config.dynamic_sources, self.kv_cache.dynamic_sources)
        with torch.compiler.config.patch(dynamic_sources=sources):
            graphs.warmup()
        graphs.install()
        self.graphs = graphs
        self.startup = {"warmup_requests_s": round(t1 - t0, 3), "capture_s": round(time.perf_counter() - t1, 3),
                        "of_which_static_buffer_forwards_s": round(graphs.compile_s, 3),
                        "of_which_graphs_s": round(graphs.capture_s, 3), "captured": len(graphs.buckets)}

    def _new_session_state(self, session_id: str) -> PagedKVSessionState:
        if self.kv_cache is None:
            raise RuntimeError("AR-Diffusion session requested before KV cache initialization")
        return self.kv_cache.begin_session(session_id)

    @contextlib.contextmanager
    def _bound_ar_session(self, session_id: str, *, description: str, synchronize: bool = True) -> Iterator[None]:
        with super()._bound_ar_session(session_id, description=description, synchronize=synchronize):
            yield
            self._sessions[session_id].end_invocation()

    def _compile_settings(self) -> contextlib.AbstractContextManager:
        model_sources = self.kv_cache.dynamic_sources if self.kv_cache is not None else ()
        sources = _dynamic_sources(torch.compiler.config.dynamic_sources, model_sources)
        stack = contextlib.ExitStack()
        stack.enter_context(torch.compiler.config.patch(dynamic_sources=sources))
        if self.graphs is not None:
            stack.enter_context(torch.compiler.set_stance("fail_on_recompile"))
        return stack

    def execute_model(self, req, kv_prefetch_job=None):
        with self._compile_settings():
            return super().execute_model(req, kv_prefetch_job=kv_prefetch_job)

    def execute_model_batch(self, scheduler_output, od_config):
        """The engine's requests of several sessions (max_num_seqs > 1), served in lockstep: one batched model
        call per step of their loops (`vllm_omni_ar_batch`); a request that cannot be admitted is answered with
        an error and the others proceed."""
        with self._compile_settings():
            return serve_batch(self, [new.req for new in scheduler_output.scheduled_new_reqs], od_config)
