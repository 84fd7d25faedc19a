"""Which pages of a request whose prompt K/V another stage writes are ready (`kv_import.py`), of which generation.

The family keeps one on its owner record (HunyuanImage-3: `HunyuanRecord.imported`) and its step plan asks it
(`check_ready`); `kv_import` marks pages ready as it writes them. A module of its own so that the families need
not import `kv_import`, which imports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .errors import RequestError

__all__ = ["ImportRecord"]


@dataclass
class ImportRecord:
    """Which pages of an imported request are ready (`Owner.state.imported`): per row, per page."""

    generation: int
    ready: list[list[bool]]

    @classmethod
    def empty(cls, generation: int, pages_per_row: Sequence[int]) -> "ImportRecord":
        return cls(generation, [[False] * n for n in pages_per_row])

    def missing(self) -> dict[int, list[int]]:
        """Per row with pages not ready, their indices in the row."""
        return {r: [i for i, ok in enumerate(row) if not ok] for r, row in enumerate(self.ready) if not all(row)}

    @property
    def complete(self) -> bool:
        return all(all(row) for row in self.ready)

    def check_ready(self, owner_id: str, generation: int | None) -> None:
        """Refuse a forward over pages not all ready, or one expecting another generation."""
        if generation is not None and generation != self.generation:
            raise RequestError(
                f"this forward of request {owner_id!r} expects imported pages of generation {generation}, but the "
                f"reservation is generation {self.generation} (it was re-made): import into the current ticket "
                "(kv_import.ticket) and run the forward with its generation. Nothing was planned"
            )
        missing = self.missing()
        if missing:
            rows = "; ".join(f"row {r}: pages {pages}" for r, pages in missing.items())
            raise RequestError(
                f"request {owner_id!r} imports its prompt K/V (generation {self.generation}) and not all its pages are "
                f"ready ({rows}): import them (kv_import.import_dense / import_vllm_blocks) before its first step. "
                "Nothing was planned"
            )
