"""Shared write-once regions (`regions.py`): DreamZero's cross-attention K/V in the pool, shared by content and salt.

Isolation is the point: sessions of different tenants (`cache_salt`) never share a block, a forged or colliding
caller key never makes a session read another's bytes (the content is compared before sharing), and nobody writes
a region after admission. Refcounts always equal the rows holding a block.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from paged_kv_compile import CapacityError, ConfigError, RequestError, families
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
from paged_kv_compile.models.dreamzero import DreamZeroConfig
from paged_kv_compile.regions import region_digest
from paged_kv_compile.runtime import PagedKVRuntime

# 2 layers x 4 heads x 16; cross K/V of 6 tokens = 2 blocks of 4 (the last one partly used).
CFG = DreamZeroConfig(num_layers=2, frame_seqlen=4, num_frame_per_block=1, local_attn_size=3, sink_size=1,
                      window_reset_frames=64, action_register_length=2, text_len=6)
SPEC = DreamZeroSpec.from_model_config(CFG)
ALLOCATORS = ["builtin", pytest.param("vllm", marks=pytest.mark.vllm)]


def make_runtime(allocator: str = "builtin", sessions: int = 4, cross_regions: int = 6, **kw) -> PagedKVRuntime:
    cfg = dreamzero_runtime_config(CFG, sessions=sessions, cross_regions=cross_regions, kernel="reference", **kw)
    return PagedKVRuntime(cfg, allocator=allocator)


def row_kv(seed: int) -> list[torch.Tensor]:
    """One row's cross K/V per layer, (2, 1, text_len, H, D)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 1, CFG.text_len, CFG.num_heads, CFG.head_dim, generator=g) for _ in range(CFG.num_layers)]


def cross_kv(*seeds: int) -> list[torch.Tensor]:
    """Per layer (2, rows, text_len, H, D): row r holds the content of `seeds[r]`."""
    rows = [row_kv(s) for s in seeds]
    return [torch.cat([r[layer] for r in rows], dim=1) for layer in range(CFG.num_layers)]


PROMPT, OTHER, NEGATIVE = 1, 2, 0


def region_blocks(rt: PagedKVRuntime, sid: str) -> list[list[int]]:
    return [r.blocks for r in rt.regions_of(sid)]


def holders(rt: PagedKVRuntime) -> dict[int, int]:
    """block -> how many live rows hold it, as history or as a region."""
    out: dict[int, int] = {}
    for oid, rows in rt.scheduler.owned_blocks().items():
        for blocks in [*rows, *region_blocks(rt, oid)]:
            for b in blocks:
                out[b] = out.get(b, 0) + 1
    return out


def assert_refcounts_exact(rt: PagedKVRuntime) -> None:
    held, alloc = holders(rt), rt.scheduler.allocator
    for b in range(alloc.num_blocks):
        assert alloc.refcount(b) == held.get(b, 0), f"block {b}"
    assert alloc.num_free == alloc.num_blocks - len(held)


def stored(rt: PagedKVRuntime, sid: str, row: int) -> torch.Tensor:
    region = rt.regions_of(sid)[row]
    return rt.pool.read_region(region.blocks, region.tokens)


def expected(seed: int) -> torch.Tensor:
    """(layers, 2, tokens, H, D): what a region of `row_kv(seed)` must hold."""
    return torch.stack([t[:, 0] for t in row_kv(seed)])


# ---- sharing and isolation ------------------------------------------------------------------------------
@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_shared_region_same_tenant_same_content_is_written_once(allocator, monkeypatch):
    rt = make_runtime(allocator, sessions=7)  # each session reserves its window (reservations)
    writes = []
    original = type(rt.pool).write_region
    monkeypatch.setattr(type(rt.pool), "write_region", lambda self, b, s: (writes.append(list(b)), original(self, b, s)))
    free = rt.scheduler.allocator.num_free
    for sid in ("a", "b", "c"):
        rt.admit(sid, SPEC, cross_kv=cross_kv(PROMPT, NEGATIVE), cache_salt="tenant-1")
    # Two regions (conditional row, negative row), written once each, held by three sessions.
    assert len(writes) == 2 and rt.scheduler.allocator.num_free == free - 2 * 2
    assert region_blocks(rt, "a") == region_blocks(rt, "b") == region_blocks(rt, "c")
    assert [r.holders for r in rt.regions_of("a")] == [3, 3]
    assert_refcounts_exact(rt)
    # Another prompt of the same tenant shares only the negative row; caller keys share the same way.
    rt.admit("d", SPEC, cross_kv=cross_kv(OTHER, NEGATIVE), cache_salt="tenant-1")
    assert len(writes) == 3
    assert region_blocks(rt, "d")[1] == region_blocks(rt, "a")[1] != region_blocks(rt, "d")[0]
    rt.admit("k1", SPEC, cross_kv=cross_kv(PROMPT, NEGATIVE), cache_salt="tenant-1", content_keys=["p", "n"])
    rt.admit("k2", SPEC, cross_kv=cross_kv(PROMPT, NEGATIVE), cache_salt="tenant-1", content_keys=["p", "n"])
    assert len(writes) == 5 and region_blocks(rt, "k1") == region_blocks(rt, "k2")
    assert_refcounts_exact(rt)
    for sid, seeds in (("a", (PROMPT, NEGATIVE)), ("d", (OTHER, NEGATIVE)), ("k2", (PROMPT, NEGATIVE))):
        for row, seed in enumerate(seeds):
            assert torch.equal(stored(rt, sid, row), expected(seed))
    # Two rows of one session with the same content hold one region twice.
    rt.admit("twice", SPEC, cross_kv=cross_kv(OTHER, OTHER), cache_salt="tenant-2")
    assert region_blocks(rt, "twice")[0] == region_blocks(rt, "twice")[1]
    assert rt.regions_of("twice")[0].holders == 2
    assert_refcounts_exact(rt)


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_shared_region_two_tenants_with_the_same_prompt_share_nothing(allocator):
    rt = make_runtime(allocator)
    for sid, salt in (("alice", "tenant-a"), ("bob", "tenant-b"), ("anon", None)):
        rt.admit(sid, SPEC, cross_kv=cross_kv(PROMPT, NEGATIVE), cache_salt=salt)
    blocks = [b for sid in ("alice", "bob", "anon") for r in region_blocks(rt, sid) for b in r]
    assert len(blocks) == len(set(blocks)) == 3 * 2 * 2  # no block in common, not even the negative row's
    assert all(r.holders == 1 for sid in ("alice", "bob", "anon") for r in rt.regions_of(sid))
    # A hit is impossible, not just unlikely: the registry is keyed by a digest that covers the salt...
    row = expected(PROMPT)
    digests = {region_digest(salt, row) for salt in ("tenant-a", "tenant-b", None, b"tenant-a\x00")}
    assert len(digests) == 4
    # ...and the same salt and content give the same key (blake2b of bytes, not Python's per-process hash).
    assert region_digest("tenant-a", row) == region_digest(b"tenant-a", row.clone())
    assert region_digest("tenant-a", row, b"k") == region_digest("tenant-a", row + 1, b"k")
    assert_refcounts_exact(rt)


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_shared_region_unsalted_sessions_share_nothing_with_the_empty_salt(allocator):
    """Issue 23, defect 7: no salt (None) and the salt "" hashed alike, so an unsalted session shared its regions
    with a tenant whose salt is "" (or b""). None is now a namespace of its own; "" and b"" are one salt (a str
    salt is its UTF-8 bytes), and unsalted sessions still share with each other."""
    rt = make_runtime(allocator)
    for sid, salt in (("anon", None), ("empty", ""), ("empty-bytes", b""), ("anon-2", None)):
        rt.admit(sid, SPEC, cross_kv=cross_kv(PROMPT, NEGATIVE), cache_salt=salt)
    assert region_blocks(rt, "anon") == region_blocks(rt, "anon-2")
    assert region_blocks(rt, "empty") == region_blocks(rt, "empty-bytes")
    anon = {b for r in region_blocks(rt, "anon") for b in r}
    assert not anon & {b for r in region_blocks(rt, "empty") for b in r}
    row = expected(PROMPT)
    assert region_digest(None, row) != region_digest("", row) == region_digest(b"", row)
    assert region_digest(None, row, b"k") != region_digest("", row, b"k")
    assert len({region_digest(salt, row) for salt in (None, "", "none", b"none", "salt:", "\x00")}) == 5  # "none" = b"none"
    assert_refcounts_exact(rt)


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_shared_region_forged_key_gets_its_own_blocks_and_reads_its_own_values(allocator):
    rt = make_runtime(allocator)
    rt.admit("victim", SPEC, cross_kv=cross_kv(PROMPT, NEGATIVE), cache_salt="t", content_keys=["p", "n"])
    victim = stored(rt, "victim", 0).clone()
    # Same tenant, same caller keys, different conditional content (a forged or colliding key).
    rt.admit("forger", SPEC, cross_kv=cross_kv(OTHER, NEGATIVE), cache_salt="t", content_keys=["p", "n"])
    assert region_blocks(rt, "forger")[0] != region_blocks(rt, "victim")[0]
    assert torch.equal(stored(rt, "forger", 0), expected(OTHER))  # its own values
    assert torch.equal(stored(rt, "victim", 0), victim)  # the victim's are untouched
    assert region_blocks(rt, "forger")[1] == region_blocks(rt, "victim")[1]  # the truly equal row is shared
    # Both candidates stay in the registry: a third session of either content finds its own.
    rt.admit("x", SPEC, cross_kv=cross_kv(OTHER, NEGATIVE), cache_salt="t", content_keys=["p", "n"])
    rt.admit("y", SPEC, cross_kv=cross_kv(PROMPT, NEGATIVE), cache_salt="t", content_keys=["p", "n"])
    assert region_blocks(rt, "x") == region_blocks(rt, "forger") and region_blocks(rt, "y") == region_blocks(rt, "victim")
    assert_refcounts_exact(rt)


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_shared_region_release_in_any_order_frees_only_blocks_nobody_holds(allocator):
    for order in itertools.permutations(["a", "b", "c", "fork"]):
        rt = make_runtime(allocator)
        total = rt.scheduler.allocator.num_blocks
        rt.admit("a", SPEC, cross_kv=cross_kv(PROMPT, NEGATIVE), cache_salt="t")
        rt.admit("b", SPEC, cross_kv=cross_kv(OTHER, NEGATIVE), cache_salt="t")
        rt.admit("c", SPEC, cross_kv=cross_kv(PROMPT, NEGATIVE), cache_salt="t")
        with rt.forward("a", "commit"):
            pass
        rt.fork("a", "fork")  # a fork holds its parent's regions too
        assert rt.regions_of("fork") == rt.regions_of("a") and rt.regions_of("a")[0].holders == 3
        rt.reset("c")  # a window reset keeps the regions (cross K/V is per session, not per window)
        assert rt.regions_of("c") == rt.regions_of("a")
        assert_refcounts_exact(rt)
        for sid in order:
            rt.release(sid)
            assert_refcounts_exact(rt)
        assert rt.scheduler.allocator.num_free == total
        assert rt.state()["regions"] == {"held": {}, "registry": []}


# ---- refusals and the write guard ---------------------------------------------------------------------
def test_shared_region_refusals_name_the_fix_and_change_nothing():
    rt = make_runtime(blocks_per_layer=16)  # a session reserves its window (6); its 2 regions take 4 of the 16
    rt.admit("live", SPEC, cross_kv=cross_kv(PROMPT, NEGATIVE), cache_salt="t")
    good = cross_kv(OTHER, NEGATIVE)
    cases = [
        (dict(cross_kv=good[:1]), ConfigError, "list of 2 per-layer tensors"),
        (dict(cross_kv=torch.stack(good)), ConfigError, "list of 2 per-layer tensors"),
        (dict(cross_kv=[t[:, :1] for t in good]), ConfigError, r"shape \(2, 2, tokens >= 1, 4, 16\)"),
        (dict(cross_kv=[t[..., :8] for t in good]), ConfigError, r"shape \(2, 2, tokens >= 1, 4, 16\)"),
        (dict(cross_kv=[good[0], good[1][:, :, :3]]), ConfigError, "one floating tensor"),
        (dict(cross_kv=[t.long() for t in good]), ConfigError, "one floating tensor"),
        (dict(cross_kv=good, content_keys=["p"]), ConfigError, "one key per row"),
        (dict(cross_kv=good, content_keys="pn"), ConfigError, "one key per row"),
        (dict(cross_kv=good, content_keys=["p", ""]), ConfigError, r"content_keys\[1\] must be a non-empty"),
        (dict(cross_kv=good, cache_salt=7), ConfigError, "cache_salt must be a str or bytes"),
        (dict(cache_salt="t"), ConfigError, "pass them with cross_kv"),
        # 6 blocks are free to reserve: a window and two new regions (10 blocks) do not fit; nothing is taken
        (dict(cross_kv=cross_kv(OTHER, OTHER + 5), cache_salt="t"), CapacityError,
         r"reserves 10 blocks per layer .* only 6 of the pool's 16 are free to reserve"),
    ]
    for kwargs, exc, match in cases:
        before = rt.state()
        with pytest.raises(exc, match=match):
            rt.admit("new", SPEC, **kwargs)
        assert rt.state() == before
        assert_refcounts_exact(rt)
    rt.admit("new", SPEC, cross_kv=cross_kv(PROMPT, NEGATIVE), cache_salt="t")  # shared: fits


def test_shared_region_write_guard_refuses_a_plan_that_writes_a_region_block(monkeypatch):
    """A region is written once, at admission; a plan laid out over one (even one with a single holder) is refused."""
    rt = make_runtime()
    rt.admit("s", SPEC, cross_kv=cross_kv(PROMPT, NEGATIVE), cache_salt="t")
    target = rt.regions_of("s")[0].blocks[0]
    family = families.get("dreamzero")
    original = type(family).plan

    def onto_the_region(self, owner, blocks, kind, **info):
        plan = original(self, owner, blocks, kind, **info)
        row = plan.rows[0]
        table = row.table.clone()
        table[0] = target
        managed = row.managed.clone()
        managed[0] = True
        plan.rows[0] = dataclasses.replace(row, table=table, managed=managed)
        return plan

    monkeypatch.setattr(type(family), "plan", onto_the_region)
    before = rt.state()
    with pytest.raises(RequestError, match=rf"would write blocks \[{target}\] of a shared write-once region"):
        rt.scheduler.plan("s", "commit")
    with pytest.raises(RequestError, match="shared write-once region"):
        rt.scheduler.plan_batch([("s", "commit")])
    assert rt.state() == before


def test_shared_region_in_an_fp8_pool_holds_the_quantized_values():
    rt = make_runtime(kv_dtype=torch.float8_e4m3fn)
    rt.pool.set_scales(torch.tensor([[0.5], [2.0]]), 1.0)
    rt.admit("a", SPEC, cross_kv=cross_kv(PROMPT, NEGATIVE), cache_salt="t")
    rt.admit("b", SPEC, cross_kv=cross_kv(PROMPT, NEGATIVE), cache_salt="t")
    assert region_blocks(rt, "a") == region_blocks(rt, "b")
    got = stored(rt, "a", 0).float()
    want = expected(PROMPT)
    scale = torch.tensor([0.5, 2.0])[:, None, None, None, None]
    k = (want[:, 0:1] / scale).to(torch.float8_e4m3fn).float()  # K quantized with each layer's scale
    assert torch.equal(got[:, 0:1], k)
    assert torch.equal(got[:, 1:], want[:, 1:].to(torch.float8_e4m3fn).float())


# ---- the benchmark behind docs/benchmarks.md ("Shared cross-attention regions") ---------------------------
def test_shared_regions_memory_benchmark():
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import fork_candidates

    big = fork_candidates.regions_14b()
    # 769 cross tokens (512 text + 257 image) fit one 880-token block of 40 layers x 40 heads x 128, K/V, bf16.
    assert (big["cross_tokens"], big["blocks_per_region"]) == (769, 1)
    assert big["region_bytes"] == 2 * 40 * 880 * 40 * 128 * 2
    assert [r["shared_gib"] for r in big["rows"]] == [round(2 * big["region_bytes"] / 2**30, 2)] * 4
    measured = fork_candidates.regions_measured(ns=(1, 3))
    assert measured[0]["shared_bytes"] == measured[1]["shared_bytes"] == measured[0]["unshared_bytes"]
    assert measured[1]["unshared_bytes"] == 3 * measured[0]["unshared_bytes"]
    assert [m["shared_writes"] for m in measured] == [2, 2] and measured[1]["unshared_writes"] == 6



def test_shared_region_admission_checks_capacity_before_evicting():
    """Regions take blocks at admission. With the LRU cap reached, a session that cannot fit is refused before
    anyone is evicted, and one that fits only with the evicted session's blocks does not share a region that the
    eviction ends (it writes its own)."""
    rt = PagedKVRuntime(dreamzero_runtime_config(CFG, kernel="reference", blocks_per_layer=10), max_sessions=1)
    rt.admit("old", SPEC, cross_kv=cross_kv(PROMPT, NEGATIVE), cache_salt="t")  # 4 of 10 blocks (+6 reserved)
    with rt.forward("old", "commit"):
        pass  # + 2 history blocks: 4 free
    huge = [torch.cat([t] * 4, dim=2)[:, :, :24] for t in cross_kv(3, 4)]  # 24 tokens: 6 blocks per row
    before = rt.state()
    with pytest.raises(CapacityError, match="needs 12 free blocks per layer .* it can never fit"):
        rt.admit("huge", SPEC, cross_kv=huge, cache_salt="t")
    assert rt.state() == before  # "old" was not evicted
    rt.admit("new", SPEC, cross_kv=cross_kv(PROMPT, NEGATIVE), cache_salt="t")  # evicts "old", 4 new blocks
    assert rt.scheduler.finished["old"].startswith("evicted")
    assert [r.holders for r in rt.regions_of("new")] == [1, 1]
    assert torch.equal(stored(rt, "new", 0), expected(PROMPT)) and torch.equal(stored(rt, "new", 1), expected(NEGATIVE))
    assert_refcounts_exact(rt)
