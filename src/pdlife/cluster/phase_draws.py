"""Phase-keyed fault draws: which requests fail (or are aborted), where, and
which draw wins, as a function of the seed alone (see :mod:`pdlife.cluster.plan`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs
import numpy as np
from numpy.typing import NDArray

from lifecycle.core.fingerprint import mix64
from lifecycle.status import KVPoll

__all__ = ["PHASES", "PHASE_VALUE", "DrawnPlan", "Decision", "draw", "phase_decisions"]

#: the phases a phase-keyed fault may name, in lifecycle order: every status a
#: request passes through before it ends
PHASES = tuple(s.name for s in KVPoll if not s.terminal)
#: each phase's status value
PHASE_VALUE = {s.name: int(s) for s in KVPoll if not s.terminal}


class DrawnPlan(Protocol):
    """What the draws read of a fault plan: its probabilistic part."""

    @property
    def seed(self) -> int: ...

    @property
    def prob(self) -> float: ...

    @property
    def prob_ranks(self) -> tuple[int, ...] | None: ...


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_mix = mix64


def draw(seed: int, salt: int, rank: int, rooms: NDArray[np.uint64]) -> NDArray[np.float64]:
    """A uniform draw in [0, 1) per room, keyed by (seed, salt, rank, room) alone:
    the same request gets the same number whatever order or step it is asked in."""
    with np.errstate(over="ignore"):
        salted = np.array([seed & (2**64 - 1)], np.uint64) + _GOLDEN * np.uint64(salt + 1)
        key = _mix(_mix(salted) ^ _mix(np.array([rank + 1], np.uint64) * _GOLDEN))
    bits = _mix(np.asarray(rooms, np.uint64) ^ key)
    out: NDArray[np.float64] = (bits >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return out


def attempt_keys(rooms: NDArray[np.uint64], epoch: int) -> NDArray[np.uint64]:
    """What an attempt's draws are keyed by: the room for the first attempt (as
    before retries existed), the room mixed with a later epoch."""
    if epoch == 0:
        return rooms
    with np.errstate(over="ignore"):
        out: NDArray[np.uint64] = _mix(rooms ^ (_GOLDEN * np.uint64(epoch)))
    return out


@attrs.frozen
class Decision:
    """One phase-keyed draw: ``rank`` fails (or, rank -1, the client aborts)
    ``room`` when it reaches ``phase``. Only the request's winner fires."""

    room: int
    rank: int
    phase: str
    kind: str  # "fail" | "abort"
    wins: bool


def phase_decisions(
    plan: DrawnPlan,
    abort_prob: float,
    abort_seed: int,
    world: int,
    rooms: NDArray[np.uint64],
    serves: Callable[[int], NDArray[np.bool_]] | None = None,
    epoch: int = 0,
) -> list[Decision]:
    """Every phase-keyed draw for ``rooms`` (each rank's fault, the client's abort),
    with each request's winner marked: the earliest phase; ties go to the abort,
    then to the lowest rank. ``serves(rank)``, if given, masks the rooms a rank
    sees at all (prefill DP groups each see their own): a rank draws no fault
    for a request it never sees, so it cannot win one it could not fire. A
    retried request's later ``epoch`` draws anew (the client's abort was drawn
    once, for its first attempt)."""
    rooms = np.asarray(rooms, np.uint64)
    keys = attempt_keys(rooms, epoch)
    n = rooms.size
    big = len(PHASES) * (world + 2)
    best = np.full(n, big, np.int64)
    found: list[tuple[NDArray[np.int64], int, str, NDArray[np.int64]]] = []
    if abort_prob > 0 and epoch == 0:
        hit = np.flatnonzero(draw(abort_seed, 3, 0, rooms) < abort_prob)
        phase = (draw(abort_seed, 4, 0, rooms[hit]) * len(PHASES)).astype(np.int64)
        found.append((hit, -1, "abort", phase))
    if plan.prob > 0:
        for r in range(world) if plan.prob_ranks is None else plan.prob_ranks:
            drawn = draw(plan.seed, 1, r, keys) < plan.prob
            hit = np.flatnonzero(drawn if serves is None else drawn & serves(r))
            phase = (draw(plan.seed, 2, r, keys[hit]) * len(PHASES)).astype(np.int64)
            found.append((hit, r, "fail", phase))
    for hit, r, _, phase in found:
        np.minimum.at(best, hit, phase * (world + 2) + r + 1)
    out = []
    for hit, r, kind, phase in found:
        wins = best[hit] == phase * (world + 2) + r + 1
        for i, p, w in zip(hit.tolist(), phase.tolist(), wins.tolist()):
            out.append(Decision(int(rooms[i]), r, PHASES[p], kind, bool(w)))
    out.sort(key=lambda d: (d.room, d.rank))
    return out
