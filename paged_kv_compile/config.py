"""PagedKVConfig: the geometry of the pool and the options of the runtime and backend, in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import ConfigError

KERNELS = ("auto", "reference", "triton", "flash_attn", "npu")
INNER_COMPILERS = ("inductor", "aot_eager", "eager")
#: Pool dtypes stored with scales (quantized on write by the op, dequantized in attention; see pool.py).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True, order=True)
class Bucket:
    """One fixed shape a compiled forward serves.

    rows: batch rows (CFG branches x requests); tokens: new tokens per row the model computes;
    context: the dense cache length the model's stand-ins show (window, or padded prefix).
    The block-table width follows from them.
    """

    rows: int
    tokens: int
    context: int

    def table_width(self, block_size: int) -> int:
        # +1: a span that starts mid-block touches one block more than its length alone needs.
        return -(-(self.context + self.tokens) // block_size) + 1


@dataclass(frozen=True)
class PagedKVConfig:
    """Geometry of the stacked all-layer pool plus runtime/backend options.

    Give either `blocks_per_layer` or `budget_bytes` (the whole pool's byte budget on this device).
    `max_rows` is the number of rows one forward may carry on this device: with CFG-parallel (one
    branch per rank) it is 1 and scratch and capacity are sized for one row.
    `dtype` is the compute dtype (query, key, value, stand-ins); `kv_dtype` the pool's storage dtype:
    None stores `dtype`, torch.float8_e4m3fn / torch.float8_e5m2 store FP8 with per (layer, kv head)
    scales (pool.py says why that granularity).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    blocks_per_layer: int | None = None
    budget_bytes: int | None = None
    max_rows: int = 2
    scratch_tokens_per_row: int = 256
    buckets: tuple[Bucket, ...] = ()
    dtype: torch.dtype = torch.float32
    kv_dtype: torch.dtype | None = None
    device: str = "cpu"
    kernel: str = "auto"
    inner_compiler: str = "inductor"
    strict: bool = False
    dump_dir: str | None = None
    #: the most tokens of a shared write-once region (regions.py) a compiled graph reads, e.g. DreamZero's
    #: cross_len: sizes each bucket's region table (metadata.py); 0 = no compiled graph reads a region
    region_tokens: int = 0
    #: whether an owner's row may hide keys inside its table (`layout.RowLayout.kv_gap`: a window that starts
    #: inside a block, a sink that ends inside one). False leaves the op's kv_gap input out of every compiled
    #: graph, so flash-attn serves each row in one call instead of splitting it; a plan with a gap is then refused
    #: (metadata.py). Family configs set it from their geometry (`dreamzero_runtime_config`)
    kv_gaps: bool = True
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_rows", "scratch_tokens_per_row"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.region_tokens < 0:
            raise ConfigError(f"region_tokens must be >= 0, got {self.region_tokens}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}; use e.g. 16")
        if (self.blocks_per_layer is None) == (self.budget_bytes is None):
            raise ConfigError(
                "give exactly one of blocks_per_layer or budget_bytes "
                f"(got blocks_per_layer={self.blocks_per_layer}, budget_bytes={self.budget_bytes})"
            )
        if self.blocks_per_layer is not None and self.blocks_per_layer < 1:
            raise ConfigError(f"blocks_per_layer must be >= 1, got {self.blocks_per_layer}")
        if self.kernel not in KERNELS:
            raise ConfigError(f"unknown kernel {self.kernel!r}; choose one of {', '.join(KERNELS)}")
        if self.inner_compiler not in INNER_COMPILERS:
            raise ConfigError(
                f"unknown inner_compiler {self.inner_compiler!r}; choose one of {', '.join(INNER_COMPILERS)}"
            )
        if self.kv_dtype is not None and self.kv_dtype != self.dtype and self.kv_dtype not in FP8_DTYPES:
            raise ConfigError(
                f"kv_dtype={self.kv_dtype} is not supported: use None (store {self.dtype}), torch.float8_e4m3fn "
                "or torch.float8_e5m2"
            )
        if self.kv_dtype in FP8_DTYPES and self.dtype in FP8_DTYPES:
            raise ConfigError(f"dtype is the compute dtype and cannot be {self.dtype}; set kv_dtype for an FP8 pool")
        for b in self.buckets:
            if b.rows < 1 or b.tokens < 1 or b.context < 0:
                raise ConfigError(f"bucket {b} needs rows >= 1, tokens >= 1, context >= 0")
            if b.rows > self.max_rows:
                raise ConfigError(f"bucket {b} has more rows than max_rows={self.max_rows}; raise max_rows")

    @property
    def pool_dtype(self) -> torch.dtype:
        """The dtype the pool stores: `kv_dtype`, or `dtype` when it is None."""
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    @property
    def scratch_blocks_per_row(self) -> int:
        # +1: transient tokens may start mid-block after a prefix that is not block-aligned.
        return -(-self.scratch_tokens_per_row // self.block_size) + 1

    @property
    def max_table_width(self) -> int:
        return max((b.table_width(self.block_size) for b in self.buckets), default=1)
