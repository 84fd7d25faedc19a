"""Graph dumps: what the passes saw, what they rewrote, and depyf's view of the whole compilation.

    from paged_kv_compile import debug

    with debug.dump("dump_dir") as d:      # wrap the code that triggers compilation (the first forwards)
        run_the_model()
    print(d.files())

For every graph the `paged_kv` backend rewrites it writes ``paged_kv_graph_NNN.before.py`` (dynamo's FX
graph as the passes received it), ``.after.py`` (the rewritten graph handed to the inner compiler) and
``.report.json`` (every attention site: pattern, layer key, rewritten/dense/refused and why). On exit it
writes ``paged_kv_summary.json`` listing them. Inside, ``depyf.prepare_debug(dir)`` adds depyf's files:
the decompiled dynamo bytecode (``full_code_for_*.py``, ``__transformed_code_*``), the captured and AOT
graphs (``__compiled_fn_*``) and Inductor's kernels. Never call ``depyf.debug()``: it stops at a breakpoint.

The backend's ``dump_dir`` option (or ``PagedKVConfig.dump_dir``) writes the three pass files alone:
depyf has to wrap the frame's compilation from the outside, which only ``dump()`` does.

depyf 0.20 replaces Inductor's ``PyCodeCache.load_by_key_path`` with a function of four positional
parameters. torch 2.13's ``PyCodeCache.load`` calls it with an extra keyword (``set_sys_modules=``), a
``TypeError`` under depyf; Inductor's own graph loader (``graph.py``, ``output_code.py``) passes only
``linemap``/``attrs``, so CPU graphs compile anyway, but every Triton kernel goes through ``load``
(``async_compile``, ``_load_triton_kernel_from_source``) and so does kernel benchmarking. ``dump()``
wraps depyf's hook in a shim that forwards extra keywords, and only when the hook would reject them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import os
import warnings
from typing import Iterator

from .passes.result import PassResult

_counter = {"n": 0}


@dataclasses.dataclass
class DumpSession:
    """What one `dump()` wrote (also available while it is open)."""

    directory: str
    depyf: bool
    graphs: list[dict] = dataclasses.field(default_factory=list)

    def files(self) -> list[str]:
        """Every file in the dump directory, sorted, relative to it."""
        out = []
        for root, _, names in os.walk(self.directory):
            for name in names:
                out.append(os.path.relpath(os.path.join(root, name), self.directory))
        return sorted(out)

    def pass_files(self) -> list[str]:
        return sorted(f for f in self.files() if f.startswith("paged_kv_"))

    def depyf_files(self) -> list[str]:
        return sorted(f for f in self.files() if not f.startswith("paged_kv_"))


_active: list[DumpSession] = []


def _report_dict(result: PassResult) -> dict:
    return {
        "sites": [dataclasses.asdict(r) for r in result.reports],
        "shape": result.shape,
        "expect": dataclasses.asdict(result.expect) if result.expect is not None else {},
    }


def _write(dump_dir: str, stem_name: str, before: str, result: PassResult) -> dict:
    os.makedirs(dump_dir, exist_ok=True)
    stem = os.path.join(dump_dir, stem_name)
    with open(stem + ".before.py", "w") as f:
        f.write(before)
    with open(stem + ".after.py", "w") as f:
        f.write(result.graph_module.print_readable(print_output=False))
    report = _report_dict(result)
    with open(stem + ".report.json", "w") as f:
        json.dump(report, f, indent=2)
    return {"name": stem_name, "before": stem_name + ".before.py", "after": stem_name + ".after.py",
            "report": stem_name + ".report.json", **report}


def maybe_dump(dump_dir: str | None, before: str, result: PassResult) -> list[str]:
    """Write the FX graph before and after the passes and the pass report under `dump_dir`.

    Also under the directory of an open `dump()`, if any. Returns the directories written to.
    """
    dirs = [dump_dir] if dump_dir else []
    session = _active[-1] if _active else None
    if session is not None and os.path.abspath(session.directory) not in {os.path.abspath(d) for d in dirs}:
        dirs.append(session.directory)
    if not dirs:
        return []
    _counter["n"] += 1
    stem_name = f"paged_kv_graph_{_counter['n']:03d}"
    for d in dirs:
        entry = _write(d, stem_name, before, result)
        if session is not None and d == session.directory:
            session.graphs.append(entry)
    return dirs


def _hook_accepts_keywords(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@contextlib.contextmanager
def depyf_code_cache_shim() -> Iterator[bool]:
    """Inside `depyf.prepare_debug`: let depyf's code-cache hook take Inductor's extra keywords.

    Yields whether a shim was installed (False when depyf did not patch, or its hook already copes).
    """
    from torch._inductor.codecache import PyCodeCache

    hook = PyCodeCache.__dict__.get("load_by_key_path")
    if hook is None or isinstance(hook, (classmethod, staticmethod)) or _hook_accepts_keywords(hook):
        yield False
        return

    @functools.wraps(hook)
    def load_by_key_path(key, path, linemap=None, attrs=None, **kwargs):
        if not kwargs:
            return hook(key, path, linemap, attrs)
        from depyf.explain.global_variables import data

        unpatched = data["unpatched_load_by_key_path"]
        data["unpatched_load_by_key_path"] = functools.partial(unpatched, **kwargs)
        try:  # depyf's hook copies the kernel's source into the dump, then calls the original
            return hook(key, path, linemap, attrs)
        finally:
            data["unpatched_load_by_key_path"] = unpatched

    PyCodeCache.load_by_key_path = load_by_key_path
    try:
        yield True
    finally:
        PyCodeCache.load_by_key_path = hook


@contextlib.contextmanager
def dump(directory: str | os.PathLike, *, use_depyf: bool = True) -> Iterator[DumpSession]:
    """Dump every compilation inside the block: the paged_kv pass files and (by default) depyf's files.

    Wrap the code that triggers compilation (the first calls of compiled modules), not the
    `torch.compile` call. Frames already compiled before the block are not compiled again, so
    nothing is dumped for them: call `torch._dynamo.reset()` first to see them.
    """
    directory = os.path.abspath(os.fspath(directory))
    os.makedirs(directory, exist_ok=True)
    session = DumpSession(directory, use_depyf)
    _active.append(session)
    try:
        with contextlib.ExitStack() as stack:
            if use_depyf:
                import depyf

                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*You are trying to debug `torch.compile`")
                    stack.enter_context(depyf.prepare_debug(directory))
                stack.enter_context(depyf_code_cache_shim())  # wraps depyf's hook: enter it after
            yield session
    finally:
        _active.remove(session)
        with open(os.path.join(directory, "paged_kv_summary.json"), "w") as f:
            json.dump({"depyf": use_depyf, "graphs": session.graphs}, f, indent=2, default=str)
