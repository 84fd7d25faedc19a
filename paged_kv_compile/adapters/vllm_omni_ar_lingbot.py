"""Our runtime behind vllm-omni's AR-Diffusion runner: the KV state its LingBot-World pipeline drives.

LingBot-World (vllm-omni 0.30.0, `diffusion/models/lingbot_world/`) reaches the runner's session state through
`LingBotDMDBlockRunner` (dmd_block.py): per AR block, four DMD probes then one clean commit, each preceded by
`state.get_kv_caches(branch, seq_len=..., commit_current=...)`, the commit followed by `commit_paged_context`;
the text K/V through `populate_cross_attention` / `get_cross_attention_kv` (as DreamZero's). Its transformer
checks whether the per-layer entries are vllm-omni's `ARDiffusionPagedLayerContext`; ours are not: each is a
`LingBotCursor` over the cache stand-in (the fields of LingBot's `LingBotAttentionCache`) presenting a full cache at
the current chunk, so `LingBotSelfAttention._update_cache` takes its repeated-start branch on every forward (the
first chunk included) and the `paged_kv` backend rewrites it (`passes/idioms/lingbot.py`, the capacity-window
idiom). The model gets no `prepare` call on this path, so the runtime's forward opens in `get_kv_caches` (the
block runner calls the transformer right after it) and closes at the next one, at the commit's
`commit_paged_context`, or when the runner's invocation ends.

The graph shows LingBot's cache capacity, not its sink: the session's window keeps the sink the spec says, so the
spec must carry the model's (`config.sink_size` frames). `check_lingbot_sink` refuses another before every forward,
before anything is planned; a direct user of the runtime calls it too (tests/upstream/lingbot_world.py does).

Nothing here imports vllm or vllm-omni.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

from ..errors import ConfigError, RequestError
from ..families.dreamzero import DreamZeroSpec
from .vllm_omni_ar_diffusion import DreamZeroPagedKV, PagedKVSessionState

#: LingBot's block arguments that only pick the cache branch: values for dynamo, one graph for every chunk
DYNAMIC_SOURCES = ("L['current_start']", "L['self_cache'].last_start", "L['self_cache'].absolute_end")

TRANSFORMER_CLASS = "CausalLingBotWorldTransformer3DModel"


def is_lingbot_world(transformer: Any) -> bool:
    """vllm-omni's LingBot-World transformer (by class name: importing it imports its pipeline's media stack)."""
    return any(c.__name__ == TRANSFORMER_CLASS for c in type(transformer).__mro__)


def lingbot_capacity_frames(config: Any) -> int:
    """The cache capacity in frames (the sink and the current block included), as LingBot sizes `allocate_cache`."""
    return int(config.local_attn_size) if int(config.local_attn_size) != -1 else int(config.sliding_window_num_frames)


def check_lingbot_sink(spec: DreamZeroSpec, model: Any, frame_tokens: int, *, session: str) -> None:
    """The session's sink must be the model's (`config.sink_size` frames of `frame_tokens`): the compiled graph cannot
    show it, and another sink keeps other history than LingBot's cache does (wrong from the first slide of the
    window). Call before each forward, before the runtime plans it."""
    want = int(model.config.sink_size) * int(frame_tokens)
    if spec.sink_tokens != want:
        raise ConfigError(
            f"session {session!r} keeps a {spec.sink_tokens}-token sink but the LingBot model's is {want} tokens "
            f"(config.sink_size={model.config.sink_size} frames of {frame_tokens} tokens): admit it with "
            "DreamZeroSpec.from_lingbot_world(model, h, w), or restore the model's sink_size")


@dataclasses.dataclass
class LingBotCursor:
    """One layer's self-attention cache as LingBot's `_update_cache` reads it (`LingBotAttentionCache`'s fields):
    the stand-in K/V and a cursor presenting a full cache at the chunk that starts at `last_start`."""

    key: torch.Tensor
    value: torch.Tensor
    end: int
    absolute_end: int
    last_start: int
    sink_end: int = 0


class LingBotPagedKV(DreamZeroPagedKV):
    """The runner's `kv_cache` for LingBot-World: the shared pool and budget, LingBot's spec and session state."""

    dynamic_sources = DYNAMIC_SOURCES
    writable_standin = True  # the model copy_s its commit into the cache; the passes drop that write

    @classmethod
    def session_spec(cls, transformer, ar_spec) -> DreamZeroSpec:
        """LingBot's window from its config (capacity, sink, block), refused where the pipeline's spec (recent
        window + sink, block, layers) describes another cache."""
        cfg = transformer.config
        capacity = lingbot_capacity_frames(cfg)
        spec = DreamZeroSpec(frame_seqlen=int(ar_spec.tokens_per_frame), chunk_frames=int(cfg.num_frames_per_block),
                             window_frames=capacity, sink_frames=int(cfg.sink_size))
        declared = {"sink_frames": (int(ar_spec.sink_frames), spec.sink_frames),
                    "window_frames + sink_frames": (int(ar_spec.window_frames) + int(ar_spec.sink_frames), capacity),
                    "frames_per_block": (int(ar_spec.frames_per_block), spec.chunk_frames),
                    "num_layers": (int(ar_spec.num_layers), len(transformer.blocks))}
        diff = {k: v for k, v in declared.items() if v[0] != v[1]}
        if diff:
            raise ConfigError(
                "the pipeline's ARDiffusionKVCacheSpec does not describe its LingBot transformer's cache: "
                + ", ".join(f"{k} (spec {a}, transformer {b})" for k, (a, b) in diff.items()))
        return spec

    @classmethod
    def group_runtime(cls, runtime):
        """Under Ulysses (vllm-omni's model-parallel groups of more than one rank) a `RankRuntime`: every rank holds
        its local heads of every token and takes each decision only when the group agrees on it."""
        ps = sys.modules.get("vllm_omni.diffusion.distributed.parallel_state")
        if ps is None or not ps.model_parallel_is_initialized():
            return runtime
        from ..distributed import ParallelConfig, RankRuntime

        parallel = ParallelConfig.from_vllm_omni()
        return runtime if parallel.model_parallel_size == 1 else RankRuntime(runtime, parallel)

    def begin_session(self, session_id: str) -> "LingBotSessionState":
        return LingBotSessionState(self, session_id)


class LingBotSessionState(PagedKVSessionState):
    """One runner session of LingBot-World in our runtime (duck-types `ARDiffusionKVState` for the calls
    `LingBotDMDBlockRunner` and the pipeline's text cache make)."""

    kv_cache: LingBotPagedKV

    def __init__(self, kv_cache: LingBotPagedKV, session_id: str) -> None:
        super().__init__(kv_cache, session_id)
        self._committed_chunks = 0

    def get_kv_caches(self, kv_branch: str, seq_len: int | None = None,
                      commit_current: bool = False) -> list[LingBotCursor]:
        """Open the runtime's forward for the transformer call that follows (a commit when `commit_current`, else a
        probe), after the checks: the chunk is the session's, the sink the model's."""
        self._live_owner()
        self.kv_cache.row_of(kv_branch)
        spec = self.kv_cache.spec
        if seq_len is None:
            raise ValueError("AR-Diffusion paged self-attention requires seq_len in get_kv_caches()")
        if int(seq_len) != spec.chunk_tokens:
            raise RequestError(
                f"LingBot block of {seq_len} tokens, but session {self.session_id!r} was sized for blocks of "
                f"{spec.chunk_tokens} ({spec.chunk_frames} frames of {spec.frame_seqlen} tokens): the request's "
                "resolution must be the runner's ar_diffusion_height/width")
        check_lingbot_sink(spec, self.kv_cache.transformer, spec.frame_seqlen, session=self.session_id)
        forward = self._announce(kv_branch, int(seq_len), bool(commit_current))
        self._start(forward, 0, int(seq_len))
        start = self._committed_chunks * spec.chunk_tokens
        key, value = self.kv_cache.standin[0], self.kv_cache.standin[1]
        return [LingBotCursor(key=key, value=value, end=spec.window_tokens, absolute_end=start + spec.chunk_tokens,
                              last_start=start) for _ in range(self.num_layers)]

    def commit_paged_context(self, kv_branch: str) -> None:
        forward = self._pending.get(kv_branch)
        ran = forward is not None and forward.started and forward.commit_current
        super().commit_paged_context(kv_branch)
        if ran:
            self._committed_chunks += 1

    def reset(self, *, keep_cross_attention=()) -> None:
        super().reset(keep_cross_attention=keep_cross_attention)
        self._committed_chunks = 0


def paged_kv_class(transformer: Any) -> type[DreamZeroPagedKV]:
    """The runner's `kv_cache` class for the pipeline's transformer: LingBot-World's, else DreamZero's."""
    return LingBotPagedKV if is_lingbot_world(transformer) else DreamZeroPagedKV
