"""One vote of the ranks of a model-parallel group: did every rank succeed, and do they agree?

Every rank reaches each decision point with (a) its own outcome (None, or the exception it raised), (b) a hash of
the call it is making, (c) a digest of the decision state every rank must share (owners, their versions and
phases: equal on all ranks, also CFG ranks holding different rows) and (d) a digest of what only ranks of one
SYMMETRIC group must share (the call's arguments, a forward's plan geometry, block tables, free blocks: equal across
the TP x Ulysses ranks of one CFG rank, which hold identical block geometry). The vote is ONE all-reduce (MAX) of a
small int64 tensor over a CPU (gloo) group, whatever the model's size:

    [failed, call, -call, decisions, -decisions, (geometry_c, -geometry_c) for each CFG rank c]

A rank of CFG rank c writes its geometry digest into slot c and INT64_MIN into the others, so after MAX the slot
holds (max, -min) over that symmetric group alone: values agree iff max == min. Only when something is wrong does a
second collective (all_gather_object) fetch every rank's story, so that every rank raises the same clear error:
the failing rank its own exception, the others the same error class naming that rank (or `RankFaultError` for an
exception that is not a paged-KV refusal), `DivergenceError` when all succeeded but disagree.

The vote runs on the host, outside any compiled region: it adds no node to a graph and no device sync.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import errors
from ..errors import DivergenceError, RankFaultError

_MASK = (1 << 62) - 1
_ABSENT = torch.iinfo(torch.int64).min


def digest(*parts: Any) -> int:
    """A 62-bit blake2b digest of the parts' reprs (ints, strings, tuples of them, numpy bytes)."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part if isinstance(part, bytes) else repr(part).encode())
        h.update(b"\x1f")
    return int.from_bytes(h.digest(), "little") & _MASK


@dataclass
class Ballot:
    """What one rank brings to a vote."""

    call: tuple  # what it is doing: (operation, owner id, kind, counter) -- no tensors
    error: BaseException | None = None
    decisions: int = 0  # digest every rank must share (0: not compared at this vote)
    geometry: int = 0  # digest the rank's symmetric group must share (0: not compared at this vote)


class Agreement:
    """Votes over `group` (a CPU/gloo process group holding every rank of one model-parallel group).

    symmetric_group: which symmetric group this rank belongs to (its CFG rank), of `num_symmetric` groups."""

    def __init__(self, group: Any, *, symmetric_group: int, num_symmetric: int) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.symmetric_group = symmetric_group
        self.num_symmetric = num_symmetric
        self.votes = 0  # how many votes this rank took part in (all ranks take part in the same ones)
        self.second_rounds = 0  # votes that needed the all_gather_object round (something was wrong)

    def vote(self, ballot: Ballot) -> None:
        """Return when every rank succeeded and agrees; otherwise raise the same story on every rank."""
        self.votes += 1
        call = digest(*ballot.call)
        row = [1 if ballot.error is not None else 0, call, -call, ballot.decisions, -ballot.decisions]
        for c in range(self.num_symmetric):
            row += [ballot.geometry, -ballot.geometry] if c == self.symmetric_group else [_ABSENT, _ABSENT]
        t = torch.tensor(row, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        v = t.tolist()
        agree = v[0] == 0 and v[1] == -v[2] and v[3] == -v[4]
        agree = agree and all(v[5 + 2 * c] == -v[6 + 2 * c] for c in range(self.num_symmetric)
                              if v[5 + 2 * c] != _ABSENT)
        if agree:
            return
        self._explain(ballot)

    def _explain(self, ballot: Ballot) -> None:
        """Second round: every rank's story, then the same error everywhere (the failing rank: its own)."""
        self.second_rounds += 1
        mine = {
            "rank": self.rank, "symmetric_group": self.symmetric_group, "call": ballot.call,
            "error": None if ballot.error is None else (type(ballot.error).__name__, str(ballot.error)),
            "decisions": ballot.decisions, "geometry": ballot.geometry,
        }
        stories: list[dict] = [None] * self.size  # type: ignore[list-item]
        dist.all_gather_object(stories, mine, group=self.group)
        if ballot.error is not None:
            raise ballot.error
        failed = [s for s in stories if s["error"] is not None]
        if failed:
            first = failed[0]
            name, message = first["error"]
            what = f"{ballot.call[0]} {ballot.call[1:3]!r}"
            cls = getattr(errors, name, None)
            if isinstance(cls, type) and issubclass(cls, errors.PagedKVError):
                raise cls(f"rank {first['rank']} refused {what}: {message}. Every rank refused it; nothing changed")
            raise RankFaultError(
                f"rank {first['rank']} failed in {what} with {name}: {message}. The forward was rolled back on every "
                "rank (the ranks stay in step); fix the failing rank's input or retry"
            )
        calls = {s["rank"]: s["call"] for s in stories}
        if len({repr(c) for c in calls.values()}) > 1:
            raise DivergenceError(
                f"the ranks made different calls at the same point: {calls}. Every rank must call the runtime in the "
                "same order with the same owners and kinds; nothing was computed"
            )
        if len({s["decisions"] for s in stories}) > 1:
            by_rank = {s["rank"]: s["decisions"] for s in stories}
            raise DivergenceError(
                f"the ranks' decision state differs (owners, versions or phases; digests by rank {by_rank}): a rank "
                "changed its runtime outside the agreed calls. Nothing was computed; rebuild the ranks' runtimes"
            )
        groups: dict[int, dict[int, int]] = {}
        for s in stories:
            groups.setdefault(s["symmetric_group"], {})[s["rank"]] = s["geometry"]
        split = {g: ranks for g, ranks in groups.items() if len(set(ranks.values())) > 1}
        raise DivergenceError(
            f"ranks that must hold identical block tables do not (symmetric group -> digests by rank: {split}): "
            "their block tables, free blocks, the call's arguments or what the forward's plan computes differ "
            "(a rank passing other arguments, e.g. another branch or spec, or whose runtime changed outside the "
            "agreed calls). Nothing was computed; if the calls were the same, rebuild the ranks' runtimes"
        )
