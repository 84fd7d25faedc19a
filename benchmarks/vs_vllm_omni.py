"""The same work three ways: dense eager, vllm-omni 0.30.0's own paged KV, and ours (`backend="paged_kv"`).

DreamZero: vllm-omni's `ARDiffusionModelRunner` serves one session (5 requests: a 1-frame first commit, commits,
denoising with action/state registers, two CFG branches as separate batch-1 forwards, an explicit reset and a
window reset) through `DreamZeroPipeline`'s own KV and denoising methods on a tiny `CausalWanModel`
(tests/upstream/dreamzero_runner.py says what is stubbed). The three columns differ only in the runner's KV:
dense caches (the model's dense path, the oracle), vllm-omni's `ARDiffusionKVCache` (vLLM's KVCacheManager and
its CPU reference attention), and `PagedKVARDiffusionModelRunner` (our runtime, selected by
`diffusion_model_runner_cls`). Two more rows of ours: "paged_kv graphs" (`cuda_graphs: block`: warm-up and
capture at startup, serving by replay; on this CPU the replay runs only the recorded compiled graphs) and
"paged_kv fp8" (an e4m3 pool, scales 0.02 set at startup); "startup s" is building the runner (for the graphs row,
the warm-up requests and the capture), "1st req s" the first served request, "steady req s" the median request of
the timed passes.

HunyuanImage-3: vllm-omni's `HunyuanImage3DecoderLayer` x2, two right-padded CFG rows, a prefill and 3 steps,
bf16 under CPU autocast as its pipeline runs (tests/upstream/hunyuan_pipeline.py). Dense eager; vllm-omni's own
paged KV (`diffusion_kv_mode="paged_scheduler"`) is driven step by step until it stops
(tests/upstream/hunyuan_diffusion_kv.py); ours through `adapters.vllm_omni_hunyuan`.

Compile settings are vllm-omni's own: DreamZero's `setup_compile` compiles each DiT block with
`{"mode": "default", "fullgraph": True, "dynamic": False}` (Inductor); ours compiles the same blocks with
`backend="paged_kv"` at those settings (Inductor inside) plus `current_start_frame` as a dynamic source.
HunyuanImage-3's runner compiles regionally, which skips HunyuanImage3Model (no `_repeated_blocks`): it runs
eager there; ours compiles each decoder layer (`fullgraph=True, dynamic=False`). Frames, graph breaks and
recompiles are dynamo's counters for the whole run. Host time per forward: wall time of the served requests
(or layer calls) divided by model forwards, after a first pass that compiled everything; "KV host" is the time
inside the KV layer's calls (get/prepare/commit/close) per forward. Memory at the real sizes comes from each
system's own sizing code (vllm-omni's `ARDiffusionKVCache` built without a device, our `plan_budget`).

    python -m benchmarks.vs_vllm_omni [--json] [--no-compile] [--repeats 3] [--threads 1] [--dreamzero-only]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):  # tests/upstream holds the CPU harness for vllm-omni's classes
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
from torch._dynamo.utils import counters, guard_failures  # noqa: E402

from benchmarks._common import bench_settings, format_table, machine_info  # noqa: E402

GiB = 2**30
COLUMNS = ("dense", "vllm-omni", "paged_kv")
#: rows of ours with more runner options (model_config["paged_kv"]), after the three columns
OUR_VARIANTS = {"paged_kv": {}, "paged_kv graphs": {"cuda_graphs": "block"},
                "paged_kv fp8": {"kv_dtype": "float8_e4m3fn", "kv_scales": {"k": 0.02, "v": 0.02}}}
DZ_CALLS = 5
DZ_RESET_AT = (2,)  # an explicit reset request (extra_args["reset"]); the window resets on its own at call 4
SETUP_COMPILE_DIT = {"mode": "default", "fullgraph": True, "dynamic": False}  # pipeline_dreamzero.py setup_compile


def _harness():
    from upstream import dreamzero_runner, hunyuan_diffusion_kv, hunyuan_pipeline, vllm_omni_cpu

    vllm_omni_cpu.install()
    vllm_omni_cpu.init_distributed()
    return vllm_omni_cpu, dreamzero_runner, hunyuan_pipeline, hunyuan_diffusion_kv


def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()


def _compile_stats() -> dict:
    """Compiled frames (dynamo's unique graphs), recompiles (frames compiled for a code object that already had
    one: the cache entries of every code whose guards failed, less one each) and graph breaks."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    recompiles = sum(max(len(_debug_get_cache_entry_list(code)) - 1, 0) for code in guard_failures)
    return {"frames": int(counters["stats"]["unique_graphs"]), "recompiles": recompiles,
            "graph_breaks": sum(counters["graph_break"].values())}


@contextlib.contextmanager
def _timed(methods: list[tuple[type, str]], total: list[float]) -> Iterator[None]:
    """Add the wall time spent inside these methods (outermost calls only) to total[0]."""
    depth = [0]
    saved = [(cls, name, cls.__dict__[name]) for cls, name in methods]

    def wrap(fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    total[0] += time.perf_counter() - start
        return timed

    for cls, name, fn in saved:
        setattr(cls, name, wrap(fn))
    try:
        yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def _max_err(got: list[dict], want: list[dict]) -> float:
    return max((a[k] - b[k]).abs().max().item() for a, b in zip(got, want) for k in ("video", "actions"))


# ---- DreamZero ------------------------------------------------------------------------------------------------


def _kv_methods(column: str) -> list[tuple[type, str]]:
    from paged_kv_compile.adapters import vllm_omni_ar_diffusion as ours
    from upstream import dreamzero_runner as dr
    from vllm_omni.experimental.ar_diffusion.kv_cache.paged_attention import ARDiffusionPagedForwardContext
    from vllm_omni.experimental.ar_diffusion.kv_cache.state import ARDiffusionKVState

    if column == "vllm-omni":
        return [(ARDiffusionKVState, "get_kv_caches"), (ARDiffusionPagedForwardContext, "prepare"),
                (ARDiffusionKVState, "commit_paged_context")]
    if column in OUR_VARIANTS:
        return [(ours.PagedKVSessionState, "get_kv_caches"), (ours._BranchForward, "prepare"),
                (ours.PagedKVSessionState, "commit_paged_context"), (ours.PagedKVSessionState, "end_invocation")]
    return [(dr.DenseSessionState, "get_kv_caches"), (dr._DenseForward, "prepare"),
            (dr.DenseSessionState, "commit_paged_context")]


def dreamzero_column(column: str, *, compiled: bool, oracle: list[dict] | None, repeats: int,
                     threads: int) -> tuple[dict, list[dict]]:
    """Serve the session plan through the runner with this column's KV; parity, compile counters, host times."""
    omni, dr, _, _ = _harness()
    from paged_kv_compile.adapters.vllm_omni_ar_runner import RUNNER_PATH

    geometry = dr.TinyGeometry()
    runner_cls = {"dense": dr.DENSE_RUNNER, "vllm-omni": None}.get(column, RUNNER_PATH)
    model_config = {"paged_kv": {"inner_compiler": "inductor" if compiled else "aot_eager",
                                 **OUR_VARIANTS.get(column, {})}}
    od = dr.diffusion_config(runner_cls=runner_cls, enforce_eager=not compiled, model_config=model_config)
    inputs = dr.request_inputs(geometry, DZ_CALLS)

    def plan(session: str):
        return [dr.make_request(f"{session}-{i}", session, extra, reset=i in DZ_RESET_AT)
                for i, extra in enumerate(inputs)]

    with bench_settings(threads=threads):  # resets dynamo on entry and exit: everything below shares its caches
        _fresh_dynamo()
        with omni.model_context(od):
            pipeline = dr.build_pipeline(geometry, od)
            if compiled and column not in OUR_VARIANTS:  # ours compiles the blocks itself (vllm_omni_ar_runner)
                for block in pipeline.transformer.blocks:
                    block.forward = torch.compile(block.forward, **SETUP_COMPILE_DIT)
            t0 = time.perf_counter()
            runner = dr.build_runner(pipeline, od, available_bytes=8 * GiB)
            startup_s = time.perf_counter() - t0
        forwards = [0]
        pipeline.transformer.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        request_s: list[float] = []
        t0 = time.perf_counter()
        with omni.model_context(od):
            outs = []
            for req in plan("first"):
                t1 = time.perf_counter()
                outs += dr.serve(runner, [req])
                request_s.append(time.perf_counter() - t1)
        first_s = time.perf_counter() - t0
        stats = _compile_stats()
        per_forward, kv_host, steady = [], [], []
        for r in range(repeats):
            forwards[0], kv_total = 0, [0.0]
            with _timed(_kv_methods(column), kv_total), omni.model_context(od):
                t0 = time.perf_counter()
                again = dr.serve(runner, plan(f"timed{r}"))
                wall = time.perf_counter() - t0
            per_forward.append(1e3 * wall / forwards[0])
            steady.append(wall / DZ_CALLS)
            kv_host.append(1e6 * kv_total[0] / forwards[0])
        after = _compile_stats()
    graphs = getattr(runner, "graphs", None)
    row = {"column": column, "mode": "compiled" if compiled else "eager", "forwards": forwards[0],
           "first_pass_s": round(first_s, 2), "startup_s": round(startup_s, 2),
           "first_request_s": round(request_s[0], 3), "steady_request_s": _median(steady),
           "ms_per_forward": _median(per_forward),
           "ms_per_forward_min": round(min(per_forward), 3), "kv_host_us_per_forward": _median(kv_host),
           **stats, "compiled_in_timed_passes": after["frames"] - stats["frames"],
           "kv": type(runner.kv_cache).__name__, "repeat_equals_first": _max_err(again, outs) == 0.0,
           "replays": graphs.stats["replays"] if graphs is not None else 0}
    if oracle is not None:
        row["max_abs_err_vs_dense_eager"] = _max_err(outs, oracle)
    return row, outs


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 3) if xs else float("nan")


def dreamzero_rows(*, compile_too: bool, repeats: int, threads: int) -> list[dict]:
    rows = []
    oracle_row, oracle = dreamzero_column("dense", compiled=False, oracle=None, repeats=repeats, threads=threads)
    oracle_row["max_abs_err_vs_dense_eager"] = 0.0
    rows.append(oracle_row)
    ours = (*COLUMNS[1:], *list(OUR_VARIANTS)[1:])
    for column in ours:
        rows.append(dreamzero_column(column, compiled=False, oracle=oracle, repeats=repeats, threads=threads)[0])
    if compile_too:
        for column in (COLUMNS[0], *ours):
            rows.append(dreamzero_column(column, compiled=True, oracle=oracle, repeats=repeats, threads=threads)[0])
    return rows


def frames_by_window(max_chunk_sizes: tuple[int, ...] = (2, 5)) -> list[dict]:
    """Compiled frames over two window cycles as the window grows, under dynamo's default recompile limit.

    vllm-omni's blocks at `setup_compile`'s dynamo settings (`fullgraph=True, dynamic=False`; aot_eager inside,
    since dynamo's frames and guards do not depend on the inner compiler) against ours (aot_eager inside). A
    window of `2 * max_chunk_size + 1` frames; a failure (e.g. the recompile limit) is reported, not raised.
    """
    omni, dr, _, _ = _harness()
    from paged_kv_compile.adapters.vllm_omni_ar_runner import RUNNER_PATH

    rows = []
    for max_chunk in max_chunk_sizes:
        geometry = dataclasses.replace(dr.TinyGeometry(), max_chunk_size=max_chunk, steps=1)
        window = 2 * max_chunk + 1
        calls = 2 * (1 + math.ceil((window - 1) / geometry.num_frame_per_block))
        inputs = dr.request_inputs(geometry, calls)
        for column, runner_cls in (("vllm-omni", None), ("paged_kv", RUNNER_PATH)):
            od = dr.diffusion_config(runner_cls=runner_cls, enforce_eager=False,
                                     model_config={"paged_kv": {"inner_compiler": "aot_eager"}})
            torch._dynamo.reset()
            _fresh_dynamo()
            served, error = 0, None
            with omni.model_context(od):
                pipeline = dr.build_pipeline(geometry, od)
                if runner_cls is None:
                    for block in pipeline.transformer.blocks:
                        block.forward = torch.compile(block.forward, backend="aot_eager", fullgraph=True,
                                                      dynamic=False)
                runner = dr.build_runner(pipeline, od, available_bytes=8 * GiB)
                try:
                    for i, extra in enumerate(inputs):
                        dr.serve(runner, [dr.make_request(f"w{i}", "s", extra)])
                        served += 1
                except Exception as exc:  # noqa: BLE001 - reported in the table
                    error = f"{type(exc).__name__} at request {served + 1}: {str(exc).splitlines()[0][:120]}"
            rows.append({"column": column, "window_frames": window, "requests": calls, "served": served,
                         **_compile_stats(), "error": error or ""})
    torch._dynamo.reset()
    return rows


# ---- DreamZero: K sessions in one forward (the model call the upstream change would make) ----------------------


def dreamzero_batched_sessions(ks: tuple[int, ...] = (1, 2, 4), *, calls: int = 2, repeats: int = 3,
                               threads: int = 1) -> list[dict]:
    """K sessions of vllm-omni's `CausalWanModel` in lockstep: each model call carries the K sessions' rows of one
    CFG branch (batch K, `runtime.forward_batch`), against the same K sessions run one after another (batch 1).

    Below the pipeline: the model call alone (through the runner, pipeline loops included:
    `dreamzero_runner_batched_sessions`). The model gets the stand-ins directly (its unflagged cache path), as the
    runner's batched step hands them (`DreamZeroPagedKV.run_batched`). Parity: every batched
    session's outputs against the same session run alone. Eager mode, `aot_eager` inside, fp32. `calls` pipeline
    calls per session (2: a 1-frame commit, a denoise, a 2-frame commit, a denoise; the window resets after
    that at the tiny geometry), one denoising step each, both CFG branches."""
    omni, _, _, _ = _harness()
    from paged_kv_compile.adapters.vllm_omni_ar_diffusion import dreamzero_spec
    from paged_kv_compile.config import PagedKVConfig
    from paged_kv_compile.families.dreamzero import session_blocks_per_row
    from paged_kv_compile.runtime import PagedKVRuntime
    from upstream.dreamzero_pipeline import cross_attention_caches

    kmax = max(ks)
    rows = []
    with bench_settings(threads=threads), omni.model_context(), torch.no_grad():
        _fresh_dynamo()
        model = omni.tiny_dreamzero_model()
        spec = dreamzero_spec(model)
        fs, nfpb = model.frame_seqlen, model.num_frame_per_block
        attn = model.blocks[0].self_attn
        nact, nstate = attn.num_action_per_block, attn.num_state_per_block
        per_session = 2 * session_blocks_per_row(spec, fs)
        cfg = PagedKVConfig(
            num_layers=len(model.blocks), num_kv_heads=attn.tp_num_heads, head_dim=attn.head_dim, block_size=fs,
            blocks_per_layer=2 * kmax * per_session, max_rows=kmax, scratch_tokens_per_row=spec.tokens_per_forward,
            buckets=tuple(b for k in sorted({1, *ks}) for b in spec.buckets(rows=k)), dtype=torch.float32,
            kernel="reference",
            inner_compiler="aot_eager")
        runtime = PagedKVRuntime(cfg)
        runtime.bind(model.blocks)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(cfg.buckets))
        for block in model.blocks:
            block.forward = torch.compile(type(block).forward.__get__(block), backend="paged_kv", fullgraph=True,
                                          dynamic=False)
        standins = {k: runtime.standin(2, k, attn.max_attention_size, attn.tp_num_heads, attn.head_dim)
                    for k in sorted({1, *ks})}
        g = torch.Generator().manual_seed(5)
        text_dim = model.text_embedding[0].in_features
        state_dim = model.state_encoder.layer1.W.shape[1]
        sessions = []
        for n in range(kmax):
            text = torch.randn(1, model.text_len, text_dim, generator=g)
            contexts = (text, torch.zeros_like(text))
            sessions.append({
                "contexts": contexts, "cross": [cross_attention_caches(model, c) for c in contexts],
                "state": torch.randn(1, nstate, state_dim, generator=g),
                "obs": [torch.randn(1, 4, 1 if i == 0 else nfpb, 4, 8, generator=g) for i in range(calls)],
                "noise": [torch.randn(1, 4, nfpb, 4, 8, generator=g) for _ in range(calls)],
                "noise_action": [torch.randn(1, nact, 4, generator=g) for _ in range(calls)]})

        def cat(tensors):
            return torch.cat(tensors, dim=0)

        made = [0]

        def model_call(group, ids, kind, branch, x, timestep, seq_len, start, **extra):
            made[0] += 1
            cross = [{"is_init": True, "k": cat([sessions[i]["cross"][branch][layer]["k"] for i in group]),
                      "v": cat([sessions[i]["cross"][branch][layer]["v"] for i in group])}
                     for layer in range(len(model.blocks))]
            context = cat([sessions[i]["contexts"][branch] for i in group])
            with runtime.forward_batch([(ids[i], kind, {"branch": branch}) for i in group]):
                video, action, _ = model(x, timestep, context, seq_len, [standins[len(group)]] * len(model.blocks),
                                         start, crossattn_cache=cross, **extra)
            return video, action

        def run(group, ids):
            """`calls` pipeline calls (dreamzero_pipeline.run_session's plan, one denoising step) of the sessions in
            `group`, all in lockstep; their video and action outputs per session."""
            out = {i: [] for i in group}
            csf = 0
            for c in range(calls):
                if csf == 0:
                    for b in (0, 1):
                        model_call(group, ids, "commit", b, cat([sessions[i]["obs"][c] for i in group]),
                                   torch.zeros(len(group), 1, dtype=torch.long), fs, 0)
                    csf = 1
                else:
                    for b in (0, 1):
                        model_call(group, ids, "commit", b, cat([sessions[i]["obs"][c] for i in group]),
                                   torch.zeros(len(group), nfpb, dtype=torch.long), nfpb * fs, csf - nfpb)
                k = len(group)
                preds = [model_call(group, ids, "denoise", b, cat([sessions[i]["noise"][c] for i in group]),
                                    torch.full((k, nfpb), 500, dtype=torch.long), nfpb * fs, csf,
                                    action=cat([sessions[i]["noise_action"][c] for i in group]),
                                    timestep_action=torch.full((k, nact), 500, dtype=torch.long),
                                    state=cat([sessions[i]["state"] for i in group])) for b in (0, 1)]
                for j, i in enumerate(group):
                    out[i] += [p[0][j] for p in preds] + [p[1][j] for p in preds]
                csf += nfpb
            return out

        def admitted(tag, group):
            ids = {i: f"{tag}-{i}" for i in group}
            for i in group:
                runtime.admit(ids[i], spec, rows=2)
            return ids

        def release(ids):
            for owner in ids.values():
                runtime.release(owner)

        serial = 0
        for k in ks:
            group = list(range(k))
            alone, together, t_seq, t_batch = {}, {}, [], []
            for r in range(repeats + 1):  # pass 0 compiles
                made[0] = 0
                t0 = time.perf_counter()
                for i in group:
                    ids = admitted(f"seq{serial}", [i])
                    serial += 1
                    alone.update(run([i], ids))
                    release(ids)
                t1 = time.perf_counter()
                sequential_calls, made[0] = made[0], 0
                ids = admitted(f"batch{serial}", group)
                serial += 1
                together = run(group, ids)
                release(ids)
                t2 = time.perf_counter()
                if r:
                    t_seq.append(t1 - t0)
                    t_batch.append(t2 - t1)
            err = max((a - b).abs().max().item() for i in group for a, b in zip(together[i], alone[i]))
            rows.append({"sessions": k, "model_calls_sequential": sequential_calls, "model_calls_batched": made[0],
                         "sequential_s": _median(t_seq), "batched_s": _median(t_batch),
                         "sequential_over_batched": round(statistics.median(t_seq) / statistics.median(t_batch), 2),
                         "max_abs_err_vs_alone": err})
        assert runtime.owner_ids() == []
        runtime.close()
    return rows


def dreamzero_runner_batched_sessions(ks: tuple[int, ...] = (1, 2, 4), *, calls: int = 2, repeats: int = 3,
                                      threads: int = 1) -> list[dict]:
    """K sessions THROUGH the runner: the engine's batch of K requests (one per session, `execute_model_batch`,
    `max_num_seqs = max(ks)`), served in lockstep with one batched model call per step, against the same K
    sessions' requests served one after another (`execute_model`), on the same runner. `calls` requests per
    session (the first a 1-frame commit, then 2-frame chunks), the tiny geometry's two denoising steps, both CFG
    branches, eager mode, `aot_eager` inside, fp32. Parity: every batched session's outputs against the same
    session served alone; median of `repeats` passes after one that compiles."""
    omni, dr, _, _ = _harness()
    from paged_kv_compile.adapters.vllm_omni_ar_runner import RUNNER_PATH

    geometry = dr.TinyGeometry()
    kmax = max(ks)
    od = dr.diffusion_config(runner_cls=RUNNER_PATH, max_num_seqs=kmax,
                             model_config={"paged_kv": {"inner_compiler": "aot_eager", "kernel": "reference"}})
    rows = []
    with bench_settings(threads=threads), omni.model_context(od):
        _fresh_dynamo()
        runner = dr.build_runner(dr.build_pipeline(geometry, od), od, available_bytes=(7 * kmax) << 30)
        if runner._session_capacity < kmax:
            raise RuntimeError(f"the runner holds {runner._session_capacity} sessions, fewer than K={kmax}")
        calls_made = [0]
        runner.pipeline.transformer.register_forward_hook(lambda *_: calls_made.__setitem__(0, calls_made[0] + 1))
        inputs = [dr.request_inputs(geometry, calls, seed=20 + n) for n in range(kmax)]
        serial = 0
        for k in ks:
            t_seq, t_batch = [], []
            for r in range(repeats + 1):  # pass 0 compiles
                tag = f"p{serial}"
                serial += 1
                calls_made[0] = 0
                t0 = time.perf_counter()
                alone = [dr.serve(runner, [dr.make_request(f"{tag}s{n}-{i}", f"{tag}s{n}", x, reset=i == 0)
                                           for i, x in enumerate(inputs[n])]) for n in range(k)]
                t1 = time.perf_counter()
                sequential_calls, calls_made[0] = calls_made[0], 0
                together = [[] for _ in range(k)]
                for i in range(calls):
                    outs = dr.serve_batch(runner, [dr.make_request(f"{tag}b{n}-{i}", f"{tag}b{n}", inputs[n][i],
                                                                   reset=i == 0) for n in range(k)])
                    for n, out in enumerate(outs):
                        if out.error:
                            raise RuntimeError(f"batched session {n} failed: {out.error}")
                        together[n].append(out.output)
                t2 = time.perf_counter()
                for n in range(k):
                    runner.close_session(f"{tag}s{n}")
                    runner.close_session(f"{tag}b{n}")
                if r:
                    t_seq.append(t1 - t0)
                    t_batch.append(t2 - t1)
            rows.append({"sessions": k, "model_calls_sequential": sequential_calls, "model_calls_batched": calls_made[0],
                         "sequential_s": _median(t_seq), "batched_s": _median(t_batch),
                         "sequential_over_batched": round(statistics.median(t_seq) / statistics.median(t_batch), 2),
                         "max_abs_err_vs_alone": max(_max_err(together[n], alone[n]) for n in range(k))})
        assert runner.kv_cache.runtime.owner_ids() == []
    return rows


# ---- DreamZero memory at the real size --------------------------------------------------------------------------


def dreamzero_14b_ar_spec():
    """vllm-omni's `ar_diffusion_kv_cache_spec()` for DreamZero-14B geometry (i2v: text 512 + 257 image tokens;
    40 layers x 40 heads x 128; 880 tokens a frame, 2 frames a chunk, a 21-frame window: max_chunk_size=-1)."""
    from vllm_omni.diffusion.models.dreamzero.pipeline_dreamzero import (
        DREAMZERO_MODEL_OWNED_STATE_BYTES_PER_SESSION, MAX_DREAMZERO_SESSIONS)
    from vllm_omni.experimental.ar_diffusion.capability import (
        ARDiffusionCrossAttentionKVSpec, ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec)

    return ARDiffusionKVCacheSpec(
        num_layers=40, num_kv_heads=40, head_size=128, tokens_per_frame=880, frames_per_block=2, window_frames=21,
        kv_branches=(ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1)),
        session_capacity=MAX_DREAMZERO_SESSIONS,
        cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 512), ARDiffusionCrossAttentionKVSpec("image", 257)),
        max_scratch_tokens_per_branch=33, model_owned_state_bytes_per_session=DREAMZERO_MODEL_OWNED_STATE_BYTES_PER_SESSION,
    )


def dreamzero_memory(available_gib: float, fractions: tuple[float, ...]) -> list[dict]:
    """KV reserved per session and sessions per budget at DreamZero-14B, bf16, by each system's sizing code."""
    _harness()
    from vllm_omni.experimental.ar_diffusion.kv_cache.config import ARDiffusionKVConfig
    from vllm_omni.experimental.ar_diffusion.kv_cache.manager import ARDiffusionKVCache

    from paged_kv_compile.adapters.vllm_omni_ar_diffusion import plan_budget
    from paged_kv_compile.config import PagedKVConfig
    from paged_kv_compile.families.dreamzero import DreamZeroSpec

    spec = dreamzero_14b_ar_spec()
    ours_spec = DreamZeroSpec(frame_seqlen=880, chunk_frames=2, window_frames=21, action_tokens=33,
                              first_commit_frames=1, commit_action_tokens=0)  # the unbounded window slides
    available = int(available_gib * GiB)
    rows = []
    for fraction in fractions:
        config = ARDiffusionKVConfig(enable=True, chunk_size=880, window_chunks=21, gpu_memory_fraction=fraction)
        theirs = ARDiffusionKVCache(
            config, num_layers=40, num_kv_heads=40, head_size=128, dtype=torch.bfloat16, block_size=880,
            max_model_len=1 << 20, available_bytes=available, kv_branches=spec.kv_branches,
            session_capacity=spec.session_capacity, cross_attention_lengths=spec.cross_attention_lengths,
            frames_per_block=2, max_scratch_tokens_per_branch=33,
            model_owned_state_bytes_per_session=spec.model_owned_state_bytes_per_session, device=None,
        )
        page = theirs.spec.page_size_bytes * 40
        their_kv = theirs.num_local_kv_branches * (config.window_chunks + config.sink_chunks) * page
        rows.append({"system": "vllm-omni", "pool": "bf16", "gpu_memory_fraction": fraction,
                     "budget_gib": round(theirs.memory_budget_bytes / GiB, 2),
                     "kv_gib_per_session": round(their_kv / GiB, 2),
                     "cross_gib_per_session": round(theirs.cross_attention_bytes_per_session / GiB, 3),
                     "sessions": theirs.session_capacity,
                     "pool_gib": round((theirs.num_blocks_total * page) / GiB, 2)})
        for kv_dtype in (None, torch.float8_e4m3fn):
            cfg = PagedKVConfig(num_layers=40, num_kv_heads=40, head_dim=128, block_size=880, blocks_per_layer=1,
                                max_rows=2, scratch_tokens_per_row=ours_spec.tokens_per_forward, dtype=torch.bfloat16,
                                kv_dtype=kv_dtype)
            budget = plan_budget(spec, ours_spec, cfg, available_bytes=available, memory_fraction=fraction)
            rows.append({"system": "paged_kv", "pool": "fp8" if kv_dtype else "bf16", "gpu_memory_fraction": fraction,
                         "budget_gib": round(budget.budget_bytes / GiB, 2),
                         "kv_gib_per_session": round(budget.kv_bytes_per_session / GiB, 2),
                         "cross_gib_per_session": round(budget.cross_bytes_per_session / GiB, 3),
                         "sessions": budget.session_capacity,
                         "pool_gib": round((budget.session_capacity * budget.kv_bytes_per_session
                                            + budget.fixed_bytes) / GiB, 2)})
    return rows


# ---- HunyuanImage-3 ---------------------------------------------------------------------------------------------


def hunyuan_rows(*, repeats: int, threads: int) -> tuple[list[dict], dict]:
    omni, _, hp, probe_mod = _harness()
    from paged_kv_compile import PagedKVConfig, PagedKVRuntime
    from paged_kv_compile.adapters import vllm_omni_hunyuan

    req = hp.request_inputs()
    valid = torch.ones(len(hp.LENS), req["mask"].shape[-1], dtype=torch.bool)
    forwards = len(req["hidden"])

    def measured(column: str, mode: str, layers, dense, around=None) -> dict:
        """First pass (compiles, parity), then `repeats` timed passes; inside one bench_settings."""
        got = hp.run_layers(layers, req, around)
        stats = _compile_stats()
        ms = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            hp.run_layers(layers, req, around)
            ms.append(1e3 * (time.perf_counter() - t0) / forwards)
        err = 0.0 if dense is None else hp.max_err(dense, got, valid)
        return {"column": column, "mode": mode, "max_abs_err_vs_dense_eager": err, "ms_per_forward": _median(ms),
                "ms_per_forward_min": round(min(ms), 3), **stats,
                "compiled_in_timed_passes": _compile_stats()["frames"] - stats["frames"]}, got

    rows = []
    with omni.model_context() as _:
        with bench_settings(threads=threads):
            _fresh_dynamo()
            row, dense = measured("dense", "eager (as vllm-omni runs it)", hp.tiny_layers(omni), None)
            rows.append(row)
        with bench_settings(threads=threads):
            _fresh_dynamo()
            compiled = hp.tiny_layers(omni)
            for layer in compiled:
                layer.forward = torch.compile(layer.forward, dynamic=False)  # dense as written: breaks allowed
            rows.append(measured("dense", "compiled (Inductor, graph breaks allowed)", compiled, dense)[0])

    probe = {"uva": probe_mod.probe(uva=True), "no_uva": probe_mod.probe(uva=False)}
    for p in probe.values():
        p.pop("outputs", None)
    rows.append({"column": "vllm-omni", "mode": "paged_scheduler", "max_abs_err_vs_dense_eager": "did not run",
                 "stopped_at": probe["no_uva"]["stopped_at"], "error": probe["no_uva"]["error"]})

    with omni.model_context() as _:
        for inner in ("aot_eager", "inductor"):
            with bench_settings(threads=threads):
                _fresh_dynamo()
                layers = hp.tiny_layers(omni)
                runtime = PagedKVRuntime(PagedKVConfig(
                    num_layers=hp.LAYERS, num_kv_heads=2, head_dim=8, block_size=4, blocks_per_layer=8, max_rows=2,
                    scratch_tokens_per_row=16, dtype=torch.bfloat16, kernel="reference"))
                adapter = vllm_omni_hunyuan.install(layers, runtime)
                for layer in layers:
                    layer.forward = torch.compile(layer.forward, backend="paged_kv", fullgraph=True, dynamic=False,
                                                  options={"inner_compiler": inner})
                spec = adapter.spec(req["mask"], req["scatter"], req["step"]["position_ids"].shape[1])
                requests = iter(range(10**6))
                live: list[str] = []

                def around(phase, mask):
                    if phase == "prefill":  # each pass is a new request: finish the last one, admit the next
                        if live:
                            runtime.release(live.pop())
                        live.append(f"r{next(requests)}")
                        runtime.admit(live[-1], spec)
                    return adapter.forward(live[-1], phase=phase, attention_mask=mask)

                rows.append(measured("paged_kv", f"fullgraph, {inner}", layers, dense, around)[0])
    return rows, probe


def hunyuan_memory(prompt_lens: tuple[int, ...] = (256, 1024), target: int = 4097) -> list[dict]:
    """KV held per request at HunyuanImage-3 (32 layers, 8 KV heads x 128, bf16, 1024x1024: 4097 target tokens,
    two CFG rows): vllm-omni allocates every row's whole sequence per request (`DiffusionKVRequest(prefix_len,
    target_len, seq_len)` in pages of 16 tokens, vLLM's GPU default); ours keeps each row's prompt prefix per request
    (`families/hunyuan_image3.py: admission_blocks`) and writes the target, rewritten every step, into scratch rows
    shared by the forward in flight."""
    per_token = 2 * 32 * 8 * 128 * 2
    rows = []
    for p in prompt_lens:
        seq = p + target + 1  # [prompt | timestep + image | <eoi>]
        theirs = 2 * math.ceil(seq / 16) * 16 * per_token
        ours = 2 * math.ceil(p / 16) * 16 * per_token
        scratch = 2 * (math.ceil((15 + target) / 16) * 16) * per_token
        rows.append({"prompt_tokens": p, "vllm_omni_mib_per_request": round(theirs / 2**20, 1),
                     "paged_kv_mib_per_request": round(ours / 2**20, 1),
                     "paged_kv_fixed_scratch_mib": round(scratch / 2**20, 1),
                     "requests_in_40_gib_vllm_omni": int(40 * GiB // theirs),
                     "requests_in_40_gib_paged_kv": int((40 * GiB - scratch) // ours)})
    return rows


# ---- capabilities (each claim checked in the code it cites) ---------------------------------------------------

CAPABILITIES = [
    {"capability": "fork a session (share history blocks)",
     "vllm-omni": "no: a session is one vLLM request per branch (runner.py:176-188); KVCacheManager built with "
                  "enable_caching=False (kv_cache/manager.py:138,412), no block sharing",
     "paged_kv": "yes: runtime.fork, refcounted blocks (scheduler.py fork); not reachable through the "
                 "runner (it has no fork request)"},
    {"capability": "several sessions in one forward",
     "vllm-omni": "no: max_num_seqs=1 and request batches refused (runner.py:108-119, 336-344); the model "
                  "requires batch 1 on the paged path (causal_wan_model.py:1010-1011)",
     "paged_kv": "yes through the runner: max_num_seqs > 1 with LockstepDreamZeroPipeline; execute_model_batch "
                 "runs the sessions' pipeline loops in lockstep, one runtime.forward_batch per model call, each "
                 "session within 1e-5 of alone; a session that cannot be admitted is an error response "
                 "(tests/upstream/test_ar_runner_batching.py); not with cuda_graphs"},
    {"capability": "FP8 KV pool",
     "vllm-omni": "no: pool dtype is od_config.dtype (runner.py:141); the op casts K/V to it with no scale "
                  "(kv_cache/paged_attention.py:683-684)",
     "paged_kv": "yes: PagedKVConfig(kv_dtype=float8_*) with per-(layer, head) scales; through the runner "
                 "model_config.paged_kv.kv_dtype and kv_scales (the 'paged_kv fp8' row)"},
    {"capability": "shared cross-attention K/V",
     "vllm-omni": "no: copied per session and branch (kv_cache/manager.py:529-562), freed with the session "
                  "(manager.py:591-593)",
     "paged_kv": "yes for our reference model (shared write-once regions, regions.py); vllm-omni's DreamZero "
                 "reads a dict, so the adapter keeps it per session like vllm-omni"},
    {"capability": "CUDA-graph capture of the attention",
     "vllm-omni": "not with DreamZero's settings: DiT blocks compile with mode='default' (pipeline_dreamzero.py:"
                  "674-676); pools are marked static for reduce-overhead users (kv_cache/paged.py:131-135) but "
                  "block table, query_start_loc and seq_lens are new tensors every forward "
                  "(kv_cache/paged_attention.py:220-222)",
     "paged_kv": "yes in capture/ (static metadata buffers per bucket); through the runner "
                 "model_config.paged_kv.cuda_graphs='block': captured at startup, served by replay (the 'paged_kv "
                 "graphs' row; on this CPU a replay of the compiled graphs only, no GPU this round)"},
    {"capability": "one compiled frame per phase at every start frame",
     "vllm-omni": "no: current_start_frame is a specialized int under dynamic=False (see the frames column)",
     "paged_kv": "yes: it is a dynamic source (vllm_omni_ar_runner.execute_model)"},
    {"capability": "LingBot-World behind vllm-omni's AR runner",
     "vllm-omni": "its own paged mode under ARDiffusionEngine (lingbot_world/dmd_block.py: _paged_cache)",
     "paged_kv": "yes, by diffusion_model_runner_cls (adapters.vllm_omni_ar_lingbot; see the runner table)"},
    {"capability": "HunyuanImage-3 paged KV on a CPU",
     "vllm-omni": "no: vLLM's GPU-runner BlockTables (pinned UVA buffers, Triton kernels vLLM disables "
                  "without a GPU driver); see the probe",
     "paged_kv": "yes (adapters.vllm_omni_hunyuan, reference kernel)"},
]


# ---- main -------------------------------------------------------------------------------------------------------


LB_BLOCKS = 5  # AR blocks of LingBot-World's DMD schedule (4 probes + 1 commit each): 25 transformer forwards


def lingbot_rows(*, repeats: int, threads: int, inductor: bool = True) -> list[dict]:
    """LingBot-World (tiny `CausalLingBotWorldTransformer3DModel`, fp32) through its `LingBotDMDBlockRunner`, three
    ways: its request-local dense cache (eager, the oracle), vllm-omni's own paged path (`ARDiffusionKVState` over
    `ARDiffusionKVCache`, `paged_write_attn`, eager), ours (blocks compiled `backend="paged_kv"`, aot_eager inside,
    and with `inductor` once more with Inductor inside; the stand-in cursor of tests/upstream/lingbot_world.py).
    A fresh session per pass; the first pass compiles."""
    omni, _, _, _ = _harness()
    from helpers import CountingBackend
    from upstream import lingbot_world as lb

    geometry = lb.TinyLingBot()
    inputs = lb.block_inputs(geometry, LB_BLOCKS)
    rows, oracle = [], None
    variants = [(c, "aot_eager") for c in COLUMNS] + ([("paged_kv", "inductor")] if inductor else [])
    for column, inner in variants:
        with bench_settings(threads=threads), omni.model_context(), torch.no_grad():
            _fresh_dynamo()
            model = lb.build(geometry)
            backend = rt = None
            if column == "paged_kv":
                rt = lb.paged_runtime(geometry, model)
                backend = CountingBackend({"inner_compiler": inner, "strict": True})
                for block in model.blocks:
                    block.compile(backend=backend, fullgraph=True, dynamic=False)

            def one_pass(session: str) -> list[torch.Tensor]:
                if column == "dense":
                    recorder = lb.Recorder(model)
                    lb.rollout(recorder, lb.dense_cache(model, geometry, inputs["prompt_embeds"]), geometry, inputs)
                elif column == "vllm-omni":
                    recorder = lb.Recorder(model)
                    lb.native_rollout(recorder, model, lb.native_state(model, geometry, session_id=session),
                                      geometry, inputs)
                else:
                    rt.admit(session, geometry.spec(model), rows=1)
                    recorder = lb.Recorder(model, runtime=rt, owner=session)
                    with torch.compiler.config.patch(dynamic_sources=lb.DYNAMIC_SOURCES):
                        lb.rollout(recorder, lb.standin_cache(rt, model, geometry, inputs["prompt_embeds"]),
                                   geometry, inputs)
                    rt.release(session)
                return recorder.outputs

            t0 = time.perf_counter()
            outs = one_pass("first")
            first_s = time.perf_counter() - t0
            per_forward = []
            for r in range(repeats):
                t0 = time.perf_counter()
                again = one_pass(f"timed{r}")
                per_forward.append(1e3 * (time.perf_counter() - t0) / len(again))
        oracle = outs if oracle is None else oracle
        rows.append({"column": column, "mode": f"compiled ({inner})" if backend else "eager", "forwards": len(outs),
                     "max_abs_err_vs_dense_eager": max((a - b).abs().max().item() for a, b in zip(outs, oracle)),
                     "frames": backend.frames if backend else 0, "first_pass_s": round(first_s, 2),
                     "ms_per_forward": _median(per_forward), "repeat_equals_first": all(
                         torch.equal(a, b) for a, b in zip(again, outs))})
    return rows


LB_TICKS = 4  # realtime ticks of one LingBot-World session through the runner (one AR block each)


def lingbot_runner_rows(*, repeats: int, threads: int, inductor: bool = True) -> list[dict]:
    """LingBot-World behind vllm-omni's `ARDiffusionModelRunner` (its tick path: `LingBotWorldCausalDMDPipeline.forward`
    over a tiny transformer, tests/upstream/lingbot_runner.py): the dense oracle runner (LingBot's own cache per
    session), vllm-omni's own runner (`ARDiffusionKVCache`, `paged_write_attn`), ours (`diffusion_model_runner_cls`,
    blocks compiled `backend="paged_kv"`, aot_eager inside, and with `inductor` Inductor inside). A fresh session of
    `LB_TICKS` ticks per pass: the first request of the first pass compiles (first request s), the steady figure is
    the median tick of later passes."""
    omni, _, _, _ = _harness()
    from paged_kv_compile.adapters.vllm_omni_ar_runner import RUNNER_PATH
    from upstream import lingbot_runner as lr

    inputs = lr.session_inputs(LB_TICKS, seed=1)
    runners = [("dense", lr.DENSE_RUNNER, None), ("vllm-omni", None, None), ("paged_kv", RUNNER_PATH, "aot_eager")]
    runners += [("paged_kv", RUNNER_PATH, "inductor")] if inductor else []
    rows, oracle = [], None
    for column, path, inner in runners:
        model_config = {"paged_kv": {"inner_compiler": inner}} if inner else None
        od = lr.diffusion_config(runner_cls=path, model_config=model_config)
        with bench_settings(threads=threads), omni.model_context(od), torch.no_grad():
            _fresh_dynamo()
            runner = lr.build_runner(od, available_bytes=1 << 30)
            first_request_s, outs, tick_ms = None, None, []
            for r in range(repeats + 1):
                session = f"s{r}"
                latents = []
                for req in lr.requests(session, inputs):
                    t0 = time.perf_counter()
                    latents += lr.latents(lr.serve(runner, [req]))
                    dt = time.perf_counter() - t0
                    if first_request_s is None:
                        first_request_s = dt
                    elif r > 0:
                        tick_ms.append(1e3 * dt)
                runner.close_session(session)
                outs = latents if outs is None else outs
                same = all(torch.equal(a, b) for a, b in zip(latents, outs))
        oracle = outs if oracle is None else oracle
        rows.append({"column": column, "mode": f"compiled ({inner})" if inner else "eager",
                     "kv_cache": type(runner.kv_cache).__name__, "ticks": len(outs),
                     "max_abs_err_vs_dense_runner": max((a - b).abs().max().item() for a, b in zip(outs, oracle)),
                     "first_request_s": round(first_request_s, 2), "ms_per_tick": _median(tick_ms),
                     "repeat_equals_first": same})
    return rows


def run(*, compile_too: bool = True, repeats: int = 3, threads: int = 1, dreamzero_only: bool = False) -> dict:
    dz = dreamzero_rows(compile_too=compile_too, repeats=repeats, threads=threads)
    batched = dreamzero_batched_sessions(repeats=repeats, threads=threads)
    through_runner = dreamzero_runner_batched_sessions(repeats=repeats, threads=threads)
    windows = frames_by_window() if compile_too and not dreamzero_only else []
    hy, probe = ([], None) if dreamzero_only else hunyuan_rows(repeats=repeats, threads=threads)
    lingbot = [] if dreamzero_only else lingbot_rows(repeats=repeats, threads=threads, inductor=compile_too)
    lingbot_runner = [] if dreamzero_only else lingbot_runner_rows(repeats=repeats, threads=threads,
                                                                    inductor=compile_too)
    return {
        "benchmark": "vs_vllm_omni", "machine": machine_info(threads=threads, repeats=repeats),
        "dreamzero": dz, "dreamzero_batched_sessions": batched,
        "dreamzero_runner_batched_sessions": through_runner, "dreamzero_frames_by_window": windows,
        "dreamzero_memory_14b": dreamzero_memory(80, (0.1, 0.9)),
        "hunyuan": hy, "hunyuan_diffusion_kv_probe": probe, "hunyuan_memory_80b": hunyuan_memory(),
        "capabilities": CAPABILITIES, "lingbot_world": lingbot, "lingbot_world_runner": lingbot_runner,
    }


def print_report(result: dict) -> None:
    print("DreamZero through vllm-omni's ARDiffusionModelRunner (tiny CausalWanModel, fp32, 5 requests, "
          "2 CFG branches)")
    print(format_table(result["dreamzero"], [
        ("column", "column"), ("mode", "mode"), ("max |x-dense|", "max_abs_err_vs_dense_eager"),
        ("frames", "frames"), ("recompiles", "recompiles"), ("breaks", "graph_breaks"),
        ("ms/forward", "ms_per_forward"), ("KV host us/fwd", "kv_host_us_per_forward"),
        ("forwards", "forwards"), ("first pass s", "first_pass_s"), ("compiled later", "compiled_in_timed_passes")]))
    print("\nDreamZero runner: startup, first request and steady state (seconds; replays = captured graph launches)")
    print(format_table(result["dreamzero"], [
        ("column", "column"), ("mode", "mode"), ("startup s", "startup_s"), ("1st req s", "first_request_s"),
        ("steady req s", "steady_request_s"), ("replays", "replays")]))
    print("\nDreamZero: K sessions in lockstep, one batched model call per CFG branch (runtime.forward_batch), vs the "
          "K sessions one after another; the model call alone, below the pipeline")
    print(format_table(result["dreamzero_batched_sessions"], [
        ("K", "sessions"), ("model calls seq", "model_calls_sequential"), ("model calls batched", "model_calls_batched"),
        ("sequential s", "sequential_s"), ("batched s", "batched_s"), ("seq / batched", "sequential_over_batched"),
        ("max |batched - alone|", "max_abs_err_vs_alone")]))
    print("\nDreamZero THROUGH the runner: the engine's batch of K sessions' requests (execute_model_batch, "
          "lockstep, one batched model call per step) vs the same K sessions served one request at a time")
    print(format_table(result["dreamzero_runner_batched_sessions"], [
        ("K", "sessions"), ("model calls seq", "model_calls_sequential"), ("model calls batched", "model_calls_batched"),
        ("sequential s", "sequential_s"), ("batched s", "batched_s"), ("seq / batched", "sequential_over_batched"),
        ("max |batched - alone|", "max_abs_err_vs_alone")]))
    if result["dreamzero_frames_by_window"]:
        print("\nDreamZero compiled frames over two window cycles (fullgraph=True, dynamic=False, default recompile "
              "limit)")
        print(format_table(result["dreamzero_frames_by_window"], [
            ("column", "column"), ("window frames", "window_frames"), ("requests", "requests"), ("served", "served"),
            ("frames", "frames"), ("recompiles", "recompiles"), ("error", "error")]))
    print("\nDreamZero-14B KV (bf16 model, 80 GiB available), each system's own sizing")
    print(format_table(result["dreamzero_memory_14b"], [
        ("system", "system"), ("pool", "pool"), ("fraction", "gpu_memory_fraction"), ("budget GiB", "budget_gib"),
        ("KV GiB/session", "kv_gib_per_session"), ("cross GiB/session", "cross_gib_per_session"),
        ("sessions", "sessions")]))
    if result["hunyuan_diffusion_kv_probe"] is None:  # --dreamzero-only
        return
    print("\nHunyuanImage-3 decoder layers x2 (bf16 autocast, 2 right-padded CFG rows, prefill + 3 steps)")
    print(format_table(result["hunyuan"], [
        ("column", "column"), ("mode", "mode"), ("max |x-dense|", "max_abs_err_vs_dense_eager"),
        ("frames", "frames"), ("recompiles", "recompiles"), ("breaks", "graph_breaks"),
        ("ms/forward", "ms_per_forward")]))
    p = result["hunyuan_diffusion_kv_probe"]
    print(f"  vllm-omni paged_scheduler on CPU: reached {p['uva']['reached'][-1]!r}; stopped at "
          f"{p['uva']['stopped_at']!r}: {p['uva']['error']}")
    print(f"  with vLLM's non-UVA buffers: reached {p['no_uva']['reached'][-1]!r}; stopped at "
          f"{p['no_uva']['stopped_at']!r}: {p['no_uva']['error']} (vLLM HAS_TRITON={p['no_uva'].get('vllm_has_triton')})")
    print("\nHunyuanImage-3 KV per request (32 layers, 8 KV heads x 128, bf16, 1024x1024, 2 CFG rows)")
    print(format_table(result["hunyuan_memory_80b"], [
        ("prompt", "prompt_tokens"), ("vllm-omni MiB/req", "vllm_omni_mib_per_request"),
        ("paged_kv MiB/req", "paged_kv_mib_per_request"), ("paged_kv scratch MiB", "paged_kv_fixed_scratch_mib"),
        ("reqs/40GiB vllm-omni", "requests_in_40_gib_vllm_omni"), ("reqs/40GiB paged_kv", "requests_in_40_gib_paged_kv")]))
    print(f"\nLingBot-World through its DMD block runner (tiny, fp32, {LB_BLOCKS} AR blocks of 4 probes + 1 commit)")
    print(format_table(result["lingbot_world"], [
        ("column", "column"), ("mode", "mode"), ("max |x-dense|", "max_abs_err_vs_dense_eager"), ("frames", "frames"),
        ("ms/forward", "ms_per_forward"), ("forwards", "forwards"), ("first pass s", "first_pass_s"),
        ("repeat == first", "repeat_equals_first")]))
    print(f"\nLingBot-World behind vllm-omni's ARDiffusionModelRunner (tiny, fp32, sessions of {LB_TICKS} ticks)")
    print(format_table(result["lingbot_world_runner"], [
        ("column", "column"), ("mode", "mode"), ("kv_cache", "kv_cache"),
        ("max |x-dense|", "max_abs_err_vs_dense_runner"),
        ("first request s", "first_request_s"), ("ms/tick", "ms_per_tick"), ("ticks", "ticks"),
        ("repeat == first", "repeat_equals_first")]))
    print("\nCapabilities (checked in vllm-omni 0.30.0's code)")
    for c in result["capabilities"]:
        print(f"- {c['capability']}\n    vllm-omni: {c['vllm-omni']}\n    paged_kv:  {c['paged_kv']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line after the tables")
    parser.add_argument("--no-compile", action="store_true", help="eager rows only (skip the Inductor rows)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per row (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads while measuring")
    parser.add_argument("--dreamzero-only", action="store_true",
                        help="the DreamZero runner rows and memory only (no window cycles, no HunyuanImage-3)")
    args = parser.parse_args(argv)
    result = run(compile_too=not args.no_compile, repeats=args.repeats, threads=args.threads,
                 dreamzero_only=args.dreamzero_only)
    print_report(result)
    if args.json:
        print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
