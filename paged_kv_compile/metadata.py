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
    """Persistent buffers of one shape bucket, for all layers.

    The host stages only what is the same in every layer: layer 0's slots and table plus a mask of
    which entries are managed (per-layer) blocks. One copy moves that to the device, where two
    broadcast ops expand it to every layer: ``slots[l] = slots0 + managed * base_l * B``.

    The copy is asynchronous on a CUDA device and the host may run ahead (CUDA graphs), so a pinned
    staging buffer must not be written while a copy out of it is pending. Writes go through
    :meth:`stage`, which alternates between two pinned buffers and first waits for the copy last issued
    from the one it hands out; :meth:`upload` issues the copy from it and records that copy's event.
    """

    def __init__(self, bucket: Bucket, pool: KVPool, device: torch.device | None = None) -> None:
        self.bucket = bucket
        L, R, T = pool.num_layers, bucket.rows, bucket.tokens
        M = bucket.table_width(pool.block_size)
        self.width = M
        device = device if device is not None else pool.tensor.device
        staged = [((R, T), torch.int64), ((R, T), torch.int64), ((R, M), torch.int32), ((R, M), torch.int32),
                  ((R,), torch.int32), ((R, T), torch.int32)]
        expanded = [((L, R, T), torch.int64), ((L, R, M), torch.int32)]
        nbytes = _buffer_bytes(staged)
        self.device_buffer = torch.zeros(nbytes + _buffer_bytes(expanded), dtype=torch.uint8, device=device)
        self.host_buffer = torch.zeros(2, nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self._staged_device = self.device_buffer[:nbytes]
        (self._slot0, self._slot_managed, self._table0, self._table_managed, self.seq_lens,
         self.kv_visible_end) = _carve(self._staged_device, staged)
        self.slot_mapping, self.block_table = _carve(self.device_buffer[nbytes:], expanded)
        self._host = [_carve(self.host_buffer[i], staged) for i in range(2)]
        self._slot_base = (pool.layer_bases * pool.block_size).view(L, 1, 1).to(device)
        self._block_base = pool.layer_bases.view(L, 1, 1).to(device=device, dtype=torch.int32)
        self.layers = [LayerViews(self.slot_mapping[l], self.block_table[l]) for l in range(L)]
        self.last_key: tuple = ()
        #: Makes the event recorded after each copy (None: copies are synchronous). Tests swap in fakes.
        self.new_event = torch.cuda.Event if device.type == "cuda" else (lambda: None)
        self._copy_done: list = [None, None]  # per staging buffer: the event of the last copy out of it
        self._current = 1
        self.copies = 0  # copies issued into device_buffer (padding states included)
        self.fill_with_padding(pool)

    def stage(self) -> list[torch.Tensor]:
        """Host views (slot0, slot_managed, table0, table_managed, seq_lens, kv_visible_end) to write the
        next forward's values into; call :meth:`upload` after writing them.

        Switches to the other pinned buffer and waits until the last copy out of it has completed, so no
        write can reach a copy still pending (with two buffers the host may run one forward ahead).
        """
        self._current = 1 - self._current
        done = self._copy_done[self._current]
        if done is not None:
            done.synchronize()
            self._copy_done[self._current] = None
        return self._host[self._current]

    def fill_with_padding(self, pool: KVPool) -> None:
        """A valid all-padding state: nothing written, nothing visible (before the first forward, warm-up)."""
        slot0, slot_managed, table0, table_managed, seq, vis = self.stage()
        slot0.fill_(-1)
        table0.fill_(pool.pad_block)
        for t in (slot_managed, table_managed, seq, vis):
            t.zero_()
        self.upload()
        self.last_key = ()

    def upload(self) -> None:
        """The forward's one host-to-device copy from the buffer :meth:`stage` handed out, and its event."""
        self.copy_and_expand(self.host_buffer[self._current])
        self.copies += 1
        self._copy_done[self._current] = self.new_event()
        if self._copy_done[self._current] is not None:
            self._copy_done[self._current].record()

    def copy_and_expand(self, host: torch.Tensor) -> None:
        """Device work of one upload, in stream order: copy `host` in, expand it to every layer."""
        self._staged_device.copy_(host, non_blocking=True)
        torch.mul(self._slot_base, self._slot_managed, out=self.slot_mapping)
        self.slot_mapping.add_(self._slot0)
        torch.mul(self._block_base, self._table_managed, out=self.block_table)
        self.block_table.add_(self._table0)

    def addresses(self) -> tuple[int, ...]:
        return (self.slot_mapping.data_ptr(), self.block_table.data_ptr(), self.seq_lens.data_ptr(),
                self.kv_visible_end.data_ptr())


class MetadataBuilder:
    """Builds a forward's metadata for all layers at once, vectorized, and counts the copies."""

    def __init__(self, pool: KVPool, device: torch.device | str | None = None) -> None:
        """`device` defaults to the pool's; a "meta" pool with CPU metadata measures host cost alone."""
        self.pool = pool
        self.device = torch.device(device) if device is not None else pool.tensor.device
        self.buckets: dict[Bucket, BucketMetadata] = {}
        self.builds = 0

    @property
    def copies(self) -> int:
        """Copies issued into the metadata buffers of every bucket (each build's one, padding states too)."""
        return sum(meta.copies for meta in self.buckets.values())

    @property
    def h2d_copies(self) -> int:
        """Of those, the host-to-device ones: none when the metadata lives on the CPU."""
        return 0 if self.device.type == "cpu" else self.copies

    def buffers(self, bucket: Bucket) -> BucketMetadata:
        meta = self.buckets.get(bucket)
        if meta is None:
            meta = self.buckets[bucket] = BucketMetadata(bucket, self.pool, self.device)
        return meta

    def build(self, bucket: Bucket, rows: list[RowLayout], key: tuple = ()) -> BucketMetadata:
        """Fill `bucket`'s buffers from per-row layouts; skipped when `key` repeats the last build."""
        meta = self.buffers(bucket)
        if key and key == meta.last_key:
            return meta
        self._check_fits(bucket, meta.width, rows)
        # From here the buffers change: until this build completes they describe no plan, so a build that
        # fails half-way can never be skipped as a repeat of the previous key (another request's layout).
        meta.last_key = ()
        B = self.pool.block_size
        slot0, slot_managed, table0, table_managed, seq, vis = meta.stage()  # waits for its last copy
        slot0.fill_(-1)
        slot_managed.zero_()
        table0.fill_(self.pool.pad_block)
        table_managed.zero_()
        seq.zero_()
        vis.zero_()
        for r, row in enumerate(rows):
            m, t = row.num_blocks, row.num_tokens
            table0[r, :m] = row.table
            table_managed[r, :m] = row.managed
            valid = row.positions >= 0
            safe = row.positions.clamp(min=0)
            index = safe // B
            slots = row.table[index] * B + safe % B
            slot0[r, :t] = torch.where(valid, slots, -1)
            slot_managed[r, :t] = row.managed[index] & valid
            vis[r, :t] = row.visible_end
            seq[r] = row.seq_len
        meta.upload()
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
