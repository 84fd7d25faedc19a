"""KVPool: one stacked tensor for K and V of every layer, and its absolute addressing.

Layout of the block axis: ``[layer 0 managed | layer 1 managed | ... | scratch (per local row) | pad]``.
Layer ``l``'s local block ``b`` is absolute block ``l * blocks_per_layer + b``; slot ``s`` of absolute
block ``a`` is ``a * block_size + s``. Scratch blocks hold transient K/V (denoising steps, action
tokens, the rewritten target span) and are shared by all layers: the fused op writes and reads them in
one call, so no layer needs another layer's scratch. The pad block is never valid and never written.

FP8 pools (``kv_dtype`` float8_e4m3fn / float8_e5m2) carry ``scales`` ``[2, num_blocks_total, Hkv]``
float32 (K, V): one static scale per (layer, kv head), stored in each of the layer's blocks so that the
op finds it from a block id, without a layer index, a graph break or a host read. The op quantizes a
row's new K/V with the scales of the row's first table block and dequantizes the row with the same ones
(``ops/fp8.py``, ``row_scales``): the row's blocks of one layer share one scale, and scratch blocks
(shared by all layers, written and read within one call) hold the per-head maximum over layers.
Why this granularity:
  * FP8 is a float format: a scale only places the range (e4m3: 448 down to 2**-6 at full precision,
    2**-9 subnormal), the relative error is the same 2**-4 anywhere in it. Per-block scales, which int8
    /int4 caches need, buy little here, and a block is filled by several forwards (chunks): a dynamic
    per-block scale would have to be grown, and the block requantized, by a later write.
  * vLLM ships static per-layer scales (``kv_cache_dtype="fp8"``, ``k_scale``/``v_scale``, 1.0 unless a
    checkpoint or ``calculate_kv_scales`` sets them) and expands them to FA3's ``k_descale``/``v_descale``
    ``(num_seqs, num_kv_heads)`` (vllm/v1/attention/backends/flash_attn.py); per (layer, kv head) is
    that shape exactly, so the flash-attn adapter passes the op's own scales, not an approximation.
  * Static scales are never written by the op: the pool stays the op's only mutated argument.
Set them with `set_scales` (e.g. from a calibration run's amax, `scales_from_amax`); they default to 1.0.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .config import FP8_DTYPES, PagedKVConfig
from .errors import ConfigError
from .ops.fp8 import quantize


class KVPool:
    """The one pool tensor ``[2, num_blocks_total, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V)."""

    def __init__(
        self,
        num_layers: int,
        blocks_per_layer: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        scratch_rows: int = 1,
        scratch_blocks_per_row: int = 1,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        blocks_held: Callable[[], int] | None = None,
    ) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        if blocks_per_layer < 1:
            raise ConfigError(
                f"the pool has {blocks_per_layer} blocks per layer; it needs at least 1: raise the budget "
                "or blocks_per_layer"
            )
        if num_layers < 1 or num_kv_heads < 1 or head_dim < 1:
            raise ConfigError(
                f"num_layers, num_kv_heads and head_dim must be >= 1 (got {num_layers}, {num_kv_heads}, {head_dim})"
            )
        if not dtype.is_floating_point:
            raise ConfigError(f"the pool dtype must be a floating type, got {dtype}")
        #: float32 [2, num_blocks_total, Hkv] for FP8 pools (see the module docstring), else None.
        self.scales: torch.Tensor | None = None
        #: How many managed blocks per layer are held (each holds, or will hold, K/V quantized with the current
        #: scales): `set_scales` refuses while any is. Given at construction: the runtime passes its scheduler's
        #: live count (`Scheduler.held_blocks`); a pool no scheduler serves holds nothing.
        self.blocks_held: Callable[[], int] = blocks_held if blocks_held is not None else (lambda: 0)
        self.num_layers = num_layers
        self.blocks_per_layer = blocks_per_layer
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scratch_rows = scratch_rows
        self.scratch_blocks_per_row = scratch_blocks_per_row
        self.scratch_base = num_layers * blocks_per_layer
        self.pad_block = self.scratch_base + scratch_rows * scratch_blocks_per_row
        self.num_blocks_total = self.pad_block + 1
        self.tensor = torch.zeros(
            2, self.num_blocks_total, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        if dtype in FP8_DTYPES:
            self.scales = torch.ones(2, self.num_blocks_total, num_kv_heads, dtype=torch.float32, device=device)
        self.layer_bases = torch.arange(num_layers, dtype=torch.int64) * blocks_per_layer

    # ---- construction -------------------------------------------------------------------------
    @staticmethod
    def bytes_per_block_all_layers(cfg: PagedKVConfig) -> int:
        """Bytes one local block costs: K and V (and their FP8 scales), in every layer."""
        itemsize = torch.empty((), dtype=cfg.pool_dtype).element_size()
        per_layer = cfg.block_size * cfg.num_kv_heads * cfg.head_dim * itemsize
        if cfg.pool_dtype in FP8_DTYPES:
            per_layer += cfg.num_kv_heads * 4  # one float32 scale per kv head
        return 2 * cfg.num_layers * per_layer

    @classmethod
    def blocks_per_layer_for(cls, cfg: PagedKVConfig, *, min_tokens_per_layer: int = 0) -> int:
        """Managed blocks per layer a pool of `cfg` gets: ``blocks_per_layer``, or what ``budget_bytes`` holds after
        scratch and pad. Raises ConfigError when that is not even one block, or less than `min_tokens_per_layer`."""
        per_block = cls.bytes_per_block_all_layers(cfg) // cfg.num_layers  # one block of one layer
        scratch_blocks = cfg.max_rows * cfg.scratch_blocks_per_row
        if cfg.blocks_per_layer is not None:
            blocks = cfg.blocks_per_layer
        else:
            fixed = (scratch_blocks + 1) * per_block
            blocks = (cfg.budget_bytes - fixed) // (per_block * cfg.num_layers)
            if blocks < 1:
                raise ConfigError(
                    f"budget_bytes={cfg.budget_bytes} cannot hold one block per layer plus scratch "
                    f"(needs at least {fixed + per_block * cfg.num_layers} bytes); raise the budget or "
                    "lower block_size / scratch_tokens_per_row"
                )
        if blocks * cfg.block_size < min_tokens_per_layer:
            need = -(-min_tokens_per_layer // cfg.block_size)
            raise ConfigError(
                f"the pool holds {blocks * cfg.block_size} tokens per layer, below one window of "
                f"{min_tokens_per_layer} tokens; give at least {need} blocks per layer "
                f"(about {need * per_block * cfg.num_layers + (scratch_blocks + 1) * per_block} bytes)"
            )
        return blocks

    @classmethod
    def nbytes_for(cls, cfg: PagedKVConfig) -> int:
        """The bytes `from_config(cfg)` would allocate (pool, scratch, pad and FP8 scales), without allocating."""
        blocks = cls.blocks_per_layer_for(cfg)
        total = cfg.num_layers * blocks + cfg.max_rows * cfg.scratch_blocks_per_row + 1
        return total * (cls.bytes_per_block_all_layers(cfg) // cfg.num_layers)

    @classmethod
    def from_config(cls, cfg: PagedKVConfig, *, min_tokens_per_layer: int = 0,
                    blocks_held: Callable[[], int] | None = None) -> "KVPool":
        """Size the pool from ``blocks_per_layer`` or from ``budget_bytes`` (scratch and pad included);
        `blocks_held`: how many managed blocks per layer are held now (see `__init__`)."""
        return cls(
            cfg.num_layers,
            cls.blocks_per_layer_for(cfg, min_tokens_per_layer=min_tokens_per_layer),
            cfg.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            scratch_rows=cfg.max_rows,
            scratch_blocks_per_row=cfg.scratch_blocks_per_row,
            dtype=cfg.pool_dtype,
            device=cfg.device,
            blocks_held=blocks_held,
        )

    # ---- reports ------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.tensor.numel() * self.tensor.element_size() + scales

    # ---- FP8 scales ---------------------------------------------------------------------------
    def set_scales(self, k_scale: torch.Tensor | float, v_scale: torch.Tensor | float) -> None:
        """Static scales per (layer, kv head), each broadcastable to ``[num_layers, num_kv_heads]``.

        A stored value x means x * scale. Scratch and pad blocks get the per-head maximum over layers.
        Refused while any managed block is held (`blocks_held`): history, prompt prefixes and shared regions
        (written at admission) were quantized with the current scales, and attention would dequantize them with
        the new ones (measured: 100x off). Re-quantizing them is not exact in general (FP8 rounding of x / s_old
        then of x * s_old / s_new): set the scales before admitting anything.
        """
        if self.scales is None:
            raise ConfigError(f"the pool stores {self.tensor.dtype}, not FP8: it has no scales; set kv_dtype")
        held = self.blocks_held()
        if held:
            raise ConfigError(
                f"set_scales while {held} blocks per layer are held: their K/V (history, prompt prefixes, shared "
                "regions written at admission) was quantized with the current scales, and attention would read it "
                "with the new ones. Set the scales before admitting any session or request (e.g. right after "
                "building the runtime), or release every owner first"
            )
        shape = (self.num_layers, self.num_kv_heads)
        new = []
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            s = torch.as_tensor(s, dtype=torch.float32)
            try:
                s = s.expand(shape).to(self.scales.device)
            except RuntimeError:
                raise ConfigError(f"{name} has shape {tuple(s.shape)}; it must broadcast to {shape}") from None
            if not bool(torch.isfinite(s).all() & (s > 0).all()):
                raise ConfigError(f"{name} must be finite and > 0 (a stored value x means x * scale)")
            new.append(s)
        managed = self.scratch_base
        for half, s in enumerate(new):
            self.scales[half, :managed] = s.repeat_interleave(self.blocks_per_layer, 0)
            self.scales[half, managed:] = s.amax(0)

    @staticmethod
    def scales_from_amax(amax: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
        """Scales that map a calibrated absolute maximum onto the FP8 format's largest value (1.0 where 0)."""
        amax = torch.as_tensor(amax, dtype=torch.float32)
        return torch.where(amax > 0, amax / torch.finfo(dtype).max, torch.ones_like(amax))

    @property
    def tokens_per_layer(self) -> int:
        return self.blocks_per_layer * self.block_size

    def describe(self) -> dict:
        return {
            "bytes": self.nbytes,
            "blocks_per_layer": self.blocks_per_layer,
            "tokens_per_layer": self.tokens_per_layer,
            "scratch_blocks": self.pad_block - self.scratch_base,
            "block_size": self.block_size,
            "dtype": str(self.tensor.dtype).removeprefix("torch."),
            "shape": tuple(self.tensor.shape),
        }

    # ---- addressing (vectorized) --------------------------------------------------------------
    def block_id(self, layer: torch.Tensor | int, local_block: torch.Tensor | int) -> torch.Tensor:
        """Absolute block id of (layer, local block); broadcasts."""
        layer = torch.as_tensor(layer, dtype=torch.int64)
        local_block = torch.as_tensor(local_block, dtype=torch.int64)
        if bool((local_block < 0).any()) or bool((local_block >= self.blocks_per_layer).any()):
            raise IndexError(f"local block ids must lie in [0, {self.blocks_per_layer})")
        if bool((layer < 0).any()) or bool((layer >= self.num_layers).any()):
            raise IndexError(f"layer ids must lie in [0, {self.num_layers})")
        return layer * self.blocks_per_layer + local_block

    def slot(self, block: torch.Tensor | int, offset: torch.Tensor | int) -> torch.Tensor:
        """Absolute slot of (absolute block, offset in block); broadcasts."""
        return torch.as_tensor(block, dtype=torch.int64) * self.block_size + torch.as_tensor(offset, dtype=torch.int64)

    def slots_for_positions(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Absolute slots of logical positions ``[..., T]`` through a block table ``[..., M]``; -1 stays -1."""
        positions = positions.to(torch.int64)
        valid = positions >= 0
        safe = positions.clamp(min=0)
        blocks = torch.gather(block_table.to(torch.int64), -1, safe // self.block_size)
        slots = blocks * self.block_size + safe % self.block_size
        return torch.where(valid, slots, torch.full_like(slots, -1))

    # ---- write-once regions (regions.py) ------------------------------------------------------------
    def layer_block_ids(self, blocks: Sequence[int]) -> torch.Tensor:
        """Absolute ids ``[num_layers * len(blocks)]`` of local `blocks` in every layer, layer-major, on the pool's
        device: what a host-side read or write of whole blocks indexes `tensor[:, ids]` with."""
        layers = torch.arange(self.num_layers)[:, None]
        return self.block_id(layers, torch.as_tensor(blocks, dtype=torch.int64)[None, :]).reshape(-1).to(self.tensor.device)

    def to_stored(self, kv: torch.Tensor) -> torch.Tensor:
        """Per-layer K/V ``(num_layers, 2, tokens, Hkv, D)`` as the pool stores it: its dtype, its device, and for
        FP8 quantized with each layer's static scales (those of the layer's first block, `set_scales`)."""
        kv = kv.to(self.tensor.device)
        if self.scales is None:
            return kv.to(self.tensor.dtype).contiguous()
        scale = self.scales[:, self.layer_bases.to(self.scales.device)].transpose(0, 1)  # (L, 2, Hkv)
        return quantize(kv, scale[:, :, None, :, None], self.tensor.dtype).contiguous()

    def write_region(self, blocks: list[int], stored: torch.Tensor) -> None:
        """Write stored K/V ``(num_layers, 2, tokens, Hkv, D)`` into local `blocks` of every layer (tokens from
        offset 0; the unused tail of the last block is zeroed). Host side, once per region."""
        L, _, T, H, D = stored.shape
        n = len(blocks)
        if n * self.block_size < T:
            raise ConfigError(f"a region of {T} tokens needs {-(-T // self.block_size)} blocks, got {n}")
        padded = stored.new_zeros(L, 2, n * self.block_size, H, D)
        padded[:, :, :T] = stored
        tiles = padded.view(L, 2, n, self.block_size, H, D).transpose(0, 1).reshape(2, L * n, self.block_size, H, D)
        self.tensor[:, self.layer_block_ids(blocks)] = tiles

    def read_region(self, blocks: list[int], tokens: int) -> torch.Tensor:
        """What `write_region` stored: ``(num_layers, 2, tokens, Hkv, D)`` in the pool's dtype."""
        n = len(blocks)
        tiles = self.tensor[:, self.layer_block_ids(blocks)]  # (2, L * n, block_size, H, D)
        per_layer = tiles.view(2, self.num_layers, n * self.block_size, self.num_kv_heads, self.head_dim)
        return per_layer[:, :, :tokens].transpose(0, 1)

    def scratch_start(self, row: int) -> int:
        """Absolute id of local row ``row``'s first scratch block (the row's blocks follow it)."""
        if not 0 <= row < self.scratch_rows:
            raise IndexError(f"scratch row {row} out of range [0, {self.scratch_rows})")
        return self.scratch_base + row * self.scratch_blocks_per_row

    def scratch_block_ids(self, row: int) -> torch.Tensor:
        """Absolute ids of local row ``row``'s scratch blocks."""
        start = self.scratch_start(row)
        return torch.arange(start, start + self.scratch_blocks_per_row, dtype=torch.int64)
