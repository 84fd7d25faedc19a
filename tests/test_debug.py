"""Graph dumps: the pass files (before/after/report), depyf's files, and the depyf/Inductor shims."""

from __future__ import annotations

import json
import os

import depyf
import pytest

from paged_kv_compile import debug
from paged_kv_compile.driver import paged_run
from paged_kv_compile.families.dreamzero import dreamzero_runtime_config
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel
from paged_kv_compile.runtime import PagedKVRuntime

CFG = DreamZeroConfig(sink_size=2)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _short_rollout(options: dict) -> None:
    model = DreamZeroModel(CFG, seed=1)
    runtime = PagedKVRuntime(dreamzero_runtime_config(CFG, block_size=8, kernel="reference"))
    runtime.bind(model.blocks)
    for block in model.blocks:
        block.compile(backend="paged_kv", fullgraph=True, dynamic=False, options=options)
    paged_run(model, runtime, num_chunks=2, num_inference_steps=1, seed=3)
    return model  # keep the compiled modules alive until depyf writes its files


def test_dump_writes_pass_files_and_depyf_files(tmp_path):
    out = tmp_path / "dump"
    with debug.dump(out) as session:
        model = _short_rollout({"inner_compiler": "aot_eager"})
    del model
    files = session.files()
    assert len(session.graphs) == 1 and "paged_kv_summary.json" in files
    stem = session.graphs[0]["name"]  # paged_kv_graph_NNN
    assert {f"{stem}.before.py", f"{stem}.after.py", f"{stem}.report.json"} <= set(files)
    # depyf: decompiled dynamo code, the captured graph, AOT's forward graph.
    assert any(f.startswith("full_code_for_forward") for f in files)
    assert any(f.startswith("__transformed_code_") for f in files)
    assert any(f.startswith("__compiled_fn_") and "Forward_graph" in f for f in files)
    assert session.depyf_files() and session.pass_files()

    entry = session.graphs[0]
    before = (out / entry["before"]).read_text()
    after = (out / entry["after"]).read_text()
    assert "scaled_dot_product_attention" in before and "write_attend" not in before
    assert "paged_kv.write_attend" in after
    report = json.loads((out / entry["report"]).read_text())
    assert [s["status"] for s in report["sites"]].count("rewritten") == 1
    assert report["shape"] == [2, CFG.tokens_per_forward, CFG.max_attention_size]
    summary = json.loads((out / "paged_kv_summary.json").read_text())
    assert summary["depyf"] and summary["graphs"][0]["name"] == entry["name"]


def test_backend_dump_dir_option_still_writes_the_pass_files(tmp_path):
    out = tmp_path / "option"
    _short_rollout({"inner_compiler": "aot_eager", "dump_dir": str(out)})
    names = sorted(os.listdir(out))
    assert len(names) == 3
    assert [n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] for n in names] == [
        "after.py", "before.py", "report.json"]


def test_option_and_dump_on_the_same_directory_write_once(tmp_path):
    with debug.dump(tmp_path, use_depyf=False) as session:
        _short_rollout({"inner_compiler": "aot_eager", "dump_dir": str(tmp_path)})
    assert len(session.graphs) == 1 and len(session.pass_files()) == 4  # 3 files + the summary
    assert not session.depyf_files()


def test_code_cache_shim_lets_depyf_take_inductors_extra_keyword(tmp_path):
    """torch 2.13's PyCodeCache.load passes set_sys_modules=, which depyf 0.20's hook rejects."""
    from torch._inductor.codecache import PyCodeCache

    original = PyCodeCache.__dict__["load_by_key_path"]
    with depyf.prepare_debug(str(tmp_path / "bare")):
        hook = PyCodeCache.__dict__["load_by_key_path"]
        needs_shim = not debug._hook_accepts_keywords(hook)
        if needs_shim:  # what the shim is for (gone once depyf accepts the keyword itself)
            with pytest.raises(TypeError, match="set_sys_modules"):
                PyCodeCache.load("value = 1\n")
    with debug.dump(tmp_path / "shim") as session:
        module = PyCodeCache.load("value = 2\n")
        assert module.value == 2
    assert PyCodeCache.__dict__["load_by_key_path"] is original  # everything restored
    if needs_shim:
        assert any(".kernel_" in f for f in session.files())  # depyf still copied the source


def test_dump_with_inductor_lists_its_kernels(tmp_path):
    with debug.dump(tmp_path) as session:
        model = _short_rollout({"inner_compiler": "inductor"})
    del model
    files = session.files()
    assert any(".kernel_" in f for f in files), files
    assert len(session.graphs) == 1
