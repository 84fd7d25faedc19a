"""vllm-omni's own `DiffusionModelRunner` serving HunyuanImage-3 requests from our runtime.

The runner is the package's (`PagedKVHunyuanModelRunner` subclasses it; selected by
`od_config.diffusion_model_runner_cls`), the pipeline is `HunyuanImage3Pipeline`'s denoise loop over a tiny
`HunyuanImage3Model` (tests/upstream/hunyuan_runner.py says what is stubbed), bf16 as the pipeline runs it (its
latents and its autocast are bf16 in its own code). The oracle is the same pipeline behind the plain runner,
dense, eager.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from paged_kv_compile.adapters.vllm_omni_hunyuan_runner import RUNNER_PATH

from . import hunyuan_runner as hr

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

OURS = {"paged_kv": {"inner_compiler": "aot_eager", "kernel": "reference", "block_size": 4,
                     "scratch_tokens_per_row": 8}}
BUDGET = 1 << 16  # 124 blocks of 4 tokens per layer at this geometry: a few requests, not a 400-token prompt


def _prompts(seed: int, lens=(7, 4)) -> list[torch.Tensor]:
    """A conditional and an unconditional prompt of different lengths (the pipeline right-pads them)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 64, (n,), generator=g) for n in lens]


def _bf16_steps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max |got - want| in bf16 steps at the output's scale (the spacing of bf16 at max |want|): the pipeline's
    latents are bf16, so one step there is the resolution its own output has."""
    spacing = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(want.abs().max())))
    return float((got - want).abs().max() / spacing)


def _request(requests, name: str, **kwargs):
    prompts, seed = requests[name]
    return hr.make_request(name, prompts, seed=seed, **kwargs)


def _pool_at_baseline(runtime) -> bool:
    return runtime.owner_ids() == [] and runtime.scheduler.allocator.num_free == runtime.pool.blocks_per_layer


def test_hunyuan_runner_serves_requests_through_cancel_fault_and_refusal(omni):
    from vllm_omni.diffusion.cancellation import RequestCancellationRegistry

    requests = {name: (_prompts(seed), seed) for seed, name in enumerate(["done-1", "cancelled", "failed", "done-2"])}

    def dense_outputs(compile_layers: bool) -> dict[str, torch.Tensor]:
        od_dense = hr.diffusion_config()
        with omni.model_context(od_dense):
            pipeline = hr.build_pipeline(od_dense)
            if compile_layers:  # dense, as written (graph breaks at its .item() cache): what compiling changes
                for layer in pipeline.model.layers:
                    layer.compile(backend="inductor", dynamic=False)
            dense_runner = hr.build_runner(pipeline, od_dense)
            return {name: hr.serve(dense_runner, _request(requests, name)).output["payload"]["image"]
                    for name in requests if name.startswith("done")}

    dense = dense_outputs(False)
    floor = {name: _bf16_steps(got, dense[name]) for name, got in dense_outputs(True).items()}
    torch._dynamo.reset()

    od = hr.diffusion_config(runner_cls=RUNNER_PATH, model_config=OURS)
    with omni.model_context(od):
        pipeline = hr.build_pipeline(od)
        runner = hr.build_runner(pipeline, od, available_bytes=BUDGET)
        runtime = runner.paged_kv.runtime
        assert runtime.pool.nbytes <= BUDGET and _pool_at_baseline(runtime)

        # 1. served to completion
        out = hr.serve(runner, _request(requests, "done-1"))
        assert out.error is None
        steps = {"done-1": _bf16_steps(out.output["payload"]["image"], dense["done-1"])}
        assert _pool_at_baseline(runtime)
        graphs = counters["stats"]["unique_graphs"]

        # 2. cancelled mid-request: the engine's signal is set after the first step; the next transformer call
        # stops it, the runner answers `aborted`, and the request's blocks are back
        registry = RequestCancellationRegistry()
        signal = registry.create("cancelled")
        calls = []

        def cancel_after_first(module, args, kwargs, output):
            calls.append(kwargs.get("first_step"))
            if len(calls) == 1:
                registry.cancel(["cancelled"])

        hook = pipeline.model.register_forward_hook(cancel_after_first, with_kwargs=True)
        try:
            out = hr.serve(runner, _request(requests, "cancelled", cancellation_signal=signal))
        finally:
            hook.remove()
            registry.close()
        assert out.aborted and calls == [True], (out, calls)
        assert _pool_at_baseline(runtime)

        # 3. an error inside a forward (the second layer raises at the first step, after the first wrote its
        # K/V): the error reaches the caller, the forward is rolled back and the request aborted
        layer = pipeline.model.layers[1]
        compiled = layer.forward

        def boom(*args, **kwargs):
            raise RuntimeError("injected fault in layer 1")

        layer.forward = boom
        try:
            with pytest.raises(RuntimeError, match="injected fault"):
                hr.serve(runner, _request(requests, "failed"))
        finally:
            layer.forward = compiled
        assert _pool_at_baseline(runtime) and runner.paged_kv.request_id is None

        # 4. a request the pool cannot hold: an error output naming the capacity, nothing admitted
        out = hr.serve(runner, hr.make_request("too-long", _prompts(9, lens=(400, 380)), seed=9))
        assert out.error and "does not fit" in out.error and "blocks of 4 tokens" in out.error, out.error
        assert "kv_cache_memory_bytes" in out.error
        assert _pool_at_baseline(runtime)

        # 5. and the next request is served, from the frames compiled for the first
        out = hr.serve(runner, _request(requests, "done-2"))
        assert out.error is None
        steps["done-2"] = _bf16_steps(out.output["payload"]["image"], dense["done-2"])
        assert _pool_at_baseline(runtime)
        assert counters["stats"]["unique_graphs"] == graphs  # no compile after the first request

    print(f"paged vs dense eager through vllm-omni's runner, in bf16 steps at the output's scale: {steps}; "
          f"dense Inductor vs dense eager: {floor}")
    # bf16: the paged run and the Inductor-compiled dense run are two other roundings of the same bf16 computation
    # (3 denoising steps amplify a rounding); each is compared with eager, so their distances are of one size but
    # not ordered: within twice what compiling the dense model changes (at least one bf16 step)
    assert all(steps[name] <= 2 * max(floor[name], 1.0) for name in steps), (steps, floor)

