"""The two model families the CPU benchmarks run: their configs, compiled setups and loop arguments.

Everything here names a family; what every benchmark does with a model whatever its family (compiling it,
driving one session/request of its own loop forward by forward, timing, tables) is in `_common.py`, which
names none. A benchmark runs a family's loop as `OwnerRun(setup, owner_id, **dreamzero_loop(...))`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from benchmarks._common import Setup, make_setup
from paged_kv_compile.families.dreamzero import dreamzero_runtime_config
from paged_kv_compile.families.hunyuan_image3 import hunyuan_runtime_config
from paged_kv_compile.models.dreamzero import DREAMZERO_MID, DreamZeroConfig, DreamZeroModel
from paged_kv_compile.models.hunyuan_image3 import HUNYUAN_IMAGE3_MID, HunyuanImage3Config, HunyuanImage3Model

#: Tiny DreamZero: 4 layers, dim 64 (4 heads x 16), 16 tokens per frame, chunk 2 frames, window 8 frames.
DZ_TINY = DreamZeroConfig(local_attn_size=8, window_reset_frames=16)
#: Mid-size DreamZero: dim 512 (8 heads x 64), 64 tokens per frame, chunk 2 frames, window 8 frames,
#: 33 action/state registers as in the real model.
DZ_MID = DREAMZERO_MID
#: Tiny HunyuanImage-3: 4 layers, hidden 64, 4/2 heads x 16, image 4x4 (target 18 tokens).
HY_TINY = HunyuanImage3Config()
#: Mid-size HunyuanImage-3: hidden 512, 8/2 heads x 64, image 16x16 (target 258 tokens).
HY_MID = HUNYUAN_IMAGE3_MID

#: Hunyuan request layouts used with each config: (prompt lengths of the CFG rows, padded prefix capacity).
HY_PROMPTS = {"tiny": ((20, 7), 32), "mid": ((200, 60), 256)}


def dreamzero_setup(cfg: DreamZeroConfig, path: str, inner: str, *, seed: int = 1, sessions: int = 1,
                    blocks_per_layer: int | None = None, kernel: str = "reference") -> Setup:
    overrides = {"blocks_per_layer": blocks_per_layer} if blocks_per_layer is not None else {}
    return make_setup(DreamZeroModel(cfg, seed=seed).eval(), path, inner,
                      lambda: dreamzero_runtime_config(cfg, sessions=sessions, kernel=kernel, inner_compiler=inner,
                                                       **overrides))


def hunyuan_setup(cfg: HunyuanImage3Config, path: str, inner: str, *, max_prefix: int, seed: int = 2,
                  requests: int = 1, blocks_per_layer: int | None = None, kernel: str = "reference",
                  block_size: int = 16) -> Setup:
    overrides = {"blocks_per_layer": blocks_per_layer} if blocks_per_layer is not None else {}
    return make_setup(HunyuanImage3Model(cfg, seed=seed).eval(), path, inner,
                      lambda: hunyuan_runtime_config(cfg, max_prefix=max_prefix, requests=requests,
                                                     block_size=block_size, kernel=kernel, inner_compiler=inner,
                                                     **overrides))


def dreamzero_loop(num_chunks: int, steps: int, seed: int = 0, guidance_scale: float = 5.0) -> dict[str, Any]:
    """Arguments of one DreamZero session's loop (`dreamzero_steps`): two CFG rows, `steps` denoising forwards
    per chunk, each chunk committed at the start of the next."""
    return {"num_chunks": num_chunks, "num_inference_steps": steps, "seed": seed, "guidance_scale": guidance_scale}


def hunyuan_loop(cfg: HunyuanImage3Config, prompt_lens: Sequence[int], capacity: int, num_steps: int,
                 seed: int = 0) -> dict[str, Any]:
    """Arguments of one HunyuanImage-3 request's loop (`hunyuan_steps`): random prompts of `prompt_lens` tokens
    (one per CFG row, drawn from `seed`) padded to `capacity`; a prefill, then `num_steps - 1` steps."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=gen) for n in prompt_lens]
    return {"prompts": prompts, "prefix_capacity": capacity, "num_steps": num_steps, "seed": seed}
