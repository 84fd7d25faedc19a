"""Several AR-Diffusion sessions' pipeline loops in lockstep, their model calls batched.

vllm-omni's DreamZero pipeline runs one session's loop per `forward` (reset decision, cross-attention population,
the commits, the denoising steps, the CFG combination, the schedulers) and its model refuses batch > 1 on the
paged path. Rather than rewrite that loop for K sessions, each session runs the pipeline's own `forward`,
unchanged, in a thread of its own; the threads run one at a time (a baton, never concurrently), and a thread that
reaches a model call parks there. When every live session is parked, the caller's thread runs the parked calls:
calls of the same signature (branch, commit or denoise, sequence length, start frame, row shapes) as one batched
model call, rows stacked in session order, and hands each session its row back. A session's Python state is
therefore exactly what it would be alone; only the model call is shared.

What the pipeline object holds per session while a loop runs (the bound KV state, `state`) is made thread-local
for the duration (`lockstep_pipeline`), and its `_predict_noise_eager` parks instead of calling the transformer.
Nothing here imports vllm or vllm-omni.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch

_PER_SESSION_ATTRIBUTES = ("_ar_diffusion_kv_state", "state")  # what DreamZeroPipeline keeps per bound session


class Lockstep:
    """Runs `len(bodies)` callables in lockstep (see the module docstring); `run` returns, per body, its result
    or the exception it raised. `batched_call(calls)` gets the parked calls of one signature and returns one
    result per call, in order; if it raises, every call of that group raises it."""

    def __init__(self, batched_call: Callable[[list[Any]], Sequence[Any]],
                 signature: Callable[[Any], Hashable]) -> None:
        self._batched_call = batched_call
        self._signature = signature
        self._cv = threading.Condition()
        self._turn: int | None = None  # the body allowed to run; None: the coordinator
        self._parked: dict[int, Any] = {}
        self._answers: dict[int, tuple[bool, Any]] = {}
        self._local = threading.local()
        self.batched_calls = 0  # model calls made (each carrying one or more sessions' rows)

    # ---- called from a body's thread -------------------------------------------------------------
    @property
    def in_body(self) -> bool:
        return getattr(self._local, "index", None) is not None

    def call(self, request: Any) -> Any:
        """Park this body's model call until the coordinator has run it (batched with its peers)."""
        index = self._local.index
        with self._cv:
            self._parked[index] = request
            self._turn = None
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._turn == index)
            ok, value = self._answers.pop(index)
        if not ok:
            raise value
        return value

    # ---- the coordinator --------------------------------------------------------------------------
    def run(self, bodies: Sequence[Callable[[], Any]]) -> list[tuple[bool, Any]]:
        results: list[tuple[bool, Any] | None] = [None] * len(bodies)
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        # Grad mode, the current CUDA device and stream are per thread: the bodies run under the caller's.
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        device, stream = (torch.cuda.current_device(), torch.cuda.current_stream()) if cuda else (None, None)

        def thread_main(index: int) -> None:
            self._local.index = index
            with self._cv:
                self._cv.wait_for(lambda: self._turn == index)
            try:
                with contextlib.ExitStack() as settings:
                    settings.enter_context(torch.inference_mode(inference))
                    settings.enter_context(torch.set_grad_enabled(grad))
                    if cuda:
                        settings.enter_context(torch.cuda.device(device))
                        settings.enter_context(torch.cuda.stream(stream))
                    results[index] = (True, bodies[index]())
            except BaseException as exc:  # noqa: BLE001 - handed back to the runner as this session's error
                results[index] = (False, exc)
            with self._cv:
                self._turn = None
                self._cv.notify_all()

        threads = [threading.Thread(target=thread_main, args=(i,), daemon=True, name=f"lockstep-{i}")
                   for i in range(len(bodies))]
        for thread in threads:
            thread.start()
        waiting = list(range(len(bodies)))  # bodies to run until they park or finish
        while waiting:
            for index in waiting:
                self._hand_baton(index)
            parked, self._parked = self._parked, {}
            waiting = sorted(parked)
            groups: dict[Hashable, list[int]] = {}
            for index in waiting:
                try:
                    key = self._signature(parked[index])
                except Exception as exc:  # noqa: BLE001 - a call that cannot be batched fails alone
                    self._answers[index] = (False, exc)
                    continue
                groups.setdefault(key, []).append(index)
            for members in groups.values():
                self._answer(members, parked)
        for thread in threads:
            thread.join()
        return results  # type: ignore[return-value]

    def _hand_baton(self, index: int) -> None:
        with self._cv:
            self._turn = index
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._turn is None)

    def _answer(self, members: list[int], parked: dict[int, Any]) -> None:
        self.batched_calls += 1
        try:
            values = list(self._batched_call([parked[i] for i in members]))
            if len(values) != len(members):
                raise RuntimeError(f"a batched call returned {len(values)} results for {len(members)} calls")
            answers = [(True, v) for v in values]
        except BaseException as exc:  # noqa: BLE001 - every session of the group fails with it
            answers = [(False, exc)] * len(members)
        for index, answer in zip(members, answers):
            self._answers[index] = answer


class _ThreadLocalAttribute:
    """A data descriptor: per lockstep thread its own value; outside a body, the instance's own attribute."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        lock: Lockstep = obj.__dict__["_paged_kv_lockstep"]
        if lock.in_body:
            return getattr(lock._local, "attrs", {}).get(self.name)
        return obj.__dict__.get(self.name)

    def __set__(self, obj, value) -> None:
        lock: Lockstep = obj.__dict__["_paged_kv_lockstep"]
        if lock.in_body:
            if not hasattr(lock._local, "attrs"):
                lock._local.attrs = {}
            lock._local.attrs[self.name] = value
        else:
            obj.__dict__[self.name] = value


def _parking_predict_noise_eager(self, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`DreamZeroPipeline._predict_noise_eager` with the transformer call parked for batching: the commit after
    a commit forward stays the pipeline's (`_kv_commit`), made by the session once its row came back."""
    lock: Lockstep = self.__dict__["_paged_kv_lockstep"]
    if not lock.in_body:
        raise RuntimeError("a lockstep pipeline's model call ran outside a session loop")
    video_pred, action_pred = lock.call(kwargs)
    if kwargs.get("update_kv_cache", False):
        self._kv_commit(kwargs.get("is_negative", False))
    return video_pred, action_pred


_LOCKSTEP_CLASSES: dict[type, type] = {}


def _lockstep_class(cls: type) -> type:
    if cls not in _LOCKSTEP_CLASSES:
        namespace = {name: _ThreadLocalAttribute(name) for name in _PER_SESSION_ATTRIBUTES}
        namespace["_predict_noise_eager"] = _parking_predict_noise_eager
        _LOCKSTEP_CLASSES[cls] = type(f"Lockstep{cls.__name__}", (cls,), namespace)
    return _LOCKSTEP_CLASSES[cls]


@contextlib.contextmanager
def lockstep_pipeline(pipeline, lock: Lockstep) -> Iterator[None]:
    """While open, `pipeline` keeps its per-session attributes per lockstep thread and parks its model calls in
    `lock`; on exit it is the object it was (class and attributes restored)."""
    original = type(pipeline)
    if "_predict_noise_eager" not in dir(original):
        raise TypeError(f"{original.__name__} has no _predict_noise_eager: lockstep batching drives DreamZero's "
                        "pipeline (its model calls go through _predict_noise_eager)")
    pipeline.__dict__["_paged_kv_lockstep"] = lock
    pipeline.__class__ = _lockstep_class(original)
    try:
        yield
    finally:
        pipeline.__class__ = original
        del pipeline.__dict__["_paged_kv_lockstep"]
