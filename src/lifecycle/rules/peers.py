"""The health of one prefill peer, declared once: states, events and edges;
which failure reasons count against a peer is read from each reason's row
(:data:`lifecycle.rules.reasons.REASONS`).

Theory of operation
-------------------
A *peer* is a prefill rank or prefill DP group, named by an int. Its health
moves only on events every rank of a decode group sees alike: the agreed
outcome of a request routed to it (success, or failure with the agreed
reason), the agreed step count (a cooldown is a number of steps, never
seconds, so no rank's clock can make it see a peer differently), and the
routing decision itself (made from the same view on every rank).

``HEALTHY`` and ``SUSPECT`` admit traffic; a suspect peer has some
consecutive counted failures behind it, fewer than the threshold, and a
success makes it healthy again. The failure that reaches the threshold
*trips* it: ``OPEN`` keeps new requests away (where there is anywhere else to
go) for a cooldown of agreed steps. When the cooldown has elapsed it is
``HALF_OPEN``: the next request routed to it is its *probe*, and while that
is in flight it is ``PROBING`` (one probe at a time). The probe's success
closes it (``HEALTHY``); its counted failure reopens it with a longer,
bounded cooldown; an outcome that says nothing about the peer (a client
abort, a hook error) leaves it ``HALF_OPEN`` for the next probe.

So ``OPEN`` always leads back to a state that admits traffic on events that
cannot be withheld (steps pass; a probe is routed when the peer is asked
for): one transient failure never blacklists a peer for good, the fault
SGLang fixed with a probe (#13054, #25287).

Outcomes of requests that are not the probe, arriving while the peer is
open, half-open or probing, are ignored (:data:`IGNORED`): they were routed
before it tripped, or forced there when every candidate was open, and only
one probe at a time decides.

Everything the executor (:mod:`lifecycle.recovery.peers`) does is read from
these tables: :data:`EDGES` compiled into :data:`KERNEL` (destination table,
``transitions`` machine, diagrams), :data:`IGNORED`, :data:`RAISED_IN` and
:data:`COUNTED`. An import-time check holds them together.
"""

from __future__ import annotations

import enum

import attrs

from lifecycle.reasons import FailureReason
from lifecycle.rules.kernel import Kernel
from lifecycle.rules.reasons import REASONS, agree

__all__ = [
    "PeerState",
    "Event",
    "PeerEdge",
    "EDGES",
    "GUARDS",
    "Ignored",
    "IGNORED",
    "RAISED_IN",
    "ADMITS",
    "Counted",
    "COUNTED",
    "COUNTS",
    "KERNEL",
    "check_declaration",
    "diagram",
]


class PeerState(enum.IntEnum):
    HEALTHY = 0  # admits traffic; no counted failure since its last success
    SUSPECT = 1  # admits traffic; 1..threshold-1 consecutive counted failures
    OPEN = 2  # tripped: new requests go elsewhere until the cooldown elapses
    HALF_OPEN = 3  # cooldown elapsed: the next request routed here is its probe
    PROBING = 4  # the probe is in flight; its outcome alone decides


class Event(enum.Enum):
    SUCCESS = "success"  # a request routed here (not the probe) succeeded
    FAILURE = "failure"  # ... failed with a reason that counts
    PROBE_SUCCESS = "probe success"
    PROBE_FAILURE = "probe failure"  # the probe failed with a reason that counts
    PROBE_VOID = "probe void"  # the probe ended with a reason that does not count
    ELAPSED = "elapsed"  # the cooldown's agreed steps have passed
    PROBE = "probe"  # a new request was routed here as the probe


@attrs.frozen
class PeerEdge:
    """``event`` moves ``sources`` to ``dest`` as ``trigger`` (where ``guard``
    holds, if it names one)."""

    trigger: str
    sources: tuple[PeerState, ...]
    dest: PeerState
    event: Event
    guard: str | None = None


H, SU, OP, HO, P = PeerState

#: The one declaration of a peer's health machine.
EDGES: tuple[PeerEdge, ...] = (
    PeerEdge("succeed", (H, SU), H, Event.SUCCESS),
    PeerEdge("strike", (H, SU), SU, Event.FAILURE, guard="under_threshold"),
    PeerEdge("trip", (H, SU), OP, Event.FAILURE, guard="at_threshold"),
    PeerEdge("cool", (OP,), HO, Event.ELAPSED),
    PeerEdge("probe", (HO,), P, Event.PROBE),
    PeerEdge("close", (P,), H, Event.PROBE_SUCCESS),
    PeerEdge("reopen", (P,), OP, Event.PROBE_FAILURE),
    PeerEdge("void", (P,), HO, Event.PROBE_VOID),
)

#: The guards, exclusive and exhaustive on the one event that has them.
GUARDS: dict[str, str] = {
    "under_threshold": "this failure leaves fewer consecutive counted failures than the threshold",
    "at_threshold": "this failure makes the threshold of consecutive counted failures",
}


@attrs.frozen
class Ignored:
    """``event`` in ``states`` changes nothing, for the reason ``why``."""

    event: Event
    states: tuple[PeerState, ...]
    why: str


IGNORED: tuple[Ignored, ...] = (
    Ignored(
        Event.SUCCESS,
        (OP, HO, P),
        "a request routed before the trip, or forced here while every candidate was open: "
        "only a probe closes a peer, so one request at a time decides",
    ),
    Ignored(
        Event.FAILURE,
        (OP, HO, P),
        "the tail of the burst that tripped the peer, or a forced request: the probe "
        "decides, and counting these again would only stretch the cooldown",
    ),
)

#: The states in which the executor can raise each event: the probe's
#: outcome exists only while it is in flight, a cooldown elapses only while
#: open, a probe is routed only to a half-open peer.
RAISED_IN: dict[Event, frozenset[PeerState]] = {
    Event.SUCCESS: frozenset(PeerState),
    Event.FAILURE: frozenset(PeerState),
    Event.PROBE_SUCCESS: frozenset({P}),
    Event.PROBE_FAILURE: frozenset({P}),
    Event.PROBE_VOID: frozenset({P}),
    Event.ELAPSED: frozenset({OP}),
    Event.PROBE: frozenset({HO}),
}

#: The states whose peer takes new requests when there is a choice.
ADMITS: frozenset[PeerState] = frozenset({H, SU, HO})


@attrs.frozen
class Counted:
    """Whether a failure with ``reason`` counts against the peer it was routed to."""

    reason: FailureReason
    counts: bool
    why: str


R = FailureReason
#: Every failure reason, in code order, and whether it counts against the peer
#: (read from its row in lifecycle.rules.reasons).
COUNTED: tuple[Counted, ...] = tuple(
    Counted(row.reason, row.counts, row.counts_why) for row in REASONS
)

#: The reasons that count against a peer (read from :data:`COUNTED`).
COUNTS: frozenset[FailureReason] = frozenset(c.reason for c in COUNTED if c.counts)

#: :data:`EDGES` compiled (destination table, ``transitions`` machine, diagrams);
#: no state latches.
KERNEL: Kernel[PeerState] = Kernel(PeerState, EDGES, ())

#: reasons no table may count, whatever else changes
NEVER_COUNT = (R.ABORTED, R.HOOK_ERROR)


def check_declaration(
    edges: tuple[PeerEdge, ...] = EDGES,
    ignored: tuple[Ignored, ...] = IGNORED,
    counted: tuple[Counted, ...] = COUNTED,
) -> None:
    """Raise ``AssertionError`` naming the first rule the tables break."""
    kernel = Kernel(PeerState, edges, ())  # also refuses a trigger declared twice from a state
    for e in edges:
        if e.guard is not None and e.guard not in GUARDS:
            raise AssertionError(f"{e.trigger}: guard {e.guard!r} is not declared in GUARDS")
    for event in Event:
        for state in PeerState:
            on = [e for e in edges if e.event is event and state in e.sources]
            skip = [i for i in ignored if i.event is event and state in i.states]
            where = f"{event.value} in {state.name}"
            if state not in RAISED_IN[event]:
                if on or skip:
                    raise AssertionError(f"{where}: declared, but never raised there")
                continue
            if bool(on) == bool(skip) or len(skip) > 1:
                raise AssertionError(f"{where}: needs exactly one edge set or one ignore rule")
            guards = [e.guard for e in on]
            if len(on) > 1 and (None in guards or set(guards) != set(GUARDS)):
                raise AssertionError(f"{where}: several edges need the declared guards, each once")
            if len(on) == 1 and guards != [None]:
                raise AssertionError(f"{where}: a lone edge must not be guarded")
    if kernel.reachable(H) != set(PeerState):
        raise AssertionError("every state is reachable from HEALTHY")
    for state in PeerState:
        if not kernel.reachable(state) & {H, SU}:
            raise AssertionError(f"{state.name} must lead back to a state that admits traffic")
    # the way back from OPEN must not hang on a guard or an ignore rule
    path = [e for e in edges if e.event in (Event.ELAPSED, Event.PROBE) and e.guard is None]
    if {(e.sources, e.dest) for e in path} != {((OP,), HO), ((HO,), P)}:
        raise AssertionError("OPEN must cool to HALF_OPEN and HALF_OPEN take its probe, unguarded")
    if not any(e.event is Event.PROBE_SUCCESS and e.dest in (H, SU) for e in edges):
        raise AssertionError("a probe's success must admit traffic again")
    if [c.reason for c in counted] != [r for r in R if r is not R.NONE]:
        raise AssertionError("COUNTED lists every FailureReason but NONE once, in code order")
    if any(not isinstance(c.reason, FailureReason) for c in counted):
        raise AssertionError("COUNTED names FailureReason members only")
    bad = [c.reason.name for c in counted if c.counts and c.reason in NEVER_COUNT]
    if bad:
        raise AssertionError(f"{', '.join(bad)} must never count against a peer")
    if not any(c.counts for c in counted):
        raise AssertionError("some reason must count, or no peer could ever open")


def diagram(fmt: str = "mermaid") -> str:
    """The peer health machine as a mermaid or dot diagram."""
    return KERNEL.diagram(
        fmt,
        "peer_health",
        "prefill peer health (events: agreed outcomes, agreed steps, routing)",
        H,
        label=lambda e: f"{e.trigger} ({e.event.value})" + (f" [{e.guard}]" if e.guard else ""),
        style=lambda e: "dashed" if e.event in (Event.ELAPSED, Event.PROBE) else "solid",
        describe=lambda s: _MEANING[s],
    )


_MEANING = {
    H: "admits traffic",
    SU: "admits traffic, counted failures below the threshold",
    OP: "avoided during its cooldown (agreed steps)",
    HO: "cooldown over, the next request is its probe",
    P: "probe in flight, its outcome decides",
}

check_declaration()
agree(
    "COUNTED",
    {c.reason: (c.counts, c.why) for c in COUNTED},
    "counts",
    read=lambda row: (row.counts, row.counts_why),
)
