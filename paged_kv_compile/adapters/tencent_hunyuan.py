"""Cache stand-ins for Tencent's HunyuanImage-3.0 static cache (0 changed model lines).

Tencent's `HunyuanStaticCache.update` (hunyuan_image_3/hunyuan.py in github.com/Tencent-Hunyuan/HunyuanImage-3.0)
writes the new K/V into a static (B, Hkv, S, D) cache with `index_copy_` at `position_ids` and the attention
reads the whole cache with the mask; the passes page that as written (`families/hunyuan_image3.py:
_match_static_cache`) and check `position_ids` against the runtime's layout at every call. What a driver passes
instead of the cache tensors: `static_cache_standins`, one stand-in for the keys and one for the values, the same
for every layer index. Why the same object for every index: the attention indexes `key_cache[self.layer_idx]`;
dynamo specializes that int attribute (one compiled frame per layer) unless it is listed in
`torch.compiler.config.dynamic_sources` (`LAYER_IDX_SOURCE` for decoder layers compiled one by one), and a
Python list indexed with the symbolic int would specialize it again. Nothing here imports Tencent's code.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..runtime import PagedKVRuntime

#: the dynamo source of the attention's `layer_idx` when each `HunyuanImage3DecoderLayer` is compiled on its own
LAYER_IDX_SOURCE = "L['self']._modules['self_attn'].layer_idx"


class EveryLayer(Sequence):
    """A per-layer list whose entries are all one tensor (a cache stand-in shared by every layer)."""

    def __init__(self, tensor: torch.Tensor, layers: int) -> None:
        self.tensor, self.layers = tensor, layers

    def __getitem__(self, index):  # the index is not read: dynamo keeps a symbolic layer_idx symbolic
        return self.tensor

    def __len__(self) -> int:
        return self.layers


def static_cache_standins(runtime: PagedKVRuntime, *, rows: int, num_kv_heads: int, max_cache_len: int,
                          head_dim: int, num_layers: int) -> tuple[EveryLayer, EveryLayer]:
    """(key_cache, value_cache) for a `HunyuanStaticCache` of `rows` x `max_cache_len` tokens.

    Keys and values are distinct stand-ins (the passes follow each `index_copy_` into its own cache), both
    views of one writable buffer; compiled graphs neither read nor write it."""
    both = runtime.standin(2, rows, num_kv_heads, max_cache_len, head_dim, writable=True)
    return EveryLayer(both[0], num_layers), EveryLayer(both[1], num_layers)
