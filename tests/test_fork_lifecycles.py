"""Random lifecycles with forks, batched forwards and shared regions (hypothesis), on both allocators.

Sessions are opened (some with cross-attention K/V kept as shared write-once regions, `regions.py`: two tenants,
two prompts, caller keys that may be forged), forked, run alone or as rows of batched forwards (commits and
denoising steps whose K/V the op really writes into the pool), failed inside the forward, aborted, closed and
reset, in any order. After every step: each block's refcount is exactly the number of rows holding it as history
or region (no leak, no double free), no forward changed a byte of a block that more than one row held when it
started, and every live region still holds the bytes it was created with.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_kv_compile import CapacityError, ConfigError, PagedKVConfig, RequestError
from paged_kv_compile.runtime import PagedKVRuntime
from paged_kv_compile.families.dreamzero import DreamZeroSpec

B = 4
SPECS = [
    DreamZeroSpec(frame_seqlen=4, chunk_frames=1, window_frames=3, sink_frames=1, action_tokens=2),
    DreamZeroSpec(frame_seqlen=4, chunk_frames=1, window_frames=3, sink_frames=0, action_tokens=2),
]
MAX_ROWS = 4
CROSS_TOKENS = 6  # 2 blocks of 4, the last one partly used


def _cross_row(seed: int) -> torch.Tensor:
    """One row's cross K/V of every layer: (layers=2, 2, tokens, 1, 4)."""
    return torch.randn(2, 2, CROSS_TOKENS, 1, 4, generator=torch.Generator().manual_seed(seed))


CROSS = {seed: _cross_row(seed) for seed in range(3)}  # 0: the negative prompt, 1 and 2: two prompts


class Injected(RuntimeError):
    pass


class ForkLifecycles(RuleBasedStateMachine):
    allocator = "builtin"

    def __init__(self):
        super().__init__()
        cfg = PagedKVConfig(num_layers=2, num_kv_heads=1, head_dim=4, block_size=B, blocks_per_layer=20,
                            max_rows=MAX_ROWS, scratch_tokens_per_row=12, region_tokens=CROSS_TOKENS)
        self.rt = PagedKVRuntime(cfg, allocator=self.allocator, max_sessions=6)
        self.counter = 0
        self.gen = torch.Generator().manual_seed(0)
        self.forks = self.batched = self.shared_checked = self.regions_opened = 0
        #: id(Region) -> (that Region, the bytes it was created with); the Region is kept so that an id reused by a
        #: later region (after an eviction freed the first within the same step) is never taken for it
        self.region_bytes: dict[int, tuple] = {}
        self.tenant_of: dict[str, str | None] = {}  # session -> the cache_salt it (or its fork parent) opened with

    # ---- helpers ------------------------------------------------------------------------------------
    def _new_id(self) -> str:
        self.counter += 1
        return f"s{self.counter}"

    def _live(self) -> list[str]:
        return list(self.rt.scheduler.owners)

    def _regions(self):
        return {id(r): r for sid in self._live() for r in self.rt.regions_of(sid)}

    def _held(self) -> dict[int, int]:
        held: dict[int, int] = {}
        for sid, rows in self.rt.scheduler.owned_blocks().items():
            for row in [*rows, *(r.blocks for r in self.rt.regions_of(sid))]:
                for b in row:
                    held[b] = held.get(b, 0) + 1
        return held

    def _refused(self, call) -> bool:
        before = self.rt.state()
        try:
            call()
        except (CapacityError, RequestError, ConfigError):
            assert self.rt.state() == before, "a refused call changed the state"
            return True
        return False

    def _run(self, items, fail: bool, batched: bool) -> None:
        """Plan (alone or batched), write random K/V through the op in every layer, finish or fail."""
        rt = self.rt
        shared = [b for b, n in self._held().items() if n > 1]
        absolute = torch.tensor([base + b for base in rt.pool.layer_bases.tolist() for b in shared], dtype=torch.long)
        snapshot = rt.pool.tensor[:, absolute].clone()
        before = rt.state()
        try:
            ctx = rt.forward_batch(items) if batched else rt.forward(*items[0][:2], **items[0][2])
        except CapacityError as e:  # admission reserves what every owner may take: an admitted owner never waits
            raise AssertionError(f"an admitted owner waited for a block: {e}") from e
        except RequestError as e:
            assert rt.state() == before, f"a refused plan changed the state: {e}"
            return
        try:
            with ctx as active:
                R, T = active.bucket.rows, active.bucket.tokens
                q, k, v = (torch.randn(R, T, 1, 4, generator=self.gen) for _ in range(3))
                for layer in range(rt.config.num_layers):
                    views = active.meta.layers[layer]
                    torch.ops.paged_kv.write_attend(q, k, v, rt.pool.tensor, views.slot_mapping, views.block_table,
                                                    active.meta.seq_lens, active.meta.kv_visible_end, 0.5, "reference")
                if fail:
                    raise Injected("inside the forward")
        except Injected:
            assert rt.state()["owners"] == before["owners"], "a failed forward changed ownership"
        assert torch.equal(rt.pool.tensor[:, absolute], snapshot), "a forward wrote a shared block"
        self.shared_checked += len(shared)

    # ---- rules --------------------------------------------------------------------------------------
    @rule(spec=st.sampled_from(SPECS), rows=st.integers(1, 2))
    def open_session(self, spec, rows):
        self._refused(lambda: self.rt.admit(self._new_id(), spec, rows=rows))

    @rule(spec=st.sampled_from(SPECS), rows=st.integers(1, 2), tenant=st.sampled_from(["t1", "t2"]),
          prompt=st.sampled_from([1, 2]), keyed=st.booleans(), forged=st.booleans())
    def open_with_region(self, spec, rows, tenant, prompt, keyed, forged):
        """rows = [prompt, negative][:rows]; keyed: caller keys, forged: the key names the other prompt."""
        seeds = [prompt, 0][:rows]
        cross = [torch.stack([CROSS[s][layer] for s in seeds], dim=1) for layer in range(2)]
        keys = [f"p{3 - prompt if forged else prompt}", "neg"][:rows] if keyed else None
        sid = self._new_id()
        if self._refused(lambda: self.rt.admit(sid, spec, rows=rows, cross_kv=cross, cache_salt=tenant,
                                               content_keys=keys)):
            return
        self.regions_opened += 1
        self.tenant_of[sid] = tenant
        for r, (region, seed) in enumerate(zip(self.rt.regions_of(sid), seeds)):
            assert torch.equal(self.rt.pool.read_region(region.blocks, region.tokens), CROSS[seed]), "wrong content"
            if self.region_bytes.get(id(region), (None,))[0] is not region:
                self.region_bytes[id(region)] = (region, CROSS[seed])

    @precondition(lambda self: self._live())
    @rule(data=st.data(), commits=st.sampled_from([None, None, 0, 1, 2]))
    def fork(self, data, commits):
        """A fork, with or without a commit budget (`commits`)."""
        parent, child = data.draw(st.sampled_from(self._live())), self._new_id()
        if not self._refused(lambda: self.rt.fork(parent, child, **({} if commits is None else {"commits": commits}))):
            self.forks += 1
            self.tenant_of[child] = self.tenant_of.get(parent)

    @precondition(lambda self: self._live())
    @rule(data=st.data(), commit=st.booleans(), branch=st.sampled_from([None, 0, 1]), fail=st.booleans())
    def forward_alone(self, data, commit, branch, fail):
        sid = data.draw(st.sampled_from(self._live()))
        info = {} if branch is None else {"branch": branch}
        self._run([(sid, "commit" if commit else "denoise", info)], fail, batched=False)

    @precondition(lambda self: self._live())
    @rule(data=st.data(), commit=st.booleans(), fail=st.booleans())
    def forward_batched(self, data, commit, fail):
        sids = data.draw(st.lists(st.sampled_from(self._live()), min_size=1, max_size=4, unique=True))
        self._run([(sid, "commit" if commit else "denoise", {}) for sid in sids], fail, batched=True)
        self.batched += 1

    @precondition(lambda self: self._live())
    @rule(data=st.data(), how=st.sampled_from(["abort", "close", "reset"]))
    def end(self, data, how):
        sid = data.draw(st.sampled_from(self._live()))
        {"abort": self.rt.abort, "close": self.rt.release, "reset": self.rt.reset}[how](sid)

    @invariant()
    def refcounts_are_exact(self):
        held, alloc = self._held(), self.rt.scheduler.allocator
        for b in range(alloc.num_blocks):
            assert alloc.refcount(b) == held.get(b, 0), f"block {b}: refcount {alloc.refcount(b)}, held {held.get(b, 0)}"
        assert alloc.num_free == alloc.num_blocks - len(held), "a block leaked"
        assert self.rt.scheduler.in_flight is None and self.rt.active is None

    @invariant()
    def regions_never_change_and_never_cross_tenants(self):
        live = self._regions()
        for key, region in live.items():
            got = self.rt.pool.read_region(region.blocks, region.tokens)
            recorded, content = self.region_bytes[key]
            assert recorded is region and torch.equal(got, content), "a region's bytes changed"
        for key in set(self.region_bytes) - set(live):  # forgotten once nobody holds them (ids may be reused)
            del self.region_bytes[key]
        by_block: dict[int, set] = {}
        tenants: dict[int, set] = {}
        for sid in self._live():
            for region in self.rt.regions_of(sid):
                tenants.setdefault(id(region), set()).add(self.tenant_of[sid])
                for b in region.blocks:
                    by_block.setdefault(b, set()).add(id(region))
        assert all(len(v) == 1 for v in by_block.values()), "two live regions share a block"
        assert all(len(v) == 1 for v in tenants.values()), "sessions of two tenants hold one region"

    def teardown(self):
        for sid in self._live():
            self.rt.abort(sid)
        assert self.rt.scheduler.allocator.num_free == self.rt.pool.blocks_per_layer, "every block is free again"
        self.rt.close()


class VllmForkLifecycles(ForkLifecycles):
    allocator = "vllm"


_SETTINGS = settings(max_examples=60, stateful_step_count=25, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestForkLifecycles = ForkLifecycles.TestCase
TestForkLifecycles.settings = _SETTINGS
TestForkLifecyclesVllm = VllmForkLifecycles.TestCase
TestForkLifecyclesVllm.settings = _SETTINGS
TestForkLifecyclesVllm = pytest.mark.vllm(TestForkLifecyclesVllm)
