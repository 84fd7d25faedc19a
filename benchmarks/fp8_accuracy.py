"""FP8 pool accuracy on both families' loops: final outputs of bf16 / FP8 pools against dense bf16.

Each family's reference loop (`dreamzero_rollout`, `hunyuan_generate`: `models/hooks.py` drive over
`dreamzero_steps` / `hunyuan_steps`) runs once dense (the model's own bf16 caches, eager) and once per
pool on the paged runtime (blocks compiled with the paged_kv backend, inner compiler aot_eager, reference
kernel), every model in bfloat16. Reported: max and mean |paged - dense| of the final outputs (DreamZero:
the video and action chunks; HunyuanImage-3: the latents), and the dense output's mean |x| for scale.

Pools: bf16 (the paging alone), FP8 e4m3 and e5m2 with static per (layer, kv head) scales calibrated
from the dense run's amax of K and V (KVPool.scales_from_amax: the amax maps to the format's largest
value), and e4m3 with every scale 1.0 (vLLM's default without calibration). The calibration run is the
measured run itself: the figures are what calibrated static scales give, not a held-out estimate.

    python -m benchmarks.fp8_accuracy [--json] [--quick] [--size tiny|mid]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from benchmarks._common import format_table
from benchmarks._models import DZ_MID, DZ_TINY, HY_MID, HY_PROMPTS, HY_TINY
from paged_kv_compile.driver import PagedHooks
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
from paged_kv_compile.families.hunyuan_image3 import hunyuan_runtime_config, hunyuan_spec
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.models.hunyuan_image3 import HunyuanImage3Config, HunyuanImage3Model, hunyuan_generate
from paged_kv_compile.pool import KVPool
from paged_kv_compile.runtime import PagedKVRuntime

BF16 = torch.bfloat16
#: (label, pool dtype, scales): "calibrated" from the dense run, "1.0" vLLM's uncalibrated default.
POOLS = [
    ("bf16 pool", None, None),
    ("fp8 e4m3, calibrated", torch.float8_e4m3fn, "calibrated"),
    ("fp8 e5m2, calibrated", torch.float8_e5m2, "calibrated"),
    ("fp8 e4m3, scale 1.0", torch.float8_e4m3fn, "1.0"),
]


class KVAmax(TorchFunctionMode):
    """Records, per self-attention layer, the absolute maximum of K and V per kv head over a dense run.

    The layer is known from forward pre-hooks on the self-attention modules; SDPA's K/V ``[B, H, L, D]``
    may repeat kv heads (GQA's repeat_kv), folded back with `kv_heads`.
    """

    def __init__(self, attention_modules, kv_heads: int) -> None:
        super().__init__()
        self.kv_heads = kv_heads
        self.layer: int | None = None
        self.amax = torch.zeros(2, len(attention_modules), kv_heads)
        self.handles = []
        for i, module in enumerate(attention_modules):
            self.handles.append(module.register_forward_pre_hook(lambda _m, _a, i=i: self._enter(i)))
            self.handles.append(module.register_forward_hook(lambda _m, _a, _o: self._enter(None)))

    def _enter(self, layer: int | None) -> None:
        self.layer = layer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.layer is not None:
            for half, t in enumerate(args[1:3]):
                B, H, L, D = t.shape
                per_head = t.detach().abs().float().view(B, self.kv_heads, H // self.kv_heads, L, D).amax((0, 2, 3, 4))
                self.amax[half, self.layer] = torch.maximum(self.amax[half, self.layer], per_head)
        return func(*args, **kwargs)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _errors(got: torch.Tensor, want: torch.Tensor) -> dict:
    d = (got.float() - want.float()).abs()
    return {"max_err": d.max().item(), "mean_err": d.mean().item(), "dense_mean_abs": want.float().abs().mean().item()}


def _measure(family: str, make_model, attention, kv_heads: int, layers, run, runtime_config, spec,
             pools=POOLS) -> list[dict]:
    """One family's loop run dense (recording K/V amax) and then on a paged runtime per pool.

    `attention(model)` lists the self-attention modules (for the amax), `layers(model)` the blocks to compile,
    `run(model, hooks)` the loop's final outputs, `runtime_config(kv_dtype)` the pool and `spec` the owner's."""
    dense_model = make_model()
    amax = KVAmax(attention(dense_model), kv_heads)
    with torch.no_grad(), amax:
        want = run(dense_model, None)
    amax.close()
    rows = []
    for label, kv_dtype, scales in pools:
        torch._dynamo.reset()
        m = make_model()
        rt = PagedKVRuntime(runtime_config(kv_dtype))
        if scales == "calibrated":
            s = KVPool.scales_from_amax(amax.amax, kv_dtype)
            rt.pool.set_scales(s[0], s[1])
        rt.bind(layers(m))
        for block in layers(m):
            block.compile(backend="paged_kv", fullgraph=True, dynamic=False,
                          options={"kernel": "reference", "inner_compiler": "aot_eager"})
        rt.admit("owner", spec)
        with torch.no_grad():
            got = run(m, PagedHooks(rt, "owner"))
        rt.abort("owner")
        rt.close()
        rows.append({"family": family, "pool": label, **_errors(got, want)})
    return rows


def dreamzero(cfg, chunks: int, steps: int, pools=POOLS) -> list[dict]:
    """Final video + actions of a `chunks`-chunk rollout (two CFG rows), dense bf16 vs each pool."""
    def run(m, hooks):
        out = dreamzero_rollout(m, num_chunks=chunks, num_inference_steps=steps, seed=0, hooks=hooks)
        return torch.cat([out["video"].flatten(), out["actions"].flatten()])

    return _measure(
        "dreamzero", lambda: DreamZeroModel(cfg, seed=1).eval().to(BF16),
        lambda m: [b.self_attn for b in m.blocks], cfg.num_heads, lambda m: m.blocks, run,
        lambda kv_dtype: dreamzero_runtime_config(cfg, sessions=1, kernel="reference", inner_compiler="aot_eager",
                                                  dtype=BF16, kv_dtype=kv_dtype),
        DreamZeroSpec.from_model_config(cfg), pools)


def hunyuan(cfg, prompt_lens, capacity: int, steps: int, pools=POOLS) -> list[dict]:
    """Final latents of one two-row request, dense bf16 vs each pool."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=gen) for n in prompt_lens]

    def run(m, hooks):
        return hunyuan_generate(m, prompts, prefix_capacity=capacity, num_steps=steps, seed=0, hooks=hooks)

    return _measure(
        "hunyuan_image3", lambda: HunyuanImage3Model(cfg, seed=2).eval().to(BF16),
        lambda m: [layer.self_attn for layer in m.layers], cfg.num_kv_heads, lambda m: m.layers, run,
        lambda kv_dtype: hunyuan_runtime_config(cfg, max_prefix=capacity, requests=1, kernel="reference",
                                                inner_compiler="aot_eager", dtype=BF16, kv_dtype=kv_dtype),
        hunyuan_spec(cfg, prompts), pools)


#: --quick: 2-layer models, a 6-frame window cycle, 2 Hunyuan steps (tests/test_fp8_runtime.py's sizes).
DZ_QUICK = DreamZeroConfig(num_layers=2, local_attn_size=4, window_reset_frames=6)
HY_QUICK = HunyuanImage3Config(num_layers=2, image_h=2, image_w=3)


def run(size: str = "tiny") -> dict:
    if size == "quick":
        dz, hy, (prompt_lens, capacity), dz_steps, hy_steps = DZ_QUICK, HY_QUICK, ((9, 5), 12), 1, 2
    else:
        dz, hy = (DZ_TINY, HY_TINY) if size == "tiny" else (DZ_MID, HY_MID)
        (prompt_lens, capacity), dz_steps, hy_steps = HY_PROMPTS[size], 2, 4
    chunks = dz.window_reset_frames // dz.num_frame_per_block + 1  # a whole window cycle and the reset
    rows = dreamzero(dz, chunks=chunks, steps=dz_steps) + hunyuan(hy, prompt_lens, capacity, steps=hy_steps)
    return {"size": size, "dreamzero": {"chunks": chunks, "denoising_steps": dz_steps, "layers": dz.num_layers,
                                        "heads": dz.num_heads, "head_dim": dz.head_dim},
            "hunyuan_image3": {"prompts": list(prompt_lens), "capacity": capacity, "steps": hy_steps,
                               "layers": hy.num_layers, "kv_heads": hy.num_kv_heads, "head_dim": hy.head_dim},
            "rows": rows}


COLUMNS = [("family", "family"), ("pool", "pool"), ("max |err|", "max_err"), ("mean |err|", "mean_err"),
           ("dense mean |x|", "dense_mean_abs")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="2-layer models, short loops (a smoke run)")
    parser.add_argument("--size", choices=["tiny", "mid"], default="tiny")
    args = parser.parse_args(argv)
    result = run("quick" if args.quick else args.size)
    if args.json:
        print(json.dumps(result))
        return 0
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    print(format_table(result["rows"], COLUMNS))
    return 0


if __name__ == "__main__":
    main()
