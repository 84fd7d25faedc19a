"""Once-per-forward metadata for every layer, in persistent per-bucket buffers.

What the host builds and copies is the same for every layer: each row's block table as layer-0 ids (local
ids where a block is managed, absolute scratch ids elsewhere), which entries are managed, the logical position
of every query token (-1: padding), ``seq_lens``, ``kv_visible_end`` and ``kv_gap`` (per row the logical keys
no query sees, `layout.RowLayout.kv_gap`). All of it lives in one device
allocation per bucket, filled by ONE host-to-device copy from one staging buffer per forward. Layer l's
op inputs follow from it and one per-layer base (`pool.py`: layer l's block b is ``l * blocks_per_layer + b``):
``block_table = table0 + managed * base_l`` and ``slot_mapping[t] = block_table[pos_t // B] * B + pos_t % B``
(-1 where pos_t < 0). :func:`layer_metadata` computes them; `passes/insert.py` puts that computation into
the compiled graph next to each op call, so it runs on the device (inside a captured CUDA graph) and the host
does no per-layer and no per-token arithmetic. Every buffer keeps its address.

The host side is plain numpy on the pinned staging buffer: no torch operator (so nothing waits on torch's
intra-op thread pool, which stalls when other processes keep the cores busy).
"""

from __future__ import annotations

import numpy as np
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


def layer_block_table(table0: torch.Tensor, managed: torch.Tensor, block_base: torch.Tensor) -> torch.Tensor:
    """One layer's block table int32 [R, M]: the staged layer-0 ids plus the layer's base where managed (local
    ids), unchanged elsewhere (scratch and pad blocks are absolute). The window sites' tables (`layer_metadata`)
    and the shared regions' (regions.py, read with `paged_kv::attend`) are both made here, inside compiled graphs."""
    return table0 + managed * block_base


def layer_metadata(positions: torch.Tensor, table0: torch.Tensor, table_managed: torch.Tensor,
                   block_base: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (slot_mapping int64 [R, T], block_table int32 [R, M]) from the shared metadata and its base.

    Plain torch ops on the buffers: called inside compiled graphs (`passes/insert.py`) and by code that
    drives the op directly (:class:`LayerViews`)."""
    table = layer_block_table(table0, table_managed, block_base)
    safe = positions.clamp(min=0)
    slots = torch.gather(table, 1, (safe // block_size).long()).to(torch.int64) * block_size + safe % block_size
    return torch.where(positions >= 0, slots, -1), table


class LayerViews:
    """What one layer's op call reads besides the shared buffers: its base (a 0-d tensor at a fixed address).

    `slot_mapping` / `block_table` give that layer's values as new tensors, for code that calls the op
    directly (tests, benchmarks); compiled graphs compute them in the graph instead.
    """

    def __init__(self, meta: "BucketMetadata", layer: int) -> None:
        self.meta, self.layer = meta, layer
        self.block_base = meta.block_bases[layer]  # int32 0-d: layer * blocks_per_layer

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot_mapping, block_table) of this layer, computed together (each property below computes both)."""
        m = self.meta
        return layer_metadata(m.positions, m.table0, m.table_managed, self.block_base, m.block_size)

    @property
    def slot_mapping(self) -> torch.Tensor:  # int64 [R, T]
        return self.tensors()[0]

    @property
    def block_table(self) -> torch.Tensor:  # int32 [R, M]
        return self.tensors()[1]


class BucketMetadata:
    """Persistent buffers of one shape bucket, for all layers.

    The copy is asynchronous on a CUDA device and the host may run ahead (CUDA graphs), so a pinned
    staging buffer must not be written while a copy out of it is pending. Writes go through
    :meth:`stage`, which alternates between two pinned buffers, first waits for the copy last issued
    from the one it hands out and returns its index; :meth:`upload` issues the copy from it and records
    that copy's event. Each staging buffer remembers one extent: the (tokens, blocks) per row its last
    upload may hold beyond padding, so the next build resets only that much.
    """

    def __init__(self, bucket: Bucket, pool: KVPool, device: torch.device | None = None,
                 region_tokens: int = 0) -> None:
        self.bucket = bucket
        L, R, T = pool.num_layers, bucket.rows, bucket.tokens
        M = bucket.table_width(pool.block_size)
        self.width = M
        self.num_layers = L
        device = device if device is not None else pool.tensor.device
        self.device = device
        #: blocks per row of the region table: the shared write-once region each row reads (regions.py)
        self.region_width = Mr = max(1, -(-region_tokens // pool.block_size))
        staged = [((R, T), torch.int32), ((R, M), torch.int32), ((R, M), torch.bool), ((R,), torch.int32),
                  ((R, T), torch.int32), ((R, 2), torch.int32), ((R, Mr), torch.int32), ((R, Mr), torch.bool),
                  ((R,), torch.int32), ((R, T), torch.int32)]
        nbytes = _buffer_bytes(staged)
        self.device_buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.host_buffer = torch.zeros(2, nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        (self.positions, self.table0, self.table_managed, self.seq_lens, self.kv_visible_end, self.kv_gap,
         self.region_table0, self.region_managed, self.region_seq_lens, self.region_visible_end) = _carve(
            self.device_buffer, staged)
        self._region_staged = [True, True]  # per staging buffer: its region table may hold regions (reset it)
        self._device_regions = True  # the device buffer's region table may hold regions
        self.block_size = pool.block_size
        # What an upload copies: the whole buffer, or only the window part (everything before the region table)
        # while neither the staging buffer nor the device buffer holds a region (a runtime without regions: the
        # region table's (R, T) visible ends would otherwise be a third of the bytes copied).
        window = _buffer_bytes(staged[:6])
        self._device_parts = (self.device_buffer, self.device_buffer[:window])
        self._host_parts = [(self.host_buffer[i], self.host_buffer[i][:window]) for i in range(2)]
        # numpy views of the two staging buffers (those parts, and carved like the device buffer) and, for CPU
        # metadata, of the device buffer: the host writes and copies through them without a torch op.
        self._host_np = [tuple(part.numpy() for part in parts) for parts in self._host_parts]
        self.views = [[t.numpy() for t in _carve(self.host_buffer[i], staged)] for i in range(2)]
        self._device_np = tuple(part.numpy() for part in self._device_parts) if device.type == "cpu" else None
        self.block_bases = pool.layer_bases.to(device=device, dtype=torch.int32)
        self.layers = [LayerViews(self, l) for l in range(L)]
        self.last_key: tuple = ()
        self.pad_block = pool.pad_block
        #: per staging buffer, the (tokens, blocks) extent per row it may hold beyond padding
        self.extent = [(T, M), (T, M)]
        #: Makes the event recorded after each copy (None: copies are synchronous). Tests swap in fakes.
        self.new_event = torch.cuda.Event if device.type == "cuda" else (lambda: None)
        self._copy_done: list = [None, None]  # per staging buffer: the event of the last copy out of it
        self._current = 1
        self.copies = 0  # copies issued into device_buffer (padding states included)
        self.fill_with_padding()

    # ---- every layer at once, for tests and direct op calls (compiled graphs never read these) --------
    @property
    def slot_mapping(self) -> torch.Tensor:
        """int64 [L, R, T]: every layer's absolute slots (a new tensor)."""
        return torch.stack([views.slot_mapping for views in self.layers])

    @property
    def block_table(self) -> torch.Tensor:
        """int32 [L, R, M]: every layer's absolute block table (a new tensor)."""
        return torch.stack([views.block_table for views in self.layers])

    def stage(self) -> int:
        """The index of the staging buffer to write the next forward into (its numpy views: `views[i]`,
        positions, table0, table_managed, seq_lens, kv_visible_end; what it may hold beyond padding:
        `extent[i]`); call :meth:`upload` after writing it.

        Switches to the other pinned buffer and waits until the last copy out of it has completed, so no
        write can reach a copy still pending (with two buffers the host may run one forward ahead).
        """
        i = self._current = 1 - self._current
        done = self._copy_done[i]
        if done is not None:
            done.synchronize()
            self._copy_done[i] = None
        return i

    def fill_with_padding(self) -> None:
        """A valid all-padding state: nothing written, nothing visible (before the first forward, warm-up)."""
        i = self.stage()
        positions, table0, table_managed, seq, vis, gap = self.views[i][:6]
        positions[:] = -1
        vis[:] = 0
        table0[:] = self.pad_block
        table_managed[:] = False
        seq[:] = 0
        gap[:] = 0
        self.stage_regions(i, None)
        self.upload(i, (0, 0))
        self.last_key = ()

    def stage_regions(self, i: int, regions: list | None) -> None:
        """The region table of every row into staging buffer `i`: row r reads `regions[r]` (blocks, tokens) in
        full, or nothing (pad block, length 0). Skipped while neither this forward nor the buffer has regions."""
        if not regions and not self._region_staged[i]:
            return
        table0, managed, seq, vis = self.views[i][6:]
        table0[:] = self.pad_block
        managed[:] = False
        seq[:] = 0
        vis[:] = 0
        for r, region in enumerate(regions or ()):
            if region is not None:
                n = len(region.blocks)
                table0[r, :n] = region.blocks
                managed[r, :n] = True
                seq[r] = region.tokens
                vis[r, :] = region.tokens
        self._region_staged[i] = bool(regions)

    def upload(self, i: int, written: tuple[int, int]) -> None:
        """The forward's one host-to-device copy from staging buffer `i` (from :meth:`stage`), and its event.

        `written` is the (tokens, blocks) extent per row the caller wrote beyond padding: the next build into
        this buffer resets only that much.
        """
        self.extent[i] = written
        self.copy_in(i)
        self.copies += 1
        event = self._copy_done[i] = self.new_event()
        if event is not None:
            event.record()

    def copy_in(self, i: int) -> None:
        """Device work of one upload, in stream order: the copy of staging buffer `i` into the device buffer.

        CPU metadata is copied with numpy (a memcpy, no torch intra-op threads); a device gets one
        asynchronous copy out of the pinned buffer. The region table is left out while neither side holds one."""
        part = 0 if self._region_staged[i] or self._device_regions else 1
        self._device_regions = self._region_staged[i]
        if self._device_np is not None:
            np.copyto(self._device_np[part], self._host_np[i][part])
        else:
            self._device_parts[part].copy_(self._host_parts[i][part], non_blocking=True)

    def addresses(self) -> tuple[int, ...]:
        return (self.device_buffer.data_ptr(), self.block_bases.data_ptr())


class MetadataBuilder:
    """Builds a forward's metadata for all layers at once, vectorized, and counts the copies."""

    def __init__(self, pool: KVPool, device: torch.device | str | None = None, region_tokens: int = 0,
                 kv_gaps: bool = True) -> None:
        """`device` defaults to the pool's; a "meta" pool with CPU metadata measures host cost alone.
        `region_tokens`: the longest shared region a forward's rows read (config.region_tokens). `kv_gaps`
        (config.kv_gaps): False when the compiled graphs take no kv_gap, so a row with a gap is refused."""
        self.pool = pool
        self.region_tokens = region_tokens
        self.kv_gaps = kv_gaps
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
            meta = self.buckets[bucket] = BucketMetadata(bucket, self.pool, self.device, self.region_tokens)
        return meta

    def build(self, bucket: Bucket, rows: list[RowLayout], key: tuple = (), regions: list | None = None) -> BucketMetadata:
        """Fill `bucket`'s buffers from per-row layouts (and the shared region each row reads, `regions.py`);
        skipped when `key` repeats the last build.

        Per row: four slice copies of the layout's numpy arrays and the reset of what the staging buffer held
        beyond them (its extent); rows the bucket has beyond the forward's are reset in one slice per buffer.
        Nothing here dispatches a torch operator."""
        meta = self.buffers(bucket)
        if key and key == meta.last_key:
            return meta
        self._check_fits(bucket, meta.width, rows, self.pool.block_size, self.kv_gaps)
        if not self.region_tokens:
            regions = None  # no compiled graph of this runtime reads a region (a region site refuses to compile)
        for r, region in enumerate(regions or ()):
            if region is not None and len(region.blocks) > meta.region_width:
                raise RequestError(
                    f"row {r} reads a shared region of {region.tokens} tokens but the metadata holds "
                    f"{meta.region_width} region blocks per row: set region_tokens >= {region.tokens} in the config "
                    "(the family's runtime config with cross_regions=N sets it to the model's cross-attention length)"
                )
        # From here the buffers change: until this build completes they describe no plan, so a build that
        # fails half-way can never be skipped as a repeat of the previous key (another request's layout).
        meta.last_key = ()
        i = meta.stage()  # waits for its last copy
        positions, table0, table_managed, seq, vis, gap = meta.views[i][:6]
        meta.stage_regions(i, regions)
        tp, mp = meta.extent[i]
        # Until the upload records what was written, assume everything may be (a write that raised half-way).
        meta.extent[i] = (bucket.tokens, meta.width)
        used_t = used_m = 0
        for r, row in enumerate(rows):
            table, managed, pos, ends = row.arrays
            t, m = len(pos), len(table)
            table0[r, :m] = table
            table_managed[r, :m] = managed
            positions[r, :t] = pos
            vis[r, :t] = ends
            seq[r] = row.seq_len
            gap[r] = row.kv_gap
            if tp > t:
                positions[r, t:tp] = -1
                vis[r, t:tp] = 0
            if mp > m:
                table0[r, m:mp] = meta.pad_block
                table_managed[r, m:mp] = False
            used_t, used_m = max(used_t, t), max(used_m, m)
        n = len(rows)
        if n < bucket.rows:
            positions[n:, :tp] = -1
            vis[n:, :tp] = 0
            table0[n:, :mp] = meta.pad_block
            table_managed[n:, :mp] = False
            seq[n:] = 0
            gap[n:] = 0
        meta.upload(i, (used_t, used_m))
        self.builds += 1
        meta.last_key = key
        return meta

    @staticmethod
    def _check_fits(bucket: Bucket, width: int, rows: list[RowLayout], block_size: int, kv_gaps: bool = True) -> None:
        """Refuse rows the bucket cannot hold, before anything is staged (integer checks only: each layout
        carries its largest position)."""
        if len(rows) > bucket.rows:
            raise RequestError(f"{len(rows)} rows exceed bucket {bucket} ({bucket.rows} rows)")
        for r, row in enumerate(rows):
            t, m = row.num_tokens, row.num_blocks
            if t > bucket.tokens:
                raise RequestError(
                    f"row {r} has {t} tokens, beyond bucket {bucket} ({bucket.tokens}); "
                    "add a larger bucket to the config"
                )
            if m > width:
                raise RequestError(
                    f"row {r} needs {m} blocks, beyond bucket {bucket}'s table width {width}; "
                    "add a bucket with a larger context"
                )
            g0, g1 = row.kv_gap
            if not 0 <= g0 <= g1 <= row.seq_len:
                raise RequestError(
                    f"row {r} hides logical keys [{g0}, {g1}) of its {row.seq_len}: a kv_gap must be an interval "
                    "within the row (or (0, 0)): the plan's layout is inconsistent"
                )
            if g1 > g0 and not kv_gaps:
                raise RequestError(
                    f"row {r} hides logical keys [{g0}, {g1}) inside its table (a window or sink that does not end on "
                    f"a block boundary of {block_size} tokens), but this runtime was configured with kv_gaps=False, so "
                    "its compiled graphs take no kv_gap: build the config with kv_gaps=True (the family's runtime "
                    "config helper sets it from the geometry) or choose a block_size that divides the frame, chunk "
                    "and sink")
            if row.max_position >= m * block_size:
                raise RequestError(
                    f"row {r} writes logical position {row.max_position} but its block table covers "
                    f"{m * block_size} positions: the plan's layout is inconsistent"
                )
