"""Attention-level parity over whole loops, no compile: the runtime + op reproduce every dense attention.

The dense reference loop runs eagerly while every self-attention call is recorded (q, k, v, output).
The same sequence of forwards is then replayed on the runtime: for each layer, `write_attend` gets
the same query and only the *new* K/V, and must reproduce the dense output from the pool's history.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
from paged_kv_compile.families.hunyuan_image3 import hunyuan_runtime_config, hunyuan_spec
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.models.hooks import DenseHooks
from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config, HunyuanImage3Model, hunyuan_generate
from paged_kv_compile.runtime import PagedKVRuntime

ATOL = 1e-5


class RecordingHooks(DenseHooks):
    """Dense hooks that record each forward's kind and its self-attention calls, per layer."""

    def __init__(self, attention_modules):
        self.events: list[tuple] = []
        self._layer: int | None = None
        self._calls: list | None = None
        for index, module in enumerate(attention_modules):
            module.register_forward_pre_hook(lambda _m, _a, i=index: self._enter(i))

    def _enter(self, index: int) -> None:
        self._layer = index

    @contextlib.contextmanager
    def forward(self, kind, **info):
        self._calls = []
        original = F.scaled_dot_product_attention

        def recording(q, k, v, *args, **kwargs):
            out = original(q, k, v, *args, **kwargs)
            if self._layer is not None:  # the first SDPA inside a self-attention module
                self._calls.append((self._layer, q.clone(), k.clone(), v.clone(), out.clone()))
                self._layer = None
            return out

        F.scaled_dot_product_attention = recording
        try:
            yield
        finally:
            F.scaled_dot_product_attention = original
        self.events.append(("forward", kind, info, self._calls))

    def reset_history(self):
        self.events.append(("reset",))


def replay(runtime: PagedKVRuntime, calls, plan, num_kv_heads: int) -> float:
    """Run write_attend for every recorded layer call of one forward; max abs error vs dense."""
    worst = 0.0
    with runtime.forward_plan(plan) as active:
        assert len(calls) == runtime.config.num_layers
        for layer, q, k, v, out in calls:
            T = q.shape[2]
            rep = k.shape[1] // num_kv_heads
            k_new = k[:, ::rep, -T:].transpose(1, 2)
            v_new = v[:, ::rep, -T:].transpose(1, 2)
            views = active.meta.layers[layer]
            got = torch.ops.paged_kv.write_attend(
                q.transpose(1, 2), k_new, v_new, runtime.pool.tensor, views.slot_mapping, views.block_table,
                active.meta.seq_lens, active.meta.kv_visible_end, q.shape[-1] ** -0.5, "reference",
            )
            valid = torch.stack([torch.nn.functional.pad(r.positions, (0, T - r.num_tokens), value=-1)
                                 for r in plan.rows]) >= 0
            diff = (got - out.transpose(1, 2)).abs()[valid]
            worst = max(worst, diff.max().item())
    return worst


@pytest.mark.parametrize("sink", [0, 2])
def test_dreamzero_rollout_attention_parity(sink):
    cfg = DreamZeroConfig(sink_size=sink)
    model = DreamZeroModel(cfg, seed=0)
    hooks = RecordingHooks([b.self_attn for b in model.blocks])
    dreamzero_rollout(model, num_chunks=10, num_inference_steps=3, seed=1, hooks=hooks)
    kinds = [e[1] for e in hooks.events if e[0] == "forward"]
    assert kinds.count("commit") >= 8 and ("reset",) in hooks.events

    runtime = PagedKVRuntime(dreamzero_runtime_config(cfg, block_size=8))
    runtime.admit("s", DreamZeroSpec.from_model_config(cfg), rows=2)
    forwards = 0
    for event in hooks.events:
        if event[0] == "reset":
            runtime.reset("s")
            continue
        _, kind, _, calls = event
        plan = runtime.scheduler.plan("s", "commit" if kind == "commit" else "denoise")
        assert replay(runtime, calls, plan, cfg.num_heads) <= ATOL
        forwards += 1
    assert forwards == len(kinds)
    runtime.release("s")
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


def test_hunyuan_requests_attention_parity():
    cfg = HunyuanImage3Config()
    model = HunyuanImage3Model(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    requests = [[torch.randint(0, 64, (7,), generator=g)],
                [torch.randint(0, 64, (10,), generator=g), torch.randint(0, 64, (3,), generator=g)]]
    runtime = PagedKVRuntime(hunyuan_runtime_config(cfg, max_prefix=12, block_size=4))
    for i, prompts in enumerate(requests):
        hooks = RecordingHooks([layer.self_attn for layer in model.layers])
        hunyuan_generate(model, prompts, prefix_capacity=12, num_steps=5, seed=2, hooks=hooks)
        rid = f"r{i}"
        runtime.admit(rid, hunyuan_spec(cfg, prompts))
        phases = []
        for _, kind, info, calls in hooks.events:
            plan = runtime.scheduler.plan(rid, kind, prefix_capacity=12,
                                          attention_mask=info["attention_mask"])
            assert replay(runtime, calls, plan, cfg.num_kv_heads) <= ATOL
            phases.append(kind)
        assert phases == ["prefill"] + ["step"] * 4
        runtime.release(rid)
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer
