"""Once-per-forward metadata for every layer, in persistent per-bucket buffers.

The op of layer ``l`` reads ``slot_mapping[l]`` and ``block_table[l]`` (absolute ids: the layer's base
is added to its managed blocks) plus ``seq_lens`` and ``kv_visible_end`` (shared by all layers). All
four live in one device allocation per bucket, filled by ONE host-to-device copy from one staging
buffer per forward. Views never move, so a captured CUDA graph keeps reading the current values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import Bucket
from .errors import RequestError
from .layout import RowLayout
from .pool import KVPool


def _carve(buf: torch.Tensor, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Typed views of consecutive, 8-byte aligned regions of one byte buffer."""
    views, offset = [], 0
    for shape, dtype in shapes:
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = itemsize
        for s in shape:
            nbytes *= s
        views.append(buf[offset : offset + nbytes].view(dtype).view(shape))
        offset += -(-nbytes // 8) * 8
    return views


def _buffer_bytes(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    total = 0
    for shape, dtype in shapes:
        n = torch.empty((), dtype=dtype).element_size()
        for s in shape:
            n *= s
        total += -(-n // 8) * 8
    return total


@dataclass
class LayerViews:
    """What one layer's op call reads."""

    slot_mapping: torch.Tensor  # int64 [R, T]
    block_table: torch.Tensor  # int32 [R, M]


class BucketMetadata:
    """Persistent buffers of one shape bucket, for all layers."""

    def __init__(self, bucket: Bucket, pool: KVPool) -> None:
        self.bucket = bucket
        L, R, T = pool.num_layers, bucket.rows, bucket.tokens
        M = bucket.table_width(pool.block_size)
        self.width = M
        shapes = [((L, R, T), torch.int64), ((L, R, M), torch.int32), ((R,), torch.int32), ((R, T), torch.int32)]
        device = pool.tensor.device
        nbytes = _buffer_bytes(shapes)
        self.device_buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        pin = device.type == "cuda"
        self.host_buffer = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.slot_mapping, self.block_table, self.seq_lens, self.kv_visible_end = _carve(self.device_buffer, shapes)
        self._host = _carve(self.host_buffer, shapes)
        self.layers = [LayerViews(self.slot_mapping[l], self.block_table[l]) for l in range(L)]
        self.last_key: tuple = ()
        self._copy_done: torch.cuda.Event | None = None
        self.fill_with_padding(pool)

    def fill_with_padding(self, pool: KVPool) -> None:
        """A valid all-padding state: nothing written, nothing visible (used before the first forward)."""
        slot, table, seq, vis = self._host
        slot.fill_(-1)
        table.fill_(pool.pad_block)
        seq.zero_()
        vis.zero_()
        self.device_buffer.copy_(self.host_buffer)

    def addresses(self) -> tuple[int, ...]:
        return (self.slot_mapping.data_ptr(), self.block_table.data_ptr(), self.seq_lens.data_ptr(),
                self.kv_visible_end.data_ptr())


class MetadataBuilder:
    """Builds a forward's metadata for all layers at once, vectorized, and counts the copies."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.buckets: dict[Bucket, BucketMetadata] = {}
        self.builds = 0
        self.h2d_copies = 0

    def buffers(self, bucket: Bucket) -> BucketMetadata:
        meta = self.buckets.get(bucket)
        if meta is None:
            meta = self.buckets[bucket] = BucketMetadata(bucket, self.pool)
        return meta

    def build(self, bucket: Bucket, rows: list[RowLayout], key: tuple = ()) -> BucketMetadata:
        """Fill `bucket`'s buffers from per-row layouts; skipped when `key` repeats the last build."""
        meta = self.buffers(bucket)
        if key and key == meta.last_key:
            return meta
        self._check_fits(bucket, meta.width, rows)
        pool, B = self.pool, self.pool.block_size
        R, T, M = bucket.rows, bucket.tokens, meta.width
        table = torch.full((R, M), pool.pad_block, dtype=torch.int64)
        managed = torch.zeros((R, M), dtype=torch.bool)
        positions = torch.full((R, T), -1, dtype=torch.int64)
        visible = torch.zeros((R, T), dtype=torch.int64)
        seq = torch.zeros(R, dtype=torch.int64)
        for r, row in enumerate(rows):
            table[r, : row.num_blocks] = row.table
            managed[r, : row.num_blocks] = row.managed
            positions[r, : row.num_tokens] = row.positions
            visible[r, : row.num_tokens] = row.visible_end
            seq[r] = row.seq_len
        # Every layer at once: absolute ids = layer base + local id for managed entries.
        layer_tables = table + managed * pool.layer_bases.view(-1, 1, 1)  # [L, R, M]
        valid = positions >= 0
        safe = positions.clamp(min=0)
        blocks = torch.gather(layer_tables, 2, (safe // B).expand(pool.num_layers, R, T))
        slots = torch.where(valid, blocks * B + safe % B, -1)

        if meta._copy_done is not None:  # the previous copy must have left the staging buffer
            meta._copy_done.synchronize()
        h_slot, h_table, h_seq, h_vis = meta._host
        h_slot.copy_(slots)
        h_table.copy_(layer_tables)
        h_seq.copy_(seq)
        h_vis.copy_(visible)
        meta.device_buffer.copy_(meta.host_buffer, non_blocking=True)
        if meta.device_buffer.is_cuda:
            meta._copy_done = torch.cuda.Event()
            meta._copy_done.record()
        self.h2d_copies += 1
        self.builds += 1
        meta.last_key = key
        return meta

    @staticmethod
    def _check_fits(bucket: Bucket, width: int, rows: list[RowLayout]) -> None:
        if len(rows) > bucket.rows:
            raise RequestError(f"{len(rows)} rows exceed bucket {bucket} ({bucket.rows} rows)")
        for r, row in enumerate(rows):
            if row.num_tokens > bucket.tokens:
                raise RequestError(
                    f"row {r} has {row.num_tokens} tokens, beyond bucket {bucket} ({bucket.tokens}); "
                    "add a larger bucket to the config"
                )
            if row.num_blocks > width:
                raise RequestError(
                    f"row {r} needs {row.num_blocks} blocks, beyond bucket {bucket}'s table width {width}; "
                    "add a bucket with a larger context"
                )
