"""Compiled code never hands the pool's op an argument that shares memory with the pool it mutates.

Why: pytorch/pytorch#198031 (open in torch 2.13 and 2.14): with a custom op that mutates `x`, `y = x.clone();
op(y, x)` compiles under Inductor to `op(x, x)` (the clone is dropped, the op reads what it writes: wrong numbers,
no error). The probe sits in the op's kernel, so it sees what the compiled code really passes; a planted op
shows it reports that bug where torch has it (our op then refuses the call: `write_attend._refuse_pool_aliases`),
and a planted eager call shows it reports any shared memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from paged_kv_compile.driver import paged_run
from paged_kv_compile.errors import OpInputError
from paged_kv_compile.families.dreamzero import dreamzero_runtime_config
from paged_kv_compile.models.dreamzero import DreamZeroConfig, DreamZeroModel, dreamzero_rollout
from paged_kv_compile.ops import write_attend as wa
from paged_kv_compile.runtime import PagedKVRuntime

from _opcases import make_case
from helpers import CountingBackend, compile_blocks

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

#: the op kernel's tensor arguments, in `write_attend._run`'s order (kv_pool is the mutated one)
_ARGS = ("query", "key", "value", "kv_pool", "slot_mapping", "block_table", "seq_lens", "kv_visible_end")


def sharing_memory(mutated: torch.Tensor, **reads: torch.Tensor | None) -> list[str]:
    """The names of `reads` whose storage is the storage of `mutated` (any view of it counts)."""
    base = mutated.untyped_storage().data_ptr()
    return [name for name, t in reads.items()
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == base]


@contextlib.contextmanager
def op_calls(monkeypatch) -> Iterator[list[list[str]]]:
    """Every call of the pool op's kernel while inside: the arguments that share memory with its pool."""
    calls: list[list[str]] = []
    real = wa._run

    def probed(*args):
        named = dict(zip(_ARGS, args))
        pool = named.pop("kv_pool")
        calls.append(sharing_memory(pool, **named, kv_scales=args[-1]))
        return real(*args)

    with monkeypatch.context() as m:
        m.setattr(wa, "_run", probed)
        yield calls


_REVERSE_CALLS: list[list[str]] = []


@torch.library.custom_op("paged_kv_test::reverse_into", mutates_args=("dst",))
def _reverse_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    """pytorch#198031's op: it reads `src` while it writes `dst`."""
    _REVERSE_CALLS.append(sharing_memory(dst, src=src))
    n = src.shape[0]
    for k in range(n):
        dst[n - 1 - k] = src[k]


def _clone_then_reverse(x):
    y = x.clone()
    _reverse_into(y, x)
    return x * 2.0


def test_the_probe_reports_pytorch_198031_where_this_torch_has_it():
    """The planted case through Inductor: the probe reports `src` sharing `dst`'s memory exactly when the
    compiled result is wrong (both on torch 2.13 and 2.14 today; a torch with the fix gives neither)."""
    x = torch.arange(8.0)
    eager, compiled = x.clone(), x.clone()
    _REVERSE_CALLS.clear()
    _clone_then_reverse(eager)
    assert _REVERSE_CALLS == [[]], "eager keeps the clone"
    _REVERSE_CALLS.clear()
    torch.compile(_clone_then_reverse, backend="inductor", fullgraph=True)(compiled)
    assert len(_REVERSE_CALLS) == 1
    assert (_REVERSE_CALLS[0] == ["src"]) == (not torch.equal(compiled, eager)), (_REVERSE_CALLS, compiled, eager)


def test_an_op_call_whose_key_is_a_view_of_the_pool_is_reported_and_refused(monkeypatch):
    """Planted, eager: a `key` in the pool's memory is reported by the probe and refused by the op, pool intact."""
    case = make_case(seed=3, hkv=1, ratio=2, block_size=4, tokens=3, prefixes=[5, 2], new_counts=[3, 1],
                     modes=["causal", "full"])
    args = list(case.args())
    args[1] = case.pool.view(-1)[: case.key.numel()].view(case.key.shape)
    before = case.pool.clone()
    with op_calls(monkeypatch) as calls, pytest.raises(OpInputError, match="key share.*memory with kv_pool"):
        torch.ops.paged_kv.write_attend(*args, case.scale, "reference")
    assert calls == [["key"]] and torch.equal(case.pool, before)


def _reads_a_clone_of_the_pool(q, k, v, pool, slot, table, seq, end):
    """pytorch#198031's shape with our op: a read argument that is a clone of (part of) the pool it mutates."""
    k_from_pool = pool.clone().view(-1)[: k.numel()].view(k.shape)
    return torch.ops.paged_kv.write_attend(q, k_from_pool, v, pool, slot, table, seq, end, 0.5, "reference")


def _writes_then_reads_a_snapshot(q, k, v, pool, slot, table, seq, end):
    """A snapshot of the pool taken before the write, read after it by the read-only twin."""
    snapshot = pool.clone()
    out = torch.ops.paged_kv.write_attend(q, k, v, pool, slot, table, seq, end, 0.5, "reference")
    return out + torch.ops.paged_kv.attend(q, snapshot, table, seq, end, 0.5, "reference")


GEOMETRY = dict(seed=21, hkv=2, ratio=2, block_size=4, tokens=3, prefixes=[5, 2], new_counts=[3, 2],
                modes=["causal", "random"])


def test_inductor_handing_the_op_a_view_of_its_pool_is_reported_and_refused(monkeypatch):
    """Planted, compiled: pytorch#198031's shape with our op. Where this torch has the bug (2.13 and 2.14 today)
    the probe reports `key` in the pool's memory and the op refuses the call; with the fix, nothing is shared
    and the result matches eager."""
    eager_case, case = make_case(**GEOMETRY), make_case(**GEOMETRY)
    with torch.no_grad():
        want = _reads_a_clone_of_the_pool(*eager_case.args())
        with op_calls(monkeypatch) as calls:
            try:
                got = torch.compile(_reads_a_clone_of_the_pool, backend="inductor", fullgraph=True)(*case.args())
            except OpInputError as e:
                assert calls == [["key"]] and "key share(s) memory with kv_pool" in str(e), (calls, e)
                return
    assert calls == [[]], calls
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_inductor_keeps_a_snapshot_of_the_pool_apart_from_the_pool(monkeypatch):
    """A clone of the pool taken before the write and read after it: every op call gets memory of its own for
    every read argument, and the result and the pool match eager."""
    eager_case, case = make_case(**GEOMETRY), make_case(**GEOMETRY)
    with torch.no_grad():
        want = _writes_then_reads_a_snapshot(*eager_case.args())
        with op_calls(monkeypatch) as calls:
            got = torch.compile(_writes_then_reads_a_snapshot, backend="inductor", fullgraph=True)(*case.args())
    assert len(calls) == 2 and all(shared == [] for shared in calls), calls
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert torch.equal(case.pool, eager_case.pool)


def test_a_paged_model_under_inductor_never_hands_the_op_its_pool_twice(monkeypatch):
    """A DreamZero rollout through backend="paged_kv" with Inductor: no op call, in any layer or forward,
    receives an argument sharing memory with the pool, and the rollout matches dense eager."""
    cfg = DreamZeroConfig(sink_size=2)
    dense = dreamzero_rollout(DreamZeroModel(cfg, seed=1), num_chunks=2, num_inference_steps=1, seed=3)
    model = DreamZeroModel(cfg, seed=1)
    runtime = PagedKVRuntime(dreamzero_runtime_config(cfg, block_size=8, kernel="reference"))
    runtime.bind(model.blocks)
    compile_blocks(model.blocks, CountingBackend({"inner_compiler": "inductor"}))
    with op_calls(monkeypatch) as calls:
        paged = paged_run(model, runtime, num_chunks=2, num_inference_steps=1, seed=3)
    assert len(calls) >= 2 * cfg.num_layers, "every layer of every forward went through the op"
    assert all(shared == [] for shared in calls), calls
    for key in ("video", "actions"):
        torch.testing.assert_close(paged[key], dense[key], atol=1e-5, rtol=0)
