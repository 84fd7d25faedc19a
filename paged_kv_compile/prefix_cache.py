"""Prompt prefixes shared across requests: a block-granular hash chain and the index of cached prompt blocks.

Requests of one deployment share long prompt prefixes (a system prompt and template, earlier turns, a reference
image's tokens). As vLLM's prefix caching (`vllm/v1/core/kv_cache_utils.py`: a hash per full block chained on its
parent's; `block_pool.py`: cached blocks stay until the pool needs them), a FULL block of a row's prompt is named by a
digest of everything that determines its K/V:

  * its parent block's digest (so a block names the whole prefix up to its end: causal K/V depend on every
    earlier token), the root being the same for every row;
  * the caller's `cache_salt` (tenant isolation: two tenants with the same prompt share nothing; `None` is a
    namespace of its own, as for shared regions, `regions._salt_bytes`);
  * the caller's `prompt_keys`: whatever else changes the K/V of those tokens -- the model and adapter (LoRA)
    identity, a reference image's identity, the generator state where it enters the prompt, the grid and
    positions -- as bytes or strings, in order;
  * the block's token ids.

The digest is `regions.keyed_digest` (blake2b-256, one hashing scheme for shared K/V), never Python's `hash`. A
digest match is only a candidate: the cached block's token ids, salt, keys and parent (by identity) are compared
before anything is shared, so a colliding or forged digest gets blocks of its own.

Lifecycle (`Scheduler.admit` / `finish_forward` / `_release`):
  * admission walks each row's chain and shares the longest confirmed run of cached blocks, the same number in
    every row of the request (the dense model runs one suffix for all its rows); the rest is taken fresh;
  * only once the owner's first forward that keeps K/V (e.g. a prefill) has succeeded are its full
    prompt blocks published; a failed or aborted request publishes nothing;
  * the index holds one reference of its own on each cached block; a cached block no owner holds is *idle*: it
    counts as free for admission (`Reservations`) and is evicted, least recently used first (a released request's
    blocks tail first, as vLLM frees them), when an allocation needs the room.
No forward ever writes a cached block: its refcount is above one while anyone but the index holds it, and the
scheduler refuses a plan that writes a block with another holder (`Scheduler._check_writes`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from .allocator import BlockAllocator
from .errors import ConfigError, RequestError
from .regions import _salt_bytes, keyed_digest

__all__ = ["CachedBlock", "ChainLink", "PrefixCache", "PrefixHold", "prompt_chain"]

_PERSON = b"pkc-prefix-v1"  # blake2b personalization: prompt-block digests are never confused with regions'
_ROOT = b"root"


@dataclass(frozen=True)
class ChainLink:
    """One full prompt block of a row, as admission names it: its digest and what confirms a match."""

    digest: bytes
    tokens: bytes  # the block's token ids, int64 little-endian


@dataclass(eq=False)
class CachedBlock:
    """A published prompt block (local id `block`, the same in every layer) and what it was computed from."""

    digest: bytes
    block: int
    tokens: bytes
    parent: "CachedBlock | None"
    salt: bytes
    keys: bytes
    holders: int = 0  # owners holding it (the index's own reference is separate)

    def confirms(self, link: ChainLink, parent: "CachedBlock | None", salt: bytes, keys: bytes) -> bool:
        """Whether this block holds exactly `link`'s K/V: same tokens, salt, keys, and the same parent block."""
        return (self.digest == link.digest and self.tokens == link.tokens and self.parent is parent
                and self.salt == salt and self.keys == keys)


@dataclass
class PrefixHold:
    """What one owner holds of the cache: per row its chain, and the cached blocks it holds (shared or published)."""

    chains: list[list[ChainLink]]
    salt: bytes
    keys: bytes
    held: list[CachedBlock] = field(default_factory=list)
    shared_blocks: int = 0  # leading blocks of every row that came from the cache at admission
    published: bool = False


def _keys_bytes(prompt_keys: Sequence[Any]) -> bytes:
    if isinstance(prompt_keys, (str, bytes)):
        raise ConfigError(
            f"prompt_keys is a list of keys (e.g. [model id, adapter id, image digest]), got the single "
            f"{prompt_keys!r}: wrap it in a list")
    parts = []
    for i, key in enumerate(prompt_keys):
        if isinstance(key, str):
            key = key.encode()
        if not isinstance(key, bytes):
            raise ConfigError(
                f"prompt_keys[{i}] must be str or bytes (what else changes the prompt's K/V: model, adapter, image "
                f"identity, generator state, grid), got {type(key).__name__}")
        parts.append(len(key).to_bytes(8, "little") + key)
    return b"".join(parts)


def _token_array(tokens: Any, row: int, length: int) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise ConfigError(f"prompt_tokens[{row}] must be a 1-D integer tensor of token ids, got {tokens.dtype} "
                              f"of shape {tuple(tokens.shape)}")
        arr = tokens.detach().to("cpu", torch.int64).numpy()
    else:
        arr = np.asarray(list(tokens), dtype=np.int64)
    if arr.ndim != 1 or len(arr) != length:
        raise ConfigError(
            f"prompt_tokens[{row}] has {arr.size} token ids but the request's row {row} has a {length}-token prompt: "
            "pass each row's prompt token ids (CFG rows in order)")
    return arr


def prompt_chain(tokens: np.ndarray, block_size: int, salt: bytes, keys: bytes) -> list[ChainLink]:
    """The hash chain of a row's full prompt blocks (a partial last block is never cached)."""
    links, parent = [], _ROOT
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size].astype("<i8").tobytes()
        parent = keyed_digest(_PERSON, [parent, salt, keys, block])
        links.append(ChainLink(parent, block))
    return links


class PrefixCache:
    """The index of cached prompt blocks (digest -> candidates), their idle LRU, and what each owner holds."""

    def __init__(self) -> None:
        self._by_digest: dict[bytes, list[CachedBlock]] = {}
        self.by_block: dict[int, CachedBlock] = {}  # every cached block (the index holds one reference on each)
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached blocks no owner holds, least recently used first
        self.holds: dict[str, PrefixHold] = {}

    # ---- counts the admission arithmetic reads --------------------------------------------------------
    @property
    def idle_count(self) -> int:
        return len(self.idle)

    @property
    def pinned_count(self) -> int:
        """Cached blocks some owner holds (they stay held while it lives)."""
        return len(self.by_block) - len(self.idle)

    def index_refs(self, block: int) -> int:
        """References the index itself holds on `block` (1 if cached, else 0)."""
        return 1 if block in self.by_block else 0

    # ---- admission ------------------------------------------------------------------------------------
    def chains(self, prompt_tokens: Sequence[Any], prompt_lens: Sequence[int], block_size: int, cache_salt: Any,
               prompt_keys: Sequence[Any]) -> tuple[list[list[ChainLink]], bytes, bytes]:
        """Validate one request's per-row prompt token ids and keys; (chains, salt, keys). Changes nothing."""
        salt = _salt_bytes(cache_salt)
        keys = _keys_bytes(prompt_keys)
        if isinstance(prompt_tokens, torch.Tensor) or len(prompt_tokens) != len(prompt_lens):
            raise ConfigError(
                f"prompt_tokens gives one 1-D sequence of token ids per row ({len(prompt_lens)} rows), got "
                + (f"a tensor of shape {tuple(prompt_tokens.shape)}" if isinstance(prompt_tokens, torch.Tensor)
                   else f"{len(prompt_tokens)}"))
        arrays = [_token_array(t, r, n) for r, (t, n) in enumerate(zip(prompt_tokens, prompt_lens))]
        return [prompt_chain(a, block_size, salt, keys) for a in arrays], salt, keys

    def match(self, chain: list[ChainLink], salt: bytes, keys: bytes) -> list[CachedBlock]:
        """The longest run of cached blocks confirming `chain` from its root; changes nothing."""
        found: list[CachedBlock] = []
        parent = None
        for link in chain:
            hit = next((c for c in self._by_digest.get(link.digest, ()) if c.confirms(link, parent, salt, keys)), None)
            if hit is None:
                break
            found.append(hit)
            parent = hit
        return found

    def hold(self, owner_id: str, chains: list[list[ChainLink]], salt: bytes, keys: bytes,
             shared: list[list[CachedBlock]], allocator: BlockAllocator) -> None:
        """`owner_id` holds `shared` (per row, its leading cached blocks; one reference each) and will publish the
        rest of its chains once its prefill succeeded."""
        blocks = [c.block for row in shared for c in row]
        allocator.share(blocks)
        held = [c for row in shared for c in row]
        for c in held:
            c.holders += 1
            self.idle.pop(c.block, None)
        self.holds[owner_id] = PrefixHold(chains, salt, keys, held, len(shared[0]) if shared else 0)

    def evict(self, n: int, allocator: BlockAllocator) -> int:
        """Free up to `n` idle cached blocks, least recently used first; how many were freed."""
        freed = []
        while self.idle and len(freed) < n:
            block, _ = self.idle.popitem(last=False)
            self._forget(self.by_block[block])
            freed.append(block)
        if freed:
            allocator.free(freed)
        return len(freed)

    def _forget(self, cached: CachedBlock) -> None:
        del self.by_block[cached.block]
        candidates = self._by_digest[cached.digest]
        candidates.remove(cached)
        if not candidates:
            del self._by_digest[cached.digest]

    # ---- after the prefill ----------------------------------------------------------------------------
    def publish(self, owner_id: str, rows: Sequence[Sequence[int]], allocator: BlockAllocator) -> int:
        """Once `owner_id`'s prefill succeeded: index every full prompt block of its rows not cached yet (one index
        reference each); how many of its blocks it indexed. A block whose content another request published meanwhile
        stays private (no duplicates)."""
        hold = self.holds.get(owner_id)
        if hold is None or hold.published:
            return 0
        hold.published = True
        published = 0
        mine = {id(c) for c in hold.held}
        for chain, blocks in zip(hold.chains, rows):
            parent = None
            for link, block in zip(chain, blocks):
                hit = next((c for c in self._by_digest.get(link.digest, ())
                            if c.confirms(link, parent, hold.salt, hold.keys)), None)
                if hit is None:
                    hit = CachedBlock(link.digest, block, link.tokens, parent, hold.salt, hold.keys)
                    allocator.share([block])
                    self._by_digest.setdefault(link.digest, []).append(hit)
                    self.by_block[block] = hit
                    published += 1
                if hit.block == block and id(hit) not in mine:
                    hit.holders += 1
                    hold.held.append(hit)
                    mine.add(id(hit))
                parent = hit
        return published

    # ---- forks and release ----------------------------------------------------------------------------
    def fork(self, parent_id: str, child_id: str) -> None:
        """The child holds what the parent holds of the cache (the scheduler shares the blocks themselves)."""
        hold = self.holds.get(parent_id)
        if hold is None:
            return
        for c in hold.held:
            c.holders += 1
        self.holds[child_id] = PrefixHold(hold.chains, hold.salt, hold.keys, list(hold.held), hold.shared_blocks,
                                          hold.published)

    def release(self, owner_id: str) -> None:
        """`owner_id` no longer holds its cached blocks (the scheduler frees its references): those nobody holds
        become idle, most recently used, a row's tail before its head (evicted first)."""
        hold = self.holds.pop(owner_id, None)
        if hold is None:
            return
        for c in reversed(hold.held):
            c.holders -= 1
            if c.holders == 0:
                self.idle[c.block] = None

    # ---- multi-rank restore and introspection ---------------------------------------------------------
    def save(self) -> tuple:
        """Everything a lifecycle call may change, for `restore` (distributed/snapshot.py): small, by reference."""
        return ({d: list(c) for d, c in self._by_digest.items()}, dict(self.by_block), list(self.idle),
                {oid: (h, list(h.held), h.published) for oid, h in self.holds.items()},
                [(c, c.holders) for c in self.by_block.values()])

    def restore(self, saved: tuple) -> None:
        by_digest, by_block, idle, holds, holders = saved
        self._by_digest.clear()
        self._by_digest.update(by_digest)
        self.by_block.clear()
        self.by_block.update(by_block)
        self.idle.clear()
        self.idle.update((b, None) for b in idle)
        self.holds.clear()
        for oid, (h, held, published) in holds.items():
            h.held[:] = held
            h.published = published
            self.holds[oid] = h
        for c, n in holders:
            c.holders = n

    def snapshot(self) -> dict:
        """A comparable view (the state-unchanged checks, `PagedKVRuntime.state`)."""
        return {
            "cached": sorted((c.digest.hex()[:12], c.block, c.holders) for c in self.by_block.values()),
            "idle": list(self.idle),
            "holds": {oid: sorted(c.block for c in h.held) for oid, h in self.holds.items()},
        }

    def shared_tokens(self, owner_id: str, block_size: int) -> int:
        """Leading prompt tokens of every row of `owner_id` that it was served from the cache at admission."""
        hold = self.holds.get(owner_id)
        return 0 if hold is None else hold.shared_blocks * block_size


def check_prompt_admission(family: Any, spec: Any, rows: int, cross_kv: Any) -> list[int]:
    """The per-row prompt lengths of an owner admitted with `prompt_tokens`, or a clear refusal."""
    lens = family.cacheable_prefix(spec)
    if lens is None:
        raise RequestError(f"{family.name} {family.noun}s do not share prompt prefixes: admit without prompt_tokens")
    if cross_kv is not None:
        raise ConfigError("prompt_tokens (a cached prompt prefix) and cross_kv (a shared region) are separate "
                          "admissions: pass one of them")
    if len(lens) != rows:
        raise RequestError(f"the spec has {len(lens)} prompt rows but {rows} rows are admitted")
    return list(lens)

