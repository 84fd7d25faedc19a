"""vllm-omni's LingBot-World (0.30.0, `diffusion/models/lingbot_world/`) at a tiny size on this CPU, dense and paged.

The classes are the package's, unchanged: `CausalLingBotWorldTransformer3DModel` (its blocks, its
`LingBotSelfAttention._update_cache` fixed-capacity cache, its text K/V cached once) driven by its own
`LingBotDMDBlockRunner.generate_block` (dmd_block.py): per AR block four DMD probes (`update_cache=False`) then
the clean commit (`update_cache=True`), the schedule its pipeline runs in request mode and, one step per
scheduler call, on the AR-Diffusion path.

Two shims, besides `vllm_omni_cpu`'s: the `lingbot_world` package is imported without its `__init__` (which
imports the pipeline, whose imports need PyAV and torchvision's transforms, absent here); and
`RotaryEmbeddingWan.forward_native` gets cos/sin of shape (tokens, 1, D/2) where LingBot passes (tokens, D/2):
its CUDA path (flash-attn's rotary kernel) broadcasts those over the heads, its torch path here cannot
(`Attempting to broadcast a dimension of length 4`), so LingBot's RoPE does not run on a CPU as shipped.

Paged mode: the runtime owns the K/V. The model gets, per layer, a `LingBotAttentionCache` whose key/value are
cache stand-ins and whose cursor presents a full cache at the current chunk (`present`); its `_update_cache`
then takes the repeated-start branch for every forward, the first chunk included, and the passes read that
(`passes/idioms/lingbot.py`). Text K/V is computed once per session as the pipeline's `_ar_text_caches` does,
and stays dense (the model's own cache objects).
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from paged_kv_compile.adapters.vllm_omni_ar_lingbot import check_lingbot_sink
from paged_kv_compile.config import PagedKVConfig
from paged_kv_compile.families.dreamzero import DreamZeroSpec
from paged_kv_compile.runtime import PagedKVRuntime

from . import vllm_omni_cpu

#: the block's ints that only select the cache branch (not shapes): symbolic, so that one graph serves every chunk
DYNAMIC_SOURCES = "L['current_start'],L['self_cache'].last_start,L['self_cache'].absolute_end"
#: a DMD schedule of four probes, (timestep, sigma) as the pipeline's shifted flow schedule gives them
SCHEDULE = ((1000.0, 1.0), (937.5, 0.9375), (833.3, 0.8333), (625.0, 0.625))


@dataclass(frozen=True)
class TinyLingBot:
    """LingBot-World's geometry at a CPU size: latent frames of 4x4 (patch 1x2x2: 4 tokens per frame)."""

    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 16
    latent_hw: tuple[int, int] = (4, 4)
    frames_per_block: int = 1
    sink_frames: int = 1
    window_frames: int = 3  # sliding_window_num_frames: the cache capacity, sink and current block included
    text_len: int = 5
    text_dim: int = 8
    out_channels: int = 4
    seed: int = 0

    @property
    def tokens_per_frame(self) -> int:
        return self.latent_hw[0] * self.latent_hw[1] // 4

    @property
    def capacity(self) -> int:
        return self.window_frames * self.tokens_per_frame

    @property
    def chunk_tokens(self) -> int:
        return self.frames_per_block * self.tokens_per_frame

    def spec(self, model) -> DreamZeroSpec:
        """The session's window, read from the model's config: the sink frames resident, the most recent frames
        beside them, the chunk included."""
        return DreamZeroSpec.from_lingbot_world(model, *self.latent_hw)


def install() -> None:
    """vllm_omni_cpu's shims, LingBot's package importable without its pipeline, its RoPE runnable on a CPU."""
    vllm_omni_cpu.install()
    vllm_omni_cpu.init_distributed()
    name = "vllm_omni.diffusion.models.lingbot_world"
    if name not in sys.modules:
        import vllm_omni.diffusion.models as models

        package = types.ModuleType(name)
        package.__path__ = [os.path.join(os.path.dirname(models.__file__), "lingbot_world")]
        sys.modules[name] = package
    from vllm_omni.diffusion.layers.rope import RotaryEmbeddingWan

    if not getattr(RotaryEmbeddingWan.forward_native, "_heads_broadcast", False):
        native = RotaryEmbeddingWan.forward_native

        def forward_native(self, x, cos, sin):
            if x.dim() == 4 and cos.dim() == 2:  # (tokens, D/2) over (B, tokens, H, D): as the CUDA kernel reads it
                cos, sin = cos[:, None], sin[:, None]
            return native(self, x, cos, sin)

        forward_native._heads_broadcast = True
        RotaryEmbeddingWan.forward_native = forward_native


def build(geometry: TinyLingBot = TinyLingBot()):
    """The package's `CausalLingBotWorldTransformer3DModel` with random weights; call inside `model_context()`."""
    install()
    from vllm_omni.diffusion.models.lingbot_world.transformer import CausalLingBotWorldTransformer3DModel

    torch.manual_seed(geometry.seed)
    g = geometry
    model = CausalLingBotWorldTransformer3DModel(
        num_attention_heads=g.num_heads, attention_head_dim=g.head_dim, in_channels=2 * g.out_channels,
        out_channels=g.out_channels, text_dim=g.text_dim, freq_dim=16, ffn_dim=4 * g.num_heads * g.head_dim,
        num_layers=g.num_layers, rope_max_seq_len=64, sink_size=g.sink_frames, num_frames_per_block=g.frames_per_block,
        sliding_window_num_frames=g.window_frames,
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.1))
    return model.eval()


def block_inputs(geometry: TinyLingBot, blocks: int, seed: int = 1) -> dict[str, Any]:
    """What the pipeline hands `generate_block` per AR block: the image condition, the folded camera, the text."""
    g = torch.Generator().manual_seed(seed)
    h, w = geometry.latent_hw
    f = geometry.frames_per_block
    return {
        "conditions": [torch.randn(1, geometry.out_channels, f, h, w, generator=g) for _ in range(blocks)],
        "cameras": [torch.randn(1, 6 * 8 * 8, f, h, w, generator=g) * 0.1 for _ in range(blocks)],
        "prompt_embeds": torch.randn(1, geometry.text_len, geometry.text_dim, generator=g),
    }


def text_caches(model, prompt_embeds: torch.Tensor) -> list:
    """Text K/V projected once per layer, as the pipeline's `_ar_text_caches` populates its session's."""
    from vllm_omni.diffusion.models.lingbot_world.transformer import LingBotAttentionCache

    projected = model.text_embedding(prompt_embeds)
    out = []
    for block in model.blocks:
        cross = block.cross_attn
        shape = (cross.num_local_heads, cross.head_dim)
        key = cross.norm_k(cross.k(projected)).unflatten(2, shape)
        value = cross.v(projected).unflatten(2, shape)
        out.append(LingBotAttentionCache(key=key, value=value, end=key.shape[1], absolute_end=key.shape[1],
                                         last_start=0))
    return out


class _Progress:
    def update(self, n: int = 1) -> None:
        return None


class Recorder:
    """The transformer the DMD block runner calls: records every forward's flow prediction; in paged mode it
    presents the stand-in cursor for the call's chunk and runs it as the runtime's forward (commit or denoise)."""

    def __init__(self, model, *, runtime: PagedKVRuntime | None = None, owner: str = "s") -> None:
        self.model, self.runtime, self.owner = model, runtime, owner
        self.config = model.config
        self.outputs: list[torch.Tensor] = []

    def __call__(self, **kwargs: Any) -> torch.Tensor:
        if self.runtime is None:
            out = self.model(**kwargs)
        else:
            tokens = self.model.config.patch_size[1] * self.model.config.patch_size[2]
            frame_tokens = kwargs["hidden_states"].shape[3] * kwargs["hidden_states"].shape[4] // tokens
            chunk = kwargs["hidden_states"].shape[2] * frame_tokens
            check_sink(self.runtime, self.owner, self.model, frame_tokens)
            present(kwargs["cache"], kwargs["start_frame"] * frame_tokens, chunk)
            with self.runtime.forward(self.owner, "commit" if kwargs["update_cache"] else "denoise"):
                out = self.model(**kwargs)
        self.outputs.append(out)
        return out


def check_sink(runtime: PagedKVRuntime, owner: str, model, frame_tokens: int) -> None:
    """The package's check (`adapters.vllm_omni_ar_lingbot.check_lingbot_sink`, which the runner adapter runs before
    every forward) on this hand-driven session, before every forward."""
    check_lingbot_sink(runtime.owner(owner).spec, model, frame_tokens, session=owner)


def present(cache, current_start: int, chunk: int) -> None:
    """Each layer's stand-in cursor: a full cache at the chunk starting at `current_start` (the repeated-start
    branch of `_update_cache`: history `[0, C - chunk)`, then the chunk, written back whole on a commit)."""
    for layer in cache.self_attention:
        layer.end = layer.key.shape[1]
        layer.last_start = current_start
        layer.absolute_end = current_start + chunk
        layer.sink_end = 0


def dense_cache(model, geometry: TinyLingBot, prompt_embeds: torch.Tensor):
    """LingBot's own request-local cache (`allocate_cache`) with the session's text K/V."""
    cache = model.allocate_cache(batch_size=1, latent_height=geometry.latent_hw[0], latent_width=geometry.latent_hw[1],
                                 device=torch.device("cpu"), dtype=torch.float32)
    cache.cross_attention = text_caches(model, prompt_embeds)
    return cache


def runtime_config(geometry: TinyLingBot, *, heads: int) -> PagedKVConfig:
    """The pool of one session of `geometry` holding `heads` KV heads (block size: one frame's tokens)."""
    return PagedKVConfig(num_layers=geometry.num_layers, num_kv_heads=heads, head_dim=geometry.head_dim,
                         block_size=geometry.tokens_per_frame, blocks_per_layer=geometry.window_frames + 2, max_rows=1,
                         scratch_tokens_per_row=geometry.chunk_tokens, kernel="reference")


def paged_runtime(geometry: TinyLingBot, model) -> PagedKVRuntime:
    """A one-rank runtime for one session of `geometry`, bound to the model's blocks."""
    rt = PagedKVRuntime(runtime_config(geometry, heads=model.blocks[0].self_attn.num_sp_heads))
    rt.bind(model.blocks)
    return rt


def standin_cache(rt: PagedKVRuntime, model, geometry: TinyLingBot, prompt_embeds: torch.Tensor):
    """The cache the paged model gets: per layer a `LingBotAttentionCache` over one writable stacked stand-in
    (the passes drop the model's copy_ into it), the text K/V dense."""
    from vllm_omni.diffusion.models.lingbot_world.transformer import LingBotAttentionCache, LingBotTransformerCache

    heads = model.blocks[0].self_attn.num_sp_heads
    kv = rt.standin(2, 1, geometry.capacity, heads, geometry.head_dim, writable=True)
    layers = [LingBotAttentionCache(key=kv[0], value=kv[1]) for _ in range(geometry.num_layers)]
    return LingBotTransformerCache(self_attention=layers, cross_attention=text_caches(model, prompt_embeds))


def rollout(transformer: Callable, cache, geometry: TinyLingBot, inputs: dict[str, Any], *, seed: int = 0,
            schedule=SCHEDULE, blocks: range | None = None, generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """LingBot's `LingBotDMDBlockRunner.generate_block` over `blocks` (default: all) of `inputs`, eager around the
    transformer: the final latents of each block. Pass one `generator` to continue a rollout in several calls."""
    install()
    from vllm_omni.diffusion.models.lingbot_world.dmd_block import LingBotDMDBlockRunner

    runner = LingBotDMDBlockRunner(transformer, device=torch.device("cpu"), enforce_eager=True)
    generator = torch.Generator().manual_seed(seed) if generator is None else generator
    latents = []
    for b in blocks if blocks is not None else range(len(inputs["conditions"])):
        latents.append(runner.generate_block(
            condition=inputs["conditions"][b], camera=inputs["cameras"][b], prompt_embeds=inputs["prompt_embeds"],
            cache=cache, ar=None, start_frame=b * geometry.frames_per_block, schedule=schedule, generator=generator,
            progress_bar=_Progress()))
    return latents


def native_state(model, geometry: TinyLingBot, *, session_id: str = "s", available_bytes: int = 1 << 24):
    """vllm-omni's own AR-Diffusion KV for one LingBot session, built as `ARDiffusionModelRunner` builds it
    (`_preallocate_kv_cache`, `_new_session_state`) from the spec LingBot's pipeline declares
    (`ar_diffusion_kv_cache_spec`: its recent window is the capacity less the sink; one branch "main"; the text
    K/V as the named cross-attention "text"), without the pipeline object (its constructor loads a checkpoint)."""
    import dataclasses

    from vllm_omni.experimental.ar_diffusion.capability import (
        ARDiffusionCrossAttentionKVSpec, ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec)
    from vllm_omni.experimental.ar_diffusion.kv_cache.config import ARDiffusionKVConfig
    from vllm_omni.experimental.ar_diffusion.kv_cache.manager import ARDiffusionKVCache
    from vllm_omni.experimental.ar_diffusion.kv_cache.state import ARDiffusionKVState

    heads = model.blocks[0].self_attn.num_sp_heads
    spec = ARDiffusionKVCacheSpec(
        num_layers=geometry.num_layers, num_kv_heads=heads, head_size=geometry.head_dim,
        tokens_per_frame=geometry.tokens_per_frame, frames_per_block=geometry.frames_per_block,
        window_frames=geometry.window_frames - geometry.sink_frames, sink_frames=geometry.sink_frames,
        kv_branches=(ARDiffusionKVBranchSpec("main", 0),), session_capacity=1,
        cross_attention=(ARDiffusionCrossAttentionKVSpec("text", geometry.text_len,
                                                         num_kv_heads=model.blocks[0].cross_attn.num_local_heads),))
    config = dataclasses.replace(ARDiffusionKVConfig(enable=True), chunk_size=spec.tokens_per_frame,
                                 window_chunks=spec.window_frames, sink_chunks=spec.sink_frames)
    cache = ARDiffusionKVCache(
        config, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
        dtype=torch.float32, block_size=spec.tokens_per_frame, max_model_len=spec.max_model_len,
        available_bytes=available_bytes, kv_branches=spec.kv_branches, session_capacity=spec.session_capacity,
        cross_attention_lengths=spec.cross_attention_lengths, cross_attention_kv_heads=spec.cross_attention_kv_heads,
        frames_per_block=spec.frames_per_block, max_scratch_tokens_per_branch=spec.max_scratch_tokens_per_branch,
        model_owned_state_bytes_per_session=0, device=torch.device("cpu"))
    adapters = {b.name: cache.begin_request(f"ar::{session_id}::{b.name}") for b in spec.kv_branches}
    return ARDiffusionKVState(cache, session_id, adapters, num_layers=spec.num_layers)


def native_rollout(transformer: Callable, model, state, geometry: TinyLingBot, inputs: dict[str, Any], *,
                   seed: int = 0, schedule=SCHEDULE) -> list[torch.Tensor]:
    """`generate_block` on vllm-omni's own paged path: the block runner gets the bound session (`ARBlockContext`),
    asks it for `get_kv_caches`, and every self-attention runs vllm-omni's `paged_write_attn`; the text K/V is
    populated once into the session's cross-attention pool, as the pipeline's `_ar_text_caches` does."""
    from vllm_omni.diffusion.models.lingbot_world.dmd_block import ARBlockContext, LingBotDMDBlockRunner
    from vllm_omni.diffusion.models.lingbot_world.transformer import LingBotAttentionCache

    prompt = inputs["prompt_embeds"]
    if not state.is_cross_attention_populated("main", "text"):
        state.populate_cross_attention("main", "text", ((c.key, c.value) for c in text_caches(model, prompt)))
    cross = [LingBotAttentionCache(key=layer["k"], value=layer["v"], end=prompt.shape[1], absolute_end=prompt.shape[1],
                                   last_start=0) for layer in state.get_cross_attention_kv("main", "text")]
    runner = LingBotDMDBlockRunner(transformer, device=torch.device("cpu"), enforce_eager=True)
    generator = torch.Generator().manual_seed(seed)
    latents = []
    for b in range(len(inputs["conditions"])):
        latents.append(runner.generate_block(
            condition=inputs["conditions"][b], camera=inputs["cameras"][b], prompt_embeds=prompt, cache=None,
            ar=ARBlockContext(state=state, cross_attention=cross, branch="main"),
            start_frame=b * geometry.frames_per_block, schedule=schedule, generator=generator,
            progress_bar=_Progress()))
    return latents
