"""Shared write-once regions: K/V computed once per session (DreamZero's cross-attention), held by reference count.

A region is the K/V of `tokens` tokens of every layer of one row (one CFG branch), stored in managed pool blocks
(the same local ids in every layer, `pool.py: write_region`) and written once, on the host side, when a session
that brings it is admitted. Sessions that bring the same content under the same `cache_salt` hold the same blocks
(the allocator's `share`): the negative-prompt branch of every session of a tenant is one region. The registry
holds no reference of its own: a region is forgotten when its last holder lets go, so refcounts equal holders.

Isolation (as vLLM's `cache_salt`: a cache hit across tenants leaks through timing):
  * the registry key is a blake2b digest of the salt, the geometry and either a content key the caller gives or
    the stored K/V bytes themselves -- never Python's `hash`; no salt (None) is a namespace of its own, distinct
    from every salt including "" (`_salt_bytes`), and a str salt is its UTF-8 bytes;
  * a key match is only a candidate: its stored bytes are compared with the new content (bit for bit, in the
    pool's dtype) before any block is shared, so a forged or colliding caller key gets a region of its own and
    reads its own values;
  * region blocks are never written by a forward (`Scheduler._check_writes`).
Keying by bytes (no `content_keys`) hashes the stored K/V on the host: one device-to-host copy per row at
admission; a caller key (e.g. a hash of the prompt's token ids) avoids it, and the byte comparison stays on the device.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .allocator import BlockAllocator
from .errors import ConfigError
from .pool import KVPool

__all__ = ["Region", "RegionRequest", "SharedRegions", "region_digest"]

_PERSON = b"pkc-region-v1"  # blake2b personalization: these digests are never confused with another use


@dataclass(eq=False)
class Region:
    """One row's write-once K/V: `tokens` tokens in `blocks` (local ids, the same in every layer)."""

    digest: bytes
    blocks: list[int]
    tokens: int
    holders: int = 0  # rows holding it: each of its blocks has exactly this refcount

    @property
    def key(self) -> str:
        """A short printable name (the digest's first 12 hex digits) for messages and snapshots."""
        return self.digest.hex()[:12]


@dataclass(eq=False)
class RegionRequest:
    """One row's content, validated and converted to what the pool stores, with its registry digest."""

    digest: bytes
    stored: torch.Tensor  # (layers, 2, tokens, Hkv, D) in the pool's dtype, on the pool's device

    @property
    def tokens(self) -> int:
        return self.stored.shape[2]


@dataclass
class RegionPlan:
    """What admitting one owner's regions does: per row, an existing region or the index of a new one."""

    requests: list[RegionRequest]
    rows: list[Region | int] = field(default_factory=list)  # Region: share it; int: index into `new`
    new: list[RegionRequest] = field(default_factory=list)

    def new_block_counts(self, block_size: int) -> list[int]:
        return [-(-r.tokens // block_size) for r in self.new]


def _salt_bytes(cache_salt: Any) -> bytes:
    """What the digest hashes for a salt: b"none" for no salt, b"salt:" + the salt's bytes otherwise.

    No salt (None) is its own namespace, apart from every salt, the empty one included (once, None and ""
    both hashed as b"", so unsalted sessions shared regions with salt ""). A str salt is its UTF-8 bytes: "alice"
    and b"alice" name one tenant (vLLM's cache_salt is a str; a caller holding bytes means the same id)."""
    if cache_salt is None:
        return b"none"
    if isinstance(cache_salt, str):
        return b"salt:" + cache_salt.encode()
    if isinstance(cache_salt, bytes):
        return b"salt:" + cache_salt
    raise ConfigError(f"cache_salt must be a str or bytes (a tenant or user id), got {type(cache_salt).__name__}")


def _key_bytes(key: Any, row: int) -> bytes:
    if isinstance(key, str) and key:
        return key.encode()
    if isinstance(key, bytes) and key:
        return key
    raise ConfigError(
        f"content_keys[{row}] must be a non-empty str or bytes (e.g. a hash of the prompt's token ids), got {key!r}; "
        "or pass content_keys=None to key regions by their K/V bytes"
    )


def keyed_digest(person: bytes, parts: Sequence[bytes]) -> bytes:
    """blake2b-256 (personalized by `person`) of the parts, each length-prefixed so that no two part lists collide
    by concatenation: the one hashing scheme of shared K/V (regions here, prompt blocks in `prefix_cache.py`)."""
    h = hashlib.blake2b(digest_size=32, person=person)
    for b in parts:
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.digest()


def region_digest(cache_salt: Any, stored: torch.Tensor, content_key: bytes | None = None) -> bytes:
    """blake2b-256 of the salt, the stored geometry and dtype, and `content_key` or else the stored bytes."""
    parts = [_salt_bytes(cache_salt), repr((tuple(stored.shape), str(stored.dtype))).encode()]
    if content_key is not None:
        parts += [b"key", content_key]
    else:
        parts += [b"kv", stored.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()]
    return keyed_digest(_PERSON, parts)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads and signed zeros included)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class SharedRegions:
    """The registry of live regions (digest -> candidates) and which owner holds which, per row."""

    def __init__(self) -> None:
        self._by_digest: dict[bytes, list[Region]] = {}
        self.held: dict[str, list[Region]] = {}  # owner id -> one region per row
        self.blocks: set[int] = set()  # every live region block (no forward may write one)

    # ---- admission ------------------------------------------------------------------------------
    def requests(self, pool: KVPool, cross_kv: Any, rows: int, cache_salt: Any,
                 content_keys: Sequence[Any] | None) -> list[RegionRequest]:
        """Validate one owner's per-layer K/V `(2, rows, tokens, Hkv, D)` and key each row; changes nothing."""
        L, H, D = pool.num_layers, pool.num_kv_heads, pool.head_dim
        _salt_bytes(cache_salt)  # a bad salt is refused first
        if isinstance(cross_kv, torch.Tensor) or not isinstance(cross_kv, (list, tuple)) or len(cross_kv) != L:
            raise ConfigError(
                f"cross_kv must be a list of {L} per-layer tensors (2, rows, tokens, {H}, {D}), as "
                "DreamZeroModel.prepare_cross_kv returns them; got "
                + (f"{len(cross_kv)} entries" if isinstance(cross_kv, (list, tuple)) else type(cross_kv).__name__))
        shapes = {tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in cross_kv}
        shape = next(iter(shapes))
        if (len(shapes) != 1 or shape is None or len(shape) != 5 or shape[0] != 2 or shape[1] != rows
                or shape[3:] != (H, D) or shape[2] < 1
                or not all(t.dtype.is_floating_point for t in cross_kv)):
            raise ConfigError(
                f"cross_kv: every layer's K/V must be one floating tensor of shape (2, {rows}, tokens >= 1, {H}, {D}) "
                f"(K/V, this session's {rows} rows, the pool's kv heads and head dim); got shapes "
                f"{sorted(map(str, shapes))}. Pass model.prepare_cross_kv(...) with one context row per CFG row")
        if content_keys is not None:
            if isinstance(content_keys, (str, bytes)) or len(content_keys) != rows:
                raise ConfigError(
                    f"content_keys gives one key per row ({rows} rows): a list such as [hash(cond prompt ids), "
                    f"hash(negative prompt ids)], got {content_keys!r}")
            keys = [_key_bytes(k, r) for r, k in enumerate(content_keys)]
        else:
            keys = [None] * rows
        stacked = torch.stack([t.detach().to(pool.tensor.device) for t in cross_kv])  # (L, 2, rows, T, H, D)
        out = []
        for r in range(rows):
            stored = pool.to_stored(stacked[:, :, r])
            out.append(RegionRequest(region_digest(cache_salt, stored, keys[r]), stored))
        return out

    def resolve(self, pool: KVPool, requests: list[RegionRequest], ending: set[int] = frozenset()) -> RegionPlan:
        """Per row: a live region with this digest AND these bytes (confirmed), or a new one; changes nothing.
        `ending`: ids of regions about to be freed (an eviction's), never shared."""
        plan = RegionPlan(requests)
        for req in requests:
            found: Region | int | None = None
            for region in self._by_digest.get(req.digest, ()):
                if id(region) not in ending and region.tokens == req.tokens and _same_bytes(pool.read_region(region.blocks, region.tokens),
                                                               req.stored):
                    found = region
                    break
            if found is None:  # rows of this owner with the same content share one new region
                for i, other in enumerate(plan.new):
                    if other.digest == req.digest and _same_bytes(other.stored, req.stored):
                        found = i
                        break
            if found is None:
                plan.new.append(req)
                found = len(plan.new) - 1
            plan.rows.append(found)
        return plan

    def admit(self, owner_id: str, plan: RegionPlan, new_blocks: list[list[int]], pool: KVPool,
              allocator: BlockAllocator) -> None:
        """Write the plan's new regions into `new_blocks` (one list each, taken with refcount 1), register them
        and make `owner_id` hold one region per row."""
        created = []
        for req, blocks in zip(plan.new, new_blocks):
            pool.write_region(blocks, req.stored)
            created.append(Region(req.digest, list(blocks), req.tokens))
        held = [created[r] if isinstance(r, int) else r for r in plan.rows]
        first_hold = {id(c) for c in created}
        extra: list[int] = []
        for region in held:
            if id(region) in first_hold:
                first_hold.discard(id(region))  # the allocation is this holder's reference
            else:
                extra.extend(region.blocks)
            region.holders += 1
        allocator.share(extra)
        for region in created:
            self._by_digest.setdefault(region.digest, []).append(region)
            self.blocks.update(region.blocks)
        self.held[owner_id] = held

    def ending_with(self, owner_id: str) -> set[int]:
        """Ids of the regions that only `owner_id` holds: releasing it frees them."""
        held = self.held.get(owner_id, [])
        return {id(r) for r in held if r.holders == sum(h is r for h in held)}

    # ---- forks and release ----------------------------------------------------------------------
    def fork(self, parent_id: str, child_id: str, allocator: BlockAllocator) -> None:
        """The child holds the parent's regions too (one more reference per row)."""
        held = self.held.get(parent_id)
        if not held:
            return
        allocator.share([b for region in held for b in region.blocks])
        for region in held:
            region.holders += 1
        self.held[child_id] = list(held)

    def release(self, owner_id: str, free: Callable[[list[int]], None]) -> None:
        """Drop the owner's reference to each of its regions; a region nobody holds is forgotten."""
        for region in self.held.pop(owner_id, ()):
            free(region.blocks)
            region.holders -= 1
            if region.holders == 0:
                candidates = self._by_digest[region.digest]
                candidates.remove(region)
                if not candidates:
                    del self._by_digest[region.digest]
                self.blocks.difference_update(region.blocks)

    # ---- introspection --------------------------------------------------------------------------
    def of(self, owner_id: str) -> list[Region]:
        """The regions `owner_id` holds, one per row ([] when it brought none)."""
        return list(self.held.get(owner_id, ()))

    def snapshot(self) -> dict:
        """A comparable view of holdings and the registry (for the state-unchanged checks)."""
        return {
            "held": {oid: [(r.key, tuple(r.blocks)) for r in regs] for oid, regs in self.held.items()},
            "registry": sorted((r.key, tuple(r.blocks), r.holders) for regs in self._by_digest.values() for r in regs),
        }
