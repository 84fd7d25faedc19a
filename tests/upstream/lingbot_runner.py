"""vllm-omni's `ARDiffusionModelRunner` serving its `LingBotWorldCausalDMDPipeline` on a CPU, at a tiny size.

The runner is the package's (or a subclass named by `diffusion_model_runner_cls`), built as
`dreamzero_runner.build_runner` builds it. The pipeline is `LingBotWorldCausalDMDPipeline` with its request path
unchanged: `forward` (tick parsing, session state, chunk-index checks, the generator carried across ticks),
`_parse_request`, `_prepare_camera` (a camera trajectory per tick, joined to the previous tick's tail, Plücker
rays folded onto the latent grid), `_session_text_caches` / `_ar_text_caches` (the text K/V populated once into
the bound state), `_generate_block` and `LingBotDMDBlockRunner` (four DMD probes, one clean commit, the state's
`get_kv_caches` / `commit_paged_context`), `ar_diffusion_kv_cache_spec`, `bind_ar_diffusion_state`, reset/close,
over the real `CausalLingBotWorldTransformer3DModel` (random weights, `lingbot_world.TinyLingBot`).

What is stubbed, and why: `TinyLingBotPipeline.__init__` sets the fields those methods read instead of loading a
checkpoint (UMT5 tokenizer and encoder, the Wan VAE, config files); `encode_prompt` returns a seeded embedding per
prompt, zero beyond its tokens (what UMT5 would hand back, padded to 512); `_next_condition_chunk` returns the
image pooled onto the latent grid plus the temporal-mask channel (what the Wan encoder would produce; the tiny
model's condition has `in_channels - out_channels` channels); the VAE's per-session byte counts are 0 (no VAE).
Imports: `av` and `torchvision.transforms.functional` are placeholders (the pipeline module imports them for
media encoding and image transforms this path never calls; neither is installed here). Everything is fp32.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
import zlib
from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import dreamzero_runner as dr
from . import lingbot_world as lb
from . import vllm_omni_cpu

GEOMETRY = lb.TinyLingBot()
VAE_SPATIAL = 8  # the Wan VAE's spatial factor: pixels per latent
PIXELS = (GEOMETRY.latent_hw[0] * VAE_SPATIAL, GEOMETRY.latent_hw[1] * VAE_SPATIAL)
TEXT_TOKENS = 512  # the pipeline's _MAX_SEQUENCE_LENGTH: every prompt embedding is padded to it


def _placeholder(name: str, *, package: bool = False) -> None:
    if name in sys.modules:
        return
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    if package:
        module.__path__ = []
    sys.modules[name] = module


def install() -> None:
    """lingbot_world's shims, and the pipeline module importable (placeholders for PyAV and torchvision's
    functional transforms, neither called on this path)."""
    lb.install()
    try:
        import av  # noqa: F401
    except ImportError:
        _placeholder("av")
    try:
        import torchvision.transforms.functional  # noqa: F401
    except ImportError:
        sys.modules["torchvision.transforms"].__path__ = []
        _placeholder("torchvision.transforms.functional")


def _pipeline_class():
    install()
    from vllm_omni.diffusion.models.lingbot_world.pipeline import LingBotWorldCausalDMDPipeline
    from vllm_omni.diffusion.models.schedulers import FlowUniPCMultistepScheduler

    class TinyLingBotPipeline(LingBotWorldCausalDMDPipeline):
        """`LingBotWorldCausalDMDPipeline` over a tiny transformer, without UMT5 or the Wan VAE (module docstring)."""

        def __init__(self, *, od_config, transformer) -> None:
            nn.Module.__init__(self)
            self.od_config = od_config
            self._reuse_last_step_kv = False
            self.device = torch.device("cpu")
            self.transformer = transformer
            self.scheduler = FlowUniPCMultistepScheduler(num_train_timesteps=1000, shift=5.0,
                                                         use_dynamic_shifting=False)
            self.vae_scale_factor_temporal, self.vae_scale_factor_spatial = 4, VAE_SPATIAL
            model_config = od_config.model_config or {}
            self._ar_height = int(model_config.get("ar_diffusion_height", PIXELS[0]))
            self._ar_width = int(model_config.get("ar_diffusion_width", PIXELS[1]))
            self._ar_diffusion_kv_state = None
            self._ar_sessions = {}
            self._prompt_embeds_cache = OrderedDict()
            self._streaming_decode_states = {}
            self._cached_streaming_decoder = None
            self._streaming_decode_unsupported = True
            self._vae_shard_split_dim, self._vae_shard_world_size = None, 1

        def encode_prompt(self, prompt: str, *, max_sequence_length: int, dtype: torch.dtype) -> torch.Tensor:
            g = torch.Generator().manual_seed(zlib.crc32(" ".join(prompt.split()).encode()))
            embeds = torch.zeros(1, max_sequence_length, self.transformer.config.text_dim)
            embeds[:, :GEOMETRY.text_len] = torch.randn(1, GEOMETRY.text_len, embeds.shape[2], generator=g)
            return embeds.to(dtype)

        def _next_condition_chunk(self, inputs, *, start_frame: int, session_state, dtype: torch.dtype):
            image = self._prepare_image_tensor(inputs.image, height=inputs.height, width=inputs.width)
            latent = F.adaptive_avg_pool2d(image, GEOMETRY.latent_hw)  # (1, 3, h, w)
            mask = torch.full_like(latent[:, :1], 1.0 if start_frame == 0 else 0.0)
            condition = torch.cat((mask, latent), dim=1).unsqueeze(2)
            frames = int(self.transformer.config.num_frames_per_block)
            return condition.expand(-1, -1, frames, -1, -1).to(dtype).contiguous(), []

        def _condition_encoder_cache_bytes(self) -> int:
            return 0

        def _streaming_decode_bytes_per_session(self) -> int:
            return 0

    return TinyLingBotPipeline


def build_pipeline(od_config, geometry: lb.TinyLingBot = GEOMETRY):
    """A `TinyLingBotPipeline` over `lingbot_world.build(geometry)` (seeded: the same weights every time)."""
    return _pipeline_class()(od_config=od_config, transformer=lb.build(geometry))


def diffusion_config(*, runner_cls: str | None = None, model_config: dict | None = None, **overrides):
    """The `OmniDiffusionConfig` of a LingBot-World realtime deployment (AR-Diffusion engine), fp32, at the tiny
    resolution (`ar_diffusion_height/width`)."""
    mc = {"ar_diffusion_height": PIXELS[0], "ar_diffusion_width": PIXELS[1], **(model_config or {})}
    return dr.diffusion_config(runner_cls=runner_cls, model_config=mc, **overrides)


def session_inputs(calls: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """A session's ticks: one source image (the first tick's), and per tick a camera pose (a small step forward)."""
    g = torch.Generator().manual_seed(seed)
    image = torch.rand(1, 3, *PIXELS, generator=g)
    out = []
    for index in range(calls):
        pose = torch.eye(4)
        pose[:3, 3] = torch.tensor([0.0, 0.0, 0.1 * (index + 1)]) + 0.02 * torch.randn(3, generator=g)
        intrinsics = torch.tensor([[PIXELS[1] * 1.0, PIXELS[0] * 1.0, PIXELS[1] / 2, PIXELS[0] / 2]])
        out.append({"image": image, "pose": pose[None], "intrinsics": intrinsics})
    return out


def make_request(request_id: str, session_id: str, chunk_index: int, extra: dict[str, Any], *,
                 prompt: str = "a tiny world", reset: bool = False, seed: int = 0):
    """One realtime tick as the serving API builds it: `ar_diffusion_tick` in extra_args, the camera trajectory as
    the pre-process function materializes it, latent output."""
    from vllm_omni.diffusion.models.lingbot_world.camera import CameraTrajectory
    from vllm_omni.diffusion.models.lingbot_world.pipeline import _PREPROCESSED_CAMERA_KEY
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.experimental.ar_diffusion.tick_protocol import ARDiffusionTickRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    tick = ARDiffusionTickRequest(session_id=session_id, request_id=request_id, chunk_index=chunk_index,
                                  prompt=prompt, reset=reset)
    extra_args = {**tick.to_extra_args(),
                  _PREPROCESSED_CAMERA_KEY: CameraTrajectory(poses=extra["pose"], intrinsics=extra["intrinsics"])}
    params = OmniDiffusionSamplingParams(extra_args=extra_args, height=PIXELS[0], width=PIXELS[1], num_frames=1,
                                         output_type="latent", seed=seed)
    return OmniDiffusionRequest(prompt={"prompt": prompt, "multi_modal_data": {"image": extra["image"]}},
                                sampling_params=params, request_id=request_id)


def requests(session: str, inputs: list[dict[str, Any]], *, first_chunk: int = 0, reset: bool = False,
             seed: int = 0) -> list:
    """Consecutive ticks of one session from chunk `first_chunk` (the first a reset when `reset`)."""
    return [make_request(f"{session}-c{first_chunk + i}-{'r' if reset else 'n'}", session, first_chunk + i, extra,
                         reset=reset and i == 0, seed=seed) for i, extra in enumerate(inputs)]


def latents(outputs: list) -> list[torch.Tensor]:
    return [out["payload"]["latents"] for out in outputs]


# ---- the dense oracle behind the same runner ----------------------------------------------------------------


class DenseLingBotState:
    """LingBot's own request-local cache (`allocate_cache`), kept per session across the runner's requests: its
    dense `_update_cache` path is the oracle. Duck-types the `ARDiffusionKVState` calls of the pipeline."""

    def __init__(self, store: "DenseLingBotStore", session_id: str) -> None:
        self.kv_cache, self.session_id = store, session_id
        self.cross: dict[tuple[str, str], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.reset()

    def reset(self, *, keep_cross_attention=()) -> None:
        model = self.kv_cache.transformer
        self.cache = model.allocate_cache(batch_size=1, latent_height=GEOMETRY.latent_hw[0],
                                          latent_width=GEOMETRY.latent_hw[1], device=torch.device("cpu"),
                                          dtype=torch.float32)
        self.cross = {k: v for k, v in self.cross.items() if k[1] in keep_cross_attention}

    def get_kv_caches(self, kv_branch: str, seq_len=None, commit_current: bool = False):
        return self.cache.self_attention

    def commit_paged_context(self, kv_branch: str) -> None:
        return None

    def end_invocation(self, error=None) -> None:
        return None

    def is_cross_attention_populated(self, kv_branch: str, cache_name: str) -> bool:
        return (kv_branch, cache_name) in self.cross

    def populate_cross_attention(self, kv_branch: str, cache_name: str, layer_kv) -> None:
        self.cross[(kv_branch, cache_name)] = [(k.clone(), v.clone()) for k, v in layer_kv]

    def get_cross_attention_kv(self, kv_branch: str, cache_name: str):
        return [{"is_init": True, "k": k, "v": v} for k, v in self.cross[(kv_branch, cache_name)]]

    def clear_cross_attention(self) -> None:
        self.cross = {}

    def close(self) -> None:
        self.cross = {}


class DenseLingBotStore:
    def __init__(self, ar_spec, transformer) -> None:
        self.transformer = transformer
        self.kv_branches, self.num_layers = ar_spec.kv_branches, ar_spec.num_layers
        self.session_capacity = ar_spec.session_capacity


def dense_runner_class():
    """`ARDiffusionModelRunner` whose LingBot sessions keep LingBot's own dense cache (the oracle)."""
    install()
    from vllm_omni.experimental.ar_diffusion.runner import ARDiffusionModelRunner

    class DenseLingBotRunner(ARDiffusionModelRunner):
        def _preallocate_kv_cache(self, *, available_bytes=None) -> None:
            capability = self._require_capability(self.pipeline)
            spec = capability.ar_diffusion_kv_cache_spec()
            self.kv_cache = DenseLingBotStore(spec, self.pipeline.transformer)
            self._ar_diffusion_capability, self._ar_diffusion_kv_cache_spec = capability, spec
            self._session_capacity = spec.session_capacity

        def _new_session_state(self, session_id: str) -> DenseLingBotState:
            return DenseLingBotState(self.kv_cache, session_id)

    return DenseLingBotRunner


DENSE_RUNNER = "upstream.lingbot_runner.DenseLingBotRunner"
__getattr__ = dr.lazy_class(globals(), "DenseLingBotRunner", dense_runner_class)


def build_runner(od_config, *, available_bytes: int = 1 << 26):
    """The runner `od_config` selects, serving a fresh `TinyLingBotPipeline`; call inside `model_context(od)`."""
    return dr.build_runner(build_pipeline(od_config), od_config, available_bytes=available_bytes)


serve = dr.serve
