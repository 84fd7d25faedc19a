"""Pages imported from another stage (`kv_import.py`): reserved before the K/V exists, written by a producer into
exactly those pages, read by the denoising steps as a computed prefix is; every refusal leaves the runtime as it was.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend, compile_blocks, random_prompts

from paged_kv_compile import CapacityError, RequestError, kv_import
from paged_kv_compile.families.hunyuan_image3 import (HUNYUAN_IMAGE3, hunyuan_buckets, hunyuan_runtime_config,
                                                     hunyuan_spec)
from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config, HunyuanImage3Model, hunyuan_generate
from paged_kv_compile.runtime import PagedKVRuntime

CFG = HunyuanImage3Config()
P, B = 12, 4  # prefix capacity, block size
PROMPTS = random_prompts(CFG.vocab, [11, 5], seed=1)  # two CFG rows: 3 and 2 pages
SPEC = hunyuan_spec(CFG, PROMPTS)


def _runtime(requests: int = 2, **overrides) -> PagedKVRuntime:
    return PagedKVRuntime(hunyuan_runtime_config(CFG, max_prefix=P, block_size=B, requests=requests,
                                                 kernel="reference", buckets=hunyuan_buckets(CFG, [P]), **overrides))


@torch.no_grad()
def _dense_prefill(model: HunyuanImage3Model) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], object]:
    """The producer: a dense eager prefill of the prompts; per layer its cached (K, V) [rows, P, Hkv, D]."""
    req = model.build_request(PROMPTS, P)
    caches = model.dense_caches(len(PROMPTS), P)
    x = torch.zeros(CFG.image_tokens, CFG.latent_channels)
    target = model.embed_target(x.expand(len(PROMPTS), -1, -1), torch.full((len(PROMPTS),), 1000.0))
    model(torch.cat([req.prefix_embeds, target], 1), req.rope_cos, req.rope_sin, req.attention_mask, caches,
          req.prefix_valid, "prefill")
    return [(c.cached_key, c.cached_value) for c in caches], req


def _pages(runtime: PagedKVRuntime, request_id: str) -> list[torch.Tensor]:
    """Per row the prompt's K/V as the pool holds it: (layers, 2, prompt tokens, Hkv, D)."""
    owner = runtime.owner(request_id)
    return [runtime.pool.read_region(row, p) for row, p in zip(owner.rows, owner.spec.prefix_lens)]


@torch.no_grad()
def _latents(model, runtime, request_id: str, req, first: str, num_steps: int = 3, seed: int = 5) -> torch.Tensor:
    """`hunyuan_steps`' loop on the runtime by hand, its first forward a prefill (the request computes its prompt)
    or a step (the prompt was imported: only the target span is computed)."""
    b = req.batch
    x = torch.randn(CFG.image_tokens, CFG.latent_channels, generator=torch.Generator().manual_seed(seed))
    sigmas = torch.linspace(1.0, 0.0, num_steps + 1).tolist()
    caches = HUNYUAN_IMAGE3.standin_caches(runtime, model, b, prefix_capacity=P)
    for i in range(num_steps):
        target = model.embed_target(x.expand(b, -1, -1), torch.full((b,), sigmas[i] * 1000.0))
        if i == 0 and first == "prefill":
            with runtime.forward(request_id, "prefill", prefix_capacity=P, attention_mask=req.attention_mask):
                hidden = model(torch.cat([req.prefix_embeds, target], 1), req.rope_cos, req.rope_sin,
                               req.attention_mask, caches, req.prefix_valid, "prefill")[:, P:]
        else:
            with runtime.forward(request_id, "step", prefix_capacity=P, attention_mask=req.step_attention_mask):
                hidden = model(target, req.step_rope_cos, req.step_rope_sin, req.step_attention_mask, caches,
                               req.prefix_valid, "step")
        v = model.velocity(hidden)
        v = v[1] + 4.0 * (v[0] - v[1])
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


@pytest.mark.usefixtures("fresh_dynamo")
def test_import_from_a_dense_prefill_gives_the_steps_of_a_request_that_prefilled_itself():
    """Compiled through the passes (aot_eager, reference kernel): the imported pages hold the bytes the request's own
    prefill writes, and its steps (the first one computing only the target) give the same latents bit for bit; both
    match the dense eager loop (1e-5). No frame beyond the prefill's and the step's."""
    dense = hunyuan_generate(HunyuanImage3Model(CFG, seed=2), PROMPTS, prefix_capacity=P, num_steps=3, seed=5)
    kv, req = _dense_prefill(HunyuanImage3Model(CFG, seed=2))
    model = HunyuanImage3Model(CFG, seed=2)
    runtime = _runtime()
    runtime.bind(model.layers)
    backend = CountingBackend({"inner_compiler": "aot_eager"})
    compile_blocks(model.layers, backend)

    runtime.admit("own", SPEC)
    own = _latents(model, runtime, "own", req, "prefill")
    ticket = kv_import.reserve(runtime, "imported", SPEC, attention_mask=req.attention_mask)
    kv_import.import_dense(runtime, ticket, kv)
    for got, want in zip(_pages(runtime, "imported"), _pages(runtime, "own")):
        assert torch.equal(got, want)
    imported = _latents(model, runtime, "imported", req, "step")

    assert torch.equal(imported, own)
    assert (own - dense).abs().max().item() <= 1e-5
    assert backend.frames == 2  # the prefill bucket and the step bucket: the import compiles nothing
    assert all(r.status == "rewritten" for res in backend.results for r in res.reports)
    for rid in ("own", "imported"):
        runtime.release(rid)
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


def test_import_reservation_is_what_admission_counts_and_is_released_with_the_request():
    runtime = _runtime(requests=1)
    ticket = kv_import.reserve(runtime, "a", SPEC, prefix_capacity=P)
    assert [len(p) for p in ticket.pages] == [3, 2] and ticket.tokens == (11, 5) and ticket.generation >= 1
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer - 5
    before = runtime.state()
    with pytest.raises(CapacityError):
        kv_import.reserve(runtime, "b", SPEC, prefix_capacity=P)
    assert runtime.state() == before
    runtime.release("a")
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer
    kv_import.reserve(runtime, "b", SPEC, prefix_capacity=P)


def test_import_reserve_with_a_layout_the_spec_does_not_describe_admits_nothing():
    runtime = _runtime()
    before = runtime.state()
    wrong = hunyuan_spec(CFG, random_prompts(CFG.vocab, [9, 5])).padded_mask(P)  # row 0's prompt is 9, not 11
    with pytest.raises(RequestError, match="row 0"):
        kv_import.reserve(runtime, "a", SPEC, attention_mask=wrong)
    with pytest.raises(RequestError, match="needs its layout"):
        kv_import.reserve(runtime, "a", SPEC)
    assert runtime.state() == before
    kv_import.reserve(runtime, "a", SPEC, prefix_capacity=P)  # the id was not used up


def _ready_import() -> tuple[PagedKVRuntime, kv_import.ImportTicket, list]:
    runtime = _runtime()
    kv, _ = _dense_prefill(HunyuanImage3Model(CFG, seed=2))
    return runtime, kv_import.reserve(runtime, "r", SPEC, prefix_capacity=P), kv


def _step(runtime: PagedKVRuntime, **args) -> None:
    """A hand-driven step forward (the runtime is bound to no model: only the plan and its refusals are tested)."""
    with runtime.forward("r", "step", prefix_capacity=P, **args):
        pass


def test_import_a_step_over_pages_not_all_ready_is_refused_page_by_page():
    runtime, ticket, kv = _ready_import()
    before = runtime.state()
    with pytest.raises(RequestError, match=r"row 0: pages \[0, 1, 2\]; row 1: pages \[0, 1\]"):
        _step(runtime)
    kv_import.import_dense(runtime, ticket, [(k[:1], v[:1]) for k, v in kv], rows=[0], tokens=B)  # page 0 of row 0
    with pytest.raises(RequestError, match=r"row 0: pages \[1, 2\]; row 1"):
        _step(runtime)
    rest = [(k[:1, B:], v[:1, B:]) for k, v in kv]
    kv_import.import_dense(runtime, ticket, rest, rows=[0], first_page=1)  # pages 1-2: up to the prompt's end
    with pytest.raises(RequestError, match=r"row 1: pages \[0, 1\]") as refused:
        _step(runtime)
    assert "row 0" not in str(refused.value)
    assert runtime.state() == before  # refused before planning: nothing in flight, nothing taken
    kv_import.import_dense(runtime, ticket, [(k[1:], v[1:]) for k, v in kv], rows=[1])
    _step(runtime, import_generation=ticket.generation)
    whole = _ready_import()
    kv_import.import_dense(whole[0], whole[1], whole[2])
    for got, want in zip(_pages(runtime, "r"), _pages(whole[0], "r")):
        assert torch.equal(got, want)  # imported page by page = imported whole


def test_import_stale_tickets_and_generations_are_refused():
    runtime, first, kv = _ready_import()
    second = kv_import.renew(runtime, "r", prefix_capacity=P)
    assert second.generation > first.generation and second.pages == first.pages
    pool = runtime.pool.tensor.clone()
    with pytest.raises(RequestError, match="generation"):
        kv_import.import_dense(runtime, first, kv)
    assert torch.equal(runtime.pool.tensor, pool), "a stale import wrote"
    kv_import.import_dense(runtime, second, kv)
    with pytest.raises(RequestError, match=f"expects imported pages of generation {first.generation}"):
        _step(runtime, import_generation=first.generation)
    _step(runtime, import_generation=second.generation)

    runtime.reset("r")  # frees the pages: the import ends
    with pytest.raises(RequestError, match="reset or prefilled"):
        kv_import.import_dense(runtime, second, kv)
    with pytest.raises(RequestError, match="has not been prefilled"):
        _step(runtime)
    third = kv_import.renew(runtime, "r", prefix_capacity=P)  # the pages are taken again, none ready
    assert all(third.pages) and third.generation > second.generation
    with pytest.raises(RequestError, match="not all its pages are ready"):
        _step(runtime)
    runtime.release("r")
    with pytest.raises(RequestError, match="stale: that admission ended"):
        kv_import.import_dense(runtime, third, kv)
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


def test_import_is_superseded_by_the_requests_own_prefill():
    runtime, ticket, kv = _ready_import()
    with runtime.forward("r", "prefill", prefix_capacity=P, attention_mask=SPEC.padded_mask(P)):
        pass
    with pytest.raises(RequestError, match="reset or prefilled"):
        kv_import.import_dense(runtime, ticket, kv)
    _step(runtime)  # the prefill computed the prompt


BAD_INPUTS = ("layers", "heads", "head_dim", "nan", "mid_page", "rows", "row_count", "layout", "too_few_tokens",
              "first_page")


def _bad_inputs(kv):
    return {
        "layers": (kv[:-1], {}, "layers"),
        "heads": ([(k[:, :, :1], v[:, :, :1]) for k, v in kv], {}, "pass heads="),
        "head_dim": ([(k[..., :8], v[..., :8]) for k, v in kv], {}, "head dim"),
        "nan": ([(k.clone().fill_(float("nan")), v) for k, v in kv], {}, "NaN"),
        "mid_page": (kv, {"tokens": 3}, "end inside a page"),
        "rows": (kv, {"rows": [0, 2]}, "rows="),
        "row_count": ([(k[:1], v[:1]) for k, v in kv], {}, "pass rows="),
        "layout": (kv, {"layout": "hsbd"}, "unknown layout"),
        "too_few_tokens": ([(k[:, :4], v[:, :4]) for k, v in kv], {}, "gives 4 tokens"),
        "first_page": (kv, {"first_page": 3}, "outside row"),
    }


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_import_bad_input_is_refused_and_writes_nothing(case):
    runtime, ticket, kv = _ready_import()
    bad, args, match = _bad_inputs(kv)[case]
    pool, before = runtime.pool.tensor.clone(), runtime.state()
    with pytest.raises(RequestError, match=match):
        kv_import.import_dense(runtime, ticket, bad, **args)
    assert torch.equal(runtime.pool.tensor, pool) and runtime.state() == before
    assert runtime.owner("r").state.imported.missing() == {0: [0, 1, 2], 1: [0, 1]}


def test_import_dense_layouts_hf_and_vllm_omni_rows_store_the_same_pages():
    runtime, ticket, kv = _ready_import()
    kv_import.import_dense(runtime, ticket, kv)
    want = _pages(runtime, "r")
    for layout, given in (("bhsd", [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in kv]),
                          ("rows", [[(k[r, :p], v[r, :p]) for r, p in enumerate(SPEC.prefix_lens)] for k, v in kv]),
                          ("rows", [[(k[r, :p].flatten(1), v[r, :p].flatten(1)) for r, p in enumerate(SPEC.prefix_lens)]
                                    for k, v in kv])):
        other, t, _ = _ready_import()
        kv_import.import_dense(other, t, given, layout=layout)
        for got, w in zip(_pages(other, "r"), want):
            assert torch.equal(got, w), layout


def _vllm_cache(kv, block_size: int, num_blocks: int = 16, seed: int = 0):
    """The prompt's K/V scattered into a vLLM-style FlashAttention cache per layer ([2, num_blocks, block_size, Hkv,
    D], random other content) at shuffled block ids; returns (caches, one block table per row)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for p in SPEC.prefix_lens:
        n = -(-p // block_size)
        tables.append(ids[start : start + n])
        start += n
    caches = []
    for k, v in kv:
        cache = torch.randn(2, num_blocks, block_size, CFG.num_kv_heads, CFG.head_dim, generator=gen)
        for r, (table, p) in enumerate(zip(tables, SPEC.prefix_lens)):
            for half, x in enumerate((k, v)):
                tokens = cache[half, table].flatten(0, 1)
                tokens[:p] = x[r, :p]
                cache[half, table] = tokens.view(len(table), block_size, CFG.num_kv_heads, CFG.head_dim)
        caches.append(cache)
    return caches, tables


@pytest.mark.parametrize("vllm_block_size", [B, 8, 3], ids=["same-block-size", "re-blocked-8", "re-blocked-3"])
def test_import_from_vllm_blocks_matches_the_dense_import(vllm_block_size):
    runtime, ticket, kv = _ready_import()
    kv_import.import_dense(runtime, ticket, kv)
    want = _pages(runtime, "r")
    other, t, _ = _ready_import()
    caches, tables = _vllm_cache(kv, vllm_block_size)
    kv_import.import_vllm_blocks(other, t, caches, tables)
    for got, w in zip(_pages(other, "r"), want):
        assert torch.equal(got, w)
    with other.forward("r", "step", prefix_capacity=P):
        pass
    # the same blocks as vLLM 0.32's FlashAttention holds them, [num_blocks, Hkv, block_size, 2 * D], and as the
    # (key_cache, value_cache) halves its forward splits that into
    side_by_side = [torch.cat([c[0], c[1]], dim=-1).transpose(1, 2).contiguous() for c in caches]
    for given in (side_by_side, [(c[0], c[1]) for c in caches]):
        again = _ready_import()
        kv_import.import_vllm_blocks(again[0], again[1], given, tables)
        for got, w in zip(_pages(again[0], "r"), want):
            assert torch.equal(got, w)


def test_import_from_vllm_blocks_of_another_geometry_is_refused_with_the_reason():
    runtime, ticket, kv = _ready_import()
    caches, tables = _vllm_cache(kv, B)
    cases = [
        ([c.to(torch.float16) for c in caches], tables, "stores torch.float16"),
        ([c.transpose(0, 1).contiguous() for c in caches], tables, "not FlashAttention's layout"),
        ([c[..., :1, :] for c in caches], tables, "pass heads="),
        ([c[..., :8] for c in caches], tables, "head dim 8"),
        ([torch.cat([c[0], c[1]], -1).transpose(1, 2)[..., :24] for c in caches], tables, "holds head dim 12"),
        (caches, [tables[0][:2], tables[1]], "fewer than its 11 prompt tokens"),
        (caches, [tables[0], [0, 99]], r"must lie in \[0, 16\)"),
        (caches[:-1], tables, "layers"),
        (caches, tables[:1], "block tables for 2 rows"),
    ]
    pool, before = runtime.pool.tensor.clone(), runtime.state()
    for given, given_tables, match in cases:
        with pytest.raises(RequestError, match=match):
            kv_import.import_vllm_blocks(runtime, ticket, given, given_tables)
    assert torch.equal(runtime.pool.tensor, pool) and runtime.state() == before
    fp8 = _runtime(kv_dtype=torch.float8_e4m3fn)
    t = kv_import.reserve(fp8, "r", SPEC, prefix_capacity=P)
    with pytest.raises(RequestError, match="FP8"):
        kv_import.import_vllm_blocks(fp8, t, caches, tables)


def test_import_into_another_family_or_a_request_in_flight_is_refused():
    runtime, ticket, kv = _ready_import()
    plan = runtime.plan("r", "prefill", prefix_capacity=P, attention_mask=SPEC.padded_mask(P))
    with pytest.raises(RequestError, match="in flight"):
        kv_import.import_dense(runtime, ticket, kv)
    runtime.scheduler.abort_forward(plan)
    from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
    from paged_kv_compile.models.dreamzero import DreamZeroConfig

    dz = DreamZeroConfig(num_layers=2, frame_seqlen=4, num_frame_per_block=1, local_attn_size=3,
                         window_reset_frames=64, action_register_length=2, text_len=6)
    other = PagedKVRuntime(dreamzero_runtime_config(dz, sessions=1, dtype=torch.float32))
    before = other.state()
    with pytest.raises(RequestError, match="cannot be imported"):
        kv_import.reserve(other, "s", DreamZeroSpec.from_model_config(dz))
    assert other.state() == before


def test_import_a_batched_step_with_a_request_not_ready_is_refused_whole():
    one_row = hunyuan_spec(CFG, random_prompts(CFG.vocab, [7], seed=3))
    runtime = _runtime()
    kv, _ = _dense_prefill(HunyuanImage3Model(CFG, seed=2))
    runtime.admit("own", one_row)
    with runtime.forward("own", "prefill", prefix_capacity=P, attention_mask=one_row.padded_mask(P)):
        pass
    ticket = kv_import.reserve(runtime, "imp", one_row, prefix_capacity=P)
    before = runtime.state()
    batch = [("own", "step", {"prefix_capacity": P}), ("imp", "step", {"prefix_capacity": P})]
    with pytest.raises(RequestError, match="'imp' imports its prompt K/V"):
        with runtime.forward_batch(batch):
            pass
    assert runtime.state() == before
    kv_import.import_dense(runtime, ticket, [(k[:1], v[:1]) for k, v in kv])
    with runtime.forward_batch(batch):
        pass


def test_import_dense_into_an_fp8_pool_is_quantized_with_the_pools_scales():
    runtime = _runtime(kv_dtype=torch.float8_e4m3fn)
    runtime.pool.set_scales(0.01, 0.02)  # before anything is admitted
    kv, _ = _dense_prefill(HunyuanImage3Model(CFG, seed=2))
    ticket = kv_import.reserve(runtime, "r", SPEC, prefix_capacity=P)
    kv_import.import_dense(runtime, ticket, kv)
    for r, (stored, p) in enumerate(zip(_pages(runtime, "r"), SPEC.prefix_lens)):
        assert stored.dtype == torch.float8_e4m3fn
        for half, scale in enumerate((0.01, 0.02)):
            got = stored[:, half].float() * scale
            want = torch.stack([pair[half][r, :p] for pair in kv])
            assert torch.allclose(got, want, rtol=2**-4, atol=scale * 2**-9), (r, half)
