"""The family architecture: a third family in one file pages compiled; idioms are the matching unit.

`tests/toy_decoder.py` is a plain causal decoder with a growing cache: its model, its loop, its idiom and its
`Family`, in that one module. Registered, it is admitted, planned, compiled through the passes and checked against
its own dense model; nothing in the package names it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import toy_decoder
from helpers import CountingBackend, compile_blocks, raises_paged
from toy_decoder import CAUSAL_APPEND, TOY_DECODER, DecoderConfig, ToyDecoder, ToyDecoderFamily, decoder_steps

from paged_kv_compile import ConfigError, PagedKVConfig, PassError, RequestError, families
from paged_kv_compile.driver import paged_run
from paged_kv_compile.families.base import Family
from paged_kv_compile.models.hooks import DenseHooks, drive
from paged_kv_compile.passes.idioms import WINDOW, Idiom, PrefixExpect, WindowExpect
from paged_kv_compile.runtime import PagedKVRuntime

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "no_grad")
PACKAGE = Path(__file__).resolve().parents[1] / "paged_kv_compile"
CFG = DecoderConfig()


@pytest.fixture
def toy_family():
    family = families.register(TOY_DECODER)
    yield family
    families.unregister(family.name)


def _runtime(backend=None) -> tuple[ToyDecoder, PagedKVRuntime]:
    model = ToyDecoder(CFG, seed=1).eval()
    rt = PagedKVRuntime(PagedKVConfig(num_layers=CFG.num_layers, num_kv_heads=CFG.num_heads, head_dim=CFG.head_dim,
                                      block_size=4, blocks_per_layer=16, max_rows=2, dtype=torch.float32,
                                      kernel="reference", inner_compiler="aot_eager"))
    rt.bind(model.layers)
    compile_blocks(model.layers, backend or CountingBackend())
    return model, rt


def test_a_third_family_in_one_file_pages_compiled_with_dense_parity(toy_family):
    """The toy decoder, compiled with backend="paged_kv": two sequences (one of 2 rows) prefilled and decoded
    through the passes, equal to the dense model run eagerly (fp32, 1e-5); one frame per bucket (prefill, decode),
    every site rewritten as the toy's own idiom, every block free afterwards."""
    backend = CountingBackend()
    model, rt = _runtime(backend)
    gen = torch.Generator().manual_seed(0)
    for rows, prompt_len in [(2, 5), (1, 5)]:
        prompts = torch.randn(rows, prompt_len, CFG.dim, generator=gen)
        dense = drive(decoder_steps(ToyDecoder(CFG, seed=1).eval(), prompts=prompts, num_new=6), DenseHooks())
        paged = paged_run(model, rt, owner_id=f"seq-{rows}", prompts=prompts, num_new=6)
        torch.testing.assert_close(paged, dense, atol=1e-5, rtol=0)
    assert backend.frames == 4  # (2 rows, 1 row) x (prefill of 5 tokens, decode of 1)
    reports = [r for res in backend.results for r in res.reports]
    assert reports and {(r.status, r.pattern) for r in reports} == {("rewritten", "causal-append")}
    assert rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer and not rt.owner_ids()


def test_the_third_family_touches_no_file_of_the_package():
    """Its module is under tests/, and no module of the package names it or its idiom."""
    assert Path(toy_decoder.__file__).parent.name == "tests"
    named = [p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")
             if any(w in p.read_text() for w in ("toy_decoder", "causal-append", "ToyDecoder"))]
    assert not named


def test_a_site_two_idioms_match_is_refused_as_ambiguous_with_both_named(toy_family):
    """A second family whose idiom also matches the toy's site: the site is refused (strict: raised) naming both
    idioms and the families accepting them, never rewritten by whichever is asked first."""
    clone = type("CloneFamily", (ToyDecoderFamily,), {"name": "toy_clone", "idioms": (
        Idiom("causal-append-too", CAUSAL_APPEND.match),)})
    families.register(clone)
    try:
        model, rt = _runtime(CountingBackend({"strict": True}))
        with raises_paged(PassError, r"ambiguous: it matches idiom 'causal-append' \(accepted by toy_decoder\) and "
                                     r"idiom 'causal-append-too' \(accepted by toy_clone\)"):
            paged_run(model, rt, owner_id="s", prompts=torch.randn(1, 5, CFG.dim), num_new=1)
        assert rt.state()["owners"] == {} and rt.scheduler.allocator.num_free == rt.pool.blocks_per_layer
    finally:
        families.unregister("toy_clone")


def test_an_idiom_name_names_one_matcher(toy_family):
    clone = type("CloneFamily", (ToyDecoderFamily,), {"name": "toy_clone", "idioms": (
        Idiom("causal-append", CAUSAL_APPEND.match),)})
    with pytest.raises(ConfigError, match="declares an idiom 'causal-append' but another idiom of that name is "
                                          "accepted by toy_decoder"):
        families.register(clone)
    families.register(type("SameIdiom", (ToyDecoderFamily,), {"name": "toy_same"}))  # the same Idiom object: fine
    families.unregister("toy_same")


def test_a_family_that_leaves_out_a_method_is_refused_at_registration_with_the_names():
    partial = type("Partial", (Family,), {"name": "partial", "noun": "x", "spec_type": object, "evict_lru": False,
                                          "rows": lambda self, spec, requested: 1})
    with pytest.raises(ConfigError, match=r"Partial is not a complete Family: it lacks admission_blocks, blocks, "
                                          r"check_expectation, default_buckets, example_inputs, finish, owns_model, "
                                          r"plan, spec_for, standin_caches, steps"):
        families.register(partial)

    class DuckTyped:  # the old protocol: attributes and methods, no base class
        name, noun, spec_type, evict_lru, idioms = "duck", "x", object, False, ()

        def plan(self, *a):
            pass

    with pytest.raises(ConfigError, match="DuckTyped is not a complete Family: it lacks admission_blocks"):
        families.register(DuckTyped())
    assert "partial" not in [f.name for f in families.FAMILIES] and "duck" not in [f.name for f in families.FAMILIES]


def test_a_site_of_an_idiom_the_owners_family_does_not_accept_is_refused(toy_family):
    rt = PagedKVRuntime(PagedKVConfig(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, blocks_per_layer=16,
                                      max_rows=2, dtype=torch.float32))
    rt.admit("seq", toy_decoder.DecodeSpec(prompt_len=4, max_new=1, capacity=16))
    with rt.forward("seq", "prefill"):
        with pytest.raises(RequestError, match=r"a 'window' attention site ran inside a toy_decoder forward \('seq'\), "
                                               r"whose family accepts the idioms \['causal-append'\]"):
            rt.require_active().check_expectation(
                WindowExpect(window_tokens=8, sink_tokens=0, chunk_tokens=4, action_tokens=0), WINDOW)
        with pytest.raises(RequestError, match="reads 12 cache columns but sequence 'seq' has capacity 16"):
            rt.require_active().check_expectation(toy_decoder.AppendExpect(12), CAUSAL_APPEND)


def test_expectations_are_frozen_and_typed():
    """What a matched site expects is a frozen dataclass naming its idiom, not a dict read with .get."""
    dz = WindowExpect(window_tokens=24, sink_tokens=8, chunk_tokens=8, action_tokens=2)
    hy = PrefixExpect(12, "prefix-step")
    assert (dz.idiom, dz.context, hy.idiom, hy.context) == ("window", 24, "prefix-step", 12)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dz.window_tokens = 8
    assert isinstance(dz, families.Expectation) and isinstance(hy, families.Expectation)


def test_registry_lookups_name_the_fix():
    with pytest.raises(RequestError, match="is no family's spec"):
        families.for_spec(object())
    with pytest.raises(Exception, match="no model family knows Linear"):
        families.for_model(torch.nn.Linear(2, 2))
    with pytest.raises(Exception, match="unknown model family 'nope'"):
        families.get("nope")
    assert families.get("hunyuan-image3") is families.get("hunyuan_image3")
    families.register(families.get("dreamzero"))  # the same instance again: nothing changes
    with pytest.raises(Exception, match="already registered"):
        families.register(type(families.get("dreamzero"))())
    with pytest.raises(ConfigError, match="is a built-in family"):
        families.unregister("dreamzero")
