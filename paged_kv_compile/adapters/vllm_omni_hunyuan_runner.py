"""vllm-omni's diffusion runner serving HunyuanImage-3 from our pool, chosen by configuration.

    od_config = OmniDiffusionConfig(
        model_class_name="HunyuanImage3Pipeline",                                         # unchanged
        diffusion_model_runner_cls="paged_kv_compile.adapters.vllm_omni_hunyuan_runner.PagedKVHunyuanModelRunner",
        model_config={..., "paged_kv": {"kernel": "auto", "inner_compiler": "inductor", "block_size": 128}},
    )

Why this seam: vllm-omni's worker resolves `od_config.diffusion_model_runner_cls` before any other runner
(`diffusion/worker/diffusion_worker.py`, "explicit od_config.diffusion_model_runner_cls (user override)"), and
every transformer call of the pipeline goes through one method, `HunyuanImage3Model.forward` (called by
`forward_call`, itself called by `HunyuanImage3Text2ImagePipeline.__call__` once per denoising step). The runner
wraps that method on the loaded instance: the pipeline's code (its tokenizer-made right-padded CFG rows, its
`_update_model_kwargs_for_generation`, its autocast) runs unchanged, and each call becomes a planned forward
of ours: the first (`first_step=True`) admits the request with a spec read from the model's own prefill mask
(all CFG rows or none), the later ones are steps. The request is released when `execute_model` returns, and
aborted when it raises (an error inside a forward) or is cancelled (checked at every transformer call, so a
request-mode HunyuanImage-3 request is cancellable between steps). A request the pool cannot hold finishes with
an error output naming the capacity; the engine serves the next one.

Step execution (`step_execution=True`, `max_num_seqs > 1`, which vllm-omni refuses with its paged KV): each
`execute_stepwise` tick runs one forward per step group of the pipeline (`_denoise_step_group`); a request is
admitted right after `prepare_encode`, one runtime owner per CFG row, so that one `forward_batch` carries the
group's branch-major rows; released when it finishes, aborted when the scheduler drops it (`finished_req_ids`).

The pool is sized as vllm-omni sizes its own Diffusion KV: `vllm_config.cache_config.kv_cache_memory_bytes`
when set, else the budget the worker measured after its profile run (`available_bytes`); the rows one request
may hold are `od_config.diffusion_kv_max_rows_per_request` (default: 2, the CFG pair).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Any, Iterator

import torch

from ..backend import paged_kv_backend
from ..config import PagedKVConfig
from ..errors import CapacityError, ConfigError, RequestError
from ..families.hunyuan_image3 import HunyuanSpec
from ..runtime import PagedKVRuntime
from . import vllm_omni_hunyuan

from vllm_omni.diffusion.cancellation import check_request_cancellation  # noqa: E402  (vllm-omni users only)
from vllm_omni.diffusion.data import DiffusionOutput  # noqa: E402
from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner  # noqa: E402

logger = logging.getLogger(__name__)

RUNNER_PATH = "paged_kv_compile.adapters.vllm_omni_hunyuan_runner.PagedKVHunyuanModelRunner"
_OPTIONS = {"kernel", "inner_compiler", "block_size", "scratch_tokens_per_row"}


def _options(od_config) -> dict:
    raw = (getattr(od_config, "model_config", None) or {}).get("paged_kv") or {}
    unknown = set(raw) - _OPTIONS
    if unknown:
        raise ConfigError(f"model_config['paged_kv'] has unknown keys {sorted(unknown)}; known: {sorted(_OPTIONS)}")
    return raw


class HunyuanServing:
    """Our runtime attached to one loaded HunyuanImage-3 model: each `HunyuanImage3Model.forward` of the request
    being served is a planned forward of ours (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, runtime: PagedKVRuntime, rows_per_request: int) -> None:
        self.model = model
        self.runtime = runtime
        self.rows_per_request = rows_per_request
        self.adapter = vllm_omni_hunyuan.install(list(model.layers), runtime)
        self._ids = itertools.count()
        self.request_id: str | None = None  # the vllm-omni request being served
        self.owner_id: str | None = None  # its runtime owner, once admitted (runtime ids are single-use)
        self._dense_forward = model.forward
        model.forward = self._forward  # instance attribute: the class and other instances stay as they are
        # step execution: a runtime owner per (request, CFG branch), so that one forward can carry the
        # pipeline's branch-major rows ([cond of each request..., uncond of each request...]) in its order
        self.step_owners: dict[str, list[str]] = {}
        self._rope_embedders = [m.image_rope2d_emb for m in model.modules() if hasattr(m, "image_rope2d_emb")]
        self.group: list[str] | None = None  # the requests of the step group being forwarded, in row order
        self.ulysses = int(getattr(self.adapter.managers[0], "sp_size", 1))  # the Ulysses degree (1: none)

    @classmethod
    def build(cls, model: torch.nn.Module, *, budget_bytes: int, rows_per_request: int, dtype: torch.dtype,
              requests_per_forward: int = 1,
              device: str | torch.device = "cpu", block_size: int = 128, kernel: str = "auto",
              inner_compiler: str = "inductor", scratch_tokens_per_row: int | None = None) -> "HunyuanServing":
        """A pool of `budget_bytes` (scratch included) for `model`'s local KV heads, its layers compiled; one
        forward carries up to `requests_per_forward` requests (step batching)."""
        managers = vllm_omni_hunyuan._managers(list(model.layers))
        if not managers:
            raise ConfigError("no HunyuanImage3DecoderLayer attention found under model.layers: pass the loaded "
                              "HunyuanImage3Model (pipeline.model)")
        probe = managers[0]
        scratch = scratch_tokens_per_row or int(probe.image_token_len)
        cfg = PagedKVConfig(
            num_layers=len(model.layers), num_kv_heads=vllm_omni_hunyuan.ulysses_heads(probe)[1], head_dim=probe.head_dim,
            block_size=block_size, budget_bytes=budget_bytes, max_rows=rows_per_request * requests_per_forward,
            scratch_tokens_per_row=scratch, dtype=dtype, device=str(device), kernel=kernel,
            inner_compiler=inner_compiler, kv_gaps=False,  # a request's rows are whole prompts: nothing hidden
        )
        if getattr(probe, "sp_size", 1) > 1:
            # Ulysses keeps K/V at their KV heads (vllm_omni_hunyuan: the layer's compressed-K/V branch), so
            # vllm-omni's SDPA backend does the GQA and logs a debug line doing it: a graph break unless ignored.
            from vllm_omni.diffusion.attention.backends import sdpa as _sdpa

            torch._dynamo.config.ignore_logging_functions.add(_sdpa.logger.debug)
        runtime = PagedKVRuntime(cfg)
        runtime.allow_unconfigured_buckets()  # prompt lengths are the requests'; each new shape compiles once
        serving = cls(model, runtime, rows_per_request)
        for layer in model.layers:
            # A stand-in holds no data: the layers must run the rewritten graph, never eagerly.
            layer.forward = torch.compile(type(layer).forward.__get__(layer), backend=paged_kv_backend,
                                          fullgraph=True, dynamic=False)
        return serving

    def close(self) -> None:
        """Detach (reinitialization): the request in flight, if any, is aborted, the model's forward is its own
        again and the runtime lets go of the layers."""
        self._end(abort=True)
        for request_id in list(self.step_owners):
            self.end_step_request(request_id, abort=True)
        self.model.__dict__.pop("forward", None)
        self.runtime.close()

    # ---- one request ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def serving(self, request_id: str) -> Iterator[None]:
        """Serve `request_id` inside this block: released on return, aborted when it raises."""
        if self.request_id is not None:
            raise RequestError(f"request {request_id!r} started while {self.request_id!r} is served: one at a time")
        self.request_id = request_id
        try:
            yield
        except BaseException:
            self._end(abort=True)
            raise
        else:
            self._end(abort=False)

    def _end(self, *, abort: bool) -> None:
        owner, self.owner_id, self.request_id = self.owner_id, None, None
        if owner is not None and self.runtime.owner(owner) is not None:
            (self.runtime.abort if abort else self.runtime.release)(owner)

    def _admit(self, kwargs: dict[str, Any]) -> str:
        if self.owner_id is not None:  # a second first_step in one request: the prompt changed, start over
            self.runtime.abort(self.owner_id)
            self.owner_id = None
        mask, scatter = kwargs["attention_mask"], kwargs["gen_timestep_scatter_index"]
        self._check_rows(self.request_id, int(mask.shape[0]))
        spec = self.adapter.spec(mask, scatter, int(kwargs["num_image_tokens"]))
        owner = f"{self.request_id}#{next(self._ids)}"
        self._admit_owner(owner, spec, self.request_id)
        self.owner_id = owner
        return owner

    # ---- step execution: requests at different steps, one forward per step group ------------------
    def attach_step_mode(self, pipeline) -> None:
        """Observe the pipeline's step methods on the instance: admission right after `prepare_encode` (the
        request's mask and prompt lengths are known, no forward has run: a refusal is that request's error
        output), the requests of each `_denoise_step_group` (the row order of its forward), and a prompt-KV
        capture that keeps only the prompt lengths its masks need (the K/V is in our pool)."""
        from vllm_omni.diffusion.models.hunyuan_image3 import pipeline_hunyuan_image3 as _hy

        prepare_encode, denoise_group = pipeline.prepare_encode, pipeline._denoise_step_group
        layers = len(self.model.layers)
        probe = self.adapter.managers[0]

        def prepare_and_admit(state, **kwargs):
            state = prepare_encode(state, **kwargs)
            self.admit_step_request(state.request_id, state.extra[_hy._STEP_MODEL_KWARGS])
            return state

        def denoise_step_group(states):
            self.group = [state.request_id for state in states]
            try:
                return denoise_group(states)
            finally:
                self.group = None

        def capture_prompt_lens(states, row_state_indexes, row_branches):
            for state in states:
                lens = state.extra[_hy._STEP_MODEL_KWARGS]["gen_timestep_scatter_index"][:, -1].clone()
                empty = torch.empty(len(lens), 0, probe.num_kv_heads, probe.head_dim)
                state.extra[_hy._STEP_PROMPT_KV] = [{"key": empty, "value": empty, "lens": lens}] * layers

        pipeline.prepare_encode = prepare_and_admit
        pipeline._denoise_step_group = denoise_step_group
        pipeline._capture_prompt_kv_cache = capture_prompt_lens

    def admit_step_request(self, request_id: str, model_kwargs: dict[str, Any]) -> None:
        """One owner per CFG row of `request_id`, all or none."""
        if request_id in self.step_owners:
            raise RequestError(f"step request {request_id!r} is already admitted")
        mask, scatter = model_kwargs["attention_mask"], model_kwargs["gen_timestep_scatter_index"]
        rows = int(mask.shape[0])
        self._check_rows(request_id, rows)
        target = int(model_kwargs["num_image_tokens"])
        lens = sorted({int(p) for p in scatter[:, -1].tolist()})
        if len(lens) > 1:
            raise RequestError(
                f"request {request_id!r} has CFG rows of different prompt lengths {lens}: vllm-omni's step execution "
                "cannot split them (`_split_merged_kwargs_to_states` concatenates masks of different widths); serve "
                "it in request mode (step_execution=False), or pad its prompts to one length"
            )
        running = {self.runtime.owner(o[0]).spec.prefix_lens[0] for o in self.step_owners.values()}
        if running and running != set(lens):
            raise RequestError(
                f"request {request_id!r} has prompts of {lens[0]} tokens while step requests of {sorted(running)} "
                "tokens are in flight: vllm-omni's step merge of requests of different prompt lengths gives other "
                "numbers than each request alone, so this runner batches one prompt length at a time; resubmit it, "
                "serve it in request mode, or pad prompts to one length"
            )
        owners: list[str] = []
        try:
            for branch in range(rows):
                spec: HunyuanSpec = self.adapter.spec(mask[branch:branch + 1], scatter[branch:branch + 1], target)
                owner = f"{request_id}/{branch}#{next(self._ids)}"
                self._admit_owner(owner, spec, request_id)
                owners.append(owner)
        except BaseException:
            for owner in owners:
                self.runtime.abort(owner)
            raise
        self.step_owners[request_id] = owners

    def end_step_request(self, request_id: str, *, abort: bool) -> None:
        for owner in self.step_owners.pop(request_id, ()):
            if self.runtime.owner(owner) is not None:
                (self.runtime.abort if abort else self.runtime.release)(owner)

    def _forward_group(self, kwargs: dict[str, Any]):
        """One forward of a step group: row r is request `group[r % n]`, CFG branch `r // n` (`_step_row_order`)."""
        group, mask = self.group, kwargs["attention_mask"]
        n, rows = len(group), int(mask.shape[0])
        missing = [rid for rid in group if rid not in self.step_owners]
        if missing or rows % n:
            raise RequestError(f"step group {group} carries {rows} rows; not admitted: {missing}")
        first = bool(kwargs.get("first_step"))
        target = int(kwargs["num_image_tokens"])
        capacity = (int(kwargs["gen_timestep_scatter_index"][:, -1].max()) if first
                    else int(mask.shape[-1]) - target)  # the merged step mask pads prefixes to the longest
        phase = "prefill" if first else "step"
        items = [(self.step_owners[group[r % n]][r // n], phase,
                  {"prefix_capacity": capacity, "attention_mask": mask[r:r + 1]}) for r in range(rows)]
        probe = self.adapter.managers[0]
        standin = self.runtime.standin(rows, capacity, vllm_omni_hunyuan.ulysses_heads(probe)[1], probe.head_dim,
                                       writable=True)
        for manager in self.adapter.managers:
            manager._paged_kv_cache = (standin, standin)
        # `HunYuanRotary2DEmbedder` keeps the cos/sin of the first later step and reuses them until the next first
        # step: right for one request, stale once the step groups change between ticks (another group's rows).
        # Each group's forward reads the cos/sin its own inputs carry.
        for embedder in self._rope_embedders:
            embedder.custom_pos_emb = None
        with self.runtime.forward_batch(items):
            return self._dense_forward(**kwargs)

    def _check_rows(self, request_id: str, rows: int) -> None:
        if rows > self.rows_per_request:
            raise CapacityError(
                f"request {request_id!r} has {rows} CFG rows but diffusion_kv_max_rows_per_request="
                f"{self.rows_per_request}: raise it, or serve fewer rows per request"
            )

    def _admit_owner(self, owner: str, spec: HunyuanSpec, request_id: str) -> None:
        try:
            self.runtime.admit(owner, spec, rows=len(spec.prefix_lens))
        except CapacityError as exc:
            raise CapacityError(
                f"request {request_id!r} ({len(spec.prefix_lens)} rows, prompts {list(spec.prefix_lens)} + "
                f"{spec.target_len} target tokens) does not fit the HunyuanImage-3 pool "
                f"({self.runtime.scheduler.allocator.num_free} of {self.runtime.pool.blocks_per_layer} blocks of "
                f"{self.runtime.config.block_size} tokens free per layer): {exc}. Raise kv_cache_memory_bytes "
                "(or gpu_memory_utilization), or send shorter prompts"
            ) from exc

    def _forward(self, *args: Any, **kwargs: Any):
        if self.group is not None:
            return self._forward_group(kwargs)
        if self.request_id is None:
            raise RequestError("HunyuanImage3Model was called outside a request served by PagedKVHunyuanModelRunner: "
                               "its layers run paged attention only inside runner.execute_model")
        if args:
            raise RequestError("HunyuanImage3Model.forward is called with keyword arguments by its pipeline; "
                               f"got {len(args)} positional ones")
        check_request_cancellation()  # a cancelled request stops between transformer calls
        first = bool(kwargs.get("first_step"))
        if kwargs.get("paged_kv_cached_prefix_len") or kwargs.get("ar_kv_reuse_len"):
            raise RequestError("prefix-cache hits and imported AR KV are not served by this runner; use "
                               "diffusion_kv_mode='dense_legacy' with it")
        if first and self.ulysses > 1:
            image = int(kwargs["attention_mask"].shape[-1]) - int(kwargs["gen_timestep_scatter_index"][0, -1])
            if image % self.ulysses:
                raise ConfigError(
                    f"request {self.request_id!r}: its first step's {image} timestep + image + <eoi> tokens are not a "
                    f"multiple of ulysses_degree={self.ulysses}, so vllm-omni pads its image shard, which our plan "
                    "does not describe; choose a degree dividing them, or tensor / CFG parallel"
                )
        owner = self._admit(kwargs) if first else self.owner_id
        if owner is None:
            raise RequestError(f"request {self.request_id!r} ran a denoising step before its first step")
        u, target = self.ulysses, int(kwargs["num_image_tokens"])
        pad = 0 if first or u <= 1 else -target % u  # vllm-omni's Ulysses pads a step's image shard to the degree
        with self.adapter.forward(owner, phase="prefill" if first else "step",
                                  attention_mask=kwargs["attention_mask"], step_padding=pad):
            return self._dense_forward(**kwargs)


class PagedKVHunyuanModelRunner(DiffusionModelRunner):
    """`DiffusionModelRunner` whose HunyuanImage-3 transformer calls are planned forwards of our runtime."""

    paged_kv: HunyuanServing | None = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        if self.pipeline is not None:
            self.attach_paged_kv()

    def attach_paged_kv(self, *, available_bytes: int | None = None) -> HunyuanServing:
        """Build our pool for the loaded pipeline: `kv_cache_memory_bytes` when set (as vllm-omni's worker),
        else `available_bytes` (the budget after the profile run), else the device's free memory times
        `gpu_memory_utilization`."""
        if self.paged_kv is not None:  # reinitialization: the old pool lets go first
            self.paged_kv.close()
            self.paged_kv = None
        override = getattr(getattr(self.vllm_config, "cache_config", None), "kv_cache_memory_bytes", None)
        if override:
            budget = int(override)
        elif available_bytes is not None:
            budget = int(available_bytes)
        else:
            from vllm_omni.platforms import current_omni_platform

            utilization = float(self.vllm_config.cache_config.gpu_memory_utilization)
            budget = int(current_omni_platform.get_free_memory(torch.device(self.device)) * utilization)
        options = _options(self.od_config)
        if int(getattr(getattr(self.od_config, "parallel_config", None), "ring_degree", 1) or 1) > 1:
            raise ConfigError("ring sequence parallel HunyuanImage-3 is not paged by PagedKVHunyuanModelRunner: "
                              "use ring_degree=1 (strict Ulysses, tensor or CFG parallel)")
        inner = options.get("inner_compiler") or ("eager" if self.od_config.enforce_eager else "inductor")
        rows = int(getattr(self.od_config, "diffusion_kv_max_rows_per_request", None) or 2)
        step_mode = bool(getattr(self.od_config, "step_execution", False))
        self.paged_kv = HunyuanServing.build(
            self.pipeline.model, budget_bytes=budget, rows_per_request=rows, dtype=self.od_config.dtype,
            requests_per_forward=int(getattr(self.od_config, "max_num_seqs", 1) or 1) if step_mode else 1,
            device=self.device, block_size=int(options.get("block_size") or 128), kernel=options.get("kernel", "auto"),
            inner_compiler=inner, scratch_tokens_per_row=options.get("scratch_tokens_per_row"),
        )
        if step_mode:
            if self.paged_kv.ulysses > 1:
                raise ConfigError("step execution with sequence parallel HunyuanImage-3 is not served by "
                                  "PagedKVHunyuanModelRunner (its step groups are not planned with Ulysses' shard "
                                  "padding): use step_execution=False (request mode) with ulysses_degree > 1")
            self.paged_kv.attach_step_mode(self.pipeline)
        # Our bracket checks the request's cancellation signal at every transformer call.
        self.pipeline.supports_request_cancellation = True
        return self.paged_kv

    def execute_stepwise(self, scheduler_output):
        """One tick of step execution: requests at different steps, one forward per step group (the pipeline's
        grouping). A request's rows are released when it finishes, aborted when the scheduler drops it
        (`finished_req_ids`: cancelled, aborted), when its step errs, or when the tick raises."""
        serving = self._require_paged_kv()
        for request_id in scheduler_output.finished_req_ids:
            serving.end_step_request(request_id, abort=True)  # a finished one was released already
        tick = [r.request_id for r in scheduler_output.scheduled_new_reqs]
        tick += list(scheduler_output.scheduled_cached_reqs.request_ids)
        try:
            out = super().execute_stepwise(scheduler_output)
        except BaseException:
            for request_id in tick:
                serving.end_step_request(request_id, abort=True)
            raise
        for runner_output in out.runner_outputs:
            if runner_output.finished:
                failed = runner_output.result is not None and runner_output.result.error is not None
                serving.end_step_request(runner_output.request_id, abort=failed)
        return out

    def _require_paged_kv(self) -> HunyuanServing:
        if self.paged_kv is None:
            raise RuntimeError("PagedKVHunyuanModelRunner used before attach_paged_kv (load_model does it)")
        return self.paged_kv

    def execute_model(self, req, kv_prefetch_job=None, diffusion_kv_metadata=None) -> DiffusionOutput:
        self._require_paged_kv()
        if diffusion_kv_metadata is not None:
            raise ConfigError("PagedKVHunyuanModelRunner keeps its own pool: run it with diffusion_kv_mode="
                              "'dense_legacy' (vllm-omni's scheduler-managed paged KV is not used)")
        try:
            with self.paged_kv.serving(req.request_id):
                return super().execute_model(req, kv_prefetch_job=kv_prefetch_job)
        except (CapacityError, ConfigError) as exc:  # refused before admission: the engine serves the next one
            logger.warning("request %s not admitted: %s", req.request_id, exc)
            return DiffusionOutput(error=str(exc), error_type=type(exc).__name__)
