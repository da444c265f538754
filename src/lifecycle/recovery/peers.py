"""Prefill peers that heal: each peer's health machine run on agreed events.

:class:`PeerHealth` executes the machine declared in
:mod:`lifecycle.rules.peers` for every peer it has seen. Feed it what every
rank of a decode group agrees on and every rank holds the same view:

- :meth:`PeerHealth.observe_result` after each step, with the step's
  :class:`~lifecycle.result.StepResult` and where each room was routed;
- :meth:`PeerHealth.tick` once per agreed step (cooldowns are counted in
  steps, never seconds: one rank's slow clock must not reopen a peer early);
- :meth:`PeerHealth.choose` to route each new request, in the same order on
  every rank (it records the probe it lets through).

:meth:`PeerHealth.fingerprint` is a 64-bit digest of the whole view, for
ranks to compare. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import SupportsIndex, cast

import attrs

from lifecycle import validate
from lifecycle.errors import InvalidArgument
from lifecycle.reasons import FailureReason
from lifecycle.result import StepResult
from lifecycle.rules.peers import (
    ADMITS,
    COUNTS,
    EDGES,
    GUARDS,
    KERNEL,
    RAISED_IN,
    Event,
    PeerEdge,
    PeerState,
)
from lifecycle.status import KVPoll

__all__ = ["PeerPolicy", "PeerView", "PeerChange", "PeerHealth", "MAX_PEER", "MAX_STEPS"]

#: the largest peer id (a prefill rank or DP group id)
MAX_PEER = (1 << 63) - 1
#: the largest cooldown, or number of steps one tick may pass
MAX_STEPS = 1 << 40

_PEER_EXPECTED = (
    f"an int (or numpy integer, not bool) in 0..{MAX_PEER}: a prefill rank or DP group id"
)


def _count(lo: int) -> Callable[[object, attrs.Attribute[int], int], None]:
    def check(inst: object, attribute: attrs.Attribute[int], value: int) -> None:
        validate.integer(value, f"PeerPolicy.{attribute.name}", lo, MAX_STEPS)

    return check


@attrs.frozen
class PeerPolicy:
    """When a peer opens and for how long. Every rank must use the same policy
    (it is part of :meth:`PeerHealth.fingerprint`)."""

    #: consecutive counted failures that open a peer
    threshold: int = attrs.field(default=3, validator=_count(1))
    #: agreed steps an opened peer is avoided before its probe
    cooldown: int = attrs.field(default=128, validator=_count(0))
    #: each reopening without a close in between multiplies the cooldown by this
    backoff: int = attrs.field(default=2, validator=_count(1))
    #: ... up to this many steps
    max_cooldown: int = attrs.field(default=2048, validator=_count(0))

    def __attrs_post_init__(self) -> None:
        if self.max_cooldown < self.cooldown:
            raise InvalidArgument(
                "PeerPolicy.max_cooldown",
                self.max_cooldown,
                f"an integer >= cooldown ({self.cooldown})",
            )

    def cooldown_after(self, opens: int) -> int:
        """The cooldown of a peer opened ``opens`` times (>= 1) since it last closed."""
        if self.cooldown == 0 or self.backoff == 1:
            return self.cooldown
        steps = self.cooldown
        for _ in range(opens - 1):
            steps *= self.backoff
            if steps >= self.max_cooldown:
                return self.max_cooldown
        return min(steps, self.max_cooldown)


@attrs.frozen
class PeerView:
    """One peer's health, as every rank holds it."""

    peer: int
    state: PeerState
    #: consecutive counted failures since its last success (HEALTHY/SUSPECT)
    strikes: int = 0
    #: times opened since it last closed: the cooldown's backoff level
    opens: int = 0
    #: the agreed step its last cooldown ends (or ended) at; None: never opened
    until: int | None = None
    #: the room of its probe while PROBING
    probe: int | None = None

    @property
    def admits(self) -> bool:
        """Whether new requests go here when there is a choice."""
        return self.state in ADMITS


@attrs.frozen
class PeerChange:
    """A peer took ``trigger`` from ``src`` to ``dst`` at agreed step ``step``
    (``room``: the request whose outcome or routing moved it, if any)."""

    peer: int
    trigger: str
    src: PeerState
    dst: PeerState
    step: int
    room: int | None = None


def _under(v: PeerView, p: PeerPolicy) -> bool:
    return v.strikes + 1 < p.threshold


def _at(v: PeerView, p: PeerPolicy) -> bool:
    return v.strikes + 1 >= p.threshold


_GUARD: dict[str, Callable[[PeerView, PeerPolicy], bool]] = {
    "under_threshold": _under,
    "at_threshold": _at,
}


def _edges_on() -> dict[tuple[Event, PeerState], tuple[PeerEdge, ...]]:
    on: dict[tuple[Event, PeerState], tuple[PeerEdge, ...]] = {}
    for e in EDGES:
        for s in e.sources:
            on[e.event, s] = (*on.get((e.event, s), ()), e)
    return on


#: (event, state) -> the declared edges that event may take there
_ON = _edges_on()


def _peer(value: object, what: str) -> int:
    if validate.is_integer(value):
        pid = operator.index(cast("SupportsIndex", value))
        if 0 <= pid <= MAX_PEER:
            return pid
    raise InvalidArgument(what, value, _PEER_EXPECTED)


def _outcome(value: object, what: str) -> FailureReason:
    if not isinstance(value, FailureReason):
        raise InvalidArgument(
            what,
            value,
            "a FailureReason member: the request's agreed reason, FailureReason.NONE for success",
        )
    return value


class PeerHealth:
    """The health of every prefill peer one decode rank routes to.

    Deterministic and clock-free: two instances fed the same calls in the
    same order hold the same :meth:`view` and :meth:`fingerprint` and
    :meth:`choose` alike. A refused call (a typed
    :class:`~lifecycle.errors.InvalidArgument` naming the argument) changes
    nothing.
    """

    def __init__(self, policy: PeerPolicy | None = None, peers: Iterable[int] = ()) -> None:
        if policy is None:
            policy = PeerPolicy()
        if not isinstance(policy, PeerPolicy):
            raise InvalidArgument("policy", policy, "a PeerPolicy")
        ids = [_peer(p, "peers") for p in peers]
        self.policy = policy
        self._now = 0
        self._views: dict[int, PeerView] = {}
        for p in ids:
            self._views.setdefault(p, PeerView(p, PeerState.HEALTHY))

    @property
    def now(self) -> int:
        """Agreed steps ticked so far."""
        return self._now

    def state(self, peer: int) -> PeerState:
        """``peer``'s state (HEALTHY for a peer not seen yet)."""
        return self._get(_peer(peer, "peer")).state

    def view(self) -> dict[int, PeerView]:
        """Every peer seen so far, by id, for reports and for comparing ranks."""
        return {p: self._views[p] for p in sorted(self._views)}

    def fingerprint(self) -> int:
        """A 64-bit digest of the policy, the step count and every peer's view:
        equal on every rank that was fed the same events."""
        p = self.policy
        parts = [f"{p.threshold},{p.cooldown},{p.backoff},{p.max_cooldown};{self._now}"]
        parts += [
            f"{v.peer}:{int(v.state)},{v.strikes},{v.opens},{v.until},{v.probe}"
            for v in self.view().values()
        ]
        digest = hashlib.blake2b("|".join(parts).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    # -- events --------------------------------------------------------------

    def observe(
        self, peer: int, outcome: FailureReason, *, room: int | None = None
    ) -> PeerChange | None:
        """The agreed outcome of one finished request routed to ``peer``:
        ``FailureReason.NONE`` for success, else its agreed reason. ``room``
        names the request (its outcome closes or reopens the peer only if it
        is the peer's probe). Returns the change, or None where the event
        changes nothing (a reason that does not count, an ignored outcome)."""
        pid = _peer(peer, "peer")
        reason = _outcome(outcome, "outcome")
        r = None if room is None else validate.room(room, allow_zero=True)
        return self._observe(pid, reason, r)

    def observe_result(
        self,
        result: StepResult,
        peer_of: Mapping[int, int] | Callable[[int], int | None],
    ) -> tuple[PeerChange, ...]:
        """Every request that finished in ``result`` (a step's agreed result),
        in queue order, against the peer ``peer_of`` says it was routed to
        (a mapping room -> peer, or a function returning None for a room that
        was not routed to a peer). Returns the changes."""
        if not isinstance(result, StepResult):
            raise InvalidArgument("result", result, "a StepResult (what a step returned)")
        lookup = peer_of.get if isinstance(peer_of, Mapping) else peer_of
        if not callable(lookup):
            raise InvalidArgument("peer_of", peer_of, "a mapping room -> peer, or a function")
        moved = result.changed
        st = result.statuses[moved]
        rows = moved[(st == KVPoll.Success) | (st == KVPoll.Failed)].tolist()  # finished only
        finished: list[tuple[int, int, FailureReason]] = []
        for row in rows:  # validate everything before changing anything
            status = int(result.statuses[row])
            room = int(result.rooms[row])
            where = lookup(room)
            if where is None:
                continue
            pid = _peer(where, f"peer_of({room})")
            reason = (
                FailureReason.NONE
                if status == KVPoll.Success
                else FailureReason(int(result.reasons[row]))
            )
            finished.append((pid, room, reason))
        changes = (self._observe(pid, reason, room) for pid, room, reason in finished)
        return tuple(c for c in changes if c is not None)

    def tick(self, steps: int = 1) -> tuple[PeerChange, ...]:
        """``steps`` agreed steps have passed: every open peer whose cooldown
        has elapsed becomes half-open. Returns the changes."""
        n = validate.integer(steps, "steps", 0, MAX_STEPS)
        self._now += n
        out = []
        for pid in sorted(self._views):
            v = self._views[pid]
            if v.state is PeerState.OPEN and v.until is not None and v.until <= self._now:
                change = self._fire(pid, Event.ELAPSED, None)
                if change is not None:
                    out.append(change)
        return tuple(out)

    def choose(self, candidates: Iterable[int], room: int) -> int:
        """The peer to route new request ``room`` to, among ``candidates`` (in
        the caller's order of preference; a peer not seen yet is healthy).

        A half-open peer first (the request is its probe; one at a time),
        then the first healthy or suspect one; only when every candidate is
        open or probing, the one whose cooldown ends (or ended) first, ties
        in the caller's order. It never refuses: the request goes somewhere.
        """
        if isinstance(candidates, (str, bytes, Mapping)) or not isinstance(candidates, Iterable):
            raise InvalidArgument("candidates", candidates, "a non-empty sequence of peer ids")
        ids = [_peer(c, f"candidates[{i}]") for i, c in enumerate(candidates)]
        if not ids:
            raise InvalidArgument(
                "candidates", candidates, "a non-empty sequence of peer ids (route somewhere)"
            )
        r = validate.room(room, allow_zero=True)
        best = min(range(len(ids)), key=lambda i: self._rank(self._get(ids[i]), i))
        for pid in ids:
            self._views.setdefault(pid, PeerView(pid, PeerState.HEALTHY))
        chosen = ids[best]
        if self._views[chosen].state is PeerState.HALF_OPEN:
            self._fire(chosen, Event.PROBE, r)
        return chosen

    # -- the machine ---------------------------------------------------------

    def _rank(self, v: PeerView, position: int) -> tuple[int, int, int]:
        if v.state is PeerState.HALF_OPEN:
            return (0, 0, position)
        if v.state in (PeerState.HEALTHY, PeerState.SUSPECT):
            return (1, 0, position)
        return (2, v.until if v.until is not None else self._now, position)

    def _get(self, pid: int) -> PeerView:
        return self._views.get(pid) or PeerView(pid, PeerState.HEALTHY)

    def _observe(self, pid: int, reason: FailureReason, room: int | None) -> PeerChange | None:
        v = self._get(pid)
        self._views.setdefault(pid, v)
        is_probe = v.state is PeerState.PROBING and room is not None and room == v.probe
        if reason is FailureReason.NONE:
            event = Event.PROBE_SUCCESS if is_probe else Event.SUCCESS
        elif reason in COUNTS:
            event = Event.PROBE_FAILURE if is_probe else Event.FAILURE
        elif is_probe:
            event = Event.PROBE_VOID
        else:
            return None  # a failure that says nothing about the peer
        return self._fire(pid, event, room)

    def _fire(self, pid: int, event: Event, room: int | None) -> PeerChange | None:
        v = self._views[pid]
        if v.state not in RAISED_IN[event]:
            raise AssertionError(f"peer {pid}: {event.value} raised in {v.state.name}")
        edges = [
            e
            for e in _ON.get((event, v.state), ())
            if e.guard is None or _GUARD[e.guard](v, self.policy)
        ]
        if not edges:
            return None  # declared ignored (the import-time check holds that)
        (edge,) = edges
        dst = PeerState(int(KERNEL.dest[KERNEL.trigger_id[edge.trigger], int(v.state)]))
        new = _ACTIONS[edge.trigger](v, dst, room, self)
        if new == v:
            return None  # e.g. a success on a healthy peer: nothing to report
        self._views[pid] = new
        return PeerChange(pid, edge.trigger, v.state, dst, self._now, room)


_Action = Callable[[PeerView, PeerState, "int | None", PeerHealth], PeerView]


def _open(v: PeerView, dst: PeerState, room: int | None, h: PeerHealth) -> PeerView:
    opens = v.opens + 1
    until = h.now + h.policy.cooldown_after(opens)
    return attrs.evolve(v, state=dst, strikes=0, opens=opens, until=until, probe=None)


#: what each trigger does to a peer's counters besides moving its state
_ACTIONS: dict[str, _Action] = {
    "succeed": lambda v, dst, room, h: attrs.evolve(v, state=dst, strikes=0),
    "strike": lambda v, dst, room, h: attrs.evolve(v, state=dst, strikes=v.strikes + 1),
    "trip": _open,
    "cool": lambda v, dst, room, h: attrs.evolve(v, state=dst),
    "probe": lambda v, dst, room, h: attrs.evolve(v, state=dst, probe=room),
    "close": lambda v, dst, room, h: attrs.evolve(v, state=dst, strikes=0, opens=0, probe=None),
    "reopen": _open,
    "void": lambda v, dst, room, h: attrs.evolve(v, state=dst, probe=None),
}

if set(_ACTIONS) != set(KERNEL.triggers) or set(_GUARD) != set(GUARDS):
    raise AssertionError("every declared trigger has one action and every guard one check")
