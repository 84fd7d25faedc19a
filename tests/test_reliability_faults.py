"""Faults in the middle of serving: exceptions inside compiled forwards, pool exhaustion, aborts.

Whatever fails, the pool is never corrupted, no block leaks, and no request ever gets another
request's numbers: a failed forward is rolled back (the runtime state and every live owner's blocks
are bit-exactly what they were before it), can be retried, and the retried request gives exactly the
result of a clean run on a fresh runtime.

The library's step generators (`dreamzero_steps` / `hunyuan_steps`, the loops `dreamzero_rollout` /
`hunyuan_generate` run) are driven here by `paced`, a `models.hooks.Loop` that yields before every
forward, so a test can interleave sessions on one runtime, abort between forwards, and retry a forward
that failed.
`test_reliability_soak.py` uses them too.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import CountingBackend, compile_blocks

from paged_kv_compile import CapacityError, RequestError
from paged_kv_compile.driver import PagedHooks, paged_run
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
from paged_kv_compile.families.hunyuan_image3 import hunyuan_runtime_config, hunyuan_spec
from paged_kv_compile import models
from paged_kv_compile.metadata import BucketMetadata
from paged_kv_compile.models.hooks import Loop
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config, HunyuanImage3Model, hunyuan_generate
from paged_kv_compile.runtime import PagedKVRuntime

ATOL = 1e-5  # paged vs dense
RETRY_ATOL = 1e-6  # paged vs paged (a retried run vs a clean run): in practice bit-exact

# Tiny geometries: 3 layers so a fault can hit the middle one after layer 0 already wrote its K/V.
# DreamZero: chunk = 1 frame of 4 tokens, window = 3 frames (slides after 2 commits), reset after 5 chunks.
DZ_CFG = DreamZeroConfig(num_layers=3, frame_seqlen=4, num_frame_per_block=1, local_attn_size=3, window_reset_frames=5,
                         action_register_length=2, num_inference_steps=2)
HY_CFG = HunyuanImage3Config(num_layers=3, image_h=2, image_w=3)
HY_CAPACITY = 10


class InjectedFault(RuntimeError):
    """What a test raises inside a forward."""


# ---- the loops as generators -------------------------------------------------------------------------------
def paced(steps, hooks, *, retries: int = 0, wait_for_capacity: bool = False):
    """Drive a library step generator with `models.hooks.Loop`, as a generator: yield (kind, index) before each
    forward, then run it. On an injected fault yield ("retry", kind) and run it again (at most `retries` times);
    on CapacityError with `wait_for_capacity`, yield ("blocked", kind) and run it again. Returns the loop's result."""
    loop = Loop(steps, hooks)
    while not loop.done:
        kind, failures = loop.pending.kind, 0
        yield (kind, loop.pending.index)
        while True:
            try:
                loop.run_one()
                break
            except (InjectedFault, asyncio.CancelledError):
                failures += 1
                if failures > retries:
                    raise
                yield ("retry", kind)
            except CapacityError:
                if not wait_for_capacity:
                    raise
                yield ("blocked", kind)
    return loop.result


def dreamzero_steps(model, hooks, *, num_chunks: int, steps: int, seed: int, out: dict | None = None,
                    guidance_scale: float = 5.0, retries: int = 0, wait_for_capacity: bool = False):
    """The library's DreamZero loop, paced; completed chunks go to `out["video"]` / `out["actions"]`."""
    loop = models.dreamzero_steps(model, num_chunks=num_chunks, num_inference_steps=steps, seed=seed,
                                  guidance_scale=guidance_scale, hooks=hooks, out=out)
    return paced(loop, hooks, retries=retries, wait_for_capacity=wait_for_capacity)


def hunyuan_steps(model, hooks, prompts, *, prefix_capacity: int, num_steps: int, seed: int,
                  guidance_scale: float = 4.0, retries: int = 0):
    """The library's HunyuanImage-3 loop, paced; returns the latents."""
    loop = models.hunyuan_steps(model, prompts, prefix_capacity=prefix_capacity, num_steps=num_steps, seed=seed,
                                guidance_scale=guidance_scale, hooks=hooks)
    return paced(loop, hooks, retries=retries)


def run_to_end(gen, on_yield=None):
    """Drive a generator loop to its end; `on_yield(event)` runs between forwards. Returns its result."""
    while True:
        try:
            event = next(gen)
        except StopIteration as stop:
            return stop.value
        if on_yield is not None:
            on_yield(event)


# ---- state checks ----------------------------------------------------------------------------------------
def owned_kv(rt: PagedKVRuntime) -> dict[str, torch.Tensor]:
    """A copy of every live owner's valid history K/V, in every layer: what a failed forward must never touch.

    DreamZero: every owned block (whole committed frames). HunyuanImage-3: each row's prompt tokens once the
    request is prefilled (before that its blocks hold nothing valid yet).
    """
    out = {}
    B = rt.pool.block_size
    for oid, owner in rt.scheduler.owners.items():
        slots = []
        for r, row in enumerate(owner.rows):
            if owner.family.name == "dreamzero":
                valid = len(row) * B
            else:
                valid = owner.spec.prefix_lens[r] if "prefill" in owner.phases_done else 0
            pos = torch.arange(valid)
            local = torch.tensor(row, dtype=torch.int64)[pos // B] if valid else pos
            slots.append(local * B + pos % B)
        local_slots = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
        if local_slots.numel():
            layer_slot_base = rt.pool.layer_bases * B
            absolute = (layer_slot_base[:, None] + local_slots[None, :]).flatten()
            flat = rt.pool.tensor.view(2, -1, *rt.pool.tensor.shape[3:])
            out[oid] = flat.index_select(1, absolute).clone()
    return out


def assert_kv_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"the K/V of {k!r} changed"


def assert_no_leak(rt: PagedKVRuntime, outside: int = 0) -> None:
    """`outside`: blocks another user of the allocator holds (a shared vLLM BlockPool)."""
    owned = [b for rows in rt.scheduler.owned_blocks().values() for row in rows for b in row]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert rt.scheduler.allocator.num_free + len(owned) + outside == rt.pool.blocks_per_layer, "a block leaked"
    assert rt.scheduler.in_flight is None and rt.active is None


class Checkpoints:
    """Between forwards: remember the runtime state and the owned K/V; after a failed forward, compare."""

    def __init__(self, rt: PagedKVRuntime, outside: int = 0):
        self.rt = rt
        self.outside = outside  # blocks another user of the allocator holds
        self.state = None
        self.kv = None
        self.rollbacks = 0

    def __call__(self, event) -> None:
        if event[0] in ("retry", "blocked"):
            assert self.rt.state() == self.state, f"a failed {event[1]} forward changed the runtime state"
            assert_kv_equal(owned_kv(self.rt), self.kv)
            assert_no_leak(self.rt, self.outside)
            self.rollbacks += 1
        else:
            self.state, self.kv = self.rt.state(), owned_kv(self.rt)


# ---- setups ----------------------------------------------------------------------------------------------
pytestmark = pytest.mark.usefixtures("fresh_dynamo", "no_grad")


def paged_dreamzero(model=None, *, sessions: int = 1, blocks_per_layer: int | None = None, max_sessions=None,
                    allocator: str = "builtin"):
    """A runtime bound to `model` (a new compiled tiny DreamZero by default). Tests reuse one compiled model
    for their clean and faulty runtimes (close the first before binding the next): one compile per test."""
    if model is None:
        model = DreamZeroModel(DZ_CFG, seed=1)
        compile_blocks(model.blocks, CountingBackend())
    over = {} if blocks_per_layer is None else {"blocks_per_layer": blocks_per_layer}
    rt = PagedKVRuntime(dreamzero_runtime_config(model.cfg, kernel="reference", inner_compiler="aot_eager",
                                                 sessions=sessions, **over),
                        allocator=allocator, max_sessions=max_sessions)
    rt.bind(model.blocks)
    return model, rt


def paged_hunyuan(model=None, *, requests: int = 1, blocks_per_layer: int | None = None):
    if model is None:
        model = HunyuanImage3Model(HY_CFG, seed=2)
        compile_blocks(model.layers, CountingBackend())
    over = {} if blocks_per_layer is None else {"blocks_per_layer": blocks_per_layer}
    rt = PagedKVRuntime(hunyuan_runtime_config(model.cfg, max_prefix=HY_CAPACITY, block_size=4, kernel="reference",
                                               inner_compiler="aot_eager", requests=requests, **over))
    rt.bind(model.layers)
    return model, rt


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, HY_CFG.vocab, (n,), generator=g) for n in lengths]


class FaultyBlock(torch.nn.Module):
    """Wraps one (compiled) block: runs it, then raises on the listed call numbers (its K/V is already written)."""

    def __init__(self, inner, runtime, fail_on=(), exc=InjectedFault):
        super().__init__()
        self.inner, self.runtime, self.fail_on, self.exc = inner, runtime, set(fail_on), exc
        self.calls = 0
        self.failed_kinds: list[str] = []

    def __getattr__(self, name):  # the model's eager helpers reach into its blocks (e.g. block.cross_attn)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def forward(self, *args, **kwargs):
        self.calls += 1
        out = self.inner(*args, **kwargs)
        if self.calls in self.fail_on:
            self.failed_kinds.append(self.runtime.active.plan.kind)
            raise self.exc(f"injected fault on call {self.calls}")
        return out


def dz_session(rt, model, sid, **kw):
    rt.admit(sid, DreamZeroSpec.from_model_config(model.cfg), rows=2)
    return dreamzero_steps(model, PagedHooks(rt, sid), **kw)


def clean_dreamzero(model, num_chunks, steps, seed, **runtime_kw):
    """`model`'s session on a fresh runtime of the same geometry, closed afterwards: the reference result."""
    model, rt = paged_dreamzero(model, **runtime_kw)
    out = run_to_end(dz_session(rt, model, "clean", num_chunks=num_chunks, steps=steps, seed=seed))
    rt.release("clean")
    rt.close()
    return out


def same(a, b, atol=RETRY_ATOL):
    a = torch.stack(a) if isinstance(a, list) else a
    b = torch.stack(b) if isinstance(b, list) else b
    return a.shape == b.shape and (a - b).abs().max().item() <= atol


# ---- exceptions inside a compiled forward ------------------------------------------------------------------
@pytest.mark.parametrize("exc", [InjectedFault, asyncio.CancelledError], ids=["exception", "cancelled"])
def test_dreamzero_fault_inside_a_forward_rolls_back_and_the_retry_is_exact(exc):
    """Block 1 of 3 raises after running (layer 0 and 1 already wrote): commit and denoise forwards,
    once and twice in a row. Each failed forward leaves state and owned K/V bit-exact; retried, the
    session equals a clean run on a fresh runtime."""
    model, rt = paged_dreamzero()
    rt.close()
    want = clean_dreamzero(model, num_chunks=6, steps=2, seed=3)
    model, rt = paged_dreamzero(model)
    # Calls of block 1: d1 d2 | c3 d4 d5 | c6 d7 d8 ...: fail the first commit (3), then the denoise after
    # the second commit twice in a row (8 and its retry 9).
    faulty = FaultyBlock(model.blocks[1], rt, fail_on=(3, 8, 9), exc=exc)
    model.blocks[1] = faulty
    check = Checkpoints(rt)
    got = run_to_end(dz_session(rt, model, "s", num_chunks=6, steps=2, seed=3, retries=2), check)
    assert faulty.failed_kinds == ["commit", "denoise", "denoise"] and check.rollbacks == 3
    assert same(got["video"], want["video"]) and same(got["actions"], want["actions"])
    rt.release("s")
    assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer


@pytest.mark.parametrize("fail_on", [(1,), (2,), (3, 4)], ids=["prefill", "step", "step-twice"])
def test_hunyuan_fault_inside_a_forward_rolls_back_and_the_retry_is_exact(fail_on):
    p = prompts([9, 5], seed=1)
    model, rt = paged_hunyuan()
    spec = hunyuan_spec(HY_CFG, p)
    rt.admit("clean", spec)
    want = run_to_end(hunyuan_steps(model, PagedHooks(rt, "clean"), p, prefix_capacity=HY_CAPACITY, num_steps=4,
                                    seed=2))
    rt.release("clean")
    dense = hunyuan_generate(HunyuanImage3Model(HY_CFG, seed=2), p, prefix_capacity=HY_CAPACITY, num_steps=4, seed=2)
    assert same(want, dense, ATOL)

    rt.close()
    model2, rt2 = paged_hunyuan(model)
    model2.layers[1] = faulty = FaultyBlock(model2.layers[1], rt2, fail_on=fail_on)
    rt2.admit("r", spec)
    check = Checkpoints(rt2)
    got = run_to_end(hunyuan_steps(model2, PagedHooks(rt2, "r"), p, prefix_capacity=HY_CAPACITY, num_steps=4,
                                   seed=2, retries=2), check)
    assert check.rollbacks == len(fail_on) and faulty.failed_kinds[0] == ("prefill" if fail_on == (1,) else "step")
    assert same(got, want)
    rt2.release("r")
    assert rt2.scheduler.allocator.num_free == rt2.pool.blocks_per_layer


def test_a_fault_ends_the_request_cleanly_and_a_retry_on_the_same_runtime_is_exact():
    """Request-level retry with the library's own helpers: the failed session/request is aborted,
    every block is free, and running it again under a new id gives the clean result."""
    model, rt = paged_dreamzero()
    rt.close()
    want = clean_dreamzero(model, num_chunks=5, steps=2, seed=7)
    model, rt = paged_dreamzero(model)
    initial = rt.state()
    original = model.blocks[2]
    model.blocks[2] = FaultyBlock(original, rt, fail_on=(6,))  # the second commit
    with pytest.raises(InjectedFault):
        paged_run(model, rt, owner_id="a", num_chunks=5, num_inference_steps=2, seed=7)
    assert rt.state() == {**initial, "finished": {"a": "aborted"}}
    model.blocks[2] = original
    got = paged_run(model, rt, owner_id="b", num_chunks=5, num_inference_steps=2, seed=7)
    assert same(got["video"], want["video"]) and same(got["actions"], want["actions"])

    p = prompts([6, 10], seed=3)
    hy, rt2 = paged_hunyuan()
    want = paged_run(hy, rt2, prompts=p, owner_id="clean", prefix_capacity=HY_CAPACITY, num_steps=3, seed=1)
    initial = rt2.state()
    layer = hy.layers[0]
    hy.layers[0] = FaultyBlock(layer, rt2, fail_on=(2,))  # the first step after prefill
    with pytest.raises(InjectedFault):
        paged_run(hy, rt2, prompts=p, owner_id="bad", prefix_capacity=HY_CAPACITY, num_steps=3, seed=1)
    assert rt2.state() == {**initial, "finished": {**initial["finished"], "bad": "aborted"}}
    hy.layers[0] = layer
    got = paged_run(hy, rt2, prompts=p, owner_id="again", prefix_capacity=HY_CAPACITY, num_steps=3, seed=1)
    assert torch.equal(got, want)


def test_a_metadata_build_that_fails_half_way_never_serves_another_sessions_layout(monkeypatch):
    """Two sessions share a bucket. B's metadata upload raises after its copy reached the buffers; A's next
    denoise repeats A's last layout, so the builder would skip it and A would read B's blocks, unless a failed
    build forgets the last key. Both sessions must still equal clean runs."""
    model, rt = paged_dreamzero(sessions=2)
    rt.close()
    want_a = clean_dreamzero(model, num_chunks=4, steps=2, seed=11, sessions=2)
    want_b = clean_dreamzero(model, num_chunks=4, steps=2, seed=12, sessions=2)
    model, rt = paged_dreamzero(model, sessions=2)
    out_a, out_b = {}, {}
    a = dz_session(rt, model, "A", num_chunks=4, steps=2, seed=11, out=out_a)
    b = dz_session(rt, model, "B", num_chunks=4, steps=2, seed=12, out=out_b, retries=1)
    original = BucketMetadata.upload
    armed = {"on": False}

    def upload_then_fail(self, *args):
        original(self, *args)
        if armed["on"]:
            armed["on"] = False
            raise InjectedFault("injected after the metadata copy")

    monkeypatch.setattr(BucketMetadata, "upload", upload_then_fail)
    for _ in range(4):  # both run d d c (chunk 0's denoising steps, chunk 1's commit), then wait before a denoise
        assert next(a)[0] == next(b)[0]
    assert next(a) == ("denoise", 1)  # A: first denoise of chunk 1 (builds A's layout)
    armed["on"] = True
    assert next(b) == ("retry", "denoise")  # B: its build fails after its layout reached the buffers
    assert next(a) == ("commit", 2)  # A: second denoise of chunk 1, the same plan key as A's last build
    run_to_end(a)
    run_to_end(b)
    assert not armed["on"], "the fault was injected"
    assert same(out_a["video"], want_a["video"]), "A read another session's layout"
    assert same(out_b["video"], want_b["video"])
    rt.release("A")
    rt.release("B")
    assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer


# ---- pool exhaustion -------------------------------------------------------------------------------------------
def test_commit_without_room_for_every_row_takes_nothing_and_waits():
    """A 2-row commit with room for one row only is refused before anything is taken; the session waits
    (nothing it owns changes), continues once blocks are free, and equals a clean run.

    Admission reserves what a session holds up to its reset, so sessions of one runtime
    never run each other out of blocks: the shortage comes from another user of the same allocator (a shared
    vLLM BlockPool), who takes blocks the reservations counted as free."""
    # A pool of 12 reserves 6 blocks per session (2 rows x 3). A finished run of A keeps 2 history blocks per
    # row (window 3 frames - chunk 1); B's first commit takes 1 block per row; the other user holds 5, which
    # leaves 1 free block for B's second commit, which needs 2 (one per row).
    model, rt = paged_dreamzero(blocks_per_layer=12)
    rt.close()
    want_a = clean_dreamzero(model, num_chunks=4, steps=2, seed=21, blocks_per_layer=12)
    want_b = clean_dreamzero(model, num_chunks=3, steps=2, seed=22, blocks_per_layer=12)
    model, rt = paged_dreamzero(model, blocks_per_layer=12)
    out_a = {}
    run_to_end(dz_session(rt, model, "A", num_chunks=4, steps=2, seed=21, out=out_a))
    other_user = rt.scheduler.allocator.allocate(5)
    assert rt.scheduler.allocator.num_free == 3
    b = dz_session(rt, model, "B", num_chunks=3, steps=2, seed=22, wait_for_capacity=True)
    check = Checkpoints(rt, outside=5)
    events = []

    def on_yield(event):
        check(event)
        events.append(event)
        if event[0] == "blocked":
            assert rt.scheduler.allocator.num_free == 1
            assert [len(r) for r in rt.scheduler.owned_blocks()["B"]] == [1, 1], "neither row took a block"
            rt.scheduler.allocator.free(other_user)  # capacity comes back
            check.outside = 0

    b_result = run_to_end(b, on_yield)
    assert events.count(("blocked", "commit")) == 1 and check.rollbacks == 1
    assert same(out_a["video"], want_a["video"]) and same(b_result["video"], want_b["video"])
    rt.release("A")
    rt.release("B")
    assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer


def test_two_row_admission_with_room_for_one_row_admits_neither_then_succeeds_exactly():
    p_big, p_new = prompts([10, 10], seed=4), prompts([8, 9], seed=5)
    model, rt = paged_hunyuan(blocks_per_layer=3 + 3 + 2)  # the first request (3 + 3 blocks) leaves 2 free
    rt.admit("first", hunyuan_spec(HY_CFG, p_big))
    before, kv = rt.state(), owned_kv(rt)
    with pytest.raises(CapacityError, match="admitting 'second' reserves 5 blocks per layer .* only 2 of the pool's 8 "
                                            "are free to reserve"):
        rt.admit("second", hunyuan_spec(HY_CFG, p_new))  # row 0 (2 blocks) would fit, row 1 (3) not
    assert rt.state() == before
    assert_kv_equal(owned_kv(rt), kv)
    first = run_to_end(hunyuan_steps(model, PagedHooks(rt, "first"), p_big, prefix_capacity=HY_CAPACITY,
                                     num_steps=2, seed=0))
    rt.release("first")
    rt.admit("second", hunyuan_spec(HY_CFG, p_new))  # the id was refused, never used: still valid
    second = run_to_end(hunyuan_steps(model, PagedHooks(rt, "second"), p_new, prefix_capacity=HY_CAPACITY,
                                      num_steps=2, seed=0))
    rt.release("second")
    dense = HunyuanImage3Model(HY_CFG, seed=2)
    assert same(first, hunyuan_generate(dense, p_big, prefix_capacity=HY_CAPACITY, num_steps=2, seed=0), ATOL)
    assert same(second, hunyuan_generate(dense, p_new, prefix_capacity=HY_CAPACITY, num_steps=2, seed=0), ATOL)
    assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer


class FlakyAllocator:
    """Forwards to a real allocator but its next allocate() raises, as when a shared block pool (vLLM's)
    handed the blocks to someone else between the free-count check and the allocation."""

    def __init__(self, inner):
        self.inner = inner
        self.num_blocks = inner.num_blocks
        self.fail_next = False

    @property
    def num_free(self):
        return self.inner.num_free

    def allocate(self, n):
        if self.fail_next:
            self.fail_next = False
            raise CapacityError(f"cannot allocate {n} blocks: taken by another user of the shared pool")
        return self.inner.allocate(n)

    def free(self, blocks):
        self.inner.free(blocks)

    def share(self, blocks):
        self.inner.share(blocks)

    def refcount(self, block):
        return self.inner.refcount(block)


def test_allocator_failure_during_a_multi_row_allocation_changes_nothing():
    model, rt = paged_dreamzero()
    rt.close()
    want = clean_dreamzero(model, num_chunks=3, steps=2, seed=31)
    model, rt = paged_dreamzero(model)
    rt.scheduler.allocator = flaky = FlakyAllocator(rt.scheduler.allocator)
    check = Checkpoints(rt)
    gen = dz_session(rt, model, "s", num_chunks=3, steps=2, seed=31, wait_for_capacity=True)

    def arm(event):
        check(event)
        if event[0] == "commit":
            flaky.fail_next = True  # every commit's first allocation fails once

    got = run_to_end(gen, arm)
    assert check.rollbacks == 2  # two commits, each refused once and then retried
    assert same(got["video"], want["video"])
    rt.release("s")  # its reservation leaves no room for the request
    flaky.fail_next = True
    before = rt.state()
    with pytest.raises(CapacityError, match="taken by another user"):
        rt.admit("r", hunyuan_spec(HY_CFG, prompts([3, 3])))
    assert rt.state() == before


@pytest.mark.vllm
def test_vllm_block_pool_multi_row_exhaustion_rolls_back_every_row():
    """The same refusal when vLLM's BlockPool owns the blocks: no row of the refused commit keeps a block."""
    pytest.importorskip("vllm.v1.core.block_pool", reason="vLLM's BlockPool is not importable here")
    model, rt = paged_dreamzero(blocks_per_layer=12)
    rt.close()
    want = clean_dreamzero(model, num_chunks=3, steps=2, seed=41, blocks_per_layer=12)
    model, rt = paged_dreamzero(model, blocks_per_layer=12, allocator="vllm")  # two sessions' reservations
    run_to_end(dz_session(rt, model, "A", num_chunks=4, steps=2, seed=40))
    other_user = rt.scheduler.allocator.allocate(5)  # another user of the shared BlockPool: 1 block left for B
    check = Checkpoints(rt, outside=5)
    with pytest.raises(CapacityError, match="needs 2 free blocks per layer, 1 are free"):
        run_to_end(dz_session(rt, model, "B", num_chunks=3, steps=2, seed=41), check)
    assert rt.state() == check.state, "the refused 2-row commit took nothing"
    assert_kv_equal(owned_kv(rt), check.kv)
    rt.abort("B")
    rt.release("A")
    rt.scheduler.allocator.free(other_user)
    assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer
    got = run_to_end(dz_session(rt, model, "C", num_chunks=3, steps=2, seed=41))
    assert same(got["video"], want["video"])
    rt.release("C")


# ---- aborts and evictions between forwards -------------------------------------------------------------------
class DrivingHooks(PagedHooks):
    """Session A's hooks; before each of A's forwards they let a callback advance or abort other sessions."""

    def __init__(self, runtime, owner_id, between):
        super().__init__(runtime, owner_id)
        self.between = between
        self.count = 0

    def forward(self, kind, **info):
        self.count += 1
        self.between(self.count)  # runs while no forward is active
        return super().forward(kind, **info)


def test_aborting_a_session_during_its_denoising_steps_frees_it_and_leaves_others_exact():
    """Session A runs the library's `dreamzero_rollout`; between A's forwards, B (same runtime) advances one
    forward at a time and is aborted in the middle of its second chunk's denoising steps. A equals A alone on
    a fresh runtime; B's finished chunks equal its dense rollout; C, admitted into B's freed blocks, is exact."""
    dense = DreamZeroModel(DZ_CFG, seed=1)
    dense_b = dreamzero_rollout(dense, num_chunks=6, num_inference_steps=2, seed=52)
    dense_c = dreamzero_rollout(dense, num_chunks=3, num_inference_steps=2, seed=53)
    model, rt = paged_dreamzero(sessions=2)
    rt.close()
    want_a = clean_dreamzero(model, num_chunks=6, steps=2, seed=51, sessions=2)
    model, rt = paged_dreamzero(model, sessions=2)
    out_b: dict = {}
    b = dz_session(rt, model, "B", num_chunks=6, steps=2, seed=52, out=out_b)
    seen: list = []
    log = {}

    def between(count):
        if "aborted" in log:
            return
        event = next(b)  # B: d d | c d d | c d(abort before this one's sibling) ...
        seen.append(event)
        if event == ("denoise", 2) and seen.count(("denoise", 2)) == 2:
            owned = rt.scheduler.owned_blocks()["B"]
            assert any(owned), "B holds committed history when it is aborted"
            free = rt.scheduler.allocator.num_free
            rt.abort("B")
            b.close()
            log["aborted"] = count
            assert rt.scheduler.allocator.num_free == free + sum(len(r) for r in owned)
            assert "B" not in rt.scheduler.owners and rt.scheduler.finished["B"] == "aborted"
            assert_no_leak(rt)

    rt.admit("A", DreamZeroSpec.from_model_config(DZ_CFG), rows=2)
    got_a = dreamzero_rollout(model, num_chunks=6, num_inference_steps=2, seed=51,
                              hooks=DrivingHooks(rt, "A", between))
    rt.release("A")
    assert log["aborted"] > 0
    assert same(got_a["video"], want_a["video"]), "A's numbers depend on nothing B did"
    assert same(got_a["actions"], want_a["actions"])
    assert len(out_b["video"]) == 2
    assert same(out_b["video"], dense_b["video"][:2], ATOL), "B's finished chunks are its own"
    with pytest.raises(RequestError, match="'B' is aborted"):
        rt.scheduler.plan("B", "denoise")
    got_c = run_to_end(dz_session(rt, model, "C", num_chunks=3, steps=2, seed=53))
    assert same(got_c["video"], dense_c["video"], ATOL)
    rt.release("C")
    assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer


def test_lru_eviction_between_forwards_ends_only_the_evicted_session():
    dense = DreamZeroModel(DZ_CFG, seed=1)
    want = {s: dreamzero_rollout(dense, num_chunks=4, num_inference_steps=2, seed=s) for s in (61, 62, 63)}
    model, rt = paged_dreamzero(sessions=2, max_sessions=2)
    outs = {s: {} for s in (61, 62, 63)}
    gens = {61: dz_session(rt, model, "s61", num_chunks=4, steps=2, seed=61, out=outs[61]),
            62: dz_session(rt, model, "s62", num_chunks=4, steps=2, seed=62, out=outs[62])}
    for _ in range(5):  # both in their second chunk; 62 ran last, so 61 is least recently used
        for g in gens.values():
            next(g)
    owned_61 = sum(len(r) for r in rt.scheduler.owned_blocks()["s61"])
    free = rt.scheduler.allocator.num_free
    gens[63] = dz_session(rt, model, "s63", num_chunks=4, steps=2, seed=63, out=outs[63])
    assert rt.scheduler.finished["s61"] == "evicted (LRU cap on live sessions)"
    assert rt.scheduler.allocator.num_free == free + owned_61
    with pytest.raises(RequestError, match="'s61' is evicted"):
        run_to_end(gens.pop(61))
    for s in (62, 63):
        run_to_end(gens[s])
        assert same(outs[s]["video"], want[s]["video"], ATOL)
    partial = outs[61]["video"]
    assert same(partial, want[61]["video"][: len(partial)], ATOL)
    for sid in ("s62", "s63"):
        rt.release(sid)
    assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer


def test_abort_is_refused_while_another_forward_is_in_flight():
    model, rt = paged_dreamzero(sessions=2)
    for sid in ("A", "B"):
        rt.admit(sid, DreamZeroSpec.from_model_config(DZ_CFG), rows=2)
    with rt.forward_plan(rt.plan("A", "commit"), expect_attention=False):
        before = rt.state()
        for call in (lambda: rt.abort("B"), lambda: rt.abort("A"), lambda: rt.release("B"),
                     lambda: rt.reset("B")):
            with pytest.raises(RequestError, match="still in flight; finish or abort it before changing state"):
                call()
            assert rt.state() == before
    assert set(rt.scheduler.owners) == {"A", "B"}
