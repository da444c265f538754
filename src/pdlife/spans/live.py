"""Spans from a live stepper (a host engine's), as it steps: no I/O, no trace.

A host engine that runs this library's :class:`~lifecycle.Stepper` hands each
step's result to :meth:`LiveSpans.observe` (with the gates' holds, when the
stepper records them). The step pays for what changed and no more: a step
where no row moved, no gate held and nothing was reported stuck costs a few
attribute reads; otherwise the changed rows' columns are copied (a few array
operations, whatever their number) and queued. Turning them into spans is
:meth:`LiveSpans.take`'s work, done by whoever takes them: an exporter's
thread (:class:`pdlife.spans.otel.LiveExport`), off the step. Each request
attempt's spans are taken once it ended, with their ids, selected as
:mod:`pdlife.spans.select` does for a finished run.

What a live span knows, it knows from the step: a request's first status
begins when the row was added (the step's ``dwell`` of its first move says
how long before), so a request is opened at its first move, or earlier by a
gate's hold or a stuck report (kept until then). The steps a status lasted
are counted from the step it was agreed in (the first status of an attempt:
unknown, left out).

Ids: a room's trace is the host's when it gave one (:meth:`LiveSpans.parent`,
a W3C ``traceparent``: the request span is then the child of the host's
span), else the one derived from the run and the room, as for a finished run,
so that both sides land in one trace without propagation. Decode's request
span links to prefill's lead's span of the same attempt when that rank is
known (``prefill_lead``). Volume: every rank's spans, the lead's only, or
(``involved``, the default) the lead's and those of a rank that held a gate
on the request, originated its failure or was named its holder; ``lead`` is
this rank's own knowledge (the first rank of its TP group), so that every
rank decides alone and alike.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from lifecycle.errors import InvalidArgument
from lifecycle.result import StepResult, StuckReport
from lifecycle.rules.graph import TRIGGERS
from lifecycle.status import KVPoll
from lifecycle.validate import is_integer
from pdlife.spans.build import DRAINING, DRAINS
from pdlife.spans.model import ENDS, Attempt, Attrs, SpanData, SpanEvent
from pdlife.spans.select import Identified, Selection, sampled, span_id, trace_id

__all__ = ["LiveSpans", "parse_traceparent"]

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
_FAILED = int(KVPoll.Failed)
#: failed rooms remembered for a retry (its recovery event, the host's trace)
KEPT = 65536
#: steps queued and not taken, at most (the oldest are dropped, and counted)
QUEUED = 100_000


class _Step(NamedTuple):
    """What a step hands over: its changed rows' columns, copied."""

    ts: float
    queue: str
    step: int
    rooms: NDArray[np.uint64]
    previous: NDArray[np.int8]
    new: NDArray[np.int8]
    triggers: NDArray[np.int16]
    reasons: NDArray[np.int8]
    origins: NDArray[np.int32]
    dwell: NDArray[np.float64]
    #: the gates' holds (None: none now, and none at the step before)
    held: dict[str, NDArray[np.uint64]] | None
    stuck: tuple[StuckReport, ...]


def _remember(d: dict[int, Any], room: int, value: Any) -> None:
    d[room] = value
    if len(d) > KEPT:  # the oldest forgotten: a retry comes soon after, or never
        del d[next(iter(d))]


def parse_traceparent(value: str) -> tuple[int, int]:
    """``(trace id, span id)`` of a W3C ``traceparent`` (version 00)."""
    m = _TRACEPARENT.match(value) if isinstance(value, str) else None
    if m is None or int(m[1], 16) == 0 or int(m[2], 16) == 0:
        raise InvalidArgument(
            "traceparent", value, "a W3C traceparent, 00-<32 hex>-<16 hex>-<2 hex>, ids not 0"
        )
    return int(m[1], 16), int(m[2], 16)


class LiveSpans:
    """One rank's spans as its steppers step (see the module)."""

    def __init__(
        self,
        side: str,
        rank: int,
        run: str,
        *,
        lead: bool = True,
        selection: Selection | None = None,
        prefill_lead: int | None = None,
        clock: Callable[[], float] = time.time,
        drains: Collection[str] = (),
    ) -> None:
        if side not in ("prefill", "decode"):
            raise InvalidArgument("side", side, "prefill or decode")
        if not is_integer(rank) or rank < 0:
            raise InvalidArgument("rank", rank, "a rank, an integer >= 0")
        self.side, self.rank, self.run = side, int(rank), str(run)
        self.lead, self.selection = bool(lead), selection or Selection()
        self.prefill_lead, self.clock = prefill_lead, clock
        #: the host's queues where decode's failed requests wait for their pages to
        #: drain (the simulator's ``drain``): a failed decode attempt's span lasts
        #: until its row there ends; with none, it ends where it failed
        self.drains = frozenset(drains)
        self.live: dict[int, Attempt] = {}
        #: room -> the step its status was agreed in (its first: not known)
        self._since: dict[int, int] = {}
        #: room -> the last attempt's failure reason and number (a retry names it)
        self._failed: dict[int, tuple[str | None, int]] = {}  # (reason, its attempt)
        #: what happened to a room before it was opened: held by, and events
        self._early: dict[int, list[SpanEvent]] = {}
        #: room -> the gate holding it, and per queue the rooms its gates hold
        self._gate: dict[int, str] = {}
        self._held_in: dict[str, set[int]] = {}
        #: room -> (trace id, parent span id) the host gave
        self._parents: dict[int, tuple[int, int]] = {}
        #: room -> failed attempts whose pages wait in a drain queue (:data:`DRAINS`)
        self._draining: dict[int, list[Attempt]] = {}
        #: the steps observed and not taken yet; how many were dropped untaken
        self._queue: deque[_Step] = deque(maxlen=QUEUED)
        self.dropped = 0
        #: the queues whose gates held something at their last step
        self._held_before: set[str] = set()

    def parent(self, room: int, traceparent: str) -> None:
        """The host's trace context of ``room`` (its request's span); kept
        until the room's attempt succeeds (a retry stays in the host's trace)."""
        _remember(self._parents, int(room), parse_traceparent(traceparent))

    # -- a step: on the step's thread --------------------------------------------
    def observe(
        self,
        queue: str,
        result: StepResult,
        held: Mapping[str, NDArray[np.uint64]] | None = None,
    ) -> None:
        """One step of ``queue``'s stepper: ``result`` and ``stepper.last_holds()``."""
        holds, before = bool(held), queue in self._held_before
        if not (result.changed.size or holds or before or result.stuck):
            return
        rows = result.changed
        kept = {g: np.array(r, dtype=np.uint64) for g, r in held.items()} if held else {}
        step = _Step(
            self.clock(),
            queue,
            result.step,
            # (previous, triggers and dwell are the step's own, made for its result:
            # kept as they are; the rest are the table's columns, copied)
            result.rooms[rows],
            result.previous,
            result.statuses[rows],
            result.triggers,
            result.reasons[rows],
            result.origins[rows],
            result.dwell,
            kept if holds or before else None,
            result.stuck,
        )
        if len(self._queue) == QUEUED:
            self.dropped += 1
        self._queue.append(step)
        if holds:
            self._held_before.add(queue)
        else:
            self._held_before.discard(queue)

    # -- the spans: on the taker's thread -----------------------------------------
    def take(self) -> list[Identified]:
        """The spans of the attempts that ended in the steps observed since the
        last call, selected and with their ids (one taker at a time)."""
        out: list[Identified] = []
        while self._queue:
            out += self._apply(self._queue.popleft())
        return out

    def _apply(self, st: _Step) -> list[Identified]:
        ts = st.ts
        if st.held is not None:
            self._holds(st.queue, st.held, ts)
        for report in st.stuck:
            holders = tuple(int(h) for h in report.holders)
            attrs: Attrs = {"pdlife.status": KVPoll(report.status).name, "pdlife.holders": holders}
            self._event(int(report.room), SpanEvent("pdlife.stuck", ts, attrs))
            if self.rank in holders:
                a = self.live.get(int(report.room))
                if a is not None:
                    a.involved = True
        return self._moves(st) if st.rooms.size else []

    def _holds(self, queue: str, held: Mapping[str, NDArray[np.uint64]], ts: float) -> None:
        """``queue``'s gates hold ``held`` now: holds begun, and let go."""
        now = {int(r): gate for gate, rooms in held.items() for r in np.asarray(rooms).tolist()}
        mine = self._held_in.get(queue, set())
        self._held_in[queue] = set(now)
        for room in mine | set(now):
            gate = now.get(room)
            if gate == self._gate.get(room):
                continue
            a = self.live.get(room)
            if a is not None:
                a.hold(gate, ts)
            else:  # opened later (its first move): the events wait for it
                early, last = self._early_of(room), self._gate.get(room)
                if last is not None:
                    early.append(SpanEvent("pdlife.gate.release", ts, self._gate_attrs(last)))
                if gate is not None:
                    early.append(SpanEvent("pdlife.gate.hold", ts, self._gate_attrs(gate)))
            if gate is None:
                del self._gate[room]
            else:
                self._gate[room] = gate

    def _gate_attrs(self, gate: str) -> Attrs:
        return {"pdlife.gate": gate, "pdlife.rank": self.rank}

    def _early_of(self, room: int) -> list[SpanEvent]:
        """The events kept for ``room`` until it is opened (a room never opened,
        one the host dropped unmoved, is forgotten once KEPT others came after)."""
        early = self._early.get(room)
        if early is None:
            early = []
            _remember(self._early, room, early)
        return early

    def _event(self, room: int, event: SpanEvent) -> None:
        a = self.live.get(room)
        if a is not None:
            a.events.append(event)
        else:
            self._early_of(room).append(event)

    def _open(self, room: int, queue: str, status: int, start: float) -> Attempt:
        # attempts are counted as a finished run's are: a room opened again after
        # it failed is a retry (nothing is kept of a room that succeeded)
        last = self._failed.pop(room, None)
        n = 1 if last is None else last[1] + 1
        a = Attempt(self.side, self.rank, room, n, start, status, start, queue, steps=-1)
        a.queues.append(queue)
        if last is not None:  # the recovery table retried it: this attempt is the decision's
            after = {"pdlife.decision": "retry", "pdlife.after": str(last[0])}
            a.event("pdlife.recovery", start, after)
        early = self._early.pop(room, [])
        a.events.extend(early)
        a.involved = any(e.name == "pdlife.gate.hold" for e in early)
        a.gate = self._gate.get(room)
        self.live[room] = a
        return a

    def _moves(self, st: _Step) -> list[Identified]:
        ts, queue = st.ts, st.queue
        rooms, new = st.rooms.tolist(), st.new.tolist()
        reasons, origins = st.reasons.tolist(), st.origins.tolist()
        previous, triggers, dwell = st.previous.tolist(), st.triggers.tolist(), st.dwell.tolist()
        done: list[SpanData] = []
        succeeded: list[int] = []
        for j, room in enumerate(rooms):
            if queue in self.drains:
                done += self._drained(room, queue, new[j], ts, dwell[j])
                continue
            a = self.live.get(room)
            if a is None:
                if previous[j] in ENDS:
                    continue  # agreed terminal already: its attempt has ended
                a = self._open(room, queue, previous[j], ts - max(dwell[j], 0.0))
            elif a.queues[-1] != queue:
                a.queues.append(queue)
            since = self._since.get(room)
            a.steps = -1 if since is None else st.step - since
            if not a.move(new[j], ts, TRIGGERS[triggers[j]], queue, reasons[j], origins[j]):
                self._since[room] = st.step
                continue
            del self.live[room]
            self._since.pop(room, None)
            self._gate.pop(room, None)
            if a.outcome == _FAILED:  # (the host's trace too is kept for a retry)
                _remember(self._failed, room, (a.reason, a.attempt))
            else:
                succeeded.append(room)
            if self.drains and (self.side, a.outcome) in DRAINS:  # until its pages drain
                self._draining.setdefault(room, []).append(a)
                continue
            done += a.spans()
        out = self._identify(done)
        for room in succeeded:
            self._parents.pop(room, None)
        return out

    def _drained(self, room: int, queue: str, new: int, ts: float, dwell: float) -> list[SpanData]:
        """A row of a drain queue moved: the failed attempt that waits there ends
        once its pages are released (as a finished run's builder ends it)."""
        waiting = self._draining.get(room)
        if not waiting or new not in ENDS:
            return []
        a = waiting.pop(0)
        if not waiting:
            del self._draining[room]
        released = "drained" if new == int(KVPoll.Success) else "drain failed"
        since = max(a.end or ts, ts - max(dwell, 0.0))
        a.queues.append(queue)
        a.child(DRAINING, since, ts, {"pdlife.ended_by": released, "pdlife.queue": queue})
        a.event("pdlife.released", ts, {"pdlife.outcome": released})
        a.end = ts
        return a.spans()

    # -- what leaves ----------------------------------------------------------
    def _kept(self, request: SpanData) -> bool:
        sel = self.selection
        if not sampled(request.room, sel.sample):
            return False
        if sel.volume == "every" or self.lead:
            return True
        return sel.volume == "involved" and request.involved

    def _identify(self, spans: list[SpanData]) -> list[Identified]:
        out: list[Identified] = []
        keep = False
        for s in spans:
            if s.kind == "request":
                keep = self._kept(s)
            if not keep:
                continue
            host = self._parents.get(s.room)
            tid = host[0] if host is not None else trace_id(self.run, s.room)
            own = span_id(self.run, s.room, s.side, s.rank, s.attempt)
            if s.kind == "request":
                links: tuple[tuple[int, int], ...] = ()
                if s.side == "decode" and self.prefill_lead is not None:
                    p = span_id(self.run, s.room, "prefill", self.prefill_lead, s.attempt)
                    links = ((tid, p),)
                parent = host[1] if host is not None else None
                out.append(Identified(s, tid, own, parent, links))
            else:
                sid = span_id(self.run, s.room, s.side, s.rank, s.attempt, s.index)
                out.append(Identified(s, tid, sid, own))
        return out

    def close(self) -> list[Identified]:
        """What :meth:`take` gives, and the attempts still open, closed now (the
        host stops)."""
        out = self.take()
        ts, done = self.clock(), []
        for a in self.live.values():
            a.steps = -1
            a.move(a.status, ts, "closed", a.queues[-1] if a.queues else a.queue, 0, -1)
            a.outcome, a.end = None, ts
            done += a.spans()
        self.live.clear()
        for waiting in self._draining.values():  # still waiting for their pages
            for a in waiting:
                done += a.spans()
        self._draining.clear()
        return out + self._identify(done)
