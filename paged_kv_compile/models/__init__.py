"""Dense, paging-unaware reference models of the two families, and their generation loops.

`DreamZeroModel` + `dreamzero_rollout` (windowed AR-diffusion video/action world model) and
`HunyuanImage3Model` + `hunyuan_generate` (causal text prefix, bidirectional image span). The loops
take a `hooks` object (`DenseHooks` by default) so a paged driver can reuse them unchanged.
"""

from __future__ import annotations

from .dreamzero import (
    DREAMZERO_14B,
    CausalWanBlock,
    CausalWanSelfAttention,
    DreamZeroConfig,
    DreamZeroModel,
    dreamzero_rollout,
    dreamzero_steps,
)
from .hooks import DenseHooks, Forward, Loop, drive
from .hunyuan_image3 import (
    HUNYUAN_IMAGE3,
    HunyuanAttention,
    HunyuanDecoderLayer,
    HunyuanImage3Config,
    HunyuanImage3Model,
    HunyuanKVCache,
    HunyuanRequest,
    hunyuan_attention_mask,
    hunyuan_generate,
    hunyuan_positions,
    hunyuan_steps,
    hunyuan_rope_tables,
    repeat_kv,
)

__all__ = [
    "DenseHooks",
    "Forward",
    "Loop",
    "drive",
    "dreamzero_steps",
    "hunyuan_steps",
    "DreamZeroConfig",
    "DreamZeroModel",
    "CausalWanBlock",
    "CausalWanSelfAttention",
    "DREAMZERO_14B",
    "dreamzero_rollout",
    "HunyuanImage3Config",
    "HunyuanImage3Model",
    "HunyuanDecoderLayer",
    "HunyuanAttention",
    "HunyuanKVCache",
    "HunyuanRequest",
    "HUNYUAN_IMAGE3",
    "hunyuan_generate",
    "hunyuan_positions",
    "hunyuan_rope_tables",
    "hunyuan_attention_mask",
    "repeat_kv",
]
