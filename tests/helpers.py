"""Shared test helpers: compiling blocks regionally with a counting paged_kv backend (`paged_kv_compile.counting`)."""

from __future__ import annotations

import contextlib
import re

import torch

from paged_kv_compile.counting import CountingBackend  # noqa: F401  (the tests import it from here)

HOST_SYNC_TARGETS = {"item", "cpu", "tolist", "numpy", "_local_scalar_dense"}


def compile_blocks(blocks: torch.nn.ModuleList, backend) -> None:
    """Regional compilation, the usual way to compile DiTs: each block on its own, fullgraph."""
    for block in blocks:
        block.compile(backend=backend, fullgraph=True, dynamic=False)


def host_syncs(gm: torch.fx.GraphModule) -> list[str]:
    """Nodes of a graph that would force a device-to-host sync."""
    out = []
    for node in gm.graph.nodes:
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        if str(name).split(".")[-1] in HOST_SYNC_TARGETS:
            out.append(node.format_node())
    return out


@contextlib.contextmanager
def raises_paged(exc_type, match: str):
    """Like pytest.raises, also when dynamo wraps the error raised at compile time in BackendCompilerFailed."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - inspected below
        err = e if isinstance(e, exc_type) else (getattr(e, "inner_exception", None) or e.__cause__)
        assert isinstance(err, exc_type), f"expected {exc_type.__name__}, got {type(e).__name__}: {e}"
        assert re.search(match, str(err)), f"{match!r} not in: {err}"
    else:
        raise AssertionError(f"{exc_type.__name__} was not raised")


def hunyuan_qkv(attention, hidden_states, rope_cos, rope_sin):
    """HunyuanImage-3's projections, qk-norm and RoPE, for tests that rewrite the rest of its attention."""
    from paged_kv_compile.models.common import apply_rope_2d

    b, s, _ = hidden_states.shape
    Hq, Hkv, D = attention.num_heads, attention.num_kv_heads, attention.head_dim
    q, k, v = attention.qkv_proj(hidden_states).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(b, s, Hq, D), k.view(b, s, Hkv, D), v.view(b, s, Hkv, D)
    q, k = attention.query_layernorm(q), attention.key_layernorm(k)
    q, k = apply_rope_2d(q, k, rope_cos, rope_sin)
    return q, k, v


def hunyuan_qkv_cached(attention, hidden_states, rope_cos, rope_sin, past_key_value, prefix_valid, mode):
    """`hunyuan_qkv`, then the layer's dense cache idiom: the prefill stores its K/V, a step reads [cache | new]."""
    q, k, v = hunyuan_qkv(attention, hidden_states, rope_cos, rope_sin)
    if mode == "prefill":
        past_key_value.store(k, v, prefix_valid)
    else:
        k, v = past_key_value.extend(k, v)
    return q, k, v


def left_padded_mask(spec, capacity: int) -> torch.Tensor:
    """`spec.padded_mask(capacity)` ([prompt | pad | target] per row) with each row's padding moved to the left
    ([pad | prompt | target]): the same spec, other dense columns (a retry or re-prefill with another layout)."""
    middle = spec.padded_mask(capacity)
    S = capacity + spec.target_len
    left = torch.zeros_like(middle)
    for r, p in enumerate(spec.prefix_lens):
        order = torch.cat([torch.arange(p, capacity), torch.arange(p), torch.arange(capacity, S)])
        left[r, 0] = middle[r, 0][order][:, order]
    return left


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[torch.Tensor]:
    """One prompt of token ids in [0, vocab) per length, from a generator seeded with `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
