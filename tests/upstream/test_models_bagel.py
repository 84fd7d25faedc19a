"""vllm-omni 0.30.0's BAGEL generation attention (`PackedAttentionMoT._forward_gen`, the real class at tiny size):
a `NaiveCache` context prefix per CFG branch (the branches' caches packed by `NaiveCache.merge`, split back by
`key_values_lens`), ``cat([cache, text, vae])`` per branch, then `left_pad_stack` with its padding mask.

Refused, with the reason pinned here (docs/models.md): the keys the attention reads are not a concatenation the
passes can follow. With branches of different context lengths (the pipeline's cond / text-CFG / image-CFG
contexts), `left_pad_stack` writes each branch into a fresh zero buffer in place (``stacked[i, pad:] = ts``) and
builds the mask in the graph, so the site reads no stand-in the passes can trace and the stand-in reads left in the
graph are refused; with equal lengths each row of the stacked query is a different tensor (the packed tokens
gathered by `text_indices` / `vae_indices`, split per branch), which `provenance` does not read. Either way the
graph is rejected at compile time, never computed on a stand-in's zeros. One branch alone (a CFG-parallel rank's)
is read as the conditioning-prefix idiom (a packed (P, H, D) prefix of one row), and refused because the MoT
`qkv_proj` writes its output by index into a fresh zero buffer, which hides the projection weight that names the
layer. The layer also casts to bfloat16 as
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
    # one branch (a CFG-parallel rank's, or a step outside the CFG interval): the conditioning-prefix idiom reads
    # it, but the MoT projection writes its output by index into a fresh buffer (`output[text_idx] = ...`), so no
    # per-layer weight is seen to feed the keys
    ([7], "no per-layer 2-D weight feeds its keys, so the layer cannot be identified"),
])
def test_bagel_cfg_context_prefix_is_refused_with_the_reason(omni, omni_ctx, lengths, reason):
    from vllm_omni.diffusion.models.bagel.bagel_transformer import NaiveCache, PackedAttentionMoT

    torch.manual_seed(0)
    config = types.SimpleNamespace(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                                   num_key_value_heads=HEADS, rms_norm_eps=1e-6)
    attention = PackedAttentionMoT(config, layer_idx=0)
    for p in attention.parameters():
        torch.nn.init.normal_(p, std=0.2)
    attention.to(torch.bfloat16)  # the layer casts its inputs to bfloat16 as written
    x, query_lens, pos, text, vae = _gen_inputs(len(lengths))
    gen = dict(update_past_key_values=False, is_causal=False, mode="gen", packed_vae_token_indexes=vae,
               packed_text_indexes=text)
    with torch.no_grad():
        dense, _ = attention(x, query_lens, pos, _branch_caches(lengths), **gen)
    assert dense.shape == x.shape and torch.isfinite(dense).all()  # the dense code path runs here as written

    runtime = PagedKVRuntime(PagedKVConfig(num_layers=1, num_kv_heads=HEADS, head_dim=HEAD_DIM, block_size=4,
                                           blocks_per_layer=16, max_rows=BRANCHES, scratch_tokens_per_row=16,
                                           kernel="reference", dtype=torch.bfloat16))
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
