"""Where a request's time goes on the wire: a record of what one connector's
loop was told and what it did, each with the time it happened.

Off unless asked for (``Connector.timeline``): an operator or a bench sets a
:class:`Timeline` on each rank's connector, runs requests, then takes the
records of every rank and merges them (ranks on one host share the monotonic
clock). :func:`chrome_trace` turns them into a Chrome trace (Perfetto opens
it); :func:`hops` lines up each request's marks into the gaps between them.

Each record is ``(seconds, label, room)``. The connector notes every event its
core is handed (``recv <kind>`` for a peer's message, ``note <kind>`` for the
engine's own, ``landed``/``failed``/``unreachable`` for a write's outcome,
``stale <kind>``, ``silent [peers]`` and ``restarted [peers]``, the rest by
their type) and every effect it performs (``send <kind>``,
``forget`` once performed, ``write`` as it is handed to the engine, whose post
may copy the bytes before it returns); a caller adds its own marks with
:meth:`Timeline.mark`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import pairwise
from typing import Any

from transport.connector.core.events import (
    Arrived,
    Effect,
    Event,
    Forget,
    Restarted,
    Send,
    Silence,
    Stale,
    Write,
    Written,
)

__all__ = ["Record", "Timeline", "chrome_trace", "hops"]

#: (seconds on the monotonic clock, what happened, the request's room or -1)
Record = tuple[float, str, int]

#: the records one timeline keeps by default (the newest; older ones give way)
LIMIT = 200_000


class Timeline:
    """A bounded record of one connector's events and effects (see the module):
    the newest ``limit`` records. The connector's thread and a caller's thread
    (a scheduler's call that sends messages itself) may both add to it."""

    def __init__(self, limit: int = LIMIT, clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"Timeline limit={limit!r}: give a positive int (records kept)")
        self.limit, self.clock = limit, clock
        self._records: deque[Record] = deque(maxlen=limit)
        self._lock = threading.Lock()
        #: records that gave way to newer ones once the limit was reached
        self.dropped = 0
        self._rooms: dict[int, int] = {}  # write id -> room, for its outcome

    @property
    def records(self) -> list[Record]:
        """The records kept, oldest first (a copy)."""
        with self._lock:
            return list(self._records)

    def mark(self, label: str, room: int = -1, at: float | None = None) -> None:
        """A caller's own mark (``at``: its time, else now)."""
        self._add(self.clock() if at is None else at, label, room)

    def events(self, events: Iterable[Event], now: float) -> None:
        """What the core is handed at ``now`` (a look that found no silent or
        restarted peer is not recorded)."""
        for ev in events:
            if isinstance(ev, Arrived):
                m = ev.msg
                self._add(now, f"{'note' if m.notified else 'recv'} {m.msg.KIND}", m.room)
            elif isinstance(ev, Written):
                self._add(now, ev.outcome, self._rooms.pop(ev.write, -1))
            elif isinstance(ev, Stale):
                self._add(now, f"stale {ev.msg.msg.KIND}", ev.msg.room)
            elif isinstance(ev, Silence):
                if ev.peers:
                    self._add(now, f"silent {sorted(ev.peers)}", -1)
            elif isinstance(ev, Restarted):
                if ev.incarnations:
                    self._add(now, f"restarted {sorted(ev.incarnations)}", -1)
            else:
                self._add(now, type(ev).__name__, -1)

    def effect(self, e: Effect, now: float) -> None:
        """An effect the connector performed at ``now``."""
        if isinstance(e, Send):
            self._add(now, f"send {e.msg.KIND}", e.msg.room)
        elif isinstance(e, Write):
            self._rooms[e.write] = e.room
            self._add(now, "write", e.room)
        elif isinstance(e, Forget):
            self._add(now, "forget", self._rooms.pop(e.write, -1))

    def take(self) -> list[Record]:
        """The records so far, oldest first; the timeline starts empty again."""
        with self._lock:
            out = list(self._records)
            self._records.clear()
        return out

    def _add(self, t: float, label: str, room: int) -> None:
        with self._lock:
            if len(self._records) == self.limit:
                self.dropped += 1
            self._records.append((t, label, int(room)))


def chrome_trace(tracks: Mapping[str, Sequence[Record]]) -> dict[str, Any]:
    """The records of each track (a rank's name: its records) as a Chrome trace
    of instant events, a process per track (its one thread named too, as a
    viewer needs), microseconds from the earliest record."""
    t0 = min((r[0] for recs in tracks.values() for r in recs), default=0.0)
    out: list[dict[str, Any]] = []
    for pid, (name, recs) in enumerate(tracks.items(), start=1):
        out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        out.append(
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "connector"}}
        )
        for t, label, room in recs:
            out.append(
                {
                    "name": label,
                    "ph": "i",
                    "s": "p",
                    "ts": round((t - t0) * 1e6, 3),
                    "pid": pid,
                    "tid": 0,
                    "args": {"room": room},
                }
            )
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def hops(
    tracks: Mapping[str, Sequence[Record]], marks: Sequence[tuple[str, str, str]]
) -> dict[int, list[float | None]]:
    """Per room, the time between consecutive ``marks`` (each ``(track, label,
    which)``: the ``first`` or ``last`` record of that label for the room on that
    track), in seconds; None where a mark is missing or comes before the last."""
    bad = [m for m in marks if m[2] not in ("first", "last")]
    if bad:
        raise ValueError(f"hops: marks {bad} name neither the 'first' nor the 'last' record")
    by: dict[tuple[str, str, int], list[float]] = {}
    for name, recs in tracks.items():
        for t, label, room in recs:
            by.setdefault((name, label, room), []).append(t)
    rooms = sorted({room for (_, _, room) in by if room >= 0})
    out: dict[int, list[float | None]] = {}
    for room in rooms:
        times: list[float | None] = []
        for track, label, which in marks:
            ts = by.get((track, label, room))
            times.append(None if not ts else (min(ts) if which == "first" else max(ts)))
        gaps: list[float | None] = []
        for a, b in pairwise(times):
            gaps.append(None if a is None or b is None or b < a else b - a)
        out[room] = gaps
    return out
