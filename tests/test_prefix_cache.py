"""Prompt prefixes shared across HunyuanImage-3 requests (`prefix_cache.py`): the hash chain, confirmation before
sharing, publication only after a successful prefill, idle cached blocks counted as free and evicted least recently
used, isolation between tenants, and a request served from the cache computed over its uncached suffix only,
compiled, matching the same request computed in full by the dense model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_kv_compile import prefix_cache
from paged_kv_compile.capture import CapturedBlocks, CompiledOnlyGraphs
from paged_kv_compile.capture.calls import record_calls
from paged_kv_compile.config import Bucket
from paged_kv_compile.driver import PagedHooks
from paged_kv_compile.errors import CapacityError, ConfigError, RequestError
from paged_kv_compile.families.dreamzero import DreamZeroSpec
from paged_kv_compile.families.hunyuan_image3 import (hunyuan_buckets, hunyuan_layer_inputs, hunyuan_runtime_config,
                                                      hunyuan_spec)
from paged_kv_compile.models.dreamzero import DreamZeroConfig
from paged_kv_compile.models.hooks import DenseHooks, drive
from paged_kv_compile.models.hunyuan_image3 import (HunyuanImage3Config, HunyuanImage3Model, hunyuan_generate,
                                                    hunyuan_steps)
from paged_kv_compile.prefix_cache import prompt_chain
from paged_kv_compile.runtime import PagedKVRuntime

from helpers import CountingBackend, compile_blocks, host_syncs

ATOL = 1e-5
CFG = HunyuanImage3Config()
B = 4  # block size
P = 12  # prefix capacity


def _ids(*lengths: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab, (n,), generator=g) for n in lengths]


SYSTEM, OTHER_SYSTEM = _ids(8, 8, seed=1)
NEGATIVE = _ids(9, seed=2)[0]


def _request(tail: int, seed: int, system: torch.Tensor = SYSTEM) -> list[torch.Tensor]:
    """Two CFG rows: [system prompt | the request's own tokens] and a negative prompt every request shares."""
    return [torch.cat([system, _ids(tail, seed=seed)[0]]), NEGATIVE]


def _runtime(requests: int = 2, allocator: str = "builtin", **overrides) -> PagedKVRuntime:
    return PagedKVRuntime(hunyuan_runtime_config(CFG, max_prefix=P, block_size=B, kernel="reference",
                                                 requests=requests, **overrides), allocator=allocator)


def _admit(rt: PagedKVRuntime, rid: str, prompts, **kw) -> None:
    rt.admit(rid, hunyuan_spec(CFG, prompts), prompt_tokens=prompts, **kw)


def _prefill(rt: PagedKVRuntime, rid: str, prompts) -> None:
    """The request's prefill forward driven by hand (no model): over the suffix when it holds a ready prefix."""
    spec = hunyuan_spec(CFG, prompts)
    ready = rt.owner(rid).prefix_ready
    args = {"suffix_from": ready[0]} if ready else {}
    with rt.forward(rid, "prefill", prefix_capacity=P, attention_mask=spec.padded_mask(P), **args):
        pass


def _served(prompts_a, prompts_b, **admit_b) -> tuple[PagedKVRuntime, tuple]:
    """Request a prefilled and released, then b admitted: b's ready prefix."""
    rt = _runtime()
    _admit(rt, "a", prompts_a)
    _prefill(rt, "a", prompts_a)
    rt.release("a")
    _admit(rt, "b", prompts_b, **admit_b)
    return rt, rt.owner("b").prefix_ready


# ---- the hash chain ---------------------------------------------------------------------------------------------


def test_prefix_cache_chain_names_tokens_parent_salt_and_keys():
    tokens = torch.arange(10).numpy()
    chain = prompt_chain(tokens, B, b"salt:t", b"")
    assert len(chain) == 2  # only full blocks: the 2 trailing tokens are never cached
    assert chain == prompt_chain(tokens.copy(), B, b"salt:t", b"")  # deterministic, not Python's hash
    changed_first = tokens.copy()
    changed_first[0] += 1
    other = prompt_chain(changed_first, B, b"salt:t", b"")
    # block 1's own tokens are equal, but its parent differs: a block names its whole prefix
    assert other[1].tokens == chain[1].tokens and other[1].digest != chain[1].digest
    variants = [(b"salt:t", b""), (b"salt:u", b""), (b"none", b""), (b"salt:t", b"\x01" + bytes(7) + b"m")]
    digests = {prompt_chain(tokens, B, salt, keys)[0].digest for salt, keys in variants}
    assert len(digests) == 4


def test_prefix_cache_keys_are_validated_and_none_is_its_own_namespace():
    cache = prefix_cache.PrefixCache()
    toks = [torch.arange(8)]
    none = cache.chains(toks, [8], B, None, ())[0][0][0].digest
    empty = cache.chains(toks, [8], B, "", ())[0][0][0].digest
    assert none != empty
    as_str = cache.chains(toks, [8], B, "t", ["model", b"lora"])
    assert as_str[0] == cache.chains(toks, [8], B, b"t", [b"model", "lora"])[0]
    with pytest.raises(ConfigError, match="wrap it in a list"):
        cache.chains(toks, [8], B, None, "model")
    with pytest.raises(ConfigError, match="prompt_keys\\[0\\] must be str or bytes"):
        cache.chains(toks, [8], B, None, [3])
    with pytest.raises(ConfigError, match="has 7 token ids but the request's row 0 has a 8-token prompt"):
        cache.chains([torch.arange(7)], [8], B, None, ())
    with pytest.raises(ConfigError, match="1-D integer tensor"):
        cache.chains([torch.ones(8)], [8], B, None, ())


# ---- sharing, confirmation, isolation -----------------------------------------------------------------------------


def test_prefix_cache_shares_full_blocks_of_both_cfg_rows_by_reference_count():
    a, b = _request(3, seed=3), _request(4, seed=4)
    rt, ready = _served(a, b)
    assert ready == (8, 8)  # row 0: the 8-token system prompt; row 1: the negative prompt's 2 full blocks
    cache = rt.scheduler.prefix_cache
    rows = rt.owner("b").rows
    shared = rows[0][:2] + rows[1][:2]
    assert all(rt.scheduler.allocator.refcount(blk) == 2 for blk in shared)  # b + the index's own reference
    assert {cache.by_block[blk].holders for blk in shared} == {1}
    # b's own blocks are fresh: its third row-0 block (tokens 8..11) is new, a partial block is never cached
    assert rows[0][2] not in cache.by_block
    _prefill(rt, "b", b)
    assert rows[0][2] in cache.by_block  # published once its prefill succeeded
    rt.release("b")
    assert rt.scheduler.allocator.num_free + cache.idle_count == rt.pool.blocks_per_layer
    assert not cache.holds and cache.pinned_count == 0


def test_prefix_cache_two_tenants_with_the_same_prompt_share_nothing():
    a = b = _request(3, seed=3)
    rt, ready = _served(a, b, cache_salt="tenant-b")
    assert ready == ()
    rt2, ready2 = _served(a, b)
    assert ready2 == (8, 8)
    # the first tenant's blocks and the second's are disjoint
    cached_a = {c.block for c in rt.scheduler.prefix_cache.by_block.values()}
    assert not cached_a & {blk for row in rt.owner("b").rows for blk in row}


@pytest.mark.parametrize("keys_b", [["model-1", "lora-2"], ["model-1", "image-7"], ["model-2", "lora-1"]])
def test_prefix_cache_prompt_keys_keep_other_models_adapters_and_images_apart(keys_b):
    prompts = _request(3, seed=3)
    rt = _runtime()
    _admit(rt, "a", prompts, prompt_keys=["model-1", "lora-1"])
    _prefill(rt, "a", prompts)
    rt.release("a")
    _admit(rt, "b", prompts, prompt_keys=keys_b)
    assert rt.owner("b").prefix_ready == ()
    _admit(rt, "c", prompts, prompt_keys=["model-1", "lora-1"])
    assert rt.owner("c").prefix_ready == (8, 8)


def test_prefix_cache_a_colliding_digest_gets_blocks_of_its_own(monkeypatch):
    """Every block digest the same (a forged or colliding key): the token comparison refuses to share."""
    monkeypatch.setattr(prefix_cache, "keyed_digest", lambda person, parts: b"\x00" * 32)
    a, b = _request(3, seed=3, system=SYSTEM), _request(3, seed=3, system=OTHER_SYSTEM)
    b = [b[0], _ids(9, seed=9)[0]]  # other negative prompt too
    rt, ready = _served(a, b)
    assert ready == ()
    assert not {blk for row in rt.owner("b").rows for blk in row} & set(rt.scheduler.prefix_cache.by_block)
    # the same tokens under the same (colliding) digest are still confirmed and shared
    _admit(rt, "c", a)
    assert rt.owner("c").prefix_ready == (8, 8)


def test_prefix_cache_a_forged_entry_under_a_real_digest_is_not_shared():
    a = _request(3, seed=3)
    rt = _runtime()
    cache = rt.scheduler.prefix_cache
    chain = cache.chains(a, [11, 9], B, None, ())[0][0]
    blk = rt.scheduler.allocator.allocate(1)[0]  # a block holding something else, indexed under a's digest
    forged = prefix_cache.CachedBlock(chain[0].digest, blk, b"\x00" * 32, None, b"none", b"")
    cache._by_digest[chain[0].digest] = [forged]
    cache.by_block[blk] = forged
    cache.idle[blk] = None
    _admit(rt, "a", a)
    assert rt.owner("a").prefix_ready == ()
    assert blk not in {b for row in rt.owner("a").rows for b in row}


def test_prefix_cache_rows_share_the_fewest_blocks_any_row_found():
    a = _request(3, seed=3)
    b = [a[0], _ids(9, seed=9)[0]]  # same row 0, another negative prompt: row 1 finds nothing
    rt, ready = _served(a, b)
    assert ready == ()


# ---- publication and failure ---------------------------------------------------------------------------------------


def test_prefix_cache_a_failed_prefill_publishes_nothing():
    a = _request(3, seed=3)
    rt = _runtime()
    _admit(rt, "a", a)
    with pytest.raises(RuntimeError, match="model failed"):
        with rt.forward("a", "prefill", prefix_capacity=P, attention_mask=hunyuan_spec(CFG, a).padded_mask(P)):
            raise RuntimeError("model failed")
    assert not rt.scheduler.prefix_cache.by_block
    rt.abort("a")
    assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer  # an aborted request leaves nothing cached
    _admit(rt, "b", a)
    assert rt.owner("b").prefix_ready == ()


def test_prefix_cache_an_aborted_request_keeps_what_it_shared_cached():
    a, b = _request(3, seed=3), _request(4, seed=4)
    rt, _ = _served(a, b)
    rt.abort("b")  # before its prefill: it publishes nothing, the blocks it shared stay cached (idle)
    cache = rt.scheduler.prefix_cache
    assert len(cache.by_block) == 4 and cache.idle_count == 4
    assert rt.scheduler.allocator.num_free + cache.idle_count == rt.pool.blocks_per_layer


# ---- admission arithmetic and eviction -----------------------------------------------------------------------------


def test_prefix_cache_idle_blocks_count_as_free_and_are_evicted_least_recently_used():
    rt = _runtime(requests=1)  # 6 blocks: one request of two 12-token rows
    first, second = _request(4, seed=3), _request(4, seed=4, system=OTHER_SYSTEM)
    second = [second[0], _ids(9, seed=9)[0]]
    _admit(rt, "a", first)
    _prefill(rt, "a", first)
    rt.release("a")
    cache = rt.scheduler.prefix_cache
    assert cache.idle_count == 5 and rt.scheduler.allocator.num_free == 1  # row 0: 3 full blocks, row 1: 2
    idle_before = list(cache.idle)
    _admit(rt, "b", second)  # needs all 6 blocks: evicts 5 idle cached ones
    assert not cache.by_block and rt.owner("b").prefix_ready == ()
    assert sorted(b for row in rt.owner("b").rows for b in row) == sorted(idle_before + [5])
    rt.release("b")
    # LRU order: the oldest idle block goes first, a released row's tail before its head
    rt2 = _runtime(requests=2)
    _admit(rt2, "a", first)
    _prefill(rt2, "a", first)
    rt2.release("a")
    order = list(rt2.scheduler.prefix_cache.idle)
    rows_a = [[0, 1, 2], [3, 4, 5]]
    assert order == [4, 3, 2, 1, 0] and rows_a  # row 1's blocks (3, 4) then row 0's (0, 1, 2), tails first
    rt2.scheduler.prefix_cache.evict(1, rt2.scheduler.allocator)
    assert list(rt2.scheduler.prefix_cache.idle) == [3, 2, 1, 0]


@pytest.mark.vllm
def test_prefix_cache_over_vllms_block_pool_shares_publishes_and_evicts():
    """The same lifecycle when vLLM's BlockPool owns the blocks (the allocator contract: share, free, refcounts)."""
    pytest.importorskip("vllm.v1.core.block_pool", reason="vLLM's BlockPool is not importable here")
    rt = _runtime(requests=1, allocator="vllm")
    first, second = _request(4, seed=3), _request(4, seed=4)
    _admit(rt, "a", first)
    _prefill(rt, "a", first)
    rt.release("a")
    alloc, cache = rt.scheduler.allocator, rt.scheduler.prefix_cache
    assert cache.idle_count == 5 and alloc.num_free == 1
    _admit(rt, "b", second)  # shares 2 + 2 cached blocks, needs 2 of its own: evicts 1 idle block
    assert rt.owner("b").prefix_ready == (8, 8)
    assert all(alloc.refcount(blk) == 2 for row in rt.owner("b").rows for blk in row[:2])
    assert alloc.num_free == 0 and cache.idle_count == 0
    rt.release("b")
    assert alloc.num_free + cache.idle_count == rt.pool.blocks_per_layer


def test_prefix_cache_admission_refused_when_even_idle_blocks_do_not_fit_changes_nothing():
    rt = _runtime(requests=1)
    a = _request(4, seed=3)
    _admit(rt, "a", a)
    _prefill(rt, "a", a)
    before = rt.state()
    with pytest.raises(CapacityError):
        _admit(rt, "b", _request(4, seed=4, system=OTHER_SYSTEM))
    assert rt.state() == before


def test_prefix_cache_a_refused_admission_that_would_share_idle_blocks_leaves_their_lru_order():
    rt = _runtime(requests=1)  # 6 blocks
    a = _request(4, seed=3)
    _admit(rt, "a", a)
    _prefill(rt, "a", a)
    rt.release("a")  # 5 idle cached blocks, 1 free
    _admit(rt, "d", _ids(4, seed=30))  # one row, one block: takes the free one
    before = rt.state()
    with pytest.raises(CapacityError):
        _admit(rt, "b", _request(4, seed=4))  # would share 2 + 2 idle blocks and needs 2 more: 1 is left
    assert rt.state() == before and list(rt.scheduler.prefix_cache.idle) == before["prefix_cache"]["idle"]


def test_prefix_cache_shared_blocks_are_reserved_once():
    """A pool for 2 full requests holds 3 that share their system prompt and negative prompt."""
    rt = _runtime(requests=2)  # 12 blocks
    prompts = {f"r{i}": _request(4, seed=10 + i) for i in range(4)}
    _admit(rt, "r0", prompts["r0"])
    _prefill(rt, "r0", prompts["r0"])  # 6 blocks, 5 published
    for rid in ("r1", "r2"):
        _admit(rt, rid, prompts[rid])  # 2 + 2 shared, 1 own block per row... row 0: 1, row 1: 1
        assert rt.owner(rid).prefix_ready == (8, 8)
    assert rt.scheduler.held_blocks() == 6 + 2 + 2
    with pytest.raises(CapacityError):
        rt.admit("dense", hunyuan_spec(CFG, prompts["r3"]))  # 6 blocks without sharing: does not fit
    _admit(rt, "r3", prompts["r3"])  # 2 own blocks with sharing: fits
    assert rt.scheduler.held_blocks() == 12


# ---- write check and bad input ---------------------------------------------------------------------------------------


def test_prefix_cache_a_forward_never_writes_a_shared_block():
    a, b = _request(3, seed=3), _request(4, seed=4)
    rt, _ = _served(a, b)
    before = rt.state()
    mask = hunyuan_spec(CFG, b).padded_mask(P)
    with pytest.raises(RequestError, match="suffix_from"):  # a full prefill would rewrite the shared prefix
        rt.forward("b", "prefill", prefix_capacity=P, attention_mask=mask)
    with pytest.raises(RequestError, match="ready prefix is positions \\[0, 8\\)"):
        rt.forward("b", "prefill", prefix_capacity=P, attention_mask=mask, suffix_from=4)
    assert rt.state() == before
    # the scheduler's own write check, whatever the family plans: a plan writing a shared block is refused
    owner = rt.owner("b")
    fam = owner.family
    original = fam._plan_suffix

    def overwrite(owner, blocks, attention_mask, suffix_from):
        layouts, keys, taken, state, tokens = original(owner, blocks, attention_mask, suffix_from)
        return fam._plan_prefill(owner, blocks, P, attention_mask)

    fam._plan_suffix = overwrite
    try:
        with pytest.raises(RequestError, match="which other owners share"):
            rt.forward("b", "prefill", prefix_capacity=P, attention_mask=mask, suffix_from=8)
    finally:
        del fam._plan_suffix
    assert rt.state() == before


def test_prefix_cache_bad_admissions_are_refused_and_change_nothing():
    a = _request(3, seed=3)
    rt, _ = _served(a, _request(4, seed=4))
    before = rt.state()
    spec = hunyuan_spec(CFG, a)
    for kwargs, match in [
        (dict(prompt_tokens=[a[0]]), "one 1-D sequence of token ids per row"),
        (dict(prompt_tokens=[a[0][:5], a[1]]), "has 5 token ids"),
        (dict(prompt_tokens=a, content_keys=["x", "y"]), "content_keys key a shared region"),
        (dict(prompt_keys=["model"]), "pass them with prompt_tokens"),
        (dict(prompt_tokens=a, prompt_keys="model"), "wrap it in a list"),
        (dict(prompt_tokens=a, cache_salt=3), "cache_salt must be a str or bytes"),
    ]:
        with pytest.raises((ConfigError, RequestError), match=match):
            rt.admit("c", spec, **kwargs)
        assert rt.state() == before
    with pytest.raises(RequestError, match="do not share prompt prefixes"):
        rt.admit("d", DreamZeroSpec.from_model_config(DreamZeroConfig()), rows=1, prompt_tokens=[[1, 2]])
    assert rt.state() == before
    with pytest.raises(RequestError, match="release it and admit it again"):
        rt.reset("b")
    assert rt.state() == before


# ---- the model: a request served from the cache is computed over its suffix only, compiled --------------------------


T_LEN = CFG.target_len
#: prefill (P + T), a suffix over a cached 8-token prefix (P + T - 8 tokens over a context of 8), step (T)
BUCKETS = hunyuan_buckets(CFG, [P], rows=(2,), cached_prefixes=[8])
assert set(BUCKETS) == {Bucket(2, P + T_LEN, P), Bucket(2, P + T_LEN - 8, 8), Bucket(2, T_LEN, P)}


def _compiled(buckets=BUCKETS):
    model = HunyuanImage3Model(CFG, seed=2)
    rt = _runtime(buckets=buckets)
    rt.bind(model.layers)
    backend = CountingBackend({"inner_compiler": "aot_eager"})
    compile_blocks(model.layers, backend)
    return model, rt, backend


def _run(model, rt, rid, prompts, num_steps=3):
    _admit(rt, rid, prompts)
    hooks = PagedHooks(rt, rid)
    ready = rt.owner(rid).prefix_ready
    with torch.no_grad():
        out = drive(hunyuan_steps(model, prompts, prefix_capacity=P, num_steps=num_steps, seed=5, hooks=hooks,
                                  suffix_from=ready[0] if ready else 0), hooks)
    rt.release(rid)
    return out, ready


def _dense(prompts, num_steps=3):
    return hunyuan_generate(HunyuanImage3Model(CFG, seed=2), prompts, prefix_capacity=P, num_steps=num_steps, seed=5)


def test_prefix_cache_a_suffix_bucket_of_a_prefills_shape_is_refused():
    with pytest.raises(ConfigError, match="C = P / 2"):
        hunyuan_buckets(CFG, [16], cached_prefixes=[8])


def test_prefix_cache_cached_request_matches_the_full_dense_request_compiled():
    a, b = _request(3, seed=3), _request(4, seed=4)
    model, rt, backend = _compiled()
    _, ready_a = _run(model, rt, "a", a)
    got, ready_b = _run(model, rt, "b", b)
    assert ready_a == () and ready_b == (8, 8)
    assert (got - _dense(b)).abs().max().item() <= ATOL
    assert backend.frames == 3  # one graph per bucket, shared by every layer
    patterns = sorted(r.pattern for res in backend.results for r in res.reports)
    assert patterns == ["prefill-store", "prefix-step", "prefix-step"]
    for res in backend.results:
        assert all(r.status == "rewritten" for r in res.reports)
        assert not host_syncs(res.graph_module)
    assert rt.bucket_misses == {}


def test_prefix_cache_cached_request_through_captured_forwards_runs_no_python_and_matches_dense():
    """The captured path: every bucket (the suffix's too) warmed up and captured; serving replays with the per-call
    checks on the host and no Python inside the graphs."""
    a, b = _request(3, seed=3), _request(4, seed=4)
    model, rt, _ = _compiled()
    captured = CapturedBlocks(model.layers, rt, lambda bucket: hunyuan_layer_inputs(model, rt, bucket),
                              graphs=CompiledOnlyGraphs(), granularity="forward")
    captured.warmup(progress=False)
    with captured.serving(), record_calls() as python_calls:
        _run(model, rt, "a", a)
        got, ready = _run(model, rt, "b", b)
    assert ready == (8, 8)
    assert python_calls == [] and captured.stats["replays"] == 2 * 3  # a prefill (b: its suffix) and two steps each
    assert captured.stats["direct_calls"] == captured.stats["fallback_calls"] == 0
    assert (got - _dense(b)).abs().max().item() <= ATOL


def test_prefix_cache_a_suffix_needs_a_cache_that_holds_the_prefix():
    model = HunyuanImage3Model(CFG, seed=2)
    with pytest.raises(ValueError, match="a dense cache holds nothing there"):
        drive(hunyuan_steps(model, _request(3, seed=3), prefix_capacity=P, num_steps=1, suffix_from=8), DenseHooks())
    rt = _runtime()
    a = _request(3, seed=3)
    rt.admit("plain", hunyuan_spec(CFG, a))  # no prompt tokens: nothing ready, a suffix would skip real tokens
    before = rt.state()
    with pytest.raises(RequestError, match="ready prefix is positions \\[0, 0\\)"):
        rt.forward("plain", "prefill", prefix_capacity=P, attention_mask=hunyuan_spec(CFG, a).padded_mask(P),
                   suffix_from=8)
    assert rt.state() == before


# ---- the benchmark's arithmetic ------------------------------------------------------------------------------------


def test_prefix_cache_benchmark_real_geometry_counts_blocks_as_the_arithmetic_says():
    from benchmarks import prefix_cache as bench

    real = bench.real_geometry([1, 8], budget_gib=8.0)
    per_block = 32 * 2 * 16 * 8 * 128 * 2  # layers x K/V x block x kv heads x head dim x bf16: 2 MiB
    assert real["bytes_per_block_all_layers"] == per_block
    own = -(-1064 // 16) + -(-1008 // 16)  # 67 + 63 blocks: cond 1000 + 64 tokens, uncond 1000 + 8
    unshared_per_request = own  # nothing shared
    shared_later = own - 2 * (1000 // 16)  # 62 full system-prompt blocks shared in each row
    one, eight = real["held"]
    assert one["unshared_gib"] == one["shared_gib"] == round(own * per_block / 2**30, 3)
    assert eight["unshared_gib"] == round(8 * unshared_per_request * per_block / 2**30, 3)
    assert eight["shared_gib"] == round((own + 7 * shared_later) * per_block / 2**30, 3)
    budget = 8 * 2**30 // per_block
    assert real["admitted_unshared"] == budget // own
    assert real["admitted_shared"] == 1 + (budget - own) // shared_later


def test_prefix_cache_idle_cached_blocks_keep_fp8_scales_fixed():
    """An idle cached block still holds K/V quantized with the current scales: new scales are refused."""
    rt = _runtime(kv_dtype=torch.float8_e4m3fn)
    a = _request(3, seed=3)
    _admit(rt, "a", a)
    _prefill(rt, "a", a)
    rt.release("a")
    assert rt.scheduler.prefix_cache.idle_count == 4
    with pytest.raises(ConfigError, match="set_scales while 4 blocks per layer are held"):
        rt.pool.set_scales(0.5, 0.5)


# ---- random lifecycles --------------------------------------------------------------------------------------------


_PROMPT_PARTS = [_ids(4, seed=50 + i)[0] for i in range(3)]  # one block each: prompts are drawn from these


@settings(max_examples=150, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
class PrefixCacheLifecycles(RuleBasedStateMachine):
    """Random admissions (prompts drawn from a few blocks, two salts), prefills that succeed or fail, releases and
    aborts on a small pool: refcounts always equal the owners' holds plus the index's own, idle cached blocks are
    exactly those no owner holds, nothing leaks, and every shared block holds the tokens its requests name."""

    def __init__(self):
        super().__init__()
        self.rt = _runtime(requests=2)
        self.serial = 0
        self.prompts: dict[str, list[torch.Tensor]] = {}

    @rule(parts=st.lists(st.integers(0, 2), min_size=1, max_size=3), tail=st.integers(0, 3),
          salt=st.sampled_from([None, "t"]), neg=st.lists(st.integers(0, 2), min_size=1, max_size=2))
    def admit(self, parts, tail, salt, neg):
        rid = f"r{self.serial}"
        self.serial += 1
        row0 = torch.cat([_PROMPT_PARTS[i] for i in parts] + [_ids(tail, seed=self.serial)[0]])[:P]
        prompts = [row0, torch.cat([_PROMPT_PARTS[i] for i in neg])]
        before = self.rt.state()
        try:
            _admit(self.rt, rid, prompts, cache_salt=salt)
        except CapacityError:
            assert self.rt.state() == before
            return
        self.prompts[rid] = prompts
        ready = self.rt.owner(rid).prefix_ready
        event(f"admitted with {ready[0] if ready else 0} cached tokens per row")
        if ready:  # what it shares is what it would have computed: the same tokens, confirmed
            for row, prompt in zip(self.rt.owner(rid).rows, prompts):
                for i, blk in enumerate(row[: ready[0] // B]):
                    cached = self.rt.scheduler.prefix_cache.by_block[blk]
                    assert cached.tokens == prompt[i * B : (i + 1) * B].numpy().astype("<i8").tobytes()

    @precondition(lambda self: self.prompts)
    @rule(pick=st.integers(0, 100), fail=st.booleans())
    def prefill(self, pick, fail):
        rid = sorted(self.prompts)[pick % len(self.prompts)]
        if "prefill" in self.rt.owner(rid).phases_done:
            return
        cached = len(self.rt.scheduler.prefix_cache.by_block)
        try:
            spec = hunyuan_spec(CFG, self.prompts[rid])
            ready = self.rt.owner(rid).prefix_ready
            with self.rt.forward(rid, "prefill", prefix_capacity=P, attention_mask=spec.padded_mask(P),
                                 **({"suffix_from": ready[0]} if ready else {})):
                if fail:
                    raise RuntimeError("model failed")
        except RuntimeError:
            assert len(self.rt.scheduler.prefix_cache.by_block) == cached  # a failed prefill publishes nothing

    @precondition(lambda self: self.prompts)
    @rule(pick=st.integers(0, 100), abort=st.booleans())
    def end(self, pick, abort):
        rid = sorted(self.prompts)[pick % len(self.prompts)]
        (self.rt.abort if abort else self.rt.release)(rid)
        del self.prompts[rid]

    @invariant()
    def refcounts_are_holds(self):
        sched = self.rt.scheduler
        cache, alloc = sched.prefix_cache, sched.allocator
        holds: dict[int, int] = {}
        for owner in sched.owners.values():
            for row in owner.rows:
                for blk in row:
                    holds[blk] = holds.get(blk, 0) + 1
        for blk in range(alloc.num_blocks):
            assert alloc.refcount(blk) == holds.get(blk, 0) + cache.index_refs(blk), blk
        assert set(cache.idle) == {b for b in cache.by_block if holds.get(b, 0) == 0}
        assert all(c.holders == holds.get(b, 0) for b, c in cache.by_block.items())
        assert alloc.num_free + len(holds.keys() | cache.by_block.keys()) == alloc.num_blocks


TestPrefixCacheLifecycles = PrefixCacheLifecycles.TestCase
