"""HunyuanImage-3 rows padded where the tokenizer puts them: paged exactly, or refused; never wrong.

vllm-omni's pipeline right-pads its CFG rows (``[prompt | target | <eoi> | pad]``, causal pads) while our
reference model pads in the middle (``[prompt | pad | target]``). The runtime reads each row's layout from
the model's own prefill mask once per request (`paged_kv_compile.layout.layout_from_prefill_mask`), so
both, and left padding, page exactly; a mask it cannot express is refused at the prefill, before any op.
The dense side here is the unmodified reference model (`paged_kv_compile.models.hunyuan_image3`) driven
with the padded inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers import CountingBackend, compile_blocks, left_padded_mask

from paged_kv_compile import RequestError
from paged_kv_compile.families.hunyuan_image3 import HunyuanSpec, hunyuan_runtime_config
from paged_kv_compile.models.hunyuan_image3 import (
    HunyuanImage3Config,
    HunyuanImage3Model,
    HunyuanKVCache,
    hunyuan_rope_tables,
)
from paged_kv_compile.runtime import PagedKVRuntime

ATOL = 1e-5
CFG = HunyuanImage3Config()


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@dataclass
class Padded:
    """One request's dense inputs for a given padding style (built eagerly, like a pipeline does)."""

    lens: list[int]
    capacity: int  # the cache's prefix capacity (longest prompt)
    starts: list[int]  # dense index of each row's target span in the prefill
    embeds: torch.Tensor  # (b, S, hidden)
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor  # (b, 1, S, S) bool
    prefix_valid: torch.Tensor  # (b, capacity): which cached columns hold the row's prompt
    step_cos: torch.Tensor
    step_sin: torch.Tensor
    step_mask: torch.Tensor  # (b, 1, T, capacity + T)


def padded_request(model: HunyuanImage3Model, prompts, target: torch.Tensor, style: str, eoi: bool = False) -> Padded:
    """style: "right" ([prompt | target | eoi? | pad], causal pads, as vllm-omni's tokenizer pads),
    "left" ([pad | prompt | target | eoi?], pads hidden from everyone, HF style)."""
    cfg, T, hw = model.cfg, model.cfg.target_len, model.cfg.image_tokens
    lens = [len(p) for p in prompts]
    b, P, E = len(prompts), max(lens), int(eoi)
    S = P + T + E
    hidden = cfg.hidden
    embeds = torch.zeros(b, S, hidden)
    pos = torch.zeros(b, S, 2, dtype=torch.int64)
    mask = torch.zeros(b, S, S, dtype=torch.bool)
    starts = []
    eoi_embed = model.embed_tokens(torch.tensor([cfg.vocab - 1]))[0]
    for r, (p, n) in enumerate(zip(prompts, lens)):
        pad = P - n
        first = pad if style == "left" else 0  # dense index of the row's first prompt token
        start = first + n
        starts.append(start)
        embeds[r, first:start] = model.embed_tokens(p)
        embeds[r, start:start + T] = target[r]
        if eoi:
            embeds[r, start + T] = eoi_embed
        logical = torch.arange(S) - first  # positions follow the row's own tokens, not the padding
        pos[r] = logical.clamp(min=0)[:, None]
        ys, xs = torch.meshgrid(torch.arange(cfg.image_h), torch.arange(cfg.image_w), indexing="ij")
        pos[r, start + 1:start + 1 + hw, 0] = n + 1 + ys.flatten()
        pos[r, start + 1:start + 1 + hw, 1] = n + 1 + xs.flatten()
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        causal[start + 1:start + 1 + hw, start + 1:start + 1 + hw] = True
        if style == "left":
            causal[:, :first] = False
            causal[torch.arange(first), torch.arange(first)] = True  # a pad sees itself only: no NaN row
        mask[r] = causal
    cos, sin = hunyuan_rope_tables(pos, cfg.head_dim, cfg.rope_theta)
    # The cache holds key[:, :P]; a row's prompt is cached where its dense index is a prompt token.
    dense_idx = torch.arange(P)
    prefix_valid = torch.stack([
        (dense_idx >= (P - n if style == "left" else 0)) & (dense_idx < s) for n, s in zip(lens, starts)])
    step_rows = [torch.arange(s, s + T) for s in starts]
    step_cos = torch.stack([cos[r, idx] for r, idx in enumerate(step_rows)])
    step_sin = torch.stack([sin[r, idx] for r, idx in enumerate(step_rows)])
    step_mask = torch.stack([
        torch.cat([mask[r][idx][:, :P] & prefix_valid[r], mask[r][idx][:, idx]], dim=1)
        for r, idx in enumerate(step_rows)])
    return Padded(lens, P, starts, embeds, cos, sin, mask[:, None], prefix_valid, step_cos, step_sin,
                  step_mask[:, None])


def _target(seed: int, b: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, CFG.target_len, CFG.hidden, generator=g)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab - 1, (n,), generator=g) for n in lengths]


def run(model, req: Padded, caches, targets, forward=None):
    """Prefill then one step per extra target; returns the target rows' outputs of every forward."""
    forward = forward or (lambda phase, mask: torch.no_grad())
    outs = []
    with forward("prefill", req.mask):
        h = model(req.embeds, req.cos, req.sin, req.mask, caches, req.prefix_valid, "prefill")
    outs.append(torch.stack([h[r, s:s + CFG.target_len] for r, s in enumerate(req.starts)]))
    for t in targets:
        with forward("step", req.step_mask):
            outs.append(model(t, req.step_cos, req.step_sin, req.step_mask, caches, req.prefix_valid, "step"))
    return outs


class ContiguousMask(torch.nn.Module):
    """A layer whose mask passes through `.contiguous()` inside the compiled region, as vllm-omni's does."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, h, cos, sin, mask, *rest):
        return self.layer(h, cos, sin, mask.transpose(-1, -2).transpose(-1, -2).contiguous(), *rest)


def dense_and_paged(style: str, eoi: bool, lengths=(7, 4), spec: HunyuanSpec | None = None, wrap=False,
                    runtime_step_mask=True, model_step_mask=None):
    torch.manual_seed(0)
    model = HunyuanImage3Model(CFG, seed=2)
    prompts = _prompts(lengths)
    b = len(prompts)
    targets = [_target(10 + i, b) for i in range(3)]
    with torch.no_grad():
        req = padded_request(model, prompts, targets[0], style, eoi)
        shape = (b, req.capacity, CFG.num_kv_heads, CFG.head_dim)
        dense_caches = [HunyuanKVCache(torch.zeros(shape), torch.zeros(shape)) for _ in range(CFG.num_layers)]
        dense = run(model, req, dense_caches, targets[1:])

    runtime = PagedKVRuntime(hunyuan_runtime_config(CFG, max_prefix=req.capacity, block_size=4, kernel="reference",
                                                    scratch_tokens_per_row=CFG.target_len + req.capacity + 4))
    runtime.bind(model.layers)
    if wrap:
        model.layers = torch.nn.ModuleList(ContiguousMask(layer) for layer in model.layers)
    compile_blocks(model.layers, CountingBackend({"inner_compiler": "aot_eager", "check_mask": True}))
    spec = spec or HunyuanSpec(tuple(req.lens), CFG.target_len, ((1, 1 + CFG.image_tokens),))
    runtime.admit("r", spec)
    standin = runtime.standin(*shape, writable=True)
    caches = [HunyuanKVCache(standin, standin) for _ in range(CFG.num_layers)]

    import contextlib

    @contextlib.contextmanager
    def forward(phase, mask):
        given = mask if phase == "prefill" or runtime_step_mask else None
        with torch.no_grad(), runtime.forward("r", phase, prefix_capacity=req.capacity,
                                              attention_mask=given):
            yield

    if model_step_mask is not None:
        req.step_mask = model_step_mask(req.step_mask)

    try:
        paged = run(model, req, caches, targets[1:], forward)
    finally:
        if "r" in runtime.scheduler.owners:
            runtime.abort("r")
    return dense, paged, runtime


@pytest.mark.parametrize("eoi", [False, True], ids=["no-eoi", "eoi"])
@pytest.mark.parametrize("style", ["right", "left"])
def test_padded_cfg_rows_page_exactly(style, eoi):
    """Right padding with the prefill's <eoi> left out has the token counts of the middle-padded layout the
    runtime used to assume: before this test's fix it paged the shorter row's prefill silently wrong."""
    dense, paged, runtime = dense_and_paged(style, eoi)
    for d, p in zip(dense, paged):
        assert (d - p).abs().max().item() <= ATOL
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


def test_a_spec_that_does_not_describe_the_mask_is_refused_at_the_prefill():
    wrong = HunyuanSpec((6, 4), CFG.target_len, ((1, 1 + CFG.image_tokens),))  # row 0's prompt has 7 tokens
    with pytest.raises(RequestError, match="row 0.*request spec"):
        dense_and_paged("right", True, spec=wrong)


def test_a_prefill_without_the_mask_is_refused():
    runtime = PagedKVRuntime(hunyuan_runtime_config(CFG, max_prefix=8, block_size=4, kernel="reference"))
    runtime.admit("r", HunyuanSpec((5,), CFG.target_len))
    before = runtime.state()
    with pytest.raises(RequestError, match="attention_mask"):
        runtime.forward("r", "prefill", prefix_capacity=8)
    assert runtime.state() == before


def test_check_mask_reads_the_mask_through_contiguous():
    """vllm-omni calls `attention_mask.contiguous()` inside the layer: check_mask follows data movement."""
    dense, paged, _ = dense_and_paged("right", True, wrap=True)
    for d, p in zip(dense, paged):
        assert (d - p).abs().max().item() <= ATOL


def _hide_first_prompt_token(step_mask):
    out = step_mask.clone()
    out[1, :, :, 0] = False
    return out


def test_a_step_mask_that_disagrees_with_the_prefill_is_refused_once_per_request():
    with pytest.raises(RequestError, match="row 1: the step's mask disagrees with the layout read at the prefill"):
        dense_and_paged("right", True, model_step_mask=_hide_first_prompt_token)


def test_check_mask_catches_a_step_mask_the_runtime_was_not_given():
    with pytest.raises(RequestError, match="check_mask: row 1's dense mask disagrees"):
        dense_and_paged("right", True, runtime_step_mask=False, model_step_mask=_hide_first_prompt_token)


def test_a_step_mask_is_checked_again_after_a_re_prefill():
    """Issue 23, suspected (b), confirmed: the step mask is checked once per request (`step_mask_checked`), and
    the flag survived a re-prefill with another mask. A step mask written for the first prefill's layout (padding
    in the middle) then passed unchecked after a re-prefill that moved the padding to the left, and the steps
    attended with a layout the model's mask disagrees with. A prefill now clears the flag."""
    spec = HunyuanSpec((3, 5), 4, ((1, 3),))
    capacity = 6
    middle = spec.padded_mask(capacity)  # [prompt | pad | target]
    left = left_padded_mask(spec, capacity)  # [pad | prompt | target]
    rt = PagedKVRuntime(hunyuan_runtime_config(CFG, max_prefix=capacity, block_size=4))
    sched = rt.scheduler
    rt.admit("r", spec)

    def run(phase, mask):
        sched.finish_forward(sched.plan("r", phase, prefix_capacity=capacity, attention_mask=mask))

    run("prefill", middle)
    run("step", middle[:, :, capacity:])  # checked against the middle layout: agrees
    run("prefill", left)
    before = rt.state()
    with pytest.raises(RequestError, match="row 0: the step's mask disagrees with the layout read at the prefill"):
        run("step", middle[:, :, capacity:])
    assert rt.state() == before
    run("step", left[:, :, capacity:])


def test_a_target_token_that_reads_as_padding_is_refused():
    """Issue 23, suspected (c), confirmed: a token that sees only itself and that no other token sees reads as
    padding (`layout_from_prefill_mask`), and padding gets no output. Inside the target span such a token was
    accepted: with a causal tail token after the target, the kept count and every visible end still matched
    the spec, the prefill gave the token zeros where dense attention gives its value (2.24 off), and the steps
    would have fed it at another token's position. The mask alone cannot tell padding from such a token; the
    spec says the target is T consecutive tokens, so a padding-looking token inside it is refused."""
    from paged_kv_compile.layout import layout_from_prefill_mask

    p, T = 3, 4
    S = p + T + 1  # [prompt | t0 x t2 t3 | tail]
    x = p + 1
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    mask[x, :] = mask[:, x] = False
    mask[x, x] = True
    assert layout_from_prefill_mask(mask).positions[x] == -1  # read as padding: the reader's rule stands
    rt = PagedKVRuntime(hunyuan_runtime_config(CFG, max_prefix=8, block_size=4))
    rt.admit("r", HunyuanSpec((p,), T))
    before = rt.state()
    with pytest.raises(RequestError, match=r"row 0: dense token 4 lies inside the target span \(dense tokens 3..7\) "
                                           r"but reads as padding"):
        rt.scheduler.plan("r", "prefill", prefix_capacity=p, attention_mask=mask[None, None])
    assert rt.state() == before
    # the same token as padding between the prompt and the target (the reference model's layout) pages as before
    middle = torch.ones(S, S, dtype=torch.bool).tril()
    middle[p, :] = middle[:, p] = False
    middle[p, p] = True
    rt.scheduler.finish_forward(rt.scheduler.plan("r", "prefill", prefix_capacity=p + 1,
                                                          attention_mask=middle[None, None]))
