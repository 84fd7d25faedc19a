"""Soak: many sessions and requests interleaved on one runtime per family, with compiled blocks.

One runtime per family serves a random stream of admissions, forwards of whichever owner is picked,
aborts, LRU evictions (DreamZero, `max_sessions`), window resets (the loop's own), capacity refusals
(HunyuanImage-3: the request waits and retries; DreamZero: admission reserves what a session holds up to its
reset, so no commit may ever wait), and exceptions injected inside compiled forwards (rolled back, retried).
Every tick checks block ownership (no leak, no double owner). Every completed session/request, and the
finished chunks of every aborted or evicted session, must equal its dense reference (<= 1e-5). After a
warm-up, nothing grows: no recompiles, no new metadata buckets, the pool and metadata buffers keep their
addresses, and the bytes held by live tensors are the same at the end as after the warm-up.

Kept short in CI. Longer: ``PAGED_KV_SOAK_ITERS=5000 python -m pytest -q tests/test_reliability_soak.py``
(ticks per family; ``PAGED_KV_SOAK_SEED`` picks another random stream).
"""

from __future__ import annotations

import gc
import os
import random
from dataclasses import dataclass

import pytest
import torch
from helpers import CountingBackend, compile_blocks
from test_reliability_faults import (
    InjectedFault,
    assert_no_leak,
    dreamzero_steps,
    hunyuan_steps,
)

from paged_kv_compile import CapacityError, RequestError
from paged_kv_compile.config import Bucket
from paged_kv_compile.driver import PagedHooks
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
from paged_kv_compile.families.hunyuan_image3 import hunyuan_runtime_config, hunyuan_spec, prefix_capacity_for
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config, HunyuanImage3Model, hunyuan_generate
from paged_kv_compile.runtime import PagedKVRuntime

ITERS = int(os.environ.get("PAGED_KV_SOAK_ITERS", "600"))
SEED = int(os.environ.get("PAGED_KV_SOAK_SEED", "0"))
WARMUP = max(40, ITERS // 5)
ATOL = 1e-5

# Window 3 frames with a 1-frame sink, chunk 1 frame of 4 tokens; the loop resets the window every 4 chunks.
DZ_CFG = DreamZeroConfig(num_layers=2, frame_seqlen=4, num_frame_per_block=1, local_attn_size=3, sink_size=1,
                         window_reset_frames=4, action_register_length=2, num_inference_steps=2)
DZ_SEEDS = (100, 101, 102, 103)
DZ_MAX_CHUNKS = 6
HY_CFG = HunyuanImage3Config(num_layers=2, image_h=2, image_w=2)
HY_CAPACITY = 8


pytestmark = pytest.mark.usefixtures("fresh_dynamo", "no_grad")


class Flaky(torch.nn.Module):
    """Wraps a compiled block; when armed, its next call runs and then raises (once)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.armed = False
        self.faults = 0

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        if self.armed:
            self.armed = False
            self.faults += 1
            raise InjectedFault("soak: injected inside a compiled forward")
        return out


def live_tensor_bytes() -> tuple[int, int]:
    """(number, bytes) of distinct CPU storages held by live tensors."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if type(obj) is not torch.Tensor and type(obj) is not torch.nn.Parameter:
            continue
        if obj.device.type != "cpu":
            continue
        storage = obj.untyped_storage()
        key = storage.data_ptr(), storage.nbytes()
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return len(seen), total


def fixed_addresses(rt: PagedKVRuntime) -> dict:
    return {"pool": rt.pool.tensor.data_ptr(),
            "buckets": {b: m.addresses() for b, m in rt.metadata.buckets.items()}}


def close_enough(got, want) -> bool:
    got = torch.stack(got) if isinstance(got, list) else got
    return got.shape == want.shape and (got - want).abs().max().item() <= ATOL


@dataclass
class Stats:
    opened: int = 0
    completed: int = 0
    aborted: int = 0
    evicted: int = 0
    refused: int = 0  # capacity refusals (the owner waited)
    faults: int = 0
    resets: int = 0
    forwards: int = 0
    compared: int = 0  # outputs compared with their dense reference (DreamZero: chunks)


class CountingHooks(PagedHooks):
    def __init__(self, runtime, owner_id, stats):
        super().__init__(runtime, owner_id)
        self.stats = stats

    def reset_history(self):
        self.stats.resets += 1
        super().reset_history()


# ---- DreamZero -------------------------------------------------------------------------------------------
def test_dreamzero_soak():
    rng = random.Random(SEED)
    dense = DreamZeroModel(DZ_CFG, seed=1)
    refs = {s: dreamzero_rollout(dense, num_chunks=DZ_MAX_CHUNKS, num_inference_steps=2, seed=s) for s in DZ_SEEDS}
    model = DreamZeroModel(DZ_CFG, seed=1)
    # A session holds 2 blocks per row between chunks (sink + 1 frame) and 3 while committing: admission reserves
    # 6. A pool for two sessions with an LRU cap of two: opening a third evicts the least recently used one,
    # whose reservation makes room. No commit may ever wait for a block (before reservations,
    # a pool of 6 admitted three sessions whose commits then waited, and when all waited one had to be aborted).
    rt = PagedKVRuntime(dreamzero_runtime_config(DZ_CFG, sessions=2, kernel="reference", inner_compiler="aot_eager"),
                        max_sessions=2)
    assert rt.pool.blocks_per_layer == 12
    rt.bind(model.blocks)
    backend = CountingBackend()
    compile_blocks(model.blocks, backend)
    model.blocks[1] = flaky = Flaky(model.blocks[1])
    spec = DreamZeroSpec.from_model_config(DZ_CFG)
    stats = Stats()
    live: dict[str, dict] = {}  # sid -> {gen, out, seed, chunks, last}
    counter = iter(range(10**9))

    def check_partial(sess) -> None:
        done = len(sess["out"].get("video", []))
        if done:
            assert close_enough(sess["out"]["video"], refs[sess["seed"]]["video"][:done]), "another session's numbers"
            assert close_enough(sess["out"]["actions"], refs[sess["seed"]]["actions"][:done])
            stats.compared += done

    def open_one() -> None:
        sid = f"s{next(counter)}"
        before = set(rt.scheduler.owners)
        rt.admit(sid, spec, rows=2)
        for gone in before - set(rt.scheduler.owners):  # evicted by the LRU cap
            assert rt.scheduler.finished[gone].startswith("evicted")
            sess = live.pop(gone)
            sess["gen"].close()
            check_partial(sess)
            stats.evicted += 1
        seed, chunks = rng.choice(DZ_SEEDS), rng.randint(2, DZ_MAX_CHUNKS)
        out: dict = {}
        gen = dreamzero_steps(model, CountingHooks(rt, sid, stats), num_chunks=chunks, steps=2, seed=seed, out=out,
                              retries=10**6, wait_for_capacity=True)  # every injected fault is retried
        live[sid] = dict(gen=gen, out=out, seed=seed, chunks=chunks, last=None)
        stats.opened += 1

    def abort(sid) -> None:
        sess = live.pop(sid)
        rt.abort(sid)
        sess["gen"].close()
        check_partial(sess)
        stats.aborted += 1

    def step(sid) -> None:
        sess = live[sid]
        if rng.random() < 0.03 and (sess["last"] is None or sess["last"][0] != "retry"):
            flaky.armed = True  # the next forward fails inside block 1 (after block 0 ran) and is retried once
        try:
            event = next(sess["gen"])
        except StopIteration:
            live.pop(sid)
            rt.release(sid)
            assert len(sess["out"]["video"]) == sess["chunks"]
            check_partial(sess)
            stats.completed += 1
            return
        flaky.armed = False
        sess["last"] = event
        stats.forwards += 1
        if event[0] == "blocked":
            stats.refused += 1

    def tick() -> None:
        r = rng.random()
        if not live or r < (0.1 if len(live) < 2 else 0.03):
            open_one()  # with two live sessions this evicts the least recently used one
        elif r < 0.13:
            abort(rng.choice(sorted(live)))
        else:
            step(rng.choice(sorted(live)))
        assert stats.refused == 0, "a commit waited for blocks: admission reserved too little"
        assert_no_leak(rt)

    def drain() -> None:
        for sid in sorted(live):
            abort(sid)
        assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer, "every block is free"

    for _ in range(WARMUP):
        tick()
    drain()
    frames, addresses, memory = backend.frames, fixed_addresses(rt), live_tensor_bytes()
    for _ in range(ITERS - WARMUP):
        tick()
    drain()
    stats.faults = flaky.faults
    assert backend.frames == frames == 1, "one compiled graph for every layer, commit and denoise; no recompiles"
    assert fixed_addresses(rt) == addresses, "the pool and the metadata buffers never move; no new buckets"
    assert live_tensor_bytes() == memory, "tensor memory is flat across the run"
    assert stats.completed >= 3 and stats.aborted >= 1 and stats.evicted >= 1 and stats.resets >= 1, stats
    print(f"\ndreamzero soak: ticks={ITERS} {stats}")


# ---- HunyuanImage-3 ----------------------------------------------------------------------------------------
def test_hunyuan_soak():
    rng = random.Random(SEED + 1)
    T = HY_CFG.target_len
    buckets = tuple(Bucket(r, t, HY_CAPACITY) for r in (1, 2) for t in (HY_CAPACITY + T, T))
    dense = HunyuanImage3Model(HY_CFG, seed=3)
    model = HunyuanImage3Model(HY_CFG, seed=3)
    # Room for two 2-row requests with full prompts; up to four may want in, so admissions are refused.
    rt = PagedKVRuntime(hunyuan_runtime_config(HY_CFG, max_prefix=HY_CAPACITY, block_size=4, requests=2,
                                               kernel="reference", inner_compiler="aot_eager", buckets=buckets))
    rt.bind(model.layers)
    backend = CountingBackend()
    compile_blocks(model.layers, backend)
    model.layers[0] = flaky = Flaky(model.layers[0])
    stats = Stats()
    live: dict[str, dict] = {}
    waiting: list[dict] = []
    counter = iter(range(10**9))

    def new_request() -> dict:
        rows = rng.choice((1, 2))
        g = torch.Generator().manual_seed(rng.randrange(10**6))
        prompts = [torch.randint(0, HY_CFG.vocab, (rng.randint(1, HY_CAPACITY),), generator=g) for _ in range(rows)]
        return dict(rid=f"r{next(counter)}", prompts=prompts, steps=rng.randint(2, 4), seed=rng.randrange(100))

    def admit(req) -> bool:
        try:
            rt.admit(req["rid"], hunyuan_spec(HY_CFG, req["prompts"]))
        except CapacityError:
            stats.refused += 1
            return False
        capacity = prefix_capacity_for(rt.config.buckets, [len(p) for p in req["prompts"]], T)
        req["gen"] = hunyuan_steps(model, PagedHooks(rt, req["rid"]), req["prompts"], prefix_capacity=capacity,
                                   num_steps=req["steps"], seed=req["seed"], retries=10**6)
        live[req["rid"]] = req
        stats.opened += 1
        return True

    def step(rid) -> None:
        req = live[rid]
        if rng.random() < 0.03 and req.get("last") != "retry":
            flaky.armed = True  # the next forward fails inside layer 0 and is retried once
        try:
            req["last"] = next(req["gen"])[0]
        except StopIteration as stop:
            live.pop(rid)
            rt.release(rid)
            want = hunyuan_generate(dense, req["prompts"], prefix_capacity=HY_CAPACITY, num_steps=req["steps"],
                                    seed=req["seed"])
            assert close_enough(stop.value, want), "another request's numbers"
            stats.completed += 1
            stats.compared += 1
            return
        flaky.armed = False
        stats.forwards += 1

    def abort(rid) -> None:
        live.pop(rid)["gen"].close()
        rt.abort(rid)
        stats.aborted += 1

    def tick() -> None:
        r = rng.random()
        if waiting and admit(waiting[0]):
            waiting.pop(0)
        elif not live or (r < 0.2 and len(waiting) < 3):
            req = new_request()
            if not admit(req):
                waiting.append(req)
        elif r < 0.25:
            abort(rng.choice(sorted(live)))
        else:
            step(rng.choice(sorted(live)))
        assert_no_leak(rt)

    def drain() -> None:
        for rid in sorted(live):
            abort(rid)
        waiting.clear()
        assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer, "every block is free"

    for _ in range(WARMUP):
        tick()
    drain()
    assert set(rt.metadata.buckets) == set(buckets), "the warm-up saw every bucket"
    frames, addresses, memory = backend.frames, fixed_addresses(rt), live_tensor_bytes()
    for _ in range(ITERS - WARMUP):
        tick()
    drain()
    stats.faults = flaky.faults
    assert backend.frames == frames == len(buckets), "one graph per bucket for every layer; no recompiles"
    assert fixed_addresses(rt) == addresses and not rt.bucket_misses
    assert live_tensor_bytes() == memory, "tensor memory is flat across the run"
    assert stats.completed >= 3 and stats.aborted >= 1 and stats.refused >= 1, stats
    print(f"\nhunyuan soak: ticks={ITERS} {stats}")


def test_a_refused_admission_of_a_waiting_request_changes_nothing():
    """The soak's waiting requests rely on this: a refused admission can be retried with the same id."""
    rt = PagedKVRuntime(hunyuan_runtime_config(HY_CFG, max_prefix=HY_CAPACITY, block_size=4, requests=1))
    g = torch.Generator().manual_seed(0)
    big = [torch.randint(0, HY_CFG.vocab, (HY_CAPACITY,), generator=g) for _ in range(2)]
    rt.admit("a", hunyuan_spec(HY_CFG, big))
    before = rt.state()
    with pytest.raises(CapacityError, match="free to reserve .*retry after another one ends"):
        rt.admit("b", hunyuan_spec(HY_CFG, big))
    assert rt.state() == before
    rt.release("a")
    rt.admit("b", hunyuan_spec(HY_CFG, big))
    with pytest.raises(RequestError, match="already live"):
        rt.admit("b", hunyuan_spec(HY_CFG, big))
