"""HunyuanImage-3 dense reference: layout, mask, prefix-cache idiom, generation loop, compile."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

from paged_kv_compile.models import (
    HUNYUAN_IMAGE3,
    DenseHooks,
    HunyuanImage3Config,
    HunyuanImage3Model,
    hunyuan_attention_mask,
    hunyuan_generate,
    hunyuan_positions,
)

PROMPTS = [torch.tensor([5, 9, 13, 2, 7, 11]), torch.tensor([3, 1, 4])]  # cond, uncond: lengths differ
P = 8  # padded prefix capacity > longest prompt: both rows carry pads


@pytest.fixture(scope="module")
def model() -> HunyuanImage3Model:
    return HunyuanImage3Model(HunyuanImage3Config(), seed=0).eval()


def target_embeds(model: HunyuanImage3Model, b: int, seed: int, t: float) -> torch.Tensor:
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(b, cfg.image_tokens, cfg.latent_channels, generator=g)
    with torch.no_grad():
        return model.embed_target(lat, torch.full((b,), t))


class RecordingHooks(DenseHooks):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def caches(self, model, batch, *, prefix_capacity):
        self.events.append(("caches", batch, prefix_capacity))
        return super().caches(model, batch, prefix_capacity=prefix_capacity)

    @contextlib.contextmanager
    def forward(self, kind, **info):
        self.events.append((kind, info))
        yield


# ---- config and layout -------------------------------------------------------------------------


def test_config_derived_sizes():
    cfg = HunyuanImage3Config()
    assert cfg.image_tokens == 16 and cfg.target_len == 18 and cfg.n_rep == 2 and cfg.seq_len(P) == 26
    assert HUNYUAN_IMAGE3.image_tokens == 4096 and HUNYUAN_IMAGE3.target_len == 4098  # 4097 + tail
    assert (HUNYUAN_IMAGE3.num_heads, HUNYUAN_IMAGE3.num_kv_heads, HUNYUAN_IMAGE3.head_dim) == (32, 8, 128)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        HunyuanImage3Config(num_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim"):
        HunyuanImage3Config(head_dim=14, hidden=56)


def test_mask_matches_published_example():
    """One row, no pads, a 1x5 image at [5, 10): tril(11x11) with [5:10, 5:10] set, spans [(5, 10)]."""
    mask, spans = hunyuan_attention_mask([4], 4, 1, 5)
    want = torch.ones(11, 11, dtype=torch.bool).tril()
    want[5:10, 5:10] = True
    assert torch.equal(mask[0, 0], want) and spans == [[(5, 10)]]


def test_mask_pads_and_spans():
    cfg = HunyuanImage3Config()
    mask, spans = hunyuan_attention_mask([6, 3], P, cfg.image_h, cfg.image_w)
    S, img = P + cfg.target_len, slice(P + 1, P + 1 + cfg.image_tokens)
    assert mask.shape == (2, 1, S, S) and mask.dtype == torch.bool
    assert spans == [[(P + 1, P + 17)], [(P + 1, P + 17)]]
    m = mask[1, 0]
    real = torch.ones(S, dtype=torch.bool)
    real[3:P] = False
    assert not m[real][:, 3:P].any()  # no real query sees a pad
    for r in range(3, P):  # a pad query sees only itself
        assert m[r].nonzero().flatten().tolist() == [r]
    assert m[img, img].all() and m.any(dim=1).all()
    assert not m[P, img].any()  # the timestep token is causal
    assert torch.equal(mask[0, 0, :6, :6], torch.ones(6, 6, dtype=torch.bool).tril())


def test_positions_depend_on_prompt_length_only():
    pos8 = hunyuan_positions([6, 3], 8, 4, 4)
    pos12 = hunyuan_positions([6, 3], 12, 4, 4)
    assert torch.equal(pos8[:, 8:], pos12[:, 12:])
    row = pos8[1]
    assert row[:3, 0].tolist() == [0, 1, 2] and (row[3:8] == 0).all()
    assert row[8].tolist() == [3, 3]  # timestep token at prefix_len
    assert row[9].tolist() == [4, 4] and row[9 + 4 * 1 + 2].tolist() == [4 + 1, 4 + 2]  # (base+y, base+x)
    assert row[-1].tolist() == [4 + 4, 4 + 4]  # tail: base + max(h, w)


# ---- the prefix-cache idiom ----------------------------------------------------------------------


def test_layer_step_equals_prefill_restricted_to_target(model):
    req = model.build_request(PROMPTS, P)
    layer = model.layers[0]
    g = torch.Generator().manual_seed(1)
    prefix_hidden = torch.randn(2, P, model.cfg.hidden, generator=g)
    tgt_a, tgt_b = target_embeds(model, 2, 1, 900.0), target_embeds(model, 2, 2, 400.0)
    with torch.no_grad():
        cache = DenseHooks().caches(model, 2, prefix_capacity=P)[0]
        layer(torch.cat([prefix_hidden, tgt_a], 1), req.rope_cos, req.rope_sin, req.attention_mask, cache,
              req.prefix_valid, "prefill")  # fmt: skip
        step = layer(tgt_b, req.step_rope_cos, req.step_rope_sin, req.step_attention_mask, cache,
                     req.prefix_valid, "step")  # fmt: skip
        fresh = DenseHooks().caches(model, 2, prefix_capacity=P)[0]
        full = layer(torch.cat([prefix_hidden, tgt_b], 1), req.rope_cos, req.rope_sin, req.attention_mask,
                     fresh, req.prefix_valid, "prefill")  # fmt: skip
    torch.testing.assert_close(step, full[:, P:], rtol=1e-5, atol=1e-5)
    assert (cache.cached_key[1, 3:] == 0).all() and (cache.cached_value[1, 3:] == 0).all()  # pads zeroed
    assert (cache.cached_key[0, :6] != 0).any(dim=-1).all()


def test_model_step_equals_prefill_restricted_to_target(model):
    req = model.build_request(PROMPTS, P)
    tgt_a, tgt_b = target_embeds(model, 2, 3, 1000.0), target_embeds(model, 2, 4, 250.0)
    with torch.no_grad():
        caches = DenseHooks().caches(model, 2, prefix_capacity=P)
        model(torch.cat([req.prefix_embeds, tgt_a], 1), req.rope_cos, req.rope_sin, req.attention_mask,
              caches, req.prefix_valid, "prefill")  # fmt: skip
        step = model(tgt_b, req.step_rope_cos, req.step_rope_sin, req.step_attention_mask, caches,
                     req.prefix_valid, "step")  # fmt: skip
        full = model(torch.cat([req.prefix_embeds, tgt_b], 1), req.rope_cos, req.rope_sin, req.attention_mask,
                     DenseHooks().caches(model, 2, prefix_capacity=P), req.prefix_valid, "prefill")  # fmt: skip
    torch.testing.assert_close(step, full[:, P:], rtol=1e-5, atol=1e-5)


def test_cfg_rows_are_independent_of_each_other_and_of_padding(model):
    """Row 1 of a 2-row request (padded to P) equals the same prompt alone without pads."""
    two = model.build_request(PROMPTS, P)
    one = model.build_request(PROMPTS[1:], None)
    tgt = target_embeds(model, 2, 5, 700.0)
    with torch.no_grad():
        h2 = model(torch.cat([two.prefix_embeds, tgt], 1), two.rope_cos, two.rope_sin, two.attention_mask,
                   DenseHooks().caches(model, 2, prefix_capacity=P), two.prefix_valid, "prefill")  # fmt: skip
        h1 = model(torch.cat([one.prefix_embeds, tgt[1:]], 1), one.rope_cos, one.rope_sin, one.attention_mask,
                   DenseHooks().caches(model, 1, prefix_capacity=3), one.prefix_valid, "prefill")  # fmt: skip
    torch.testing.assert_close(h2[1:, P:], h1[:, 3:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h2[1:, :3], h1[:, :3], rtol=1e-5, atol=1e-5)


# ---- the generation loop ------------------------------------------------------------------------


def test_generate_end_to_end_deterministic(model):
    hooks = RecordingHooks()
    velocities = []
    handle = model.head.register_forward_hook(lambda mod, args, out: velocities.append(out.clone()))
    try:
        a = hunyuan_generate(model, PROMPTS, prefix_capacity=P, num_steps=4, seed=0, hooks=hooks)
    finally:
        handle.remove()
    b = hunyuan_generate(model, PROMPTS, prefix_capacity=P, num_steps=4, seed=0)
    c = hunyuan_generate(model, PROMPTS, prefix_capacity=P, num_steps=4, seed=1)
    cfg = model.cfg
    assert a.shape == (cfg.image_tokens, cfg.latent_channels) and torch.isfinite(a).all()
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert hooks.events[0] == ("caches", 2, P)
    assert [ev[0] for ev in hooks.events[1:]] == ["prefill", "step", "step", "step"]
    assert [ev[1].get("step") for ev in hooks.events[2:]] == [1, 2, 3]
    info = dict(hooks.events[1][1])
    mask = info.pop("attention_mask")  # the prefill hands its mask over: the paged runtime reads the layout from it
    assert info == dict(prefix_lens=[6, 3], prefix_capacity=P, target_len=cfg.target_len)
    assert mask.shape == (2, 1, P + cfg.target_len, P + cfg.target_len)
    # the velocity is read every step and changes every step (the latents move)
    assert len(velocities) == 4 and all(v.abs().max() > 0 for v in velocities)
    assert all(not torch.equal(u, v) for u, v in zip(velocities, velocities[1:]))


def test_generate_single_row_and_padding_invariance(model):
    one = hunyuan_generate(model, PROMPTS[:1], num_steps=3, seed=2)
    padded = hunyuan_generate(model, PROMPTS[:1], prefix_capacity=11, num_steps=3, seed=2)
    assert torch.isfinite(one).all()
    torch.testing.assert_close(one, padded, rtol=1e-5, atol=1e-5)
    cfg_default = hunyuan_generate(model, PROMPTS, num_steps=3, seed=2)  # P = longest prompt
    cfg_padded = hunyuan_generate(model, PROMPTS, prefix_capacity=10, num_steps=3, seed=2)
    torch.testing.assert_close(cfg_default, cfg_padded, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="prefix_capacity"):
        hunyuan_generate(model, PROMPTS, prefix_capacity=5)
    with pytest.raises(ValueError, match="1 or 2 rows"):
        hunyuan_generate(model, PROMPTS * 2)


# ---- compile ------------------------------------------------------------------------------------


def _layer_both_modes(model, layer):
    """Run `layer` prefill then step; return outputs and the cache contents after prefill."""
    req = model.build_request(PROMPTS, P)
    g = torch.Generator().manual_seed(7)
    full = torch.randn(2, P + model.cfg.target_len, model.cfg.hidden, generator=g)
    tgt = torch.randn(2, model.cfg.target_len, model.cfg.hidden, generator=g)
    cache = DenseHooks().caches(model, 2, prefix_capacity=P)[0]
    with torch.no_grad():
        out_prefill = layer(full, req.rope_cos, req.rope_sin, req.attention_mask, cache, req.prefix_valid, "prefill")
        stored = (cache.cached_key.clone(), cache.cached_value.clone())
        out_step = layer(tgt, req.step_rope_cos, req.step_rope_sin, req.step_attention_mask, cache,
                         req.prefix_valid, "step")  # fmt: skip
    return out_prefill, out_step, stored


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_layer_compiles_fullgraph_both_modes(model, backend):
    torch._dynamo.reset()
    layer = model.layers[0]
    want = _layer_both_modes(model, layer)
    got = _layer_both_modes(model, torch.compile(layer, backend=backend, fullgraph=True))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_all_layers_share_one_graph_per_mode():
    torch._dynamo.reset()
    m = HunyuanImage3Model(HunyuanImage3Config(), seed=1).eval()
    counter = torch._dynamo.testing.CompileCounter()
    for i, layer in enumerate(m.layers):
        m.layers[i] = torch.compile(layer, backend=counter, fullgraph=True)
    hunyuan_generate(m, PROMPTS, prefix_capacity=P, num_steps=3)
    assert counter.frame_count == 2  # one "prefill" graph, one "step" graph, for all 4 layers
