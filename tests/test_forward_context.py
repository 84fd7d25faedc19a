"""The per-forward object compiled code talks to (`forward_context.ForwardContext`): what it counts and checks.

A compiled site (and the captured path) checks, records and reads through the forward in progress, not through
the runtime; "did any paged attention run" is counted on that forward, so a call of the op outside it counts for
nothing.
"""

from __future__ import annotations

import pytest
import torch

from paged_kv_compile import PagedKVConfig, RequestError
from paged_kv_compile.distributed import rank_runtime
from paged_kv_compile.families.dreamzero import DreamZeroSpec
from paged_kv_compile.forward_context import ForwardContext
from paged_kv_compile.passes.idioms import WindowExpect
from paged_kv_compile.runtime import PagedKVRuntime

B = 4
DZ = DreamZeroSpec(frame_seqlen=8, chunk_frames=1, window_frames=4, sink_frames=0, action_tokens=3)
#: what compiled sites used to call on the runtime (and a RankRuntime forwarded): now the forward context's
CALLBACKS = ("record_layers", "check_regions", "check_layout", "check_dense_mask")


def bound_runtime() -> PagedKVRuntime:
    cfg = PagedKVConfig(num_layers=2, num_kv_heads=1, head_dim=4, block_size=B, blocks_per_layer=32, max_rows=2,
                        scratch_tokens_per_row=32, dtype=torch.float32)
    rt = PagedKVRuntime(cfg)
    rt.bind([torch.nn.Linear(4, 4) for _ in range(cfg.num_layers)])
    rt.admit("s", DZ, rows=1)
    return rt


def call_op(rt: PagedKVRuntime, active: ForwardContext, layer: int = 0) -> torch.Tensor:
    """One real call of the paged op on the forward's metadata (as a site without a compiled graph would)."""
    tokens = active.bucket.tokens
    q, k, v = (torch.randn(1, tokens, 1, 4) for _ in range(3))
    views = active.meta.layers[layer]
    return torch.ops.paged_kv.write_attend(q, k, v, rt.pool.tensor, views.slot_mapping, views.block_table,
                                          active.meta.seq_lens, active.meta.kv_visible_end, 0.5, "reference")


def test_the_paged_calls_of_a_forward_are_counted_on_that_forward_only():
    rt = bound_runtime()
    with rt.forward("s", "denoise") as active:
        assert isinstance(active, ForwardContext) and active.paged_calls == 0 and not active.attention_ran
        call_op(rt, active)
        call_op(rt, active, layer=1)
        assert active.paged_calls == 2 and active.attention_ran
    state = rt.state()
    call_op(rt, active)  # between forwards: no open forward counts it ...
    assert active.paged_calls == 2
    with pytest.raises(RequestError, match="no paged attention ran in this denoise forward of 's'"):
        with rt.forward("s", "denoise") as second:  # ... so the next forward, which runs none, is still refused
            pass
    assert second.paged_calls == 0 and rt.state() == state


def test_a_forward_whose_sites_recorded_layers_needs_no_op_call():
    """The captured path runs no Python op: the layers it records on the forward are what counts."""
    rt = bound_runtime()
    with rt.forward("s", "commit") as active:
        active.record_layers([0, 1])
    assert active.layers_seen == {0, 1} and active.paged_calls == 0
    assert rt.active is None


def test_a_site_outside_a_forward_is_refused_by_the_runtime_and_the_context_is_gone():
    rt = bound_runtime()
    with pytest.raises(RequestError, match="a paged attention site ran outside a forward"):
        rt.require_active()


def test_the_context_reads_the_live_owner_after_the_scheduler_state_is_replaced():
    """A multi-rank restore replaces the scheduler's owners (a saved copy): the context must not read the old
    dict. It finds owners through the runtime at every check."""
    import copy

    rt = bound_runtime()
    saved = copy.deepcopy(vars(rt.scheduler), memo={id(rt.scheduler.pool): rt.scheduler.pool})
    vars(rt.scheduler).clear()
    vars(rt.scheduler).update(saved)  # what RankRuntime._restore does
    with rt.forward("s", "denoise") as active:
        assert active.owner_of("s") is rt.scheduler.owners["s"]
        assert active.owner_of("s").family is rt.scheduler.owners["s"].family  # a family is never copied
        call_op(rt, active)


def test_compiled_code_no_longer_calls_back_into_the_runtime():
    """The callbacks live on the forward context; neither the runtime nor a RankRuntime offers them."""
    for name in CALLBACKS:
        assert not hasattr(PagedKVRuntime, name), name
        assert name not in rank_runtime._PASS_THROUGH, name
    assert "require_active" not in rank_runtime._PASS_THROUGH
    for name in ("record_layers", "check_regions", "check_expectation", "check_dense_mask"):
        assert callable(getattr(ForwardContext, name)), name


def test_a_family_accepts_an_idiom_by_identity_not_by_name():
    """An idiom another module declares under a taken name is not the family's: a site of it is refused."""
    from paged_kv_compile.families import DREAMZERO
    from paged_kv_compile.passes.idioms import WINDOW, Idiom

    lookalike = Idiom(WINDOW.name, WINDOW.match)
    assert DREAMZERO.accepts(WINDOW) and not DREAMZERO.accepts(lookalike) and not DREAMZERO.accepts(None)
    rt = bound_runtime()
    with rt.forward("s", "denoise") as active:
        call_op(rt, active)
        with pytest.raises(RequestError, match=r"a 'window' attention site ran inside a dreamzero forward \('s'\)"):
            active.check_expectation(WindowExpect(window_tokens=DZ.window_tokens, sink_tokens=DZ.sink_tokens,
                                                  chunk_tokens=DZ.chunk_tokens, action_tokens=DZ.action_tokens),
                                     lookalike)
        active.check_expectation(WindowExpect(window_tokens=DZ.window_tokens, sink_tokens=DZ.sink_tokens,
                                              chunk_tokens=DZ.chunk_tokens, action_tokens=DZ.action_tokens), WINDOW)
