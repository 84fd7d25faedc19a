"""What only a CUDA device shows: kernels on the device, CUDA-graph capture with Inductor, the staging race.

Marked `gpu`; run by `benchmarks/gpu_check.py`. Without CUDA they skip, unless PAGED_KV_GPU_DRY_RUN=1
(the check's `--dry-run`): then the same code runs on the CPU -- Triton under TRITON_INTERPRET=1,
graphs emulated, aot_eager instead of Inductor, fewer chunks -- so a change that breaks these paths
shows up in CI too. Each test appends its figures (one JSON line) to $PAGED_KV_GPU_FIGURES when set.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from helpers import CountingBackend, compile_blocks, random_prompts

import paged_kv_compile  # noqa: F401  (registers torch.ops.paged_kv)
from paged_kv_compile.capture import CapturedBlocks, EmulatedGraphs, model_blocks_and_inputs, warm_up
from paged_kv_compile.families.dreamzero import dreamzero_buckets, dreamzero_runtime_config
from paged_kv_compile.families.hunyuan_image3 import hunyuan_buckets, hunyuan_runtime_config
from paged_kv_compile.driver import paged_run
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config, HunyuanImage3Model, hunyuan_generate
from paged_kv_compile.ops import flash_attn as fa
from paged_kv_compile.ops import write_attend as write_attend_module
from paged_kv_compile.runtime import PagedKVRuntime

from _opcases import dense_oracle, expected_fp8_pool, expected_pool, fp8_case, make_case, strided_view

CUDA = torch.cuda.is_available()
DRY = os.environ.get("PAGED_KV_GPU_DRY_RUN") == "1" and not CUDA
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA or DRY), reason="needs a CUDA device (PAGED_KV_GPU_DRY_RUN=1: CPU dry run)"),
    pytest.mark.usefixtures("fresh_dynamo"),
]
INNER = "aot_eager" if DRY else "inductor"
FP32_ATOL = 1e-5 if DRY else 1e-4  # fp32 SDPA on a GPU reorders its sums; the CPU oracle holds to 1e-5

# Window 6 frames + 2-frame sink, chunk 2 frames: slides after 3 commits, resets after 8 chunks. The dry run
# (interpreted Triton) takes 2 layers, 2 heads and 4-token frames.
DZ_CFG = DreamZeroConfig(sink_size=2) if not DRY else DreamZeroConfig(
    num_layers=2, dim=32, num_heads=2, head_dim=16, ffn_dim=64, frame_seqlen=4, action_register_length=2, text_len=4,
    sink_size=2)
HY_CFG = HunyuanImage3Config() if not DRY else HunyuanImage3Config(
    num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate=64, image_h=2, image_w=2)
HY_CAPACITY = 12


def record(name: str, **figures) -> None:
    path = os.environ.get("PAGED_KV_GPU_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, "device": DEVICE, **figures}) + "\n")


@pytest.fixture
def no_host_checks(monkeypatch):
    monkeypatch.setattr(write_attend_module, "CHECK_VALUES", False)  # as on a device: no host reads


# ---- the Triton kernel on the device --------------------------------------------------------------------

GEOMETRIES = {
    "gqa2, padded row, block 3": dict(seed=10, hkv=2, ratio=2, head_dim=64, block_size=3, tokens=5,
                                      prefixes=[40, 0, 17], new_counts=[5, 0, 3], modes=["random", "padded", "causal"],
                                      layout="transposed"),
    "mha, block 16, padding first": dict(seed=12, hkv=4, ratio=1, head_dim=128, block_size=16, tokens=33,
                                         prefixes=[100, 7], new_counts=[33, 20], modes=["full", "random"],
                                         right_aligned=True, extra_width=2),
}


def _on_device(case, meta_layout: str):
    """The case's tensors on DEVICE; the metadata as strided views there when asked."""
    moved = {name: getattr(case, name).to(DEVICE) for name in
             ("query", "key", "value", "pool", "slot_mapping", "block_table", "seq_lens", "kv_visible_end")}
    if meta_layout == "strided":
        fillers = {"slot_mapping": -1, "block_table": 0, "seq_lens": 0, "kv_visible_end": 10**6}
        for name, filler in fillers.items():
            moved[name] = strided_view(moved[name].contiguous(), filler)
    return moved


@pytest.mark.parametrize("meta_layout", ["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_triton_kernel_on_device(name, dtype, meta_layout, no_host_checks):
    if DRY and dtype == torch.bfloat16:
        # Measured with triton 3.7.1: the interpreter's tl.dot on two bfloat16 16x16 tiles is off by ~1e10.
        pytest.skip("Triton's CPU interpreter computes bfloat16 tl.dot wrongly; bf16 runs on the GPU only")
    case = make_case(**GEOMETRIES[name], dtype=dtype)
    t = _on_device(case, meta_layout)
    before = t["pool"].clone()
    args = [t[n] for n in ("query", "key", "value", "pool", "slot_mapping", "block_table", "seq_lens",
                           "kv_visible_end")]
    got = torch.ops.paged_kv.write_attend(*args, case.scale, "triton")
    want = dense_oracle(case)
    diff = (got.float().cpu() - want).abs().max().item()
    record(f"triton op {name} {dtype} {meta_layout}", max_abs_diff_vs_dense=diff)
    assert diff <= (FP32_ATOL if dtype == torch.float32 else 2e-2)
    case.pool = before.cpu()
    assert torch.equal(t["pool"].cpu(), expected_pool(case, before.cpu())), "exactly the valid slots written"


@pytest.mark.parametrize("pool_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("kernel", ["triton", "reference"])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_fp8_pool_on_device(name, kernel, pool_dtype, no_host_checks):
    """FP8 pool on the device: the quantized bytes equal ops/fp8.py's on the CPU bit for bit, and attention
    matches dense fp32 attention over the same quantize-dequantize round trip (tests/test_op_fp8.py on CPU)."""
    if CUDA and kernel == "triton" and pool_dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's float8_e4m3fn needs compute capability >= 8.9")
    case = make_case(**GEOMETRIES[name])
    pool, scales, oracle = fp8_case(case, pool_dtype, seed=7)
    t = _on_device(case, "contiguous")
    t["pool"] = pool.to(DEVICE)
    args = [t[n] for n in ("query", "key", "value", "pool", "slot_mapping", "block_table", "seq_lens",
                           "kv_visible_end")]
    got = torch.ops.paged_kv.write_attend(*args, case.scale, kernel, kv_scales=scales.to(DEVICE))
    diff = (got.float().cpu() - dense_oracle(oracle)).abs().max().item()
    record(f"fp8 pool {kernel} {name} {pool_dtype}", max_abs_diff_vs_dense=diff,
           oracle="dense fp32 attention over the same quantize-dequantize round trip of K/V")
    assert diff <= FP32_ATOL
    want = expected_fp8_pool(case, pool, scales)
    assert torch.equal(t["pool"].cpu().view(torch.uint8), want.view(torch.uint8)), "quantized bytes at the slots"


# ---- both families' loops, compiled with Inductor, captured and replayed --------------------------------


def _warm_up(model, runtime, granularity: str = "block") -> CapturedBlocks:
    """warm_up (CUDA graphs) on a GPU; in the dry run the same with emulated graphs."""
    if CUDA:
        return warm_up(model, runtime, progress=False, granularity=granularity)
    blocks, inputs, family = model_blocks_and_inputs(model, runtime)
    buckets = runtime.config.buckets or (dreamzero_buckets(model.cfg) if family == "dreamzero" else None)
    captured = CapturedBlocks(blocks, runtime, inputs, buckets=buckets, graphs=EmulatedGraphs(),
                              granularity=granularity)
    captured.warmup(progress=False)
    return captured.install()


def _dreamzero_dense(num_chunks: int, steps: int) -> dict:
    with torch.no_grad():
        return dreamzero_rollout(DreamZeroModel(DZ_CFG, seed=1).to(DEVICE), num_chunks=num_chunks,
                                 num_inference_steps=steps, seed=3)


@pytest.mark.parametrize("kernel", ["triton", "reference"])
def test_dreamzero_captured_rollout_matches_dense_eager(kernel, no_host_checks):
    num_chunks, steps = (3, 1) if DRY else (10, 2)  # 10 chunks: the window slides, keeps its sink, resets
    dense = _dreamzero_dense(num_chunks, steps)
    model = DreamZeroModel(DZ_CFG, seed=1).to(DEVICE)
    runtime = PagedKVRuntime(dreamzero_runtime_config(DZ_CFG, block_size=DZ_CFG.frame_seqlen // 2, kernel=kernel,
                                                      device=DEVICE))
    runtime.bind(model.blocks)
    backend = CountingBackend({"inner_compiler": INNER if kernel == "triton" else "aot_eager"})
    compile_blocks(model.blocks, backend)
    t0 = time.perf_counter()
    captured = _warm_up(model, runtime)
    warm_s = time.perf_counter() - t0
    assert captured.capture
    before = captured.addresses()
    t0 = time.perf_counter()
    with torch.no_grad(), captured.serving():
        paged = paged_run(model, runtime, num_chunks=num_chunks, num_inference_steps=steps, seed=3)
    if CUDA:
        torch.cuda.synchronize()
    diff = max((dense[k] - paged[k]).abs().max().item() for k in ("video", "actions"))
    record(f"dreamzero captured rollout {kernel}", max_abs_diff_vs_dense=diff, chunks=num_chunks, steps=steps,
           replays=captured.stats["replays"], inner=backend.options["inner_compiler"], warmup_s=round(warm_s, 2),
           rollout_s=round(time.perf_counter() - t0, 2), graphs="cuda" if CUDA else "emulated")
    assert diff <= FP32_ATOL
    assert backend.frames == 1 and captured.stats["replays"] > 0 and captured.stats["direct_calls"] == 0
    assert captured.addresses() == before
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


def _prompts(lengths, seed=0):
    return random_prompts(HY_CFG.vocab, lengths, seed)


@pytest.mark.parametrize("kernel", ["triton", "reference"])
def test_hunyuan_captured_generation_matches_dense_eager(kernel, no_host_checks):
    steps = 2 if DRY else 4
    requests = [_prompts([9, 5], seed=1), _prompts([12, 3], seed=2)]
    with torch.no_grad():
        dense = [hunyuan_generate(HunyuanImage3Model(HY_CFG, seed=2).to(DEVICE), p, prefix_capacity=HY_CAPACITY,
                                  num_steps=steps, seed=5) for p in requests]
    model = HunyuanImage3Model(HY_CFG, seed=2).to(DEVICE)
    runtime = PagedKVRuntime(hunyuan_runtime_config(HY_CFG, max_prefix=HY_CAPACITY, block_size=4, kernel=kernel,
                                                    buckets=hunyuan_buckets(HY_CFG, [HY_CAPACITY], rows=(2,)),
                                                    device=DEVICE))
    runtime.bind(model.layers)
    backend = CountingBackend({"inner_compiler": INNER if kernel == "triton" else "aot_eager"})
    compile_blocks(model.layers, backend)
    captured = _warm_up(model, runtime)
    with torch.no_grad(), captured.serving():
        got = [paged_run(model, runtime, prompts=p, owner_id=f"r{i}", prefix_capacity=HY_CAPACITY,
                         num_steps=steps, seed=5) for i, p in enumerate(requests)]
    diff = max((g - d).abs().max().item() for g, d in zip(got, dense))
    record(f"hunyuan captured generation {kernel}", max_abs_diff_vs_dense=diff, requests=len(requests), steps=steps,
           replays=captured.stats["replays"], inner=backend.options["inner_compiler"],
           graphs="cuda" if CUDA else "emulated")
    assert diff <= FP32_ATOL
    assert backend.frames == 2 and captured.stats["direct_calls"] == 0  # prefill and step buckets
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


@pytest.mark.parametrize("family", ["dreamzero", "hunyuan"])
def test_one_graph_per_forward_captured_matches_dense_eager(family, no_host_checks):
    """granularity="forward": one CUDA graph per bucket over every block, one launch per forward, through the
    models' own loops (DreamZero's cross-attention K/V in shared regions: a forward graph takes no per-layer
    tensors)."""
    kernel = "triton" if CUDA else "reference"
    backend = CountingBackend({"inner_compiler": INNER if CUDA else "aot_eager"})
    if family == "dreamzero":
        num_chunks, steps = (3, 1) if DRY else (10, 2)
        dense = _dreamzero_dense(num_chunks, steps)
        model = DreamZeroModel(DZ_CFG, seed=1).to(DEVICE)
        runtime = PagedKVRuntime(dreamzero_runtime_config(DZ_CFG, block_size=DZ_CFG.frame_seqlen // 2, kernel=kernel,
                                                          cross_regions=2, device=DEVICE))
        runtime.bind(model.blocks)
        compile_blocks(model.blocks, backend)
        captured = _warm_up(model, runtime, "forward")
        with torch.no_grad(), captured.serving():
            paged = paged_run(model, runtime, num_chunks=num_chunks, num_inference_steps=steps, seed=3,
                              shared_kv=True)
        forwards = num_chunks * steps + num_chunks - 1 - len(dense["resets"])
        diff = max((dense[k] - paged[k]).abs().max().item() for k in ("video", "actions"))
    else:
        steps, prompts = (2 if DRY else 4), _prompts([9, 5], seed=1)
        with torch.no_grad():
            want = hunyuan_generate(HunyuanImage3Model(HY_CFG, seed=2).to(DEVICE), prompts,
                                    prefix_capacity=HY_CAPACITY, num_steps=steps, seed=5)
        model = HunyuanImage3Model(HY_CFG, seed=2).to(DEVICE)
        runtime = PagedKVRuntime(hunyuan_runtime_config(
            HY_CFG, max_prefix=HY_CAPACITY, block_size=4, kernel=kernel,
            buckets=hunyuan_buckets(HY_CFG, [HY_CAPACITY], rows=(2,)), device=DEVICE))
        runtime.bind(model.layers)
        compile_blocks(model.layers, backend)
        captured = _warm_up(model, runtime, "forward")
        with torch.no_grad(), captured.serving():
            got = paged_run(model, runtime, prompts=prompts, owner_id="r", prefix_capacity=HY_CAPACITY,
                            num_steps=steps, seed=5)
        forwards, diff = steps, (got - want).abs().max().item()
    if CUDA:
        torch.cuda.synchronize()
    record(f"{family} one graph per forward {kernel}", max_abs_diff_vs_dense=diff, forwards=forwards,
           launches=captured.stats["replays"], graphs="cuda" if CUDA else "emulated")
    assert diff <= FP32_ATOL
    assert captured.stats["replays"] == forwards and captured.stats["direct_calls"] == 0
    assert all(b.cuda_graphs == 1 for b in captured.report.buckets)
    assert runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


# ---- flash-attn (only where a build is importable) -----------------------------------------------------


def test_flash_attn_captured_matches_reference(no_host_checks):
    if not CUDA:
        pytest.skip("flash-attn runs on CUDA only")
    capability = torch.cuda.get_device_capability()[0]
    picks = {block: fa.select(block, capability=capability) for block in (16, 256)}  # FA2 needs 256
    usable = [block for block, picked in picks.items() if not isinstance(picked, str)]
    if not usable:
        pytest.skip(f"no flash-attn build here: {picks[16]}")
    block = usable[0]
    build = fa.describe(block)
    case = make_case(seed=5, hkv=2, ratio=4, head_dim=128, block_size=block, tokens=32, prefixes=[300, 40],
                     new_counts=[32, 32], modes=["full", "full"], right_aligned=True, dtype=torch.bfloat16)
    t = _on_device(case, "contiguous")
    args = [t[n] for n in ("query", "key", "value", "pool", "slot_mapping", "block_table", "seq_lens",
                           "kv_visible_end")]
    want = torch.ops.paged_kv.write_attend(*[a.clone() for a in args], case.scale, "reference", visibility="full")

    @torch.compile(backend="inductor", fullgraph=True)
    def step(*a):
        return torch.ops.paged_kv.write_attend(*a, case.scale, "flash_attn", visibility="full") * 1.0

    for _ in range(2):
        step(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*args)
    graph.replay()
    torch.cuda.synchronize()
    diff = (out.float() - want.float()).abs().max().item()
    record("flash_attn captured op", build=build, block_size=block, max_abs_diff_vs_reference=diff)
    assert diff <= 2e-2


# ---- the metadata staging buffer with a host that runs ahead -------------------------------------------


def test_metadata_staging_with_the_host_running_ahead():
    """The stream is kept busy, so every build's copy is still pending when the host stages the next one.
    Each forward's metadata, snapshotted on the stream right after its copy, must be that forward's."""
    if not CUDA:
        pytest.skip("needs asynchronous copies (CUDA); the CPU version is tests/test_metadata.py")
    from paged_kv_compile.config import Bucket
    from paged_kv_compile.metadata import MetadataBuilder
    from paged_kv_compile.families.dreamzero import DreamZeroSpec

    spec = DreamZeroSpec(frame_seqlen=8, chunk_frames=1, window_frames=4, sink_frames=0, action_tokens=3)
    from paged_kv_compile import PagedKVConfig

    cfg = PagedKVConfig(num_layers=3, num_kv_heads=1, head_dim=4, block_size=4, blocks_per_layer=32, max_rows=2,
                        scratch_tokens_per_row=32)
    rt = PagedKVRuntime(cfg)
    rt.admit("s", spec, rows=2)
    plans = []
    for commit in (True, True, False, True, True, False, True, True):
        plan = rt.scheduler.plan("s", "commit" if commit else "denoise")
        plans.append(plan)
        rt.scheduler.finish_forward(plan)
    bucket = Bucket(2, plans[0].tokens, plans[0].context)
    sync = MetadataBuilder(rt.pool, device="cpu")
    want = []
    for plan in plans:
        m = sync.build(bucket, plan.rows)
        want.append([t.clone() for t in (m.slot_mapping, m.block_table, m.seq_lens, m.kv_visible_end)])
    builder = MetadataBuilder(rt.pool, device="cuda")
    meta = builder.buffers(bucket)
    torch.cuda.synchronize()
    snapshots = []
    for plan in plans:
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time ahead of each copy: the host runs ahead
        builder.build(bucket, plan.rows)
        snapshots.append([t.clone() for t in (meta.slot_mapping, meta.block_table, meta.seq_lens,
                                              meta.kv_visible_end)])
    torch.cuda.synchronize()
    bad = [i for i, (got, exp) in enumerate(zip(snapshots, want))
           if not all(torch.equal(g.cpu(), e) for g, e in zip(got, exp))]
    record("metadata staging, host ahead", forwards=len(plans), wrong_forwards=bad)
    assert not bad, f"forwards {bad} received another forward's metadata"
