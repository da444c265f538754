"""The consensus machine's invariants: what each rank should contribute, computed
from the raw inputs alone, and the checks of one lockstep step's results
(numbered as in :mod:`lifecycle.testing.consensus`)."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Protocol

import numpy as np
from hypothesis import event

from buffers import MetadataBuffers
from lifecycle.core.step import RawStepper
from lifecycle.errors import LifecycleError
from lifecycle.result import StepResult
from lifecycle.rules.graph import TRIGGERS
from lifecycle.rules.reference import RequestMachine
from lifecycle.status import F, KVPoll, S, T
from lifecycle.table import RequestTable
from lifecycle.testing.doubles import ListFaults, SetGate, SetStaging, StatusBoard


class World(Protocol):
    """What the checks read of a lockstep world: per rank its table, poller,
    gates, faults, metadata and stepper; per room what was decided for it."""

    @property
    def world(self) -> int: ...

    @property
    def tables(self) -> Sequence[RequestTable]: ...

    @property
    def boards(self) -> Sequence[StatusBoard]: ...

    @property
    def gates(self) -> Sequence[SetGate]: ...

    @property
    def staging(self) -> Sequence[SetStaging]: ...

    @property
    def faults(self) -> Sequence[ListFaults]: ...

    @property
    def metas(self) -> Sequence[MetadataBuffers]: ...

    @property
    def steppers(self) -> Sequence[RawStepper]: ...

    @property
    def fake(self) -> Mapping[int, bool]: ...

    @property
    def slot_of(self) -> Mapping[int, int]: ...

    @property
    def agreed(self) -> MutableMapping[int, int]: ...

    @property
    def reference(self) -> Mapping[int, RequestMachine]: ...


__all__ = [
    "World",
    "InvariantViolation",
    "check",
    "expected_local",
    "gates_open",
    "check_step",
]


class InvariantViolation(AssertionError):
    """An invariant of the consensus failed; the message names which."""

    def __init__(self, name: str, detail: str) -> None:
        self.name = name
        super().__init__(f"invariant '{name}' violated: {detail}")


def check(cond: bool, name: str, detail: str) -> None:
    if not cond:
        raise InvariantViolation(name, detail)


def expected_local(m: World, rank: int, room: int) -> int:
    """What rank ``rank`` should contribute for a live, non-terminal ``room``,
    derived from the raw inputs alone."""
    board, t = m.boards[rank], m.tables[rank]
    if board.raising is not None or room in m.faults[rank].rooms:
        return F
    if t.abort_requested[t.slot_of(room)]:
        return F
    raw = int(board.status.get(room, board.default))
    if raw != S:
        return raw
    if not m.fake[room]:
        row = m.metas[rank].room_of(m.slot_of[room])
        if row not in (0, room):
            return F  # metadata corrupt
        if row != room:
            return T
    if room in m.gates[rank].closed_rooms or room in m.staging[rank].pending_rooms:
        return T
    return S


def gates_open(m: World, rows: list[int]) -> dict[int, bool]:
    """Per room: was every rank's raw poll Success with all its gates open?"""
    out = {}
    for room in rows:
        ok = True
        for r in range(m.world):
            board = m.boards[r]
            t = m.tables[r]
            slot = m.slot_of[room]
            ok &= board.raising is None
            ok &= board.status.get(room, board.default) == S
            ok &= room not in m.gates[r].closed_rooms
            ok &= room not in m.staging[r].pending_rooms
            ok &= room not in m.faults[r].rooms
            ok &= not bool(t.abort_requested[t.slot_of(room)])
            ok &= m.fake[room] or m.metas[r].room_of(slot) == room
        out[room] = bool(ok)
    return out


def check_step(
    m: World,
    rows: list[int],
    before: dict[int, int],
    opened: dict[int, bool],
    results: list[StepResult],
    expected: dict[int, int],
    doomed: dict[int, bool],
) -> None:
    first = results[0]
    for r, res in enumerate(results[1:], start=1):
        same = (
            res.rooms.tolist() == first.rooms.tolist()
            and res.statuses.tolist() == first.statuses.tolist()
            and res.reasons.tolist() == first.reasons.tolist()
            and res.origins.tolist() == first.origins.tolist()
        )
        check(same, "agreement", f"rank {r} disagrees with rank 0 at step {res.step}")
    check(first.rooms.tolist() == rows, "agreement", "result rows are not the table rows")
    agreed_now = dict(zip(rows, first.statuses.tolist()))
    for room, want in expected.items():
        check(
            agreed_now[room] == want,
            "validity",
            f"room {room}: agreed {agreed_now[room]} != MIN over ranks of the raw inputs {want}",
        )
    for room, aborted in doomed.items():
        i = rows.index(room)
        for r, res in enumerate(results):
            check(
                int(res.statuses[i]) == F,
                "doomed",
                f"room {room}: aborted or fault-injected, but rank {r} agreed "
                f"{int(res.statuses[i])}",
            )
            if aborted:
                check(
                    int(res.reasons[i]) == 0,
                    "doomed",
                    f"room {room}: aborted but rank {r} agreed reason {int(res.reasons[i])}",
                )
    triggers = dict(zip(first.rooms[first.changed].tolist(), first.triggers.tolist()))
    for i, room in enumerate(rows):
        old, new = before[room], int(first.statuses[i])
        if old in (S, F):
            check(new == old, "latch", f"room {room} left terminal {old} for {new}")
        else:
            check(new >= old or new == F, "monotone", f"room {room} went {old} -> {new}")
        if new != old:
            event(f"transition {KVPoll(old).name} -> {KVPoll(new).name}")
        if new == S and old != S:
            check(
                opened[room],
                "success",
                f"room {room} succeeded though some rank's poll or gate said otherwise",
            )
        if new == F and old != F:
            origin, reason = int(first.origins[i]), int(first.reasons[i])
            check(0 <= origin < m.world, "origin", f"room {room} origin {origin}")
            # the steppers' values cover the rows not agreed terminal before the step
            j = int(np.searchsorted(first.active, i))
            loc = m.steppers[origin].local
            check(
                int(loc.values[j]) == F and int(loc.reasons()[j]) == reason,
                "origin",
                f"room {room}: origin rank {origin} did not fail it for reason {reason}",
            )
        m.agreed[room] = new
        ref = m.reference[room]
        try:
            fired = ref.advance(KVPoll(new), reason=first.reasons[i], origin=int(first.origins[i]))
        except LifecycleError as e:
            raise InvariantViolation("reference", str(e)) from e
        batch_fired = TRIGGERS[triggers[room]] if room in triggers else None
        check(
            fired == batch_fired,
            "reference",
            f"room {room}: reference fired {fired!r}, batch executor {batch_fired!r}",
        )
        check(
            int(ref.state) == int(m.tables[0].state[m.tables[0].slot_of(room)]),
            "reference",
            f"room {room}: reference executor {ref.state!r} != batch executor",
        )
