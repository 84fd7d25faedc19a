"""Zero-copy forks of DreamZero sessions: shared history by reference count, own blocks for new commits.

The oracle is the dense reference model with its caches reused at the fork point (what a dense fork
must clone): every forked child's outputs equal it (fp32, <= 1e-5) while the fork itself copies no KV
and takes no block.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import CountingBackend, compile_blocks

from paged_kv_compile import PagedKVConfig, RequestError, families
from paged_kv_compile.families.dreamzero import DreamZeroSpec, dreamzero_runtime_config
from paged_kv_compile.models.dreamzero import DREAMZERO_14B, DreamZeroConfig, DreamZeroModel
from paged_kv_compile.pool import KVPool
from paged_kv_compile.runtime import PagedKVRuntime
from paged_kv_compile.families.hunyuan_image3 import HunyuanSpec

ATOL = 1e-5
# Window 3 frames with a 1-frame sink, chunk 1 frame of 4 tokens: the window slides after 3 commits.
CFG = DreamZeroConfig(num_layers=2, frame_seqlen=4, num_frame_per_block=1, local_attn_size=3, sink_size=1,
                      window_reset_frames=64, action_register_length=2, num_inference_steps=2)
SPEC = DreamZeroSpec.from_model_config(CFG)
ALLOCATORS = ["builtin", pytest.param("vllm", marks=pytest.mark.vllm)]


pytestmark = pytest.mark.usefixtures("fresh_dynamo", "no_grad")


def make_runtime(allocator: str = "builtin", sessions: int = 4, max_rows: int = 2, **kw) -> PagedKVRuntime:
    cfg = dreamzero_runtime_config(CFG, sessions=sessions, kernel="reference", inner_compiler="aot_eager",
                                   max_rows=max_rows, **kw)
    return PagedKVRuntime(cfg, allocator=allocator)


def commit_empty(rt: PagedKVRuntime, sid: str, n: int = 1, branch: int | None = None) -> None:
    """Commit forwards that run no layer (the scheduler-level tests need only the block bookkeeping)."""
    for _ in range(n):
        with rt.forward(sid, "commit", branch=branch):
            pass


def holders(rt: PagedKVRuntime) -> dict[int, int]:
    """block -> how many live rows hold it."""
    out: dict[int, int] = {}
    for rows in rt.scheduler.owned_blocks().values():
        for row in rows:
            for b in row:
                out[b] = out.get(b, 0) + 1
    return out


def assert_refcounts_exact(rt: PagedKVRuntime) -> None:
    """Every block's refcount is the number of rows holding it; every other block is free."""
    held = holders(rt)
    alloc = rt.scheduler.allocator
    for b in range(alloc.num_blocks):
        assert alloc.refcount(b) == held.get(b, 0), f"block {b}"
    assert alloc.num_free == alloc.num_blocks - len(held)


# ---- bookkeeping -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_fork_shares_every_block_and_copies_nothing(allocator):
    rt = make_runtime(allocator)
    rt.admit("p", SPEC)
    g = torch.Generator().manual_seed(0)
    commit_empty(rt, "p", 3)
    rt.pool.tensor.copy_(torch.randn(rt.pool.tensor.shape, generator=g))  # stands for the committed K/V
    before, ptr, free = rt.pool.tensor.clone(), rt.pool.tensor.data_ptr(), rt.scheduler.allocator.num_free
    parent_rows = rt.scheduler.owned_blocks()["p"]
    rt.fork("p", "c1")
    rt.fork("p", "c2")
    # 0 bytes of KV copied: the pool is bit-identical, at the same address, and no block was taken.
    assert torch.equal(rt.pool.tensor, before) and rt.pool.tensor.data_ptr() == ptr
    assert rt.scheduler.allocator.num_free == free
    owned = rt.scheduler.owned_blocks()
    assert owned["c1"] == owned["c2"] == owned["p"] == parent_rows
    assert all(rt.scheduler.allocator.refcount(b) == 3 for row in parent_rows for b in row)
    # The children's next commits take blocks of their own; the shared ones keep their bytes.
    shared = [b for row in parent_rows for b in row]
    with rt.forward("c1", "commit") as active:
        new = [b for row in active.plan.new_blocks for b in row]
        assert new and not set(new) & set(shared)
    assert_refcounts_exact(rt)
    bases = rt.pool.layer_bases.tolist()
    for layer_base in bases:
        idx = torch.tensor([layer_base + b for b in shared])
        assert torch.equal(rt.pool.tensor[:, idx], before[:, idx])


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_fork_release_frees_only_blocks_nobody_else_holds(allocator):
    rt = make_runtime(allocator)
    total = rt.scheduler.allocator.num_blocks
    rt.admit("p", SPEC)
    commit_empty(rt, "p", 2)  # sink + 1 frame per row
    rt.fork("p", "a")
    rt.fork("a", "b")  # a fork of a fork shares the same blocks
    commit_empty(rt, "a", 3)  # a's window slides: its old history is dropped by a alone
    commit_empty(rt, "p", 1)
    assert_refcounts_exact(rt)
    for sid in ("p", "b", "a"):
        free = rt.scheduler.allocator.num_free
        mine = {b for row in rt.scheduler.owned_blocks()[sid] for b in row}
        others = {b for o, rows in rt.scheduler.owned_blocks().items() if o != sid for row in rows for b in row}
        rt.release(sid)
        assert rt.scheduler.allocator.num_free == free + len(mine - others)
        assert_refcounts_exact(rt)
    assert rt.scheduler.allocator.num_free == total


def test_fork_refusals_name_the_fix_and_change_nothing():
    rt = make_runtime()
    rt.admit("p", SPEC)
    commit_empty(rt, "p", 2)
    rt.admit("h", HunyuanSpec((4,), 2))
    rt.admit("done", SPEC)
    rt.release("done")
    cases = [
        (("nope", "c"), "unknown id 'nope'"),
        (("done", "c"), "'done' is released"),
        (("p", "p"), "'p' is already live"),
        (("p", "done"), "'done' was already used"),
        (("h", "c"), "hunyuan_image3 request, which cannot be forked"),
    ]
    for args, match in cases:
        before = rt.state()
        with pytest.raises(RequestError, match=match):
            rt.fork(*args)
        assert rt.state() == before
    # Mid-forward: the plan in flight would change the history the child shares.
    with rt.forward("p", "commit"):
        before = rt.state()
        with pytest.raises(RequestError, match="fork between forwards"):
            rt.fork("p", "c")
        with pytest.raises(RequestError, match="still in flight"):
            rt.scheduler.fork("p", "c")
        assert rt.state() == before
    # Not at a chunk boundary: branch 0 committed a chunk that branch 1 has not.
    commit_empty(rt, "p", 1, branch=0)
    before = rt.state()
    with pytest.raises(RequestError, match=r"not at a chunk boundary: .*\[4, 3\].*commit the same chunk"):
        rt.fork("p", "c")
    assert rt.state() == before
    commit_empty(rt, "p", 1, branch=1)
    rt.fork("p", "c")  # at a boundary again
    rt.reset("p")
    rt.fork("p", "c2")  # an empty window is a boundary too
    assert rt.scheduler.owned_blocks()["c2"] == [[], []]


def test_fork_respects_the_session_cap():
    rt = PagedKVRuntime(dreamzero_runtime_config(CFG, sessions=4), max_sessions=2)
    rt.admit("old", SPEC)
    rt.admit("p", SPEC)
    commit_empty(rt, "p", 1)
    rt.fork("p", "c")  # evicts the least recently used session that is not the parent
    assert set(rt.scheduler.owners) == {"p", "c"} and rt.scheduler.finished["old"].startswith("evicted")
    one = PagedKVRuntime(dreamzero_runtime_config(CFG, sessions=4), max_sessions=1)
    one.admit("p", SPEC)
    before = one.state()
    with pytest.raises(RequestError, match="max_sessions=1 leaves no room for a fork"):
        one.fork("p", "c")
    assert one.state() == before


def test_fork_write_guard_refuses_a_plan_that_writes_a_shared_block(monkeypatch):
    """The guard behind 'a shared block is never written': a family whose plan would write into the history a
    fork shares (here: a commit laid out over the first history block) is refused before anything runs."""
    rt = make_runtime()
    rt.admit("p", SPEC)
    commit_empty(rt, "p", 2)
    rt.fork("p", "c")
    family = families.get("dreamzero")
    original = type(family).plan

    def overwrites_history(self, owner, blocks, kind, **info):
        plan = original(self, owner, blocks, kind, **info)
        row = plan.rows[0]
        plan.rows[0] = dataclasses.replace(row, positions=row.positions - row.positions[0])  # onto the sink block
        return plan

    monkeypatch.setattr(type(family), "plan", overwrites_history)
    shared = rt.scheduler.owned_blocks()["c"][0][0]
    before = rt.state()
    with pytest.raises(RequestError, match=rf"row 0 of this commit forward of 'c' would write blocks \[{shared}, "):
        rt.scheduler.plan("c", "commit")
    assert rt.state() == before  # the commit's new blocks were given back


# ---- numbers: forked children equal the dense model continued from a cloned cache -------------------------
def make_model_rig(rows_per_forward: int = 2, sessions: int = 6):
    model = DreamZeroModel(CFG, seed=1)
    dense = DreamZeroModel(CFG, seed=1)
    rt = make_runtime(sessions=sessions, max_rows=rows_per_forward)
    rt.bind(model.blocks)
    compile_blocks(model.blocks, CountingBackend())
    return model, dense, rt


def chunk_inputs(seed: int, rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, CFG.chunk_tokens, CFG.in_channels, generator=g).expand(rows, -1, -1)
    a = torch.randn(1, CFG.action_register_length, CFG.action_dim, generator=g).expand(rows, -1, -1)
    return x, a


def cross_kvs(model: DreamZeroModel, rows: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ctx = torch.randn(1, CFG.text_len, CFG.text_dim, generator=g)
    return model.prepare_cross_kv(torch.cat([ctx, torch.zeros_like(ctx)]).repeat(rows // 2, 1, 1))


def paged_call(rt, model, sid, x, a, start, commit, t=0.0):
    rows = x.shape[0]
    caches = families.for_model(model).standin_caches(rt, model, rows)
    with rt.forward(sid, "commit" if commit else "denoise"):
        video, act, _ = model(x, a, torch.full((rows,), t), start, caches, cross_kvs(model, rows),
                              update_kv_cache=commit)
    return video, act


def test_forked_children_equal_dense_continuations_of_the_parent():
    model, dense, rt = make_model_rig()
    rt.admit("p", SPEC)
    caches = dense.dense_caches(2)
    for chunk in range(3):  # the parent's history: three commits, the window is full
        x, a = chunk_inputs(chunk)
        paged_call(rt, model, "p", x, a, chunk, commit=True)
        _, _, caches = dense(x, a, torch.zeros(2), chunk, caches, cross_kvs(dense), update_kv_cache=True)
    at_fork = caches
    worst = 0.0
    for k in range(3):
        rt.fork("p", f"c{k}")
    for k in range(3):  # each child: its own candidate chunk committed, then a denoise step over it
        caches = at_fork
        for step, start in enumerate((3, 4)):
            x, a = chunk_inputs(100 + 10 * k + step)
            got = paged_call(rt, model, f"c{k}", x, a, start, commit=True)
            want = dense(x, a, torch.zeros(2), start, caches, cross_kvs(dense), update_kv_cache=True)
            caches = want[2]
            worst = max(worst, *((g - w).abs().max().item() for g, w in zip(got, want[:2])))
        x, a = chunk_inputs(200 + k)
        got = paged_call(rt, model, f"c{k}", x, a, 5, commit=False, t=500.0)
        want = dense(x, a, torch.full((2,), 500.0), 5, caches, cross_kvs(dense), update_kv_cache=False)
        worst = max(worst, *((g - w).abs().max().item() for g, w in zip(got, want[:2])))
    # The parent was never disturbed by its children: its next denoise equals the dense one at the fork.
    x, a = chunk_inputs(300)
    got = paged_call(rt, model, "p", x, a, 3, commit=False, t=500.0)
    want = dense(x, a, torch.full((2,), 500.0), 3, at_fork, cross_kvs(dense), update_kv_cache=False)
    worst = max(worst, *((g - w).abs().max().item() for g, w in zip(got, want[:2])))
    assert worst <= ATOL, worst
    assert_refcounts_exact(rt)


# ---- the benchmark behind docs/benchmarks.md ("Forks and batched candidates") ------------------------------
def _benchmark():
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import fork_candidates

    return fork_candidates


def test_fork_capacity_at_dreamzero_14b_sizes_from_the_pool_geometry():
    """880-token blocks of 40 layers x 40 heads x 128 x K/V in bf16; a candidate's chunk is 2 frames per row."""
    cap = _benchmark().capacity()
    assert cap["block_size"] == 880 and cap["block_bytes_all_layers"] == 2 * 40 * 880 * 40 * 128 * 2
    # 2 rows x 2 frames, each frame one block of every layer, plus 2 rows x 4 scratch blocks of one layer each
    per_fork = 4 * cap["block_bytes_all_layers"] + 2 * 4 * cap["block_bytes_all_layers"] // 40
    assert abs(cap["per_fork_gib"] - per_fork / 2**30) < 0.01
    assert (cap["forks_fit"], cap["clones_fit"]) == (18, 1)
    # admission reserves a session's need for each fork: 2 rows x 18 frames (the loop resets at frame 20)
    assert abs(cap["per_fork_reserved_gib"] - (36 * cap["block_bytes_all_layers"] + 2 * 4 * cap["block_bytes_all_layers"] // 40) / 2**30) < 0.01
    assert cap["forks_admitted"] == 2
    # with commits=1 a fork reserves the 2 rows x 2 frames one commit takes; beside them the pool keeps the
    # parent's 36 history blocks (shared) and the 36 it may take anew once it drops them
    pcfg = dreamzero_runtime_config(DREAMZERO_14B, dtype=torch.bfloat16, budget_bytes=80 * 2**30, device="meta",
                                    blocks_per_layer=None)
    blocks = KVPool.from_config(pcfg).blocks_per_layer
    assert cap["forks_admitted_commits_1"] == (blocks - 36 - 36) // 4 == 11


def test_fork_candidates_benchmark_quick(capsys):
    assert _benchmark().main(["--quick", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert [r["K"] for r in out["timing"]] == [1, 2] and all(r["ratio"] > 0 for r in out["timing"])
    assert out["bytes"]["fork_bytes_copied"] == 0 and out["bytes"]["fork_blocks_taken"] == 0
    assert out["bytes"]["dense_clone_bytes"] > 0
    assert 0 < out["bytes"]["fork_metadata_bytes"] < out["bytes"]["dense_clone_bytes"]


def test_fork_host_bytes_are_measured_and_grow_with_the_shared_history():
    """Issue 23, defect 8: fork_metadata_bytes was the constant 0. It is measured now (tracemalloc): a fork keeps
    its Owner and one list of block ids per row on the host, so a parent with more history costs more per fork."""
    fc = _benchmark()
    spec = DreamZeroSpec(frame_seqlen=4, chunk_frames=1, window_frames=64, action_tokens=2)
    per_fork = {}
    for commits in (1, 40):
        rt = PagedKVRuntime(PagedKVConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4,
                                          blocks_per_layer=1000, max_rows=2, scratch_tokens_per_row=8))
        rt.admit("p", spec, rows=2)
        for _ in range(commits):
            rt.scheduler.finish_forward(rt.scheduler.plan("p", "commit"))
        per_fork[commits] = fc.fork_host_bytes(rt, "p", [f"c{i}" for i in range(4)])
    assert 0 < per_fork[1] < per_fork[40]
    assert per_fork[40] - per_fork[1] >= 39 * 8  # the 39 extra blocks of a row cost at least a reference each
