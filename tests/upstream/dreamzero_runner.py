"""vllm-omni's `ARDiffusionModelRunner` serving its `DreamZeroPipeline` on a CPU, at a tiny size.

The closest real objects of vllm-omni's AR-Diffusion stack that run here (vllm-omni 0.30.0):

* the runner is the package's `ARDiffusionModelRunner` (or a subclass named by `diffusion_model_runner_cls`),
  built by its own constructor; only `load_model` is replaced by handing it the pipeline below, because loading
  reads a checkpoint. `_preallocate_kv_cache(available_bytes=...)` then sizes its pools as at load time (the CPU
  platform has no `get_free_memory`), and `execute_model(request)` serves requests: session lookup, LRU
  eviction, `extra_args["reset"]`, `_bound_ar_session`, the pipeline's forward, fail-closed release;
* the pipeline is `DreamZeroPipeline` with everything from `_kv_get` down unchanged: the capability methods
  (`ar_diffusion_kv_cache_spec`, `bind_ar_diffusion_state`, reset/close), `_kv_get`, `_kv_commit`,
  `_kv_get_cross`, `_kv_populate_cross`, `_kv_reset`, `_prefill_kv_cache`, `diffuse`, `predict_noise`,
  `predict_noise_maybe_with_cfg`, `combine_cfg_noise`, the session state (`DreamZeroState`, its
  `reset_reason`), its UniPC schedulers, and the real `CausalWanModel` (random weights, tiny geometry).

What is stubbed, and why: `TinyDreamZeroPipeline.__init__` sets the fields the methods above read instead of
loading a checkpoint (DreamZero's constructor needs config.json, the umt5-xxl tokenizer, a 4096-wide UMT5
encoder, the Wan VAE and CLIP); its `forward` is `DreamZeroPipeline.forward` without the encoders: the request
carries the observation latents, the prompt's token ids and its embeddings (what tokenizer, UMT5, the robot
transform and the VAE would produce), and the actions come back un-normalized (no embodiment statistics). The
model is text-to-video, so the conditioning `ys` has no channels (DreamZero-DROID's image conditioning and CLIP
branch are left out) and CFG runs sequentially (one rank; `predict_noise_maybe_with_cfg` runs both branches).
Everything runs in fp32 (`od_config.dtype`), the pool dtype included.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import vllm_omni_cpu

AR_ENGINE = "vllm_omni.experimental.ar_diffusion.engine.ARDiffusionEngine"


@dataclass(frozen=True)
class TinyGeometry:
    """DreamZero's pipeline geometry at a CPU size (frame_seqlen = h * w / 4 with patch 1x2x2)."""

    num_layers: int = 2
    dim: int = 32
    num_heads: int = 2
    frame_hw: tuple[int, int] = (4, 8)
    num_frame_per_block: int = 2
    max_chunk_size: int = 2  # window = max_chunk_size * nfpb + 1 frames (CausalWanModel)
    num_action_per_block: int = 3
    num_state_per_block: int = 1
    text_len: int = 6
    steps: int = 2
    cfg_scale: float = 2.0
    seed: int = 0

    @property
    def frame_seqlen(self) -> int:
        return self.frame_hw[0] * self.frame_hw[1] // 4


def _pipeline_class():
    vllm_omni_cpu.install()
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.models.dreamzero.pipeline_dreamzero import DreamZeroPipeline, VideoActionScheduler
    from vllm_omni.diffusion.models.schedulers.scheduling_flow_unipc_multistep import FlowUniPCMultistepScheduler

    class TinyDreamZeroPipeline(DreamZeroPipeline):
        """`DreamZeroPipeline` over a tiny `CausalWanModel`, fed pre-encoded inputs (see the module docstring)."""

        def __init__(self, *, od_config, transformer, geometry: TinyGeometry, negative_prompt_embeds: torch.Tensor):
            nn.Module.__init__(self)
            self.od_config = od_config
            self.transformer = transformer
            self.scheduler = FlowUniPCMultistepScheduler(num_train_timesteps=1000, shift=1,
                                                         use_dynamic_shifting=False)
            self.num_frame_per_block = transformer.num_frame_per_block
            self._states = OrderedDict()
            self._use_memory_manager, self._memory_manager = False, None
            self.state = self._get_or_create_state("default")
            self.num_inference_steps = geometry.steps
            self.cfg_scale = geometry.cfg_scale
            self.sigma_shift = 5.0
            self.num_frames = transformer.local_attn_size
            self.action_horizon = geometry.num_action_per_block
            self.decouple_inference_noise = False
            self.seed = geometry.seed
            self._negative_prompt_embeds_cache = negative_prompt_embeds
            self.geometry = geometry

        def ar_diffusion_warmup_requests(self, session_id: str):
            """The pipeline's own warm-up plan (one request per window-fill shape, the first a reset) on tiny
            inputs: `DreamZeroPipeline.ar_diffusion_warmup_requests` builds robot observations instead."""
            spec = self.ar_diffusion_kv_cache_spec()
            n_forwards = 1 + math.ceil(max(0, spec.window_frames - 1) / spec.frames_per_block)
            inputs = request_inputs(self.geometry, n_forwards, seed=1234)
            for index, extra in enumerate(inputs):
                yield make_request(f"ardiffusion-warmup-{index}", session_id, extra, reset=index == 0)

        @torch.no_grad()
        def forward(self, req, **kwargs):
            """`DreamZeroPipeline.forward` from the reset decision to the denoise loop, on pre-encoded inputs."""
            extra_args = req.sampling_params.extra_args or {}
            session_id = str(extra_args.get("session_id") or "default")
            state = self._get_or_create_state(session_id)
            self.state = state
            text_tokens = extra_args["prompt_tokens"]
            reset_reason = state.reset_reason(text_tokens, 0, self.transformer.local_attn_size)
            if reset_reason == "session":
                self._kv_reset(state)
            elif reset_reason == "inference":
                self._kv_reset(state, clear_video_latents=False)
            state.language = text_tokens
            if state.prompt_embeds is None:
                state.prompt_embeds = extra_args["prompt_embeds"]
            prompt_embeds = state.prompt_embeds
            negative_prompt_embeds = self._negative_prompt_embeds_cache if self.cfg_scale > 1.0 else None

            obs = extra_args["obs_latents"]  # (1, C, T, h, w): 1 frame on a session's first call, else nfpb
            _, _, _, h, w = obs.shape
            if state.current_start_frame == 0:
                obs = obs[:, :, -1:]  # a window's first commit sees one frame (`image = videos[:, :, -1:]`)
                state.clip_feas = None
                state.ys = obs.new_zeros(1, 0, self.num_frames, h, w)  # t2v: no image conditioning channels
                self._kv_populate_cross(prompt_embeds, state.clip_feas, is_negative=False)
                if negative_prompt_embeds is not None:
                    self._kv_populate_cross(negative_prompt_embeds, state.clip_feas, is_negative=True)
            image = obs
            generator = torch.Generator().manual_seed(self.seed)
            noise_obs = torch.randn(1, obs.shape[1], self.num_frame_per_block, h, w, generator=generator)
            generator = torch.Generator().manual_seed(self.seed)
            noise_action = torch.randn(1, self.action_horizon, self.transformer.action_dim, generator=generator)
            frame_seqlen = h * w // 4
            seq_len = frame_seqlen * self.num_frame_per_block
            image = image.transpose(1, 2)
            noise_obs = noise_obs.transpose(1, 2)
            do_true_cfg = self.cfg_scale > 1.0 and negative_prompt_embeds is not None
            self._prefill_kv_cache(image, prompt_embeds, negative_prompt_embeds, frame_seqlen, seq_len, do_true_cfg,
                                   state)
            video_scheduler = _copy_scheduler(self.scheduler, self.num_inference_steps, self.sigma_shift)
            action_scheduler = _copy_scheduler(self.scheduler, self.num_inference_steps, self.sigma_shift)
            video_out, action_out = self.diffuse(
                video_latents=noise_obs, action_latents=noise_action,
                timesteps_video=video_scheduler.timesteps, timesteps_action=action_scheduler.timesteps,
                prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
                video_action_scheduler=VideoActionScheduler(video_scheduler, action_scheduler),
                do_true_cfg=do_true_cfg, state=state, seq_len=seq_len,
                state_features=extra_args["state_features"], embodiment_id=torch.zeros(1, dtype=torch.long),
            )
            if state.current_start_frame == 1:
                video_out = torch.cat([image, video_out], dim=1)
            state.current_start_frame += self.num_frame_per_block
            return DiffusionOutput(output={"actions": action_out, "video": video_out.transpose(1, 2)})

    return TinyDreamZeroPipeline


def _copy_scheduler(scheduler, steps: int, shift: float):
    import copy

    out = copy.deepcopy(scheduler)
    out.set_timesteps(steps, device="cpu", shift=shift)
    return out


def request_inputs(geometry: TinyGeometry, calls: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """What the encoders would hand the pipeline for `calls` consecutive requests of one session."""
    g = torch.Generator().manual_seed(seed)
    h, w = geometry.frame_hw
    text_dim, state_dim = 8, 6  # tiny_dreamzero_model's text_dim and max_state_dim
    prompt_embeds = torch.randn(1, geometry.text_len, text_dim, generator=g)
    prompt_tokens = torch.randint(0, 100, (1, geometry.text_len), generator=g)
    out = []
    for index in range(calls):
        frames = 1 if index == 0 else geometry.num_frame_per_block
        out.append({
            "prompt_tokens": prompt_tokens, "prompt_embeds": prompt_embeds,
            "obs_latents": torch.randn(1, 4, frames, h, w, generator=g),
            "state_features": torch.randn(1, geometry.num_state_per_block, state_dim, generator=g),
        })
    return out


def make_request(request_id: str, session_id: str, extra: dict[str, Any], *, reset: bool = False):
    """An `OmniDiffusionRequest` carrying a session id and the pre-encoded inputs, as the serving API builds it."""
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    extra_args = {**extra, "session_id": session_id}
    if reset:
        extra_args["reset"] = True
    return OmniDiffusionRequest(prompt="tiny", sampling_params=OmniDiffusionSamplingParams(extra_args=extra_args),
                                request_id=request_id)


def build_pipeline(geometry: TinyGeometry, od_config):
    """A `TinyDreamZeroPipeline` with seeded random weights (the same for the same geometry)."""
    model = vllm_omni_cpu.tiny_dreamzero_model(
        num_layers=geometry.num_layers, dim=geometry.dim, num_heads=geometry.num_heads, frame_hw=geometry.frame_hw,
        num_frame_per_block=geometry.num_frame_per_block, max_chunk_size=geometry.max_chunk_size,
        num_action_per_block=geometry.num_action_per_block, num_state_per_block=geometry.num_state_per_block,
        text_len=geometry.text_len, seed=geometry.seed,
    )
    negative = torch.zeros(1, geometry.text_len, 8)  # the empty prompt's embedding
    return _pipeline_class()(od_config=od_config, transformer=model, geometry=geometry,
                             negative_prompt_embeds=negative)


def diffusion_config(*, runner_cls: str | None = None, enforce_eager: bool = True, **overrides):
    """The `OmniDiffusionConfig` a DreamZero deployment uses (AR-Diffusion engine), fp32, `max_num_seqs=1`."""
    kw: dict[str, Any] = dict(dtype=torch.float32, engine_backend=AR_ENGINE, enforce_eager=enforce_eager)
    if runner_cls is not None:
        kw["diffusion_model_runner_cls"] = runner_cls
    kw.update(overrides)
    return vllm_omni_cpu.diffusion_config(**kw)


def build_runner(pipeline, od_config, *, available_bytes: int):
    """The runner `od_config` selects (as the worker resolves it), serving `pipeline` with pools sized for
    `available_bytes` (what `get_free_memory` would report on a GPU)."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.import_utils import resolve_obj_by_qualname

    path = od_config.diffusion_model_runner_cls or "vllm_omni.experimental.ar_diffusion.runner.ARDiffusionModelRunner"
    runner_cls = resolve_obj_by_qualname(path)
    with set_current_vllm_config(vllm_omni_cpu.vllm_config()):
        runner = runner_cls(vllm_omni_cpu.vllm_config(), od_config, torch.device("cpu"))
    runner.pipeline = pipeline  # what load_model's loader would produce
    runner._preallocate_kv_cache(available_bytes=available_bytes)
    return runner


def serve(runner, requests) -> list:
    """`execute_model` per request, inside the vLLM config the worker runs under; returns the outputs."""
    from vllm.config import set_current_vllm_config

    outs = []
    with set_current_vllm_config(vllm_omni_cpu.vllm_config()):
        for req in requests:
            out = runner.execute_model(req)
            if out.error:
                raise RuntimeError(f"request {req.request_id} failed: {out.error}")
            outs.append(out.output)
    return outs


def serve_batch(runner, requests) -> list:
    """The requests as vllm-omni's engine serves them with `max_num_seqs > 1`: its `RequestScheduler` admits them,
    schedules them as one wave (checked: all of them), the runner's `execute_model_batch` runs the wave, and the
    scheduler takes the output back; inside the vLLM config the worker runs under. One `DiffusionOutput` per
    request, errors included (an error is a response here, not an exception)."""
    from vllm.config import set_current_vllm_config
    from vllm_omni.diffusion.sched.request_scheduler import RequestScheduler

    scheduler = RequestScheduler()
    scheduler.initialize(runner.od_config)
    for req in requests:
        scheduler.add_request(req)
    scheduled = scheduler.schedule()
    if sorted(scheduled.scheduled_request_ids) != sorted(r.request_id for r in requests):
        raise AssertionError(f"the scheduler put {scheduled.scheduled_request_ids} in one wave, not all of "
                             f"{[r.request_id for r in requests]} (max_num_seqs={runner.od_config.max_num_seqs})")
    with set_current_vllm_config(vllm_omni_cpu.vllm_config()):
        out = runner.execute_model_batch(scheduled, runner.od_config)
    finished = scheduler.update_from_output(scheduled, out)
    if finished != {r.request_id for r in requests}:
        raise AssertionError(f"the scheduler finished {sorted(finished)} of {[r.request_id for r in requests]}")
    return [out[r.request_id].result for r in requests]


# ---- the dense oracle behind the same runner ----------------------------------------------------------------


class _DenseLayer:
    is_ar_diffusion_paged_context = True  # CausalWanModel._forward_blocks: prepare, then to_layer_inputs()

    def __init__(self, forward, layer: int) -> None:
        self.forward_ctx, self.layer = forward, layer

    def to_layer_inputs(self) -> torch.Tensor:
        return self.forward_ctx.state.caches[self.forward_ctx.kv_branch][self.layer]


class _DenseForward:
    def __init__(self, state, kv_branch: str, seq_len: int, commit: bool) -> None:
        self.state, self.kv_branch, self.seq_len, self.commit = state, kv_branch, seq_len, commit

    def prepare(self, device, action_len: int, query_len: int) -> None:
        self.state.running = self


class DenseSessionState:
    """The dense legacy idiom behind the runner: per branch a growing `(2, 1, L, H, D)` cache per layer, replaced
    by what the blocks return when a commit is confirmed (`commit_paged_context`). The blocks' returned caches
    are caught by a forward hook on the transformer (`DenseKVStore`)."""

    def __init__(self, store: "DenseKVStore", session_id: str) -> None:
        self.kv_cache, self.session_id = store, session_id
        self.running: _DenseForward | None = None
        self.updated: dict[str, list[torch.Tensor]] = {}
        self.reset()

    def reset(self, *, keep_cross_attention=()) -> None:
        empty = self.kv_cache.empty
        self.caches = {b.name: [empty] * self.kv_cache.num_layers for b in self.kv_cache.kv_branches}
        kept = getattr(self, "cross", {})
        self.cross = {k: v for k, v in kept.items() if k[1] in keep_cross_attention}

    def get_kv_caches(self, kv_branch: str, seq_len=None, commit_current: bool = False):
        forward = _DenseForward(self, kv_branch, int(seq_len), bool(commit_current))
        return [_DenseLayer(forward, i) for i in range(self.kv_cache.num_layers)]

    def model_returned(self, updated: list[torch.Tensor]) -> None:
        if self.running is not None:
            self.updated[self.running.kv_branch] = updated
            self.running = None

    def commit_paged_context(self, kv_branch: str) -> None:
        if kv_branch in self.updated:
            self.caches[kv_branch] = self.updated.pop(kv_branch)

    def end_invocation(self, error=None) -> None:
        self.running, self.updated = None, {}

    def is_cross_attention_populated(self, kv_branch: str, cache_name: str) -> bool:
        return (kv_branch, cache_name) in self.cross

    def populate_cross_attention(self, kv_branch: str, cache_name: str, layer_kv) -> None:
        self.cross[(kv_branch, cache_name)] = [(k.clone(), v.clone()) for k, v in layer_kv]

    def get_cross_attention_kv(self, kv_branch: str, cache_name: str):
        return [{"is_init": True, "k": k, "v": v} for k, v in self.cross[(kv_branch, cache_name)]]

    def close(self) -> None:
        self.caches, self.cross = {}, {}


class DenseKVStore:
    """The dense oracle's `kv_cache`: geometry from the spec, a hook that hands each branch forward's returned
    caches to the session that ran it."""

    def __init__(self, ar_spec, transformer) -> None:
        attn = transformer.blocks[0].self_attn
        self.kv_branches, self.num_layers = ar_spec.kv_branches, ar_spec.num_layers
        self.cross_attention_lengths = dict(ar_spec.cross_attention_lengths)
        self.empty = torch.zeros(2, 1, 0, attn.tp_num_heads, attn.head_dim)
        self.session_capacity = ar_spec.session_capacity
        self.current: DenseSessionState | None = None
        transformer.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        if self.current is not None:
            self.current.model_returned(output[2])


def dense_runner_class():
    """`ARDiffusionModelRunner` whose sessions keep dense caches: column 1 (the oracle) through the same runner."""
    vllm_omni_cpu.install()
    import contextlib

    from vllm_omni.experimental.ar_diffusion.runner import ARDiffusionModelRunner

    class DenseARDiffusionModelRunner(ARDiffusionModelRunner):
        def _preallocate_kv_cache(self, *, available_bytes=None) -> None:
            capability = self._require_capability(self.pipeline)
            spec = capability.ar_diffusion_kv_cache_spec()
            self.kv_cache = DenseKVStore(spec, self.pipeline.transformer)
            self._ar_diffusion_capability, self._ar_diffusion_kv_cache_spec = capability, spec
            self._session_capacity = spec.session_capacity

        def _new_session_state(self, session_id: str) -> DenseSessionState:
            return DenseSessionState(self.kv_cache, session_id)

        @contextlib.contextmanager
        def _bound_ar_session(self, session_id, *, description, synchronize=True):
            with super()._bound_ar_session(session_id, description=description, synchronize=synchronize):
                state = self._sessions[session_id]
                self.kv_cache.current = state
                try:
                    yield
                finally:
                    self.kv_cache.current = None
                    state.end_invocation()

    return DenseARDiffusionModelRunner


DENSE_RUNNER = "upstream.dreamzero_runner.DenseARDiffusionModelRunner"


def lazy_class(module_globals: dict, name: str, build):
    """A module `__getattr__` that builds class `name` on first access (resolved by qualname, as the worker
    resolves runners; vllm-omni's base class is imported only then) and keeps it in the module."""

    def __getattr__(attr: str):
        if attr != name:
            raise AttributeError(attr)
        cls = module_globals[attr] = build()
        return cls

    return __getattr__


__getattr__ = lazy_class(globals(), "DenseARDiffusionModelRunner", dense_runner_class)
