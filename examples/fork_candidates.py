"""K candidate action sequences from one DreamZero state: zero-copy forks run as rows of ONE forward.

A world model plans by imagining: from the session's current state (its committed history), try K
candidate action sequences and score what the model predicts for each. The session is forked K times
(`runtime.fork`: every history block is shared by reference count, no KV is copied, no block taken), each
candidate commits its own chunk with its own actions and denoises the next chunk, and the K candidates run
as the rows of ONE batched forward (`runtime.forward_batch`). The same candidates run one at a time give
the same numbers; closing every session gives every block back.

    python examples/fork_candidates.py [K]
"""

from __future__ import annotations

import sys
import time

import torch

from paged_kv_compile import families
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
from paged_kv_compile.models import DreamZeroConfig, DreamZeroModel
from paged_kv_compile.runtime import PagedKVRuntime

INNER_COMPILER = "aot_eager"
CFG = DreamZeroConfig(num_layers=2, frame_seqlen=8, num_frame_per_block=1, local_attn_size=4, sink_size=1,
                      window_reset_frames=64, action_register_length=4)


def inputs(seed: int, rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, CFG.chunk_tokens, CFG.in_channels, generator=g)
    a = torch.randn(1, CFG.action_register_length, CFG.action_dim, generator=g)
    return x.expand(rows, -1, -1), a.expand(rows, -1, -1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    K = int(argv[0]) if argv else 4
    model = DreamZeroModel(CFG, seed=0)
    runtime = PagedKVRuntime(dreamzero_runtime_config(CFG, sessions=2 * K + 1, max_rows=2 * K, kernel="reference",
                                                      inner_compiler=INNER_COMPILER))
    runtime.bind(model.blocks)
    for block in model.blocks:
        block.compile(backend="paged_kv", fullgraph=True, dynamic=False, options={"inner_compiler": INNER_COMPILER})
    g = torch.Generator().manual_seed(1)
    text = torch.randn(1, CFG.text_len, CFG.text_dim, generator=g)
    # cross-attention K/V per layer: (2, 2 rows, len, H, D), cond row then uncond row; repeated per candidate
    cross = model.prepare_cross_kv(torch.cat([text, torch.zeros_like(text)]))

    def cross_for(rows: int) -> list[torch.Tensor]:
        return [c.repeat(1, rows // 2, 1, 1, 1) for c in cross]

    def forward(sessions, chunks, start, commit, t=0.0):
        x, a = torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])
        rows = x.shape[0]
        caches = families.for_model(model).standin_caches(runtime, model, rows)
        with runtime.forward_batch([(sid, "commit" if commit else "denoise") for sid in sessions]):
            video, act, _ = model(x, a, torch.full((rows,), t), start, caches, cross_for(rows), update_kv_cache=commit)
        return [(video[2 * k : 2 * k + 2], act[2 * k : 2 * k + 2]) for k in range(len(sessions))]

    with torch.no_grad():
        runtime.admit("world", DreamZeroSpec.from_model_config(CFG), rows=2)
        for chunk in range(3):  # the state the candidates start from: three committed chunks
            forward(["world"], [inputs(chunk)], chunk, commit=True)
        pool_before, free_before = runtime.pool.tensor.clone(), runtime.scheduler.allocator.num_free
        dense = DreamZeroModel(CFG, seed=0)
        caches = dense.dense_caches(2)
        for chunk in range(3):  # what a dense fork would have to clone per candidate
            x, a = inputs(chunk)
            _, _, caches = dense(x, a, torch.zeros(2), chunk, caches, cross, update_kv_cache=True)
        clone_bytes = sum(c.numel() * c.element_size() for c in caches)

        start = time.perf_counter()
        for k in range(K):
            runtime.fork("world", f"batched{k}", commits=1)  # a candidate commits once: it reserves one commit
            runtime.fork("world", f"alone{k}", commits=1)
        fork_s = time.perf_counter() - start
        copied = 0 if torch.equal(runtime.pool.tensor, pool_before) else runtime.pool.nbytes
        taken = free_before - runtime.scheduler.allocator.num_free
        print(f"forked {2 * K} sessions from 'world' in {fork_s * 1e3:.2f} ms: blocks taken {taken}, KV bytes copied "
              f"{copied}; a dense fork clones {clone_bytes} bytes per candidate")

        # Each candidate: commit the chunk its own actions lead to, then predict the next chunk (one denoise step).
        candidates = [inputs(100 + k) for k in range(K)]
        nxt = [inputs(200)] * K
        batched = forward([f"batched{k}" for k in range(K)], candidates, 3, commit=True)
        batched = forward([f"batched{k}" for k in range(K)], nxt, 4, commit=False, t=500.0)
        alone = []
        for k in range(K):
            forward([f"alone{k}"], [candidates[k]], 3, commit=True)
            alone += forward([f"alone{k}"], [nxt[k]], 4, commit=False, t=500.0)
        worst = max((b - a).abs().max().item() for bk, ak in zip(batched, alone) for b, a in zip(bk, ak))
        scores = [float(v[0].pow(2).mean()) for v, _ in batched]  # a stand-in reward: predicted motion energy
        best = min(range(K), key=scores.__getitem__)
        print(f"{K} candidates as rows of one forward ({2 * K} rows) vs one at a time: max |batched - alone| = "
              f"{worst:.2g}")
        print("candidate scores: " + ", ".join(f"{s:.4f}" for s in scores) + f"; best candidate: {best}")

        for sid in runtime.owner_ids():
            runtime.release(sid)
    total = runtime.pool.blocks_per_layer
    print(f"blocks free again: {runtime.scheduler.allocator.num_free} of {total}")
    return 0 if worst <= 1e-5 and taken == 0 and copied == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
