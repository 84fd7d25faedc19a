"""vllm-omni 0.30.0's BAGEL generation attention (`PackedAttentionMoT._forward_gen`, the real class at tiny size):
a `NaiveCache` context prefix per CFG branch (the branches' caches packed by `NaiveCache.merge`, split back by
`key_values_lens`), ``cat([cache, text, vae])`` per branch, then `left_pad_stack` with its padding mask.

Refused, with the reason pinned here (docs/models.md): the keys the attention reads are not a concatenation the
passes can follow. With branches of different context lengths (the pipeline's cond / text-CFG / image-CFG
contexts), `left_pad_stack` writes each branch into a fresh zero buffer in place (``stacked[i, pad:] = ts``) and
builds the mask in the graph, so the site reads no stand-in the passes can trace and the stand-in reads left in the
graph are refused; with equal lengths each row of the stacked query is a different tensor (the packed tokens
gathered by `text_indices` / `vae_indices`, split per branch), which `provenance` does not read. Either way the
graph is rejected at compile time, never computed on a stand-in's zeros.

One branch alone (a CFG-parallel rank's branch, or a step outside the CFG interval, where the model runs the
conditional branch only) pages as written: ``cat([cache, text, vae])`` stacked into one row is the
conditioning-prefix idiom over a packed (P, H, D) prefix, the context stored once by `store_prefix`; the layer is
named by the MoT projection weight whose output `qkv_proj` writes by index into a fresh buffer
(`passes/graph.py: find_parameter`). Bit-exact against the dense layer in the dtype it runs in (bfloat16, as
written). The layer also casts to bfloat16 as
written, so an fp32 parity run would need the model edited.

The packed cache is handed as ONE stand-in of the merged shape: `NaiveCache.merge` concatenates the branch caches
eagerly, which would materialize per-branch stand-ins into real zeros before any compiled code sees them.
"""

from __future__ import annotations

import types

import pytest
import torch
from helpers import CountingBackend, raises_paged

from paged_kv_compile import PagedKVConfig, PagedKVRuntime, PassError

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

HEADS, HEAD_DIM, BRANCHES, TEXT, VAE = 2, 8, 3, 2, 4


def _gen_inputs(branches: int = BRANCHES):
    """A packed generation forward as `_forward_gen` receives it: each branch's text markers then its VAE tokens."""
    g = torch.Generator().manual_seed(0)
    per = TEXT + VAE
    text = torch.cat([torch.arange(b * per, b * per + TEXT) for b in range(branches)])
    vae = torch.cat([torch.arange(b * per + TEXT, (b + 1) * per) for b in range(branches)])
    x = torch.randn(branches * per, HEADS * HEAD_DIM, generator=g).bfloat16()
    angles = torch.randn(branches * per, HEAD_DIM, generator=g)
    return x, torch.tensor([per] * branches), (angles.cos(), angles.sin()), text, vae


def _attention():
    from vllm_omni.diffusion.models.bagel.bagel_transformer import PackedAttentionMoT

    torch.manual_seed(0)
    config = types.SimpleNamespace(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                                   num_key_value_heads=HEADS, rms_norm_eps=1e-6)
    attention = PackedAttentionMoT(config, layer_idx=0)
    for p in attention.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return attention.to(torch.bfloat16)  # the layer casts its inputs to bfloat16 as written


def _runtime() -> PagedKVRuntime:
    return PagedKVRuntime(PagedKVConfig(num_layers=1, num_kv_heads=HEADS, head_dim=HEAD_DIM, block_size=4,
                                        blocks_per_layer=16, max_rows=BRANCHES, scratch_tokens_per_row=16,
                                        kernel="reference", dtype=torch.bfloat16))


def _branch_caches(lengths: list[int]):
    """One `NaiveCache` per CFG branch holding its context K/V, merged as the model merges them for the packed
    forward (`NaiveCache.merge`: packed tokens, `key_values_lens`)."""
    from vllm_omni.diffusion.models.bagel.bagel_transformer import NaiveCache

    g = torch.Generator().manual_seed(1)
    caches = []
    for n in lengths:
        cache = NaiveCache(1)
        cache.key_cache[0] = torch.randn(n, HEADS, HEAD_DIM, generator=g).bfloat16()
        cache.value_cache[0] = torch.randn(n, HEADS, HEAD_DIM, generator=g).bfloat16()
        caches.append(cache)
    return NaiveCache.merge(caches)


@pytest.mark.parametrize("lengths, reason", [
    ([7, 5, 6], "the graph still reads a KV-cache stand-in after rewriting"),  # left_pad_stack + its mask
    ([6, 6, 6], "query: a key/value column mixes several tensors"),  # torch.stack of per-branch rows
])
def test_bagel_cfg_context_prefix_is_refused_with_the_reason(omni, omni_ctx, lengths, reason):
    from vllm_omni.diffusion.models.bagel.bagel_transformer import NaiveCache

    attention = _attention()
    x, query_lens, pos, text, vae = _gen_inputs(len(lengths))
    gen = dict(update_past_key_values=False, is_causal=False, mode="gen", packed_vae_token_indexes=vae,
               packed_text_indexes=text)
    with torch.no_grad():
        dense, _ = attention(x, query_lens, pos, _branch_caches(lengths), **gen)
    assert dense.shape == x.shape and torch.isfinite(dense).all()  # the dense code path runs here as written

    runtime = _runtime()
    runtime.bind([attention])
    paged = NaiveCache(1)
    paged.key_cache[0] = runtime.standin(sum(lengths), HEADS, HEAD_DIM)
    paged.value_cache[0] = runtime.standin(sum(lengths), HEADS, HEAD_DIM)
    paged.key_values_lens = list(lengths)
    backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
    compiled = torch.compile(attention.forward, backend=backend, fullgraph=True, dynamic=False)
    before = runtime.state()
    with raises_paged(PassError, reason), torch.no_grad():
        compiled(x, query_lens, pos, paged, **gen)
    assert backend.results == [] and runtime.state() == before  # no graph came out; the runtime untouched


def test_bagel_one_branch_context_prefix_pages_as_written(omni, omni_ctx):
    """One CFG branch's generation steps over its `NaiveCache` context: the context stored once, every step's
    attention rewritten (one frame for the steps), bit-exact vs the dense layer (bfloat16, as written)."""
    from vllm_omni.diffusion.models.bagel.bagel_transformer import NaiveCache

    from paged_kv_compile.families.conditioning_prefix import ConditioningPrefixSpec, store_prefix

    attention, context = _attention(), 7
    dense_cache = _branch_caches([context])
    runtime = _runtime()
    runtime.bind([attention])
    runtime.admit("branch", ConditioningPrefixSpec((context,), TEXT + VAE))
    k, v = store_prefix(runtime, "branch", [(dense_cache.key_cache[0][None], dense_cache.value_cache[0][None])])
    paged_cache = NaiveCache(1)  # what the model keeps instead: the packed (P, H, D) stand-ins
    paged_cache.key_cache[0], paged_cache.value_cache[0] = k[0], v[0]
    paged_cache.key_values_lens = [context]
    backend = CountingBackend({"inner_compiler": "aot_eager", "strict": True})
    compiled = torch.compile(attention.forward, backend=backend, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(2)
    _, query_lens, _, text, vae = _gen_inputs(1)
    gen = dict(update_past_key_values=False, is_causal=False, mode="gen", packed_vae_token_indexes=vae,
               packed_text_indexes=text)
    with torch.no_grad():
        for _ in range(3):  # the denoising steps: new VAE tokens, the same context
            x = torch.randn(TEXT + VAE, HEADS * HEAD_DIM, generator=g).bfloat16()
            angles = torch.randn(TEXT + VAE, HEAD_DIM, generator=g)
            pos = (angles.cos(), angles.sin())
            dense, _ = attention(x, query_lens, pos, dense_cache, **gen)
            with runtime.forward("branch", "step", new_tokens=TEXT + VAE):
                paged, _ = compiled(x, query_lens, pos, paged_cache, **gen)
            assert torch.equal(dense, paged)
    assert backend.frames == 1
    assert [(r.pattern, r.status) for res in backend.results for r in res.reports] == [
        ("conditioning-prefix", "rewritten")]
    runtime.release("branch")
    assert runtime.state()["num_free"] == 16
