"""Find pool-sized allocations and pool copies in Inductor's generated wrapper code.

No compiled region may allocate or copy a pool-sized buffer (README.md, "Pool"). Pass the code
strings from ``torch._inductor.utils.run_and_get_code`` and the pool's shape; an empty list means clean.
"""

from __future__ import annotations

import math
import re

_ALLOC = re.compile(r"^\s*(\w+)\s*=\s*(?:empty_strided\w*|torch\.empty(?:_strided)?|torch\.zeros)\(\s*\(([^()]*)\)")
_ASSERT = re.compile(r"assert_size_stride\((\w+),\s*\(([^()]*)\)")
_COPY = re.compile(r"copy|clone")


def _shape(text: str) -> tuple[int, ...] | None:
    """The ints of a shape tuple's text; None when a dim is symbolic."""
    dims = [d.strip() for d in text.split(",") if d.strip()]
    return tuple(int(d) for d in dims) if all(d.isdigit() for d in dims) else None


def pool_sized_allocations(code: str, pool_shape: tuple[int, ...]) -> list[str]:
    """Lines of `code` that allocate, copy or clone pool-sized memory.

    Flagged: allocations with at least as many elements as one pool half (the K or the V of every
    layer), and any copy/clone call (``.copy_(``, a fused ``*clone*``/``*copy*`` kernel) that passes the
    pool input (found by its ``assert_size_stride`` shape) or such a buffer. Symbolic shapes are skipped.
    """
    half = math.prod(pool_shape) // 2
    big = {name for name, s in _ASSERT.findall(code) if _shape(s) == tuple(pool_shape)}
    found = []
    lines = [line.strip() for line in code.splitlines() if line.strip() and not line.strip().startswith("#")]
    for line in lines:
        m = _ALLOC.match(line)
        shape = _shape(m.group(2)) if m else None
        if shape is not None and math.prod(shape) >= half:
            big.add(m.group(1))
            found.append(line)
    for line in lines:
        if _COPY.search(line) and not _ALLOC.match(line) and any(re.search(rf"\b{n}\b", line) for n in big):
            found.append(line)
    return found
