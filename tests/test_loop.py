"""`models.hooks.Loop`, the one driver of the step generators (`drive`, the benchmarks' `OwnerRun`, the fault
tests' `paced`): on a toy loop, no model."""

from __future__ import annotations

import contextlib

import pytest

from paged_kv_compile.models.hooks import DenseHooks, Forward, Loop, drive


class RecordingHooks(DenseHooks):
    """Records every forward context: (kind, info) on entry, "exit" on exit."""

    def __init__(self) -> None:
        self.log: list = []

    @contextlib.contextmanager
    def forward(self, kind, **info):
        self.log.append((kind, info))
        yield
        self.log.append("exit")


def toy_steps(calls: list, fail: set | None = None):
    """Two indices of two forwards ("a", "b"); each call returns 10 * index + position, and fails once if listed
    in `fail` as (kind, index); returns the sum of what it was sent."""
    fail = set(fail or ())
    total = 0
    for index in range(2):
        for position, kind in enumerate(("a", "b")):
            def call(kind=kind, index=index, position=position):
                calls.append((kind, index))
                if (kind, index) in fail:
                    fail.discard((kind, index))
                    raise RuntimeError(f"fault in {kind} {index}")
                return 10 * index + position

            total += yield Forward(kind, index, call, {"index": index})
    return total


def test_call_pending_runs_the_forward_inside_its_context_and_does_not_advance():
    calls, hooks = [], RecordingHooks()
    loop = Loop(toy_steps(calls), hooks)
    assert (loop.pending.kind, loop.pending.index) == ("a", 0) and not calls  # started, nothing run yet
    assert loop.call_pending() == 0 and loop.call_pending() == 0
    assert calls == [("a", 0), ("a", 0)] and hooks.log == [("a", {"index": 0}), "exit"] * 2
    assert (loop.pending.kind, loop.pending.index) == ("a", 0) and loop.forwards == 0


def test_run_one_run_index_run_while_and_run():
    calls = []
    loop = Loop(toy_steps(calls), RecordingHooks())
    seen = []
    assert loop.run_one(after=lambda f, r: seen.append((f.kind, r, loop.pending.kind))) == 0
    assert seen == [("a", 0, "a")]  # `after` runs before the loop moves on
    loop.run_index()  # the rest of index 0: "b"
    assert calls == [("a", 0), ("b", 0)] and (loop.pending.kind, loop.pending.index) == ("a", 1)
    loop.run_while(lambda f: f.kind == "b")  # the pending "a" does not satisfy it: nothing runs
    assert loop.forwards == 2
    assert loop.run() == 0 + 1 + 10 + 11 and loop.done and loop.result == 22 and loop.forwards == 4
    loop.run_index()  # nothing left: a no-op
    with pytest.raises(RuntimeError, match="no pending forward"):
        loop.call_pending()


def test_a_forward_that_raises_leaves_the_loop_at_it_and_runs_again():
    calls = []
    loop = Loop(toy_steps(calls, fail={("b", 0)}), RecordingHooks())
    loop.run_one()
    with pytest.raises(RuntimeError, match="fault in b 0"):
        loop.run_one()
    assert (loop.pending.kind, loop.pending.index) == ("b", 0) and loop.forwards == 1
    assert loop.run() == 22 and calls == [("a", 0), ("b", 0), ("b", 0), ("a", 1), ("b", 1)]


def test_a_loop_that_raises_between_forwards_has_ended():
    def broken():
        yield Forward("a", 0, lambda: 1)
        raise ValueError("the loop itself failed")

    loop = Loop(broken(), DenseHooks())
    with pytest.raises(ValueError, match="the loop itself failed"):
        loop.run_one()
    assert loop.done  # its last forward is not pending any more: it must not run again


def test_drive_is_a_loop_run_to_its_end():
    calls_a, calls_b = [], []
    hooks_a, hooks_b = RecordingHooks(), RecordingHooks()
    assert drive(toy_steps(calls_a), hooks_a) == Loop(toy_steps(calls_b), hooks_b).run() == 22
    assert calls_a == calls_b and hooks_a.log == hooks_b.log
