"""Upstream models on the captured path: the per-call checks their paging rests on run before every replay.

Tencent's static cache (tencent_hunyuan.py) is paged because `position_ids` are checked against the layout at
every call, and its dense mask can be checked too (`check_mask`); the Self-Forcing rolling cache in its
fill-state form (self_forcing.py) is paged because the session's visible history is checked at every call to
hold exactly what the frame reads. Served through `CompiledOnlyGraphs` (a replay that runs only the compiled
graphs, as a CUDA graph does), each check still refuses, and leaves the runtime as it was.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import CountingBackend

from paged_kv_compile.capture import CapturedBlocks, CompiledOnlyGraphs
from paged_kv_compile.adapters.tencent_hunyuan import LAYER_IDX_SOURCE
from paged_kv_compile.errors import CaptureError, RequestError
from paged_kv_compile.families.hunyuan_image3 import HunyuanSpec

from . import tencent_hunyuan as th
from .self_forcing import FillStateSelfAttention, RollingSelfAttention
from .test_rolling_cache import BLOCK_FRAMES, FRAME, STEPS, WINDOW_FRAMES, _inputs, _rolling_dense, _session_runtime
from .test_tencent_hunyuan import _layers, _paged, _request, _run

pytestmark = pytest.mark.usefixtures("fresh_dynamo")



def _refused(runtime, body, match: str) -> None:
    before = runtime.state()
    with pytest.raises(RequestError, match=match), torch.no_grad():
        body()
    assert runtime.state() == before


# ---- Tencent's static cache: position_ids and the dense mask ---------------------------------------------------


def _tencent_captured(req, options):
    """Tencent's layers compiled and captured for the prefill and step buckets of `req`, installed."""
    layers, rt, _, cache, around = _paged(req, options)
    B, S, T, hidden_size = len(req["lens"]), req["S"], req["T"], th.TinyConfig().hidden_size
    prefill_pos = torch.arange(S)[None].expand(B, -1).contiguous()
    phases = {"prefill": dict(attention_mask=req["mask"], position_ids=prefill_pos, past_key_value=cache,
                              custom_pos_emb=th.get_pos_emb(req["rope"], prefill_pos)),
              "step": dict(attention_mask=req["step"]["attention_mask"], position_ids=req["step"]["position_ids"],
                           past_key_value=cache,
                           custom_pos_emb=th.get_pos_emb(req["rope"], req["step"]["position_ids"]))}
    hidden, kwargs = {}, {}
    rt.admit("plan", HunyuanSpec.from_prefill_mask(req["mask"], req["scatter"][:, -1].tolist(), T))
    for phase, tokens in (("prefill", S), ("step", T)):  # nothing runs: the plans only name the buckets
        plan = rt.plan("plan", phase, prefix_capacity=S, attention_mask=phases[phase]["attention_mask"])
        with rt.forward_plan(plan, expect_attention=False) as active:
            hidden[active.bucket] = torch.zeros(B, tokens, hidden_size)
            kwargs[active.bucket] = phases[phase]
    rt.release("plan")
    blocks = torch.nn.ModuleList(layers)
    captured = CapturedBlocks(blocks, rt, lambda b: ((hidden[b],), kwargs[b]), buckets=list(hidden),
                              graphs=CompiledOnlyGraphs())
    captured.warmup(progress=False)
    captured.install()
    return blocks, rt, cache, around, captured


def test_tencent_position_ids_are_checked_on_the_captured_path():
    """Prefill and steps replayed (no Python) equal dense eager; a step whose position_ids disagree with the layout
    is refused before its replay, as it is uncaptured."""
    req = _request((6, 3))
    dense = _run(_layers(), th.HunyuanStaticCache.zeros(th.TinyConfig(), 2, 2, req["S"]), req)
    with torch.compiler.config.patch(dynamic_sources=LAYER_IDX_SOURCE):
        blocks, rt, cache, around, captured = _tencent_captured(req, {})
        with captured.serving():
            paged = _run(blocks, cache, req, around)
            forwards = len(req["hidden"])
            assert captured.stats["replays"] == captured.stats["checks"] == 2 * forwards
            bad = req["step"]["position_ids"] + 1
            replays = captured.stats["replays"]
            _refused(rt, lambda: _run(blocks, cache, req, around, step_positions=bad, forwards=slice(1, 2)),
                     "position_ids that disagree with the layout")
            assert captured.stats["replays"] == replays
    assert max((a - b).abs().max().item() for a, b in zip(dense, paged)) <= 1e-5


def test_tencent_dense_mask_is_checked_on_the_captured_path():
    """With `check_mask`, a step whose dense mask lets image tokens see a pad the layout hides is refused
    before its replay (the plan was given the right mask; the model gets the wrong one)."""
    req = _request((6, 3))
    with torch.compiler.config.patch(dynamic_sources=LAYER_IDX_SOURCE):
        blocks, rt, cache, around, captured = _tencent_captured(req, {"check_mask": True})
        step_mask, pos = req["step"]["attention_mask"], req["step"]["position_ids"]
        bad = step_mask.clone()
        bad[1, :, :, req["S"] - 1] = True  # row 1's last column is a pad after its <eoi>: nobody sees it
        pos_emb = th.get_pos_emb(req["rope"], pos)

        def step(mask):
            with around("step", step_mask):
                hidden = req["hidden"][1]
                for layer in blocks:
                    (hidden,) = layer(hidden, attention_mask=mask, position_ids=pos, past_key_value=cache,
                                      custom_pos_emb=pos_emb)

        with captured.serving(), torch.no_grad():
            _run(blocks, cache, req, around, forwards=slice(0, 1))
            step(step_mask)
            _refused(rt, lambda: step(bad), "check_mask: row 1's dense mask disagrees with the runtime's layout")


# ---- the Self-Forcing rolling cache: the history count --------------------------------------------------------


class FillStateBlock(torch.nn.Module):
    """FillStateSelfAttention with its fill state passed in: a captured call cannot update its caller's cache dict
    (dynamo replays that side effect after the graph; a replay runs no Python), so the driver keeps the state."""

    def __init__(self, inner: FillStateSelfAttention) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x, k, v, local_end_index: int, new_block: bool):
        return self.inner(x, {"k": k, "v": v, "local_end_index": local_end_index, "new_block": new_block}, 0)


def _advance(state: tuple[int, bool], tokens: int, size: int) -> tuple[int, bool]:
    """The fill state after one forward (what FillStateSelfAttention writes into its cache dict)."""
    end, new = state
    return (min(end + tokens, size) if new else end), False


def test_the_rolling_cache_history_count_is_checked_on_the_captured_path():
    """Block 1's steps at fill state (16, new_block=False) replay (no Python) and equal the original's dense
    output; at block 2 a driver that forgot `start_block` calls that same frame (it reads 8 history tokens, the
    session shows 16): refused before the replay, the runtime unchanged."""
    blocks = _inputs()
    with torch.no_grad():
        expected = _rolling_dense(RollingSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME), blocks)
    block = FillStateBlock(FillStateSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME))
    rt = _session_runtime(block)
    kv = rt.standin(2, 1, WINDOW_FRAMES * FRAME, 2, 16, writable=True)
    compiled = torch.nn.ModuleList([block])
    compiled[0].compile(backend=CountingBackend({"inner_compiler": "aot_eager", "strict": True}), fullgraph=True,
                        dynamic=False)
    n, size = BLOCK_FRAMES * FRAME, WINDOW_FRAMES * FRAME
    with rt.forward_plan(rt.plan("s", "denoise"), expect_attention=False) as active:  # names the bucket only
        bucket = active.bucket
    captured = CapturedBlocks(compiled, rt, lambda b: ((torch.zeros(1, n, 32), kv[0], kv[1], 16, False), {}),
                              buckets=[bucket], fallback="eager", graphs=CompiledOnlyGraphs())
    captured.warmup(progress=False)
    state, got = (0, True), []
    with captured.serving(), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # other fill states run uncaptured, with a warning
        for b, (noisy, clean) in enumerate(blocks[:2]):
            state = (state[0], True)  # start_block
            for i, x in enumerate(noisy + [clean]):
                with rt.forward("s", "commit" if i == len(noisy) else "denoise"):
                    out = captured.call(0, x, kv[0], kv[1], *state)
                if i < len(noisy):
                    got.append(out)
                state = _advance(state, n, size)
        assert state == (16, False) and captured.stats["replays"] == STEPS  # block 1: its second step and its commit
        x = blocks[2][0][0]
        _refused(rt, lambda: _call_in_forward(rt, captured, x, kv, state), r"reads 8 history tokens .* shows 16")
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def _call_in_forward(rt, captured, x, kv, state):
    with rt.forward("s", "denoise"):
        captured.call(0, x, kv[0], kv[1], *state)


def test_a_block_that_changes_its_cache_dict_is_refused_at_warm_up():
    """FillStateSelfAttention as written advances its cache dict's fill state (dynamo replays that after the graph):
    a captured call would not, so warm-up refuses it and names the fix (FillStateBlock above)."""
    module = FillStateSelfAttention(local_attn_size=WINDOW_FRAMES, frame_seqlen=FRAME)
    rt = _session_runtime(module)
    blocks = torch.nn.ModuleList([module])
    blocks[0].compile(backend=CountingBackend({"inner_compiler": "aot_eager", "strict": True}), fullgraph=True,
                      dynamic=False)
    kv = rt.standin(2, 1, WINDOW_FRAMES * FRAME, 2, 16, writable=True)
    with rt.forward_plan(rt.plan("s", "denoise"), expect_attention=False) as active:  # names the bucket only
        bucket = active.bucket
    cache = {"k": kv[0], "v": kv[1], "local_end_index": 16, "new_block": True}  # a new block: 16 -> 24
    captured = CapturedBlocks(blocks, rt, lambda b: ((torch.zeros(1, BLOCK_FRAMES * FRAME, 32), cache, 0), {}),
                              buckets=[bucket], graphs=CompiledOnlyGraphs())
    with pytest.raises(CaptureError, match=r"block 0 changes its arguments' Python state while it runs \(argument 3"):
        captured.warmup(progress=False)
