"""Bad input across the public surface: every refusal names the problem and the fix, and changes nothing.

Each case asserts the error type and message, then that `runtime.state()` is exactly what it was and,
where the pool is reachable, that the pool tensor is bit-exactly unchanged. The runtime the cases run
against is not empty: it holds a DreamZero session with committed history, a prefilled HunyuanImage-3
request, and finished/aborted ids, and its pool is filled with random values (so "unchanged" means
something). Cases that the older suites already cover are not repeated here; `docs/reliability.md`
lists both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from helpers import CountingBackend, compile_blocks, raises_paged

from paged_kv_compile import (
    BindingError,
    CapacityError,
    ConfigError,
    KernelUnavailableError,
    OpInputError,
    PassError,
    RequestError,
)
from paged_kv_compile import binding
from paged_kv_compile.config import Bucket, PagedKVConfig
from paged_kv_compile.driver import PagedHooks, paged_run
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
from paged_kv_compile.families.hunyuan_image3 import (
    HunyuanSpec,
    hunyuan_runtime_config,
    hunyuan_spec,
    prefix_capacity_for,
)
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel
from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config, HunyuanImage3Model
from paged_kv_compile.runtime import PagedKVRuntime

write_attend = torch.ops.paged_kv.write_attend
attend = torch.ops.paged_kv.attend

B = 4
DZ = DreamZeroSpec(frame_seqlen=4, chunk_frames=1, window_frames=3, sink_frames=0, action_tokens=2)
BASE = dict(num_layers=3, num_kv_heads=2, head_dim=8, block_size=B, blocks_per_layer=24, max_rows=2,
            scratch_tokens_per_row=16)


pytestmark = pytest.mark.usefixtures("fresh_dynamo", "no_grad")


# ---- a runtime in use ------------------------------------------------------------------------------------
@dataclass
class World:
    rt: PagedKVRuntime
    op: dict = field(default_factory=dict)  # a valid write_attend call on the runtime's pool and metadata


def make_world() -> World:
    rt = PagedKVRuntime(PagedKVConfig(**BASE))
    rt.admit("live", DZ, rows=2)
    with rt.forward("live", "commit"):
        pass
    rt.admit("gone", DZ, rows=2)
    rt.abort("gone")
    rt.admit("closed", DZ, rows=1)
    rt.release("closed")
    spec = HunyuanSpec((5, 3), 6, ((1, 5),))
    rt.admit("req", spec)
    with rt.forward("req", "prefill", prefix_capacity=8, attention_mask=spec.padded_mask(8)):
        pass
    rt.admit("done", HunyuanSpec((2,), 3))
    rt.release("done")
    with rt.forward("live", "denoise") as active:
        meta = active.meta
    g = torch.Generator().manual_seed(0)
    rt.pool.tensor.copy_(torch.randn(rt.pool.tensor.shape, generator=g))
    R, T = meta.bucket.rows, meta.bucket.tokens
    layer = meta.layers[1]
    op = dict(query=torch.randn(R, T, 4, 8, generator=g), key=torch.randn(R, T, 2, 8, generator=g),
              value=torch.randn(R, T, 2, 8, generator=g), kv_pool=rt.pool.tensor, slot_mapping=layer.slot_mapping,
              block_table=layer.block_table, seq_lens=meta.seq_lens, kv_visible_end=meta.kv_visible_end)
    return World(rt, op)


def call_op(w: World, kernel: str = "reference", visibility: str = "general", **changes):
    args = {**w.op, **changes}
    return write_attend(*args.values(), 8**-0.5, kernel, visibility)


def test_the_worlds_op_call_is_valid():
    """Each op case below differs from this valid call in one argument."""
    w = make_world()
    pool = w.rt.pool.tensor.clone()
    out = call_op(w, kv_pool=pool)
    assert out.shape == w.op["query"].shape and torch.isfinite(out).all()
    assert not torch.equal(pool, w.rt.pool.tensor), "the valid call writes its slots"


def _plan_live(w):
    return w.rt.scheduler.plan("live", "commit")


def _stale_plan(rt):
    """A commit plan that already ran: replaying it would write into blocks it no longer owns."""
    plan = rt.scheduler.plan("live", "commit")
    with rt.forward_plan(plan):
        pass
    return plan


def _fill_pool(w):
    """Another user of a shared allocator (vLLM's BlockPool) takes every free block: reservations
    keep this runtime's own owners from ever doing so."""
    w.rt.scheduler.allocator.allocate(w.rt.scheduler.allocator.num_free)


def _reserve_all(w):
    """Admit sessions until the next would not fit beside the reservations of the live owners."""
    for i in range(w.rt.pool.blocks_per_layer):
        try:
            w.rt.admit(f"filler{i}", DZ, rows=1)
        except CapacityError:
            return


# (id, call(world), error type, message pattern, setup(world) run before the "before" snapshot or None)
CASES = [
    # -- the op, on the runtime's own pool and metadata --------------------------------------------------
    ("op: value dtype", lambda w: call_op(w, value=w.op["value"].double()), OpInputError,
     r"value is torch.float64 but query is torch.float32.*cast them to the pool's dtype", None),
    ("op: seq_lens device", lambda w: call_op(w, seq_lens=w.op["seq_lens"].to("meta")), OpInputError,
     r"seq_lens is on meta but query is on cpu; move every op input to one device", None),
    ("op: block_table device", lambda w: call_op(w, block_table=w.op["block_table"].to("meta")), OpInputError,
     r"block_table is on meta but query is on cpu", None),
    ("op: pool without a K/V axis of 2", lambda w: call_op(w, kv_pool=w.rt.pool.tensor[:1]),
     OpInputError, r"kv_pool's first dim must be 2 \(K, V\)", None),
    ("op: empty block table", lambda w: call_op(w, block_table=w.op["block_table"][:, :0]), OpInputError,
     r"block_table has shape \(2, 0\), expected \[R=2, M>=1\]; pad unused entries", None),
    ("op: more kv heads than query heads", lambda w: call_op(w, query=w.op["query"][:, :, :1]), OpInputError,
     r"query heads Hq=1 are not a multiple of the pool's kv heads Hkv=2", None),
    ("op: unknown kernel", lambda w: call_op(w, kernel="fast"), OpInputError,
     r"unknown kernel 'fast'; choose one of auto, reference, triton, flash_attn, npu", None),
    ("op: npu kernel on cpu tensors", lambda w: call_op(w, kernel="npu"), KernelUnavailableError,
     r"kernel='npu' \(torch_npu\) runs on Ascend NPU tensors, got cpu; use kernel='reference'", None),
    ("op: causal hint contradicted", lambda w: call_op(w, visibility="causal"), OpInputError,
     r"kv_visible_end\[0, 0\] = \d+ is not what the visibility='causal' hint promises; pass visibility='general'",
     None),
    ("op: slot in another row's table beyond the pool", lambda w: call_op(
        w, slot_mapping=w.op["slot_mapping"].clone().index_fill_(1, torch.tensor([2]), w.rt.pool.num_blocks_total * B)),
     OpInputError, r"slot_mapping\[0, 2\] = \d+ is outside \[-1, N\*B=\d+\)", None),
    ("op: read-only attend with a block id beyond the pool", lambda w: attend(
        w.op["query"], w.rt.pool.tensor, w.op["block_table"].clone().fill_(w.rt.pool.num_blocks_total),
        w.op["seq_lens"], w.op["kv_visible_end"], 0.3, "reference"), OpInputError,
     r"block_table\[0, 0\] = \d+ is outside \[0, N=\d+\): pad unused entries with a valid id", None),
    ("op: seq_lens beyond the block table of the real metadata", lambda w: call_op(
        w, seq_lens=w.op["seq_lens"] + w.op["block_table"].shape[1] * B), OpInputError,
     r"seq_lens\[0\] = \d+ is outside \[0, M\*B=\d+\], the block table's capacity", None),
    # -- configuration and pool sizing ------------------------------------------------------------------------
    ("config: block_size 0", lambda w: PagedKVConfig(**{**BASE, "block_size": 0}), ConfigError,
     r"block_size must be >= 1, got 0; use e.g. 16", None),
    ("config: blocks and budget both given", lambda w: PagedKVConfig(**BASE, budget_bytes=1 << 20), ConfigError,
     r"give exactly one of blocks_per_layer or budget_bytes", None),
    ("config: unknown kernel", lambda w: PagedKVConfig(**BASE, kernel="cudnn"), ConfigError,
     r"unknown kernel 'cudnn'; choose one of", None),
    ("config: unknown inner compiler", lambda w: PagedKVConfig(**BASE, inner_compiler="tvm"), ConfigError,
     r"unknown inner_compiler 'tvm'; choose one of inductor, aot_eager, eager", None),
    ("config: bucket wider than max_rows", lambda w: PagedKVConfig(**BASE, buckets=(Bucket(3, 8, 8),)), ConfigError,
     r"has more rows than max_rows=2; raise max_rows", None),
    ("config: bucket of 0 tokens", lambda w: PagedKVConfig(**BASE, buckets=(Bucket(1, 0, 8),)), ConfigError,
     r"needs rows >= 1, tokens >= 1, context >= 0", None),
    ("config: zero layers", lambda w: PagedKVConfig(**{**BASE, "num_layers": 0}), ConfigError,
     r"num_layers must be >= 1, got 0", None),
    ("pool: budget below one block plus scratch", lambda w: PagedKVRuntime(PagedKVConfig(
        **{**BASE, "blocks_per_layer": None}, budget_bytes=4096)), ConfigError,
     r"budget_bytes=4096 cannot hold one block per layer plus scratch \(needs at least \d+ bytes\); raise the budget",
     None),
    ("pool: budget below one window", lambda w: PagedKVRuntime(PagedKVConfig(**{**BASE, "blocks_per_layer": 2}),
                                                               min_tokens_per_layer=DZ.window_tokens * 2),
     ConfigError, r"holds 8 tokens per layer, below one window of 24 tokens; give at least 6 blocks per layer", None),
    ("pool: integer dtype", lambda w: PagedKVRuntime(PagedKVConfig(**BASE, dtype=torch.int32)), ConfigError,
     r"the pool dtype must be a floating type, got torch.int32", None),
    # -- DreamZero sessions -----------------------------------------------------------------------------------
    ("session: one window can never fit the pool", lambda w: w.rt.admit(
        "big", DreamZeroSpec(frame_seqlen=4, chunk_frames=1, window_frames=13)), CapacityError,
     r"one full window needs 26 blocks per layer \(2 rows x 13\) but the whole pool has 24: it can never fit", None),
    ("session: a forward larger than the scratch", lambda w: w.rt.admit(
        "wide", DreamZeroSpec(frame_seqlen=4, chunk_frames=4, window_frames=5, action_tokens=8)), ConfigError,
     r"a forward needs 6 scratch blocks per row but the pool has 5; raise scratch_tokens_per_row", None),
    ("session: reusing an aborted id", lambda w: w.rt.admit("gone", DZ), RequestError,
     r"id 'gone' was already used and is aborted; pick a new id \(the last 4096 finished ids are refused", None),
    ("session: forward of an aborted session", lambda w: w.rt.forward("gone", "denoise"), RequestError,
     r"id 'gone' is aborted; admit a new one to continue", None),
    ("session: a DreamZero kind on a request id", lambda w: w.rt.forward("req", "commit"), RequestError,
     r"unknown phase 'commit'; use 'prefill' or 'step'", None),
    ("session: commit with the pool full", lambda w: w.rt.forward("live", "commit"), CapacityError,
     r"needs 2 free blocks per layer, 0 are free; retry after other requests finish", _fill_pool),
    ("session: admission beyond the reservations", lambda w: w.rt.admit("extra", DZ, rows=1), CapacityError,
     r"admitting 'extra' reserves \d+ blocks per layer \(the most it takes up to its reset.*free to reserve", _reserve_all),
    ("session: fork beyond the reservations", lambda w: w.rt.fork("live", "kid"), CapacityError,
     r"forking 'live' into 'kid' reserves \d+ blocks per layer .*free to reserve", _reserve_all),
    ("session: planning while another forward is in flight", lambda w: w.rt.scheduler.plan(
        "req", "step", prefix_capacity=8), RequestError,
     r"a forward for 'live' is still in flight; finish or abort it before changing state", _plan_live),
    # -- HunyuanImage-3 requests ------------------------------------------------------------------------------
    ("request: target span of 0 tokens", lambda w: w.rt.admit("x", HunyuanSpec((4,), 0)), RequestError,
     r"prefix lengths and target_len must be >= 1", None),
    ("request: full span outside the target", lambda w: w.rt.admit("x", HunyuanSpec((4,), 6, ((3, 9),))),
     RequestError, r"full span \(3, 9\) must lie inside the target span \[0, 6\)", None),
    ("request: unknown phase", lambda w: w.rt.forward("req", "decode", prefix_capacity=8),
     RequestError, r"unknown phase 'decode'; use 'prefill' or 'step'", None),
    ("request: a HunyuanImage-3 kind on a session id", lambda w: w.rt.forward("live", "step", prefix_capacity=8),
     RequestError, r"unknown DreamZero forward kind 'step'; use 'commit' or 'denoise'", None),
    ("request: abort of an unknown id", lambda w: w.rt.abort("nobody"), RequestError,
     r"unknown id 'nobody'; admit it first \(runtime.admit\)", None),
    ("request: abort of a finished id", lambda w: w.rt.abort("done"), RequestError, r"id 'done' is released", None),
    # -- forwards and buckets -----------------------------------------------------------------------------------
    ("forward: replaying a finished plan", lambda w: w.rt.forward_plan(w.stale).__enter__(), RequestError,
     r"this forward plan is not the one in flight \(finished twice, or stale\)",
     lambda w: setattr(w, "stale", _stale_plan(w.rt))),
    ("forward: finishing a plan twice", lambda w: w.rt.scheduler.finish_forward(w.stale), RequestError,
     r"not the one in flight", lambda w: setattr(w, "stale", _stale_plan(w.rt))),
    ("forward: warm-up inside a forward", lambda w: w.rt.warmup_forward(Bucket(2, 6, 12)).__enter__(), RequestError,
     r"a forward is already active on this runtime; warm up between forwards",
     lambda w: setattr(w, "ctx", w.rt.forward("live", "denoise")) or w.ctx.__enter__()),
]


def _bucketed_world():
    """A runtime whose buckets serve a 1-row HunyuanImage-3 request of prefix capacity 8 and target 6 only."""
    cfg = PagedKVConfig(**BASE, buckets=(Bucket(1, 14, 8), Bucket(1, 6, 8)))
    return World(PagedKVRuntime(cfg))


BUCKET_CASES = [
    ("bucket: prompt longer than every bucket's capacity", lambda w: prefix_capacity_for(w.rt.config.buckets, [9], 6),
     RequestError, r"no configured step bucket with rows=1, tokens=6 and context >= 9; add one", None),
    ("bucket: token count beyond every bucket", lambda w: prefix_capacity_for(w.rt.config.buckets, [5], 7), RequestError,
     r"no configured step bucket with rows=1, tokens=7", None),
    ("bucket: 2-row request on 1-row buckets", lambda w: prefix_capacity_for(w.rt.config.buckets, [5, 5], 6), RequestError,
     r"no configured step bucket with rows=2, tokens=6", None),
    ("bucket: warm-up of an unconfigured bucket", lambda w: w.rt.warmup_forward(Bucket(1, 7, 8)).__enter__(),
     RequestError, r"cannot warm up bucket Bucket\(rows=1, tokens=7, context=8\): not configured", None),
    ("bucket: forward outside the buckets", lambda w: w.rt.forward("r", "prefill", prefix_capacity=5,
                                                                             attention_mask=HunyuanSpec((5,), 6)
                                                                             .padded_mask(5)).__enter__(), RequestError,
     r"no configured bucket for rows=1, tokens=11, context=5; configured: .* Pad the forward",
     lambda w: w.rt.admit("r", HunyuanSpec((5,), 6))),
]


def _check(world: World, call, exc, pattern, setup) -> None:
    if setup is not None:
        setup(world)
    before, pool = world.rt.state(), world.rt.pool.tensor.clone()
    with pytest.raises(exc, match=pattern):
        call(world)
    assert world.rt.state() == before, "a refused call changed the runtime state"
    assert torch.equal(world.rt.pool.tensor, pool), "a refused call changed the pool"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_refused_without_change(case):
    _, call, exc, pattern, setup = case
    _check(make_world(), call, exc, pattern, setup)


@pytest.mark.parametrize("case", BUCKET_CASES, ids=[c[0] for c in BUCKET_CASES])
def test_bucket_refusals_without_change(case):
    _, call, exc, pattern, setup = case
    _check(_bucketed_world(), call, exc, pattern, setup)


def test_the_refused_cases_leave_a_usable_runtime():
    """After a refusal the runtime serves the same owners as if nothing had been tried."""
    w = make_world()
    for name, call, exc, pattern, setup in CASES:
        if setup is None and not name.startswith(("config", "pool")):
            with pytest.raises(exc):
                call(w)
    with w.rt.forward("live", "commit"):
        pass
    with w.rt.forward("req", "step", prefix_capacity=8):
        pass
    w.rt.release("live")
    w.rt.release("req")
    assert w.rt.scheduler.allocator.num_free == w.rt.pool.blocks_per_layer


def test_a_nested_forward_is_refused_without_touching_the_outer_one():
    """The inner refusal must not roll back the outer forward's plan (it is not the inner call's to abort)."""
    rt = make_world().rt
    version = rt.state()["versions"]["live"]
    plan = rt.scheduler.plan("live", "commit")
    with rt.forward_plan(plan):
        inside, pool = rt.state(), rt.pool.tensor.clone()
        with pytest.raises(RequestError, match=r"a forward is already active on this runtime; forwards do not nest"):
            with rt.forward_plan(plan):
                pass
        assert rt.state() == inside and torch.equal(rt.pool.tensor, pool)
    assert rt.state()["versions"]["live"] == version + 1, "the outer commit went through"
    assert rt.scheduler.in_flight is None and rt.active is None


def test_a_forward_inside_a_warm_up_is_refused_before_it_takes_blocks():
    """A warm-up is the active forward but the scheduler does not know it: a forward run inside one must be refused
    before planning (or hand back what it planned), never left in flight holding blocks."""
    rt = make_world().rt
    before = rt.state()
    bucket = next(iter(rt.config.buckets)) if rt.config.buckets else Bucket(2, 6, 16)
    with rt.warmup_forward(bucket):
        with pytest.raises(RequestError, match="forwards do not nest"):
            with rt.forward("live", "commit"):
                pass
        with pytest.raises(RequestError, match="forwards do not nest"):
            with rt.forward_batch([("live", "commit")]):
                pass
        with pytest.raises(RequestError, match="forwards do not nest"):
            with rt.forward_plan(rt.scheduler.plan("live", "commit")):  # planned first: handed back
                pass
    assert rt.state() == before, "the refused forward kept its blocks or stayed in flight"
    rt.release("live")  # every later call still works


# ---- the library's loop drivers ----------------------------------------------------------------------------------
def test_a_request_no_bucket_can_serve_is_refused_before_it_holds_blocks():
    """`paged_run` (HunyuanImage-3) used to admit first and then fail to find a bucket: the request kept its blocks."""
    cfg = HunyuanImage3Config(num_layers=2, image_h=2, image_w=2)
    T = cfg.target_len
    rt = PagedKVRuntime(hunyuan_runtime_config(cfg, max_prefix=8, block_size=4, buckets=(Bucket(1, 8 + T, 8),
                                                                                          Bucket(1, T, 8))))
    model = HunyuanImage3Model(cfg, seed=0)
    before, pool = rt.state(), rt.pool.tensor.clone()
    for prompts, pattern in (([torch.arange(9)], r"rows=1, tokens=\d+ and context >= 9"),
                             ([torch.arange(3), torch.arange(4)], r"rows=2")):
        with pytest.raises(RequestError, match=r"no configured step bucket with " + pattern):
            paged_run(model, rt, prompts=prompts, owner_id="r", num_steps=2)
        assert rt.state() == before and torch.equal(rt.pool.tensor, pool)
    paged_run(model, rt, prompts=[torch.arange(5)], owner_id="r", num_steps=2)  # the id is still unused


def test_a_request_the_model_rejects_gives_back_its_blocks():
    """Token ids outside the vocabulary: the model refuses after admission; the request is aborted, every block
    is free again (its id is consumed: it appears as aborted)."""
    cfg = HunyuanImage3Config(num_layers=2, image_h=2, image_w=2)
    rt = PagedKVRuntime(hunyuan_runtime_config(cfg, max_prefix=8, block_size=4))
    before, pool = rt.state(), rt.pool.tensor.clone()
    with pytest.raises(ValueError, match=r"prompt token ids must lie in \[0, 64\)"):
        paged_run(HunyuanImage3Model(cfg, seed=0), rt, prompts=[torch.tensor([3, 99])], owner_id="r")
    assert rt.state() == {**before, "finished": {"r": "aborted"}}
    assert torch.equal(rt.pool.tensor, pool)


def test_a_dreamzero_rollout_under_a_live_id_is_refused_without_change():
    rt = _dz_runtime()
    rt.admit("s", DreamZeroSpec.from_model_config(TINY_DZ), rows=2)
    before = rt.state()
    with pytest.raises(RequestError, match=r"id 's' is already live; finish or close it first, or use a new id"):
        paged_run(DreamZeroModel(TINY_DZ, seed=0), rt, owner_id="s", num_chunks=1)
    assert rt.state() == before


# ---- binding ---------------------------------------------------------------------------------------------------
TINY_DZ = DreamZeroConfig(num_layers=2)


def _dz_runtime(cfg=TINY_DZ, **over):
    kw = dict(block_size=8, kernel="reference", inner_compiler="aot_eager", sessions=2)
    return PagedKVRuntime(dreamzero_runtime_config(cfg, **{**kw, **over}))


def test_bind_with_the_wrong_layer_count():
    rt = _dz_runtime()
    model = DreamZeroModel(TINY_DZ, seed=0)
    before = rt.state()
    with pytest.raises(BindingError,
                       match=r"1 layers given but the runtime was configured for 2; bind the model's list"):
        rt.bind(model.blocks[:1])
    assert rt.state() == before and list(binding.registered_layers(rt)) == []


def test_bind_a_layer_without_parameters():
    rt = _dz_runtime()
    with pytest.raises(BindingError, match=r"layer 1 \(GELU\) has no parameters; bind the attention blocks"):
        rt.bind([torch.nn.Linear(2, 2), torch.nn.GELU()])
    assert list(binding.registered_layers(rt)) == []


def test_bind_weights_of_another_live_runtime_keeps_every_binding():
    first, second = DreamZeroModel(TINY_DZ, seed=0), DreamZeroModel(TINY_DZ, seed=1)
    rt1, rt2 = _dz_runtime(), _dz_runtime()
    rt1.bind(first.blocks)
    rt2.bind(second.blocks)
    with pytest.raises(BindingError, match=r"already bound to another live runtime; close it first"):
        rt2.bind(first.blocks)
    # Refused means refused: rt2 still serves its own model, rt1 still owns the other.
    assert binding.resolve(second.blocks[1].self_attn.qkv.weight) == (rt2, 1)
    assert binding.resolve(first.blocks[0].self_attn.qkv.weight) == (rt1, 0)


# ---- compiled models -------------------------------------------------------------------------------------------
def _block_inputs(model, rt, rows: int = 2, dtype=torch.float32):
    cfg = model.cfg
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cfg.tokens_per_forward, cfg.dim, generator=g).to(dtype)
    e = (torch.randn(rows, 6, cfg.dim, generator=g) * 0.1).to(dtype)
    cos, sin = model.rope_tables(0, cfg.num_frame_per_block)
    cross = model.prepare_cross_kv(torch.randn(rows, cfg.text_len, cfg.text_dim, generator=g).to(dtype))[0]
    standin = rt.standin(2, rows, cfg.max_attention_size, cfg.num_heads, cfg.head_dim)
    return x, e, cos.to(dtype), sin.to(dtype), standin, cross


def _dz_compiled(cfg=TINY_DZ, options=None, dtype=torch.float32, **runtime_over):
    """A compiled tiny DreamZero bound to a runtime, with one session "s" that has committed one chunk."""
    model = DreamZeroModel(cfg, seed=0).to(dtype)
    rt = _dz_runtime(cfg, **runtime_over)
    rt.bind(model.blocks)
    compile_blocks(model.blocks, CountingBackend(options or {}))
    rt.admit("s", DreamZeroSpec.from_model_config(cfg), rows=2)
    return model, rt


def _commit_once(model, rt, inputs):
    with rt.forward("s", "commit"):
        for block in model.blocks:
            block(*inputs)


def _refused_forward(rt, plan_forward, body, exc, pattern):
    """`body()` inside `plan_forward()` is refused; the state and the pool are exactly as before."""
    before, pool = rt.state(), rt.pool.tensor.clone()
    with raises_paged(exc, pattern):
        with plan_forward():
            body()
    assert rt.state() == before
    assert torch.equal(rt.pool.tensor, pool)


@pytest.mark.parametrize("session_rows, batch_rows", [(2, 1), (1, 2)], ids=["2-row session, 1-row batch",
                                                                             "1-row session, 2-row batch"])
def test_cfg_rows_of_the_batch_must_match_the_session(session_rows, batch_rows):
    model, rt = _dz_compiled()
    _commit_once(model, rt, _block_inputs(model, rt))
    rt.admit("t", DreamZeroSpec.from_model_config(TINY_DZ), rows=session_rows)
    inputs = _block_inputs(model, rt, rows=batch_rows)
    _refused_forward(rt, lambda: rt.forward("t", "commit"), lambda: model.blocks[0](*inputs),
                     RequestError, rf"compiled for bucket Bucket\(rows={batch_rows}, .* but the active forward is "
                                   rf"bucket Bucket\(rows={session_rows}, .*do not match the runtime's plan")


def test_a_block_of_another_bucket_than_the_active_forward_is_refused():
    """HunyuanImage-3's step graph called inside a prefill forward (stale metadata for that graph)."""
    cfg = HunyuanImage3Config(num_layers=2)
    model = HunyuanImage3Model(cfg, seed=0)
    rt = PagedKVRuntime(hunyuan_runtime_config(cfg, max_prefix=8, block_size=4, kernel="reference",
                                               inner_compiler="aot_eager"))
    rt.bind(model.layers)
    compile_blocks(model.layers, CountingBackend())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in (7, 4)]
    rt.admit("r", hunyuan_spec(cfg, prompts))
    req = model.build_request(prompts, 8)
    caches = PagedHooks(rt, "r").caches(model, 2, prefix_capacity=8)
    target = model.embed_target(torch.randn(2, cfg.image_tokens, cfg.latent_channels, generator=g), torch.zeros(2))
    with rt.forward("r", "prefill", prefix_capacity=8, attention_mask=req.attention_mask):
        model(torch.cat([req.prefix_embeds, target], 1), req.rope_cos, req.rope_sin, req.attention_mask, caches,
              req.prefix_valid, "prefill")
    step = (target, req.step_rope_cos, req.step_rope_sin, req.step_attention_mask, caches, req.prefix_valid, "step")
    with rt.forward("r", "step", prefix_capacity=8):
        model(*step)  # compiles the step graph
    _refused_forward(rt, lambda: rt.forward("r", "prefill", prefix_capacity=8,
                                                        attention_mask=req.attention_mask), lambda: model(*step),
                     RequestError, r"compiled for bucket Bucket\(rows=2, tokens=\d+, context=8\) but the active "
                                   r"forward is bucket Bucket\(rows=2, tokens=\d+, context=8\).*stale metadata")


def test_a_dreamzero_site_inside_a_hunyuan_forward_is_refused():
    """Same bucket shape, other family: the layout check refuses instead of reading a prefix as a window."""
    model, rt = _dz_compiled()
    inputs = _block_inputs(model, rt)
    _commit_once(model, rt, inputs)
    cfg = TINY_DZ
    spec = HunyuanSpec((cfg.max_attention_size,) * 2, cfg.tokens_per_forward)
    rt.admit("h", spec)
    with rt.forward_plan(rt.plan("h", "prefill", prefix_capacity=cfg.max_attention_size,
                                 attention_mask=spec.padded_mask(cfg.max_attention_size)), expect_attention=False):
        pass
    _refused_forward(rt, lambda: rt.forward("h", "step", prefix_capacity=cfg.max_attention_size),
                     lambda: model.blocks[0](*inputs), RequestError,
                     r"a 'window' attention site ran inside a hunyuan_image3 forward \('h'\), whose family accepts "
                     r"the idioms \['prefill-store', 'prefix-step', 'static-cache'\]")


def test_a_session_spec_that_disagrees_with_the_model_is_refused():
    model, rt = _dz_compiled()
    inputs = _block_inputs(model, rt)
    _commit_once(model, rt, inputs)
    wrong = DreamZeroSpec(frame_seqlen=16, chunk_frames=2, window_frames=6, sink_frames=1, action_tokens=5)
    rt.admit("t", wrong, rows=2)
    _refused_forward(rt, lambda: rt.forward("t", "commit"), lambda: model.blocks[0](*inputs),
                     RequestError, r"the compiled DreamZero site and session 't' disagree on sink_tokens \(graph 0, "
                                   r"session 16\): admit the session with DreamZeroSpec.from_model_config")


def test_a_graph_compiled_against_another_pool_geometry_is_refused():
    model, rt = _dz_compiled()
    _commit_once(model, rt, _block_inputs(model, rt))
    rt.close()
    rt2 = _dz_runtime(sessions=3)  # a bigger pool
    rt2.bind(model.blocks)
    rt2.admit("s", DreamZeroSpec.from_model_config(TINY_DZ), rows=2)
    inputs = _block_inputs(model, rt2)
    _refused_forward(rt2, lambda: rt2.forward("s", "denoise"), lambda: model.blocks[0](*inputs),
                     RequestError, r"compiled against another pool geometry; compile again for this runtime")


def test_weights_swapped_between_layers_after_binding_are_refused_then_rebinding_is_exact():
    """Swapping two layers' projections keeps every address bound, so the address alone would let layer 0
    read layer 1's KV; the binding also checks that the bound layer still holds the weight."""
    model, rt = _dz_compiled()
    dense = DreamZeroModel(TINY_DZ, seed=0)
    inputs = _block_inputs(model, rt)
    _commit_once(model, rt, inputs)
    for m in (model, dense):
        a, b = m.blocks[0].self_attn.qkv, m.blocks[1].self_attn.qkv
        a.weight, b.weight = b.weight, a.weight
    _refused_forward(rt, lambda: rt.forward("s", "denoise"), lambda: model.blocks[0](*inputs),
                     BindingError, r"bound as 'self_attn.qkv.weight' of layer 1, but that layer no longer holds it "
                                   r"\(weights swapped, replaced or re-loaded after binding\): call runtime.bind")
    rt.bind(model.blocks)  # the fix the message names: layer 0 is now the layer holding that weight
    rt.admit("fresh", DreamZeroSpec.from_model_config(TINY_DZ), rows=2)
    x, e, cos, sin, standin, cross = inputs
    with rt.forward("fresh", "denoise"):
        got = [model.blocks[i](x, e, cos, sin, standin, cross)[0] for i in range(2)]
    empty = torch.zeros(2, 2, 0, TINY_DZ.num_heads, TINY_DZ.head_dim)
    want = [dense.blocks[i](x, e, cos, sin, empty, cross)[0] for i in range(2)]
    for g_, w_ in zip(got, want):
        assert (g_ - w_).abs().max().item() <= 1e-5


def test_weights_moved_in_place_after_binding_are_refused():
    model, rt = _dz_compiled()
    inputs = _block_inputs(model, rt)
    _commit_once(model, rt, inputs)
    weight = model.blocks[1].self_attn.qkv.weight
    weight.data = weight.data.clone()  # same Parameter object, new storage (e.g. a manual re-load)
    _refused_forward(rt, lambda: rt.forward("s", "denoise"), lambda: model.blocks[1](*inputs),
                     BindingError, r"that no live runtime has bound: call runtime.bind\(layers\) with this model's "
                                   r"layers \(again, if the weights were moved")


def test_a_model_whose_heads_do_not_match_the_pool_is_refused_at_compile_time():
    model, rt = _dz_compiled(num_kv_heads=2)  # the model has 4 heads per layer
    inputs = _block_inputs(model, rt)
    _refused_forward(rt, lambda: rt.forward("s", "denoise"), lambda: model.blocks[0](*inputs),
                     OpInputError, r"key has shape \(2, 37, 4, 16\), expected \[R, T, Hkv, D\] = \(2, 37, 2, 16\)")


def test_a_model_in_another_dtype_than_the_pool_is_refused_at_compile_time():
    model, rt = _dz_compiled(dtype=torch.float64)  # the pool is float32
    inputs = _block_inputs(model, rt, dtype=torch.float64)
    _refused_forward(rt, lambda: rt.forward("s", "denoise"), lambda: model.blocks[0](*inputs),
                     OpInputError, r"kv_pool is torch.float32 but query is torch.float64; .*cast them to the pool's "
                                   r"dtype")


def test_a_kernel_this_machine_cannot_run_is_refused_at_the_first_forward():
    model, rt = _dz_compiled(kernel="flash_attn")
    inputs = _block_inputs(model, rt)
    _refused_forward(rt, lambda: rt.forward("s", "denoise"), lambda: model.blocks[0](*inputs),
                     KernelUnavailableError, r"kernel='flash_attn' .* runs on CUDA tensors, got cpu; use "
                                             r"kernel='reference' or 'triton'")


class CausalLMLayer(torch.nn.Module):
    """A decoder layer of neither family: 4-D KV cache, causal attention via is_causal=True."""

    def __init__(self, heads=2, dim=16):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, cache_k, cache_v):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        k, v = torch.cat([cache_k, k], 1), torch.cat([cache_v, v], 1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2).flatten(2)


def test_a_model_of_an_unsupported_family_is_refused_in_strict_mode():
    layer = CausalLMLayer()
    rt = PagedKVRuntime(PagedKVConfig(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, blocks_per_layer=8,
                                      max_rows=1, inner_compiler="aot_eager"))
    rt.bind([layer])
    layer.compile(backend=CountingBackend({"strict": True}), fullgraph=True, dynamic=False)
    before, pool = rt.state(), rt.pool.tensor.clone()
    cache = rt.standin(1, 8, 2, 8)
    with raises_paged(PassError, r"cannot be rewritten: window: history does not come from a \(2, B, L, H, D\) "
                                 r"cache stand-in; .*prefix-step: is_causal=True is not a prefix idiom"):
        layer(torch.randn(1, 4, 16), cache, cache)
    assert rt.state() == before and torch.equal(rt.pool.tensor, pool)
