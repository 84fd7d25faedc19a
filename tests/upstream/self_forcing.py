"""Transcription of the CausVid / Self-Forcing rolling KV cache (self-attention with a preallocated cache).

Source: github.com/guandeh17/Self-Forcing, wan/modules/causal_model.py, commit
33593df3e81fa3ec10239271dd2c100facac6de1, `CausalWanSelfAttention.forward` (the `kv_cache is not None` branch)
and `pipeline/causal_inference.py` (how the cache is created and driven). Kept: the preallocated
(B, C, H, D) cache dict with `global_end_index` / `local_end_index` tensors, the in-place write of the new
keys/values at `[local_start:local_end]`, the rolling eviction that shifts the cache left in place (keeping
`sink` tokens), attention over the keys read back from the cache, indices from `.item()`. Left out: RoPE
tables (a fixed random rotation stands in), cross-attention, FFN, the flex-attention training branch.

`RollingSelfAttention` is the code as written. Two changes make it page: `FillStateSelfAttention` keeps the
in-place cache and its indices as a fill state (Python ints the compiled frame is specialized on, bounded by
the cache size; 9 lines), `WindowSelfAttention` writes the same math as DreamZero's window idiom (concatenate,
slice the last `C` tokens, return the new cache), the write position and eviction left to the runtime.
`StaticIndexSelfAttention` (absolute indices as ints) is dense-exact but compiles new frames every block.
See docs/models.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RollingSelfAttention(nn.Module):
    """Self-Forcing's causal self-attention with the rolling in-place cache, as written (indices via .item())."""

    def __init__(self, dim: int = 32, num_heads: int = 2, local_attn_size: int = 3, frame_seqlen: int = 8,
                 sink_size: int = 0, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.local_attn_size, self.sink_size, self.frame_seqlen = local_attn_size, sink_size, frame_seqlen
        self.max_attention_size = local_attn_size * frame_seqlen
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def new_cache(self, batch: int = 1) -> dict:
        """`_initialize_kv_cache` of pipeline/causal_inference.py: zeros of the window's size, indices 0."""
        size = self.local_attn_size * self.frame_seqlen
        shape = (batch, size, self.num_heads, self.head_dim)
        return {"k": torch.zeros(shape), "v": torch.zeros(shape),
                "global_end_index": torch.tensor([0], dtype=torch.long),
                "local_end_index": torch.tensor([0], dtype=torch.long)}

    def qkv(self, x: torch.Tensor):
        b, s, _ = x.shape
        n, d = self.num_heads, self.head_dim
        q, k, v = self.q(x).view(b, s, n, d), self.k(x).view(b, s, n, d), self.v(x).view(b, s, n, d)
        return q, k, v

    def forward(self, x: torch.Tensor, kv_cache: dict, current_start: int) -> torch.Tensor:
        q, k, v = self.qkv(x)
        roped_query, roped_key = q, k  # RoPE left out (a per-position rotation does not change the cache idiom)
        frame_seqlen = self.frame_seqlen
        current_end = current_start + roped_query.shape[1]
        sink_tokens = self.sink_size * frame_seqlen
        kv_cache_size = kv_cache["k"].shape[1]
        num_new_tokens = roped_query.shape[1]
        if self.local_attn_size != -1 and (current_end > kv_cache["global_end_index"].item()) and (
                num_new_tokens + kv_cache["local_end_index"].item() > kv_cache_size):
            num_evicted_tokens = num_new_tokens + kv_cache["local_end_index"].item() - kv_cache_size
            num_rolled_tokens = kv_cache["local_end_index"].item() - num_evicted_tokens - sink_tokens
            kv_cache["k"][:, sink_tokens:sink_tokens + num_rolled_tokens] = \
                kv_cache["k"][:, sink_tokens + num_evicted_tokens:sink_tokens + num_evicted_tokens + num_rolled_tokens].clone()
            kv_cache["v"][:, sink_tokens:sink_tokens + num_rolled_tokens] = \
                kv_cache["v"][:, sink_tokens + num_evicted_tokens:sink_tokens + num_evicted_tokens + num_rolled_tokens].clone()
            local_end_index = kv_cache["local_end_index"].item() + current_end - \
                kv_cache["global_end_index"].item() - num_evicted_tokens
            local_start_index = local_end_index - num_new_tokens
            kv_cache["k"][:, local_start_index:local_end_index] = roped_key
            kv_cache["v"][:, local_start_index:local_end_index] = v
        else:
            local_end_index = kv_cache["local_end_index"].item() + current_end - kv_cache["global_end_index"].item()
            local_start_index = local_end_index - num_new_tokens
            kv_cache["k"][:, local_start_index:local_end_index] = roped_key
            kv_cache["v"][:, local_start_index:local_end_index] = v
        lo = max(0, local_end_index - self.max_attention_size)
        x = F.scaled_dot_product_attention(
            roped_query.transpose(1, 2), kv_cache["k"][:, lo:local_end_index].transpose(1, 2),
            kv_cache["v"][:, lo:local_end_index].transpose(1, 2)).transpose(1, 2)
        kv_cache["global_end_index"].fill_(current_end)
        kv_cache["local_end_index"].fill_(local_end_index)
        return self.o(x.flatten(2))


class WindowSelfAttention(RollingSelfAttention):
    """The user's change: the same attention as DreamZero's window idiom (pages with 0 further edits).

    The cache is a (2, B, C, H, D) tensor passed in and returned; the forward appends the new keys/values,
    keeps the last C tokens (`cat(...)[:, -C:]`) and attends over them. Every index is gone from the block:
    where tokens are written and what is evicted is the paged runtime's window (or, densely, the caller's
    bookkeeping of the returned cache). Sinks: not transcribed (Self-Forcing's default `sink_size=0`).
    """

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, current_start: int = 0):  # type: ignore[override]
        q, k, v = self.qkv(x)
        C = self.max_attention_size
        new_k = torch.cat([kv_cache[0], k], dim=1)[:, -C:]
        new_v = torch.cat([kv_cache[1], v], dim=1)[:, -C:]
        x = F.scaled_dot_product_attention(q.transpose(1, 2), new_k.transpose(1, 2), new_v.transpose(1, 2))
        return self.o(x.transpose(1, 2).flatten(2)), torch.stack([new_k, new_v])


class StaticIndexSelfAttention(RollingSelfAttention):
    """The smallest change that makes every index static: `global_end_index` / `local_end_index` kept as Python
    ints in the cache dict instead of tensors read with `.item()` (9 lines: the two of the eviction condition,
    `num_evicted_tokens`, `num_rolled_tokens`, the two `local_end_index` computations, the two `fill_`s).
    Dense results equal the original's bit for bit; dynamo then compiles one frame per index state."""

    def new_cache(self, batch: int = 1) -> dict:
        cache = super().new_cache(batch)
        cache["global_end_index"], cache["local_end_index"] = 0, 0
        return cache

    def forward(self, x: torch.Tensor, kv_cache: dict, current_start: int) -> torch.Tensor:
        q, k, v = self.qkv(x)
        roped_query, roped_key = q, k
        current_end = current_start + roped_query.shape[1]
        sink_tokens = self.sink_size * self.frame_seqlen
        kv_cache_size = kv_cache["k"].shape[1]
        num_new_tokens = roped_query.shape[1]
        if self.local_attn_size != -1 and (current_end > kv_cache["global_end_index"]) and (
                num_new_tokens + kv_cache["local_end_index"] > kv_cache_size):
            num_evicted_tokens = num_new_tokens + kv_cache["local_end_index"] - kv_cache_size
            num_rolled_tokens = kv_cache["local_end_index"] - num_evicted_tokens - sink_tokens
            kv_cache["k"][:, sink_tokens:sink_tokens + num_rolled_tokens] = \
                kv_cache["k"][:, sink_tokens + num_evicted_tokens:sink_tokens + num_evicted_tokens + num_rolled_tokens].clone()
            kv_cache["v"][:, sink_tokens:sink_tokens + num_rolled_tokens] = \
                kv_cache["v"][:, sink_tokens + num_evicted_tokens:sink_tokens + num_evicted_tokens + num_rolled_tokens].clone()
            local_end_index = kv_cache["local_end_index"] + current_end - kv_cache["global_end_index"] - num_evicted_tokens
            local_start_index = local_end_index - num_new_tokens
            kv_cache["k"][:, local_start_index:local_end_index] = roped_key
            kv_cache["v"][:, local_start_index:local_end_index] = v
        else:
            local_end_index = kv_cache["local_end_index"] + current_end - kv_cache["global_end_index"]
            local_start_index = local_end_index - num_new_tokens
            kv_cache["k"][:, local_start_index:local_end_index] = roped_key
            kv_cache["v"][:, local_start_index:local_end_index] = v
        lo = max(0, local_end_index - self.max_attention_size)
        x = F.scaled_dot_product_attention(
            roped_query.transpose(1, 2), kv_cache["k"][:, lo:local_end_index].transpose(1, 2),
            kv_cache["v"][:, lo:local_end_index].transpose(1, 2)).transpose(1, 2)
        kv_cache["global_end_index"] = current_end
        kv_cache["local_end_index"] = local_end_index
        return self.o(x.flatten(2))


class FillStateSelfAttention(RollingSelfAttention):
    """The static-index form with BOUNDED compiled frames: the cache dict keeps the fill state, not absolute indices.

    `local_end_index` stays a Python int (bounded by the cache size) and `new_block` (a bool) says whether this
    forward starts a new block (Self-Forcing's `current_end > global_end_index`: the first denoising step of a
    block; the later steps and the clean/context forward of the same block overwrite its slots).
    `global_end_index` is gone: with contiguous blocks, as `pipeline/causal_inference.py` drives them,
    `current_end - global_end_index` is `num_new_tokens` on a new block and 0 otherwise. Dynamo specializes on
    (`local_end_index`, `new_block`): one frame per fill state, then one steady state once the window is full.
    `current_start` is no longer read by the attention (the real model's RoPE still reads it: see docs/models.md).

    Changed lines of `RollingSelfAttention.forward` (9, marked `# changed`): the two lines of the eviction
    condition, `num_evicted_tokens`, `num_rolled_tokens`, the two-line and the one-line `local_end_index`, the
    two `fill_`s. The driver: the cache dict's two index entries (`new_cache`) and `cache["new_block"] = True` for
    every layer's cache at the start of each block (`start_block`).
    """

    def new_cache(self, batch: int = 1) -> dict:
        cache = super().new_cache(batch)
        del cache["global_end_index"]
        cache["local_end_index"], cache["new_block"] = 0, True
        return cache

    @staticmethod
    def start_block(cache: dict) -> None:
        """What the driver does before the first forward of each block (the line it adds to its block loop)."""
        cache["new_block"] = True

    def forward(self, x: torch.Tensor, kv_cache: dict, current_start: int) -> torch.Tensor:
        q, k, v = self.qkv(x)
        roped_query, roped_key = q, k
        frame_seqlen = self.frame_seqlen
        current_end = current_start + roped_query.shape[1]  # noqa: F841 (as written; unused here, RoPE reads current_start)
        sink_tokens = self.sink_size * frame_seqlen
        kv_cache_size = kv_cache["k"].shape[1]
        num_new_tokens = roped_query.shape[1]
        if self.local_attn_size != -1 and kv_cache["new_block"] and (  # changed
                num_new_tokens + kv_cache["local_end_index"] > kv_cache_size):  # changed
            num_evicted_tokens = num_new_tokens + kv_cache["local_end_index"] - kv_cache_size  # changed
            num_rolled_tokens = kv_cache["local_end_index"] - num_evicted_tokens - sink_tokens  # changed
            kv_cache["k"][:, sink_tokens:sink_tokens + num_rolled_tokens] = \
                kv_cache["k"][:, sink_tokens + num_evicted_tokens:sink_tokens + num_evicted_tokens + num_rolled_tokens].clone()
            kv_cache["v"][:, sink_tokens:sink_tokens + num_rolled_tokens] = \
                kv_cache["v"][:, sink_tokens + num_evicted_tokens:sink_tokens + num_evicted_tokens + num_rolled_tokens].clone()
            local_end_index = kv_cache["local_end_index"] + \
                num_new_tokens - num_evicted_tokens  # changed (2 lines)
            local_start_index = local_end_index - num_new_tokens
            kv_cache["k"][:, local_start_index:local_end_index] = roped_key
            kv_cache["v"][:, local_start_index:local_end_index] = v
        else:
            local_end_index = kv_cache["local_end_index"] + (num_new_tokens if kv_cache["new_block"] else 0)  # changed
            local_start_index = local_end_index - num_new_tokens
            kv_cache["k"][:, local_start_index:local_end_index] = roped_key
            kv_cache["v"][:, local_start_index:local_end_index] = v
        lo = max(0, local_end_index - self.max_attention_size)
        x = F.scaled_dot_product_attention(
            roped_query.transpose(1, 2), kv_cache["k"][:, lo:local_end_index].transpose(1, 2),
            kv_cache["v"][:, lo:local_end_index].transpose(1, 2)).transpose(1, 2)
        kv_cache["new_block"] = False  # changed
        kv_cache["local_end_index"] = local_end_index  # changed
        return self.o(x.flatten(2))
