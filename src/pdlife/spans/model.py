"""The values a request's spans are made of (:mod:`pdlife.spans.build` makes
them): a finished span, its events, and the request attempt that collects
them while it is open."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll

__all__ = ["ENDS", "STATUS_SPANS", "AttrValue", "Attempt", "Attrs", "SpanData", "SpanEvent"]

#: the status a request span's child is named after, for each non-terminal status
STATUS_SPANS: Mapping[int, str] = {
    int(s): f"pdlife.status.{s.name}" for s in KVPoll if not s.terminal
}
#: the agreed statuses that end an attempt
ENDS = (int(KVPoll.Success), int(KVPoll.Failed))

AttrValue = str | int | float | bool | tuple[int, ...]
Attrs = Mapping[str, AttrValue]


@attrs.frozen
class SpanEvent:
    name: str
    #: wall-clock seconds
    ts: float
    attributes: Mapping[str, AttrValue] = attrs.field(factory=dict)


@attrs.frozen
class SpanData:
    """One finished span, before any id is given to it."""

    #: "request" or "status"
    kind: str
    name: str
    room: int
    side: str
    rank: int
    #: 1 for the first attempt; a retry is the next
    attempt: int
    #: a status span's place among its request's children (0 for the request)
    index: int
    #: wall-clock seconds
    start: float
    end: float
    attributes: Mapping[str, AttrValue]
    events: tuple[SpanEvent, ...] = ()
    #: a failed request's agreed reason (FailureReason name, lower case)
    error: str | None = None
    #: this rank held a gate, originated the failure or was named a holder
    involved: bool = False


@attrs.define
class Attempt:
    """One request attempt on one rank, open: what its spans will say."""

    side: str
    rank: int
    room: int
    attempt: int
    start: float
    status: int
    status_start: float
    queue: str
    steps: int = 0
    gate: str | None = None
    #: when it began waiting in a drain queue
    draining_since: float | None = None
    end: float | None = None
    outcome: int | None = None
    reason: str | None = None
    origin: int = -1
    involved: bool = False
    queues: list[str] = attrs.field(factory=list)
    events: list[SpanEvent] = attrs.field(factory=list)
    children: list[SpanData] = attrs.field(factory=list)

    def child(self, name: str, start: float, end: float, attributes: Attrs) -> None:
        self.children.append(
            SpanData(
                "status",
                name,
                self.room,
                self.side,
                self.rank,
                self.attempt,
                len(self.children) + 1,
                start,
                end,
                attributes,
            )
        )

    def event(self, name: str, ts: float, attributes: Attrs) -> None:
        self.events.append(SpanEvent(name, ts, attributes))

    def hold(self, gate: str | None, ts: float) -> None:
        """The gate holding it on this rank is now ``gate`` (None: none): the
        last one's release and the new one's hold, as events."""
        if gate == self.gate:
            return
        if self.gate is not None:
            self.event(
                "pdlife.gate.release", ts, {"pdlife.gate": self.gate, "pdlife.rank": self.rank}
            )
        if gate is not None:
            self.event("pdlife.gate.hold", ts, {"pdlife.gate": gate, "pdlife.rank": self.rank})
            self.involved = True
        self.gate = gate

    def move(self, new: int, ts: float, trigger: str, queue: str, reason: int, origin: int) -> bool:
        """Its agreed status became ``new`` at ``ts`` (by ``trigger``): the span
        of the status it left ends, with the steps it lasted (``steps``, as the
        caller counted them). True if the attempt ended (Success or Failed: a
        failure's reason and origin are set, and on its origin rank the
        failure, and a digest mismatch, are events)."""
        attributes: dict[str, AttrValue] = {"pdlife.ended_by": trigger, "pdlife.queue": queue}
        if self.steps >= 0:
            attributes["pdlife.steps"] = self.steps
        name = STATUS_SPANS.get(self.status, f"pdlife.status.{self.status}")
        self.child(name, self.status_start, ts, attributes)
        self.status, self.status_start, self.steps = new, ts, 0
        if new not in ENDS:
            return False
        if new == int(KVPoll.Failed):
            why = FailureReason(reason)
            self.reason, self.origin = why.name.lower(), origin
            if origin == self.rank:
                self.involved = True
                fired: Attrs = {"pdlife.reason": self.reason, "pdlife.origin_rank": origin}
                self.event("pdlife.failure", ts, fired)
                if why is FailureReason.CHECKSUM_MISMATCH:
                    self.event("pdlife.digest.mismatch", ts, {"pdlife.origin_rank": origin})
        self.hold(None, ts)
        self.outcome, self.end = new, ts
        return True

    def spans(self) -> list[SpanData]:
        end = self.start if self.end is None else self.end
        outcome = "live" if self.outcome is None else KVPoll(self.outcome).name
        attributes: dict[str, AttrValue] = {
            # a room is 64 bits unsigned; OTLP's integers are signed
            "pdlife.room": str(self.room),
            "pdlife.side": self.side,
            "pdlife.rank": self.rank,
            "pdlife.queue": self.queues[0] if self.queues else self.queue,
            "pdlife.queues": ",".join(self.queues) or self.queue,
            "pdlife.attempt": self.attempt,
            "pdlife.epoch": self.attempt - 1,
            "pdlife.outcome": outcome,
        }
        if self.reason is not None:
            attributes["error.type"] = self.reason
            attributes["pdlife.origin_rank"] = self.origin
        request = SpanData(
            "request",
            "pdlife.request",
            self.room,
            self.side,
            self.rank,
            self.attempt,
            0,
            self.start,
            end,
            attributes,
            tuple(sorted(self.events, key=lambda e: e.ts)),
            self.reason,
            self.involved,
        )
        return [request, *self.children]
