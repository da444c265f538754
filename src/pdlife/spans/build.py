"""Each request's spans on one rank, built from that rank's trace records: no
I/O, no clock, no OpenTelemetry (records in, finished spans out).

Per request, side, rank and attempt, one request span, from its first
observation to its agreed end, or, for a request that must drain before its
pages are reused (:data:`DRAINS`), to its release. Inside it one child span per
agreed status it dwelt in (the steps it lasted and the trigger that ended
it), and ``Draining`` while it waited for its peer to stop writing.

Events (:data:`EVENTS`) mark a gate's hold and release on the rank whose gate
held (the trace's ``held``), a failure on its origin rank, a digest mismatch on
the rank that found it, a stuck report with its holders, and the recovery's
retry, on the attempt it started (with the reason the last one failed for). A rank that held a gate, originated the
failure or was named a holder is *involved* (:mod:`pdlife.spans.select` keeps
its spans at the default volume).

A room seen again after its attempt ended is its next attempt (a retry); the
drain of the failed attempt may overlap it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from lifecycle.status import KVPoll
from pdlife.spans.model import ENDS, STATUS_SPANS, Attempt, Attrs, SpanData

__all__ = ["DRAINS", "EVENTS", "SpanBuilder", "spans_of_records"]

#: (side, agreed end) whose pages wait in a drain queue until the peer stops
#: writing: the request span lasts until that release (the simulator's decode
#: keeps a failed request's pages and row out of reuse until then)
DRAINS = frozenset({("decode", int(KVPoll.Failed))})
#: the queues that hold those requests
DRAIN_QUEUES = frozenset({"drain"})

#: every span event: its name -> the attributes it carries
EVENTS: Mapping[str, tuple[str, ...]] = {
    "pdlife.gate.hold": ("pdlife.gate", "pdlife.rank"),
    "pdlife.gate.release": ("pdlife.gate", "pdlife.rank"),
    "pdlife.failure": ("pdlife.reason", "pdlife.origin_rank"),
    "pdlife.digest.mismatch": ("pdlife.origin_rank",),
    "pdlife.stuck": ("pdlife.status", "pdlife.holders"),
    "pdlife.recovery": ("pdlife.decision", "pdlife.after"),
    "pdlife.released": ("pdlife.outcome",),
    "pdlife.leg": ("pdlife.peer", "pdlife.outcome", "pdlife.seconds"),
}

DRAINING = "pdlife.status.Draining"
_ENDS = ENDS


def _check_tables() -> None:
    """Import-time: every status a request can dwell in has a child span, and
    the drain rule names statuses that end a request."""
    missing = [s.name for s in KVPoll if not s.terminal and int(s) not in STATUS_SPANS]
    if missing:
        raise AssertionError(f"statuses without a span: {missing}")
    for side, status in DRAINS:
        if side not in ("prefill", "decode") or status not in _ENDS:
            raise AssertionError(f"DRAINS names ({side}, {status}): not a side's agreed end")
    for name, keys in EVENTS.items():
        if not name.startswith("pdlife.") or not all(k.startswith("pdlife.") for k in keys):
            raise AssertionError(f"event {name}: names outside the pdlife namespace")


_check_tables()


class SpanBuilder:
    """One rank's spans, record by record (:meth:`feed`, then :meth:`finish`)."""

    def __init__(self) -> None:
        self.offset: float | None = None  # wall - monotonic, from the clock record
        self.live: dict[int, Attempt] = {}
        self.draining: dict[int, list[Attempt]] = {}
        self.attempts: dict[int, int] = {}
        self.last_ended: dict[int, Attempt] = {}
        #: drain records of a room no ended attempt waited for (0 on a whole trace)
        self.unattached = 0
        #: the wall time of the last observation (a stuck report is made in its step)
        self.last_ts: float | None = None
        self._obs: dict[str, Any] | None = None
        self._moves: list[dict[str, Any]] = []

    def feed(self, rec: Mapping[str, Any]) -> list[SpanData]:
        """Take the next record of this rank's trace; the spans it finished.
        An observation is handled once the moves recorded after it are in."""
        kind = rec["t"]
        if kind == "tr":
            o = self._obs
            if o is not None and (o["queue"], o["step"]) == (rec["queue"], rec["step"]):
                self._moves.append(dict(rec))
            return []
        out = self._flush()
        if kind == "clock":
            self.offset = float(rec["wall"]) - float(rec["mono"])
        elif kind == "obs":
            if self.offset is None or "ts" not in rec:
                from pdlife.trace import TraceError

                raise TraceError(
                    "the trace has no time base (no clock record, or an observation "
                    "without ts): rerun the simulation with this version to export spans"
                )
            self._obs = dict(rec)
        elif kind == "event" and rec.get("kind") == "stuck":
            self._stuck(rec)
        elif kind == "event" and rec.get("kind") == "leg":
            self._leg(rec)
        return out

    def finish(self) -> list[SpanData]:
        """The spans still open when the trace ends (closed there)."""
        out = self._flush()
        for a in self.live.values():  # its status so far, closed where the trace ends
            end = a.start if self.last_ts is None else self.last_ts
            name = STATUS_SPANS.get(a.status, f"pdlife.status.{a.status}")
            a.child(
                name, a.status_start, end, {"pdlife.steps": a.steps, "pdlife.ended_by": "trace end"}
            )
            a.end = end
            out += a.spans()
        for waiting in self.draining.values():
            for a in waiting:
                out += a.spans()
        self.live.clear()
        self.draining.clear()
        return out

    # -- one observation -------------------------------------------------
    def _flush(self) -> list[SpanData]:
        rec, moves = self._obs, self._moves
        self._obs, self._moves = None, []
        if rec is None:
            return []
        assert self.offset is not None
        ts = self.last_ts = float(rec["ts"]) + self.offset
        by_room = {int(m["room"]): m for m in moves}
        held = {int(r): g for g, rs in (rec.get("held") or {}).items() for r in rs}
        if rec["queue"] in DRAIN_QUEUES:
            return self._drain(rec, ts, by_room)
        out: list[SpanData] = []
        for room, agreed in zip(rec["rooms"], rec["agreed"]):
            move = by_room.get(room)
            out += self._row(rec, ts, int(room), int(agreed), move, held.get(room))
        return out

    def _row(
        self,
        rec: Mapping[str, Any],
        ts: float,
        room: int,
        agreed: int,
        move: Mapping[str, Any] | None,
        gate: str | None,
    ) -> list[SpanData]:
        before = int(move["from"]) if move is not None else agreed
        rank, side, queue = int(rec["rank"]), str(rec["side"]), str(rec["queue"])
        a = self.live.get(room)
        if a is None:
            if before in _ENDS:
                return []  # a row agreed terminal already: its attempt has ended
            n = self.attempts[room] = self.attempts.get(room, 0) + 1
            prev = self.last_ended.pop(room, None)
            a = self.live[room] = Attempt(side, rank, room, n, ts, before, ts, queue)
            if prev is not None:
                # the recovery table retried it: this attempt is the decision's
                retry = {"pdlife.decision": "retry", "pdlife.after": str(prev.reason)}
                a.event("pdlife.recovery", ts, retry)
            a.queues.append(queue)
        else:  # one more step in its status (the steps a status lasted: from the
            # step it was agreed in to the step it was left in)
            a.steps += 1
        if a.queues[-1] != queue:
            a.queues.append(queue)
        a.hold(gate, ts)
        if move is None:
            return []
        new = int(move["to"])
        reason, origin = int(move["reason"]), int(move["origin"])
        if not a.move(new, ts, str(move["trigger"]), queue, reason, origin):
            return []
        del self.live[room]
        if new == int(KVPoll.Failed):
            self.last_ended[room] = a  # a retry of it names it
        if (side, new) in DRAINS:
            self.draining.setdefault(room, []).append(a)
            return []
        return a.spans()

    def _drain(
        self, rec: Mapping[str, Any], ts: float, moves: Mapping[int, Mapping[str, Any]]
    ) -> list[SpanData]:
        out: list[SpanData] = []
        for room in rec["rooms"]:
            waiting = self.draining.get(int(room))
            if not waiting:
                self.unattached += 1
                continue
            a = waiting[0]
            if a.draining_since is None:  # its first step in the drain queue
                a.draining_since, a.steps = ts, 0
                a.queues.append(str(rec["queue"]))
            a.steps += 1
            a.end = ts
            move = moves.get(int(room))
            if move is None or int(move["to"]) not in _ENDS:
                continue
            released = "drained" if int(move["to"]) == int(KVPoll.Success) else "drain failed"
            a.child(
                DRAINING,
                a.draining_since,
                ts,
                {
                    "pdlife.steps": a.steps,
                    "pdlife.ended_by": released,
                    "pdlife.queue": rec["queue"],
                },
            )
            a.event("pdlife.released", ts, {"pdlife.outcome": released})
            waiting.pop(0)
            if not waiting:
                del self.draining[int(room)]
            out += a.spans()
        return out

    def _leg(self, rec: Mapping[str, Any]) -> None:
        """A leg of the request ended (by peer: decode's prefill peer, or
        prefill's decode peer): on its attempt, live or waiting to drain."""
        room = int(rec["room"])
        waiting = self.draining.get(room)
        a = self.live.get(room) or (waiting[-1] if waiting else None)
        if a is None or self.last_ts is None:
            return
        attributes: Attrs = {"pdlife.peer": int(rec["peer"]), "pdlife.outcome": str(rec["outcome"])}
        if rec.get("seconds") is not None:
            attributes = {**attributes, "pdlife.seconds": float(rec["seconds"])}
        a.event("pdlife.leg", self.last_ts, attributes)

    def _stuck(self, rec: Mapping[str, Any]) -> None:
        a = self.live.get(int(rec["room"]))
        if a is None:
            return
        holders = tuple(int(h) for h in rec.get("holders") or ())
        ts = self.last_ts if self.last_ts is not None else a.status_start
        a.event(
            "pdlife.stuck",
            ts,
            {"pdlife.status": str(rec.get("status")), "pdlife.holders": holders},
        )
        if a.rank in holders:
            a.involved = True


def spans_of_records(records: Iterable[Mapping[str, Any]]) -> Iterator[SpanData]:
    """Every span of a run's records (:func:`pdlife.trace.read_trace`: one
    rank's trace after another), one builder per rank."""
    builders: dict[int, SpanBuilder] = {}
    for rec in records:
        if "rank" not in rec:
            continue
        b = builders.get(int(rec["rank"]))
        if b is None:
            b = builders[int(rec["rank"])] = SpanBuilder()
        yield from b.feed(rec)
    for b in builders.values():
        yield from b.finish()
