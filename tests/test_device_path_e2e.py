"""Both families' loops end to end on the path a GPU takes, on the CPU.

The other end-to-end tests run the reference kernel's CPU fast path, which reads the lengths on the host
and attends over the used span only. Here the reference kernel takes its device path (the padded block
table and the visibility mask, no host read: any `.item()`, `.tolist()`, `int()`, `bool()` of a tensor
inside the kernel raises), and the Triton kernel runs under TRITON_INTERPRET=1. Each loop matches the
dense eager loop to 1e-5 with regional (per-block) compilation, and HunyuanImage-3 also compiled as a
whole model. Configurations are tiny:
interpreted Triton costs milliseconds per program.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from helpers import CountingBackend, compile_blocks, random_prompts

from paged_kv_compile.config import Bucket
from paged_kv_compile.driver import paged_run
from paged_kv_compile.families.dreamzero import dreamzero_runtime_config
from paged_kv_compile.families.hunyuan_image3 import hunyuan_runtime_config
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config, HunyuanImage3Model, hunyuan_generate
from paged_kv_compile.ops import reference
from paged_kv_compile.ops import write_attend as write_attend_module
from paged_kv_compile.runtime import PagedKVRuntime

ATOL = 1e-5
DZ_CFG = DreamZeroConfig(sink_size=2)  # window 6 frames + 2-frame sink, chunk 2 frames, 37 tokens per row
HY_CFG = HunyuanImage3Config()
HY_CAPACITY = 10
# For interpreted Triton: 2 layers, 2 heads, 4-token frames (10 tokens per row per forward), same window logic.
DZ_SMALL = DreamZeroConfig(num_layers=2, dim=32, num_heads=2, head_dim=16, ffn_dim=64, frame_seqlen=4,
                           action_register_length=2, text_len=4, sink_size=2)
HY_SMALL = HunyuanImage3Config(num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate=64,
                               image_h=2, image_w=2)

_HOST_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


class HostReadError(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads():
    """Any read of a tensor's value on the host inside this block raises HostReadError."""
    saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def forbid(name):
        def read(self, *args, **kwargs):
            raise HostReadError(f"Tensor.{name} inside a kernel: a captured CUDA graph cannot read values")
        return read

    for name in _HOST_READS:
        setattr(torch.Tensor, name, forbid(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _guarded(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with no_host_reads():
            return fn(*args, **kwargs)
    return call


@pytest.fixture
def device_path(monkeypatch):
    """The reference kernel's device path, with no value check on the host and no host read in the kernel."""
    monkeypatch.setattr(reference, "HOST_LENGTHS_ON_CPU", False)
    monkeypatch.setattr(write_attend_module, "CHECK_VALUES", False)
    monkeypatch.setattr(reference, "attend", _guarded(reference.attend))
    monkeypatch.setattr(reference, "write_kv", _guarded(reference.write_kv))


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_the_guard_catches_the_cpu_fast_path(device_path, monkeypatch):
    """The fixture can fail: the host-length path reads lengths on the host and is caught."""
    monkeypatch.setattr(reference, "HOST_LENGTHS_ON_CPU", True)
    with pytest.raises(HostReadError, match="Tensor"):
        _dreamzero_paged(kernel="reference", whole_model=False, num_chunks=1, steps=1)


def _dreamzero_paged(kernel: str, whole_model: bool, num_chunks: int, steps: int, inner: str = "aot_eager",
                     cfg: DreamZeroConfig = DZ_CFG):
    model = DreamZeroModel(cfg, seed=1)
    runtime = PagedKVRuntime(dreamzero_runtime_config(cfg, block_size=cfg.frame_seqlen // 2 or 1, kernel=kernel))
    runtime.bind(model.blocks)
    backend = CountingBackend({"inner_compiler": inner})
    if whole_model:
        model.compile(backend=backend, fullgraph=True, dynamic=False)
    else:
        compile_blocks(model.blocks, backend)
    with torch.no_grad():
        out = paged_run(model, runtime, num_chunks=num_chunks, num_inference_steps=steps, seed=3)
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer
    return out, backend


def _dreamzero_dense(num_chunks: int, steps: int, cfg: DreamZeroConfig = DZ_CFG):
    with torch.no_grad():
        return dreamzero_rollout(DreamZeroModel(cfg, seed=1), num_chunks=num_chunks, num_inference_steps=steps,
                                 seed=3)


def _max_diff(dense: dict, paged: dict) -> float:
    return max((dense[k] - paged[k]).abs().max().item() for k in ("video", "actions"))


def _hunyuan_prompts(lengths, seed=0):
    return random_prompts(HY_CFG.vocab, lengths, seed)


def _hunyuan(kernel: str, whole_model: bool, prompts, steps: int, inner: str = "aot_eager",
             cfg: HunyuanImage3Config = HY_CFG):
    T = cfg.target_len
    buckets = (Bucket(len(prompts), HY_CAPACITY + T, HY_CAPACITY), Bucket(len(prompts), T, HY_CAPACITY))
    with torch.no_grad():
        dense = hunyuan_generate(HunyuanImage3Model(cfg, seed=2), prompts, prefix_capacity=HY_CAPACITY,
                                 num_steps=steps, seed=5)
    model = HunyuanImage3Model(cfg, seed=2)
    runtime = PagedKVRuntime(hunyuan_runtime_config(cfg, max_prefix=HY_CAPACITY, block_size=4, kernel=kernel,
                                                    buckets=buckets))
    runtime.bind(model.layers)
    backend = CountingBackend({"inner_compiler": inner})
    if whole_model:
        model.compile(backend=backend, fullgraph=True, dynamic=False)
    else:
        compile_blocks(model.layers, backend)
    with torch.no_grad():
        got = paged_run(model, runtime, prompts=prompts, prefix_capacity=HY_CAPACITY, num_steps=steps, seed=5)
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer
    return (got - dense).abs().max().item(), backend


# ---- the reference kernel's device path --------------------------------------------------------------------


# DreamZero runs regionally only: compiling its whole model hit dynamo's recompile limit (8) within a
# 10-chunk rollout (FailOnRecompileLimitHit under fullgraph=True, measured with the reference kernel).
@pytest.mark.parametrize("whole_model", [False], ids=["regional"])
def test_dreamzero_device_path_rollout(device_path, whole_model):
    """10 chunks: the window fills, slides, keeps its sink and resets; 2 denoise steps + a commit each."""
    dense = _dreamzero_dense(num_chunks=10, steps=2)
    paged, backend = _dreamzero_paged("reference", whole_model, num_chunks=10, steps=2)
    assert dense["resets"] == paged["resets"] and dense["resets"]
    assert _max_diff(dense, paged) <= ATOL
    assert backend.frames == 1


@pytest.mark.parametrize("whole_model", [False, True], ids=["regional", "whole-model"])
def test_hunyuan_device_path_generation(device_path, whole_model):
    diff, backend = _hunyuan("reference", whole_model, _hunyuan_prompts([9, 4], seed=1), steps=3)
    assert diff <= ATOL
    assert backend.frames == 2  # prefill and step


def test_dreamzero_device_path_inductor(device_path):
    dense = _dreamzero_dense(num_chunks=4, steps=1)
    paged, backend = _dreamzero_paged("reference", False, num_chunks=4, steps=1, inner="inductor")
    assert _max_diff(dense, paged) <= ATOL and backend.frames == 1


# ---- the Triton kernel under the interpreter ---------------------------------------------------------------


def test_dreamzero_triton_rollout(whole_model=False):
    """A small model, 4 chunks, 1 denoise step each: the window fills and slides past the sink."""
    dense = _dreamzero_dense(num_chunks=4, steps=1, cfg=DZ_SMALL)
    paged, backend = _dreamzero_paged("triton", whole_model, num_chunks=4, steps=1, cfg=DZ_SMALL)
    assert _max_diff(dense, paged) <= ATOL
    assert backend.frames == 1


@pytest.mark.parametrize("whole_model", [False, True], ids=["regional", "whole-model"])
def test_hunyuan_triton_generation(whole_model):
    diff, backend = _hunyuan("triton", whole_model, _hunyuan_prompts([7, 3], seed=2), steps=2, cfg=HY_SMALL)
    assert diff <= ATOL
    assert backend.frames == 2
