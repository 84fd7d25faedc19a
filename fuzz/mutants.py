"""Defects 1-6 of docs/reliability.md ("no silent wrong answer") put back, one at a time: the fix's hunk reversed in the function it lives in.

That section names each fix and the hunk whose reversal puts the defect back. Where the
hunk is a line, the mutant is that function's own source with the line edited back (`_edited`: it refuses to run
when the line is no longer there, so a mutant cannot silently stop being the defect); where the fix rewrote a
function, the mutant is the old function (layout's `_attends` at 20ebac8, the commit before the fix).

    with mutant(5):
        Fuzzer("dreamzero", seed).run(200)   # raises FuzzFailure("deadlock", ...)
"""

from __future__ import annotations

import contextlib
import inspect
import re
import textwrap
from typing import Callable, Iterator

import torch

#: defect -> (what it is, the function(s) the mutant replaces)
DESCRIPTIONS = {
    1: "additive mask values above finfo.min read as 'attend' (layout._attends as at 20ebac8)",
    2: "the captured path replays without its per-call host checks (CapturedBlocks._host_checks runs none)",
    3: "an aborted forward leaves its build as the bucket's last (runtime.forward_plan without `meta.last_key = ()`) "
       "and a HunyuanImage-3 prefill has a repeat key (HunyuanImage3Family.plan's key line)",
    4: "FP8 set_scales accepted while blocks hold data quantized with the old scales (KVPool.set_scales without "
       "its `held` check)",
    5: "admission reserves nothing (Scheduler._check_reserved without its comparison)",
    6: "repeat keys name the owner by its id, reusable after the finished-id memory (DreamZeroFamily.plan and "
       "HunyuanImage3Family.plan key by owner_id instead of the admission serial)",
}


def _edited(func: Callable, pattern: str, replacement: str) -> Callable:
    """`func` rebuilt from its source with the one match of regex `pattern` replaced (in its own module's globals)."""
    src = textwrap.dedent(inspect.getsource(func))  # decorators included (forward_plan's contextmanager)
    found = re.findall(pattern, src, flags=re.MULTILINE)
    if len(found) != 1:
        raise RuntimeError(f"the fix's hunk {pattern!r} is not in {func.__qualname__} exactly once "
                           f"(found {len(found)}): update the mutant to the fixed code")
    src = re.sub(pattern, replacement, src, flags=re.MULTILINE)
    namespace: dict = {}
    exec(compile(src, f"<mutant of {func.__qualname__}>", "exec"), inspect.unwrap(func).__globals__, namespace)
    return namespace[func.__name__]


def _attends_at_20ebac8(block: torch.Tensor, out=None) -> torch.Tensor:
    """layout._attends before the fix: True for a boolean mask, `> finfo.min` for an additive one."""
    if block.dtype == torch.bool:
        return block
    return block > torch.finfo(block.dtype).min


def _patches(defect: int) -> list[tuple[object, str, object]]:
    if defect == 1:
        from paged_kv_compile import layout
        return [(layout, "_attends", _attends_at_20ebac8)]
    if defect == 2:
        from paged_kv_compile.capture.blocks import CapturedBlocks

        def _host_checks(self, made: list) -> list[int]:
            return [layer for call in made for layer in call.layers]  # the layers served, no check run
        return [(CapturedBlocks, "_host_checks", _host_checks)]
    if defect == 3:
        from paged_kv_compile.families.hunyuan_image3 import HunyuanImage3Family
        from paged_kv_compile.runtime import PagedKVRuntime
        return [(PagedKVRuntime, "forward_plan", _edited(PagedKVRuntime.forward_plan, r"^\s*meta\.last_key = \(\).*\n", "")),
                (HunyuanImage3Family, "plan", _edited(HunyuanImage3Family.plan, r' if kind == "step" else \(\)', ""))]
    if defect == 4:
        from paged_kv_compile.pool import KVPool
        fixed = KVPool.set_scales

        def set_scales(self, k_scale, v_scale) -> None:
            held, self.blocks_held = self.blocks_held, lambda: 0  # the `held` check sees nothing held
            try:
                fixed(self, k_scale, v_scale)
            finally:
                self.blocks_held = held
        return [(KVPool, "set_scales", set_scales)]
    if defect == 5:
        from paged_kv_compile.scheduler import Scheduler

        def _check_reserved(self, *args, **kwargs) -> None:
            return None  # nothing compared: every admission and fork fits
        return [(Scheduler, "_check_reserved", _check_reserved)]
    if defect == 6:
        from paged_kv_compile.families.dreamzero import DreamZeroFamily
        from paged_kv_compile.families.hunyuan_image3 import HunyuanImage3Family
        return [(family, "plan", _edited(family.plan, r"key = \(owner\.serial, kind", "key = (owner.owner_id, kind"))
                for family in (DreamZeroFamily, HunyuanImage3Family)]
    raise ValueError(f"no mutant for defect {defect}; defects 1-6 have one")


@contextlib.contextmanager
def mutant(defect: int) -> Iterator[None]:
    """Defect `defect` put back for the duration of the block (class and module attributes patched, restored)."""
    patches = _patches(defect)
    saved = [(obj, name, obj.__dict__[name]) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
