"""The per-request protocol of the connector, declared once.

Theory of operation
-------------------
Every transfer engine we drive (Mooncake, NIXL) is wrapped by one connector
(:mod:`transport.connector.hub`); what a request has done on the wire is one
:class:`Phase`, and it moves only along the edges below. A prefill request
goes Bootstrap -> Handshaken (decode registered the room) -> Metadata (decode
said where to write) -> Writing (page and metadata-field writes in flight) ->
RoomWritten (every one landed; the room field, written last, in flight) ->
Done. A decode request goes Bootstrap -> Handshaken -> Metadata (it told
prefill where to write) -> Done (prefill said every byte landed). With a KV
digest (``ConnectorConfig.digest``), both pass Verifying before Done: prefill
until every leg says its bytes matched, decode while it checks them.

Failure is two phases, because a request that failed may still have writes
in flight towards its pages: Aborted quarantines it until nothing more can
land, then Drained releases it. A peer whose heartbeat stopped fails its
requests the same way (reason peer dead): it may only be paused and write
again when it resumes, so they stay Aborted until it says it stopped. If it
is still silent at the drain timeout, decode's request is Fenced: its pages
and metadata row stay out of reuse (and are counted) for as long as that
writer is silent; once the writer speaks again it is asked again to stop
(Aborted, with a fresh drain timeout), and its word, or that timeout, drains
it. A writer that never comes back keeps its requests' pages fenced rather
than risk its writes landing in another request's. Done and Drained are
terminal, and exactly the phases whose memory may be reused.

Each edge names the :class:`KVPoll` it implies (``poll``): the scheduler's
status is raised to it (never lowered), and a Failed latches with the
reason given. Where the two sides report differently the edge says so per
role (:class:`ByRole`): decode reports WaitingForInput at the handshake (its
scheduler may now take pages and a metadata row and say where to write),
prefill only once every decode leg's page list has arrived (Metadata).
Before that a prefill request is Bootstrapping, as in the field, where a
prefill request leaves the bootstrap queue only once decode has sent its
page indices. Were prefill to report WaitingForInput at the handshake, its
scheduler could give its metadata rows to requests that decode's scheduler
has not given rows to yet, while decode gave its own to others: with
limited rows each side then waits for the other forever (one row per side
and two requests taken in opposite orders is enough). :data:`READY` names
the phase where each side is ready, and the check at import holds the table
to it.

Everything below is derived from :data:`EDGES`: the numpy tables that drive
the connector in batch (per role), the phases each side reports
Bootstrapping in (which the bootstrap timeout covers), the ``transitions``
machine the unit tests hold the tables to, and ``pdlife diagram --protocol``.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray

from lifecycle.rules.kernel import Kernel
from lifecycle.status import KVPoll
from transport.errors import TransportError

__all__ = [
    "Phase",
    "ByRole",
    "ProtocolEdge",
    "ROLES",
    "ROLE_ID",
    "READY",
    "LIVE",
    "EDGES",
    "TRIGGERS",
    "fire_one",
    "TRIGGER_ID",
    "TERMINAL",
    "KERNELS",
    "role_edges",
    "compile_polls",
    "DEST",
    "POLL",
    "BOOTSTRAPPING",
    "ProtocolError",
    "fire",
    "build_machine",
    "diagram",
]


class Phase(enum.IntEnum):
    Bootstrap = 0
    Handshaken = 1
    Metadata = 2
    Writing = 3
    RoomWritten = 4
    Done = 5
    Aborted = 6
    Drained = 7
    Fenced = 8
    Verifying = 9  # with a digest: every byte landed, being checked (last: no renumbering)


#: the two sides, in the order of the per-role tables' first axis
ROLES: tuple[str, ...] = ("prefill", "decode")
ROLE_ID: dict[str, int] = {r: i for i, r in enumerate(ROLES)}


@attrs.frozen
class ByRole:
    """The status an edge implies where the two sides differ (None: none)."""

    prefill: KVPoll | None = None
    decode: KVPoll | None = None


@attrs.frozen
class ProtocolEdge:
    """``trigger`` moves ``sources`` to ``dest`` on the sides in ``roles`` (a
    trigger both sides take from different phases is declared once per side)."""

    trigger: str
    sources: tuple[Phase, ...]
    dest: Phase
    poll: KVPoll | ByRole | None = None  # the same on both sides, unless ByRole
    doc: str = ""
    roles: tuple[str, ...] = ("prefill", "decode")

    def poll_for(self, role: str) -> KVPoll | None:
        """The status this edge implies on ``role``'s side (None: it leaves it)."""
        if isinstance(self.poll, ByRole):
            out: KVPoll | None = getattr(self.poll, role)
            return out
        return self.poll


P = Phase
_PREFILL, _DECODE = ("prefill",), ("decode",)
#: the phases a request may still fail from
LIVE = _LIVE = (P.Bootstrap, P.Handshaken, P.Metadata, P.Writing, P.RoomWritten, P.Verifying)

#: the phase from which each side reports WaitingForInput, i.e. its scheduler
#: may commit a metadata row to the request: decode once it registered the
#: request with every prefill rank; prefill only once every decode leg's page
#: list arrived (earlier, the two schedulers can each give their rows to
#: requests the other holds none for, and wait for each other forever)
READY: dict[str, Phase] = {"prefill": P.Metadata, "decode": P.Handshaken}

#: The one declaration; order is only for display and trigger ids.
EDGES: tuple[ProtocolEdge, ...] = (
    ProtocolEdge(
        "handshake",
        (P.Bootstrap,),
        P.Handshaken,
        ByRole(decode=KVPoll.WaitingForInput),
        "decode registered the room with every prefill rank it pairs with (prefill: every "
        "decode leg registered it); decode's scheduler may now give it pages and a row",
    ),
    ProtocolEdge(
        "metadata",
        (P.Handshaken,),
        P.Metadata,
        ByRole(prefill=KVPoll.WaitingForInput),
        "decode sent its page list and slot to every leg (decode) / every decode leg's "
        "arrived (prefill); prefill's scheduler may now take a metadata row",
    ),
    ProtocolEdge(
        "write", (P.Metadata,), P.Writing, None, "prefill issued page/field writes", _PREFILL
    ),
    ProtocolEdge(
        "write_room",
        (P.Writing,),
        P.RoomWritten,
        None,
        "every write landed; the room field goes last",
        _PREFILL,
    ),
    # with a digest (decode asked for it): prefill waits for every leg's verdict,
    # decode checks the bytes where they are final (after the staging scatter)
    ProtocolEdge("verify", (P.RoomWritten,), P.Verifying, None, "digests sent", _PREFILL),
    ProtocolEdge("verify", (P.Metadata,), P.Verifying, None, "digests in", _DECODE),
    ProtocolEdge(
        "complete", (P.RoomWritten,), P.Done, KVPoll.Success, "the room field landed", _PREFILL
    ),
    ProtocolEdge(
        "complete", (P.Metadata,), P.Done, KVPoll.Success, "prefill said every byte landed", _DECODE
    ),
    ProtocolEdge("matched", (P.Verifying,), P.Done, KVPoll.Success, "every leg's digest matched"),
    ProtocolEdge(
        "abort", _LIVE, P.Aborted, KVPoll.Failed, "failed here; writes may still be in flight"
    ),
    ProtocolEdge(
        "drain",
        (P.Aborted, P.Fenced),
        P.Drained,
        None,
        "nothing more can land: memory may be reused",
    ),
    ProtocolEdge(
        "peer_failed",
        _LIVE,
        P.Drained,
        KVPoll.Failed,
        "the peer failed it after its writes drained",
    ),
    ProtocolEdge(
        "peer_dead",
        (P.Aborted,),
        P.Fenced,
        None,
        "failed for a writer still silent at the drain timeout, which never said it "
        "stopped: its pages stay fenced while it is silent",
        _DECODE,
    ),
    ProtocolEdge(
        "peer_back",
        (P.Fenced,),
        P.Aborted,
        KVPoll.Failed,
        "the fenced writer speaks again: asked again to stop, with a fresh drain timeout",
        _DECODE,
    ),
)

TRIGGERS: tuple[str, ...] = tuple(dict.fromkeys(e.trigger for e in EDGES))
TRIGGER_ID: dict[str, int] = {t: i for i, t in enumerate(TRIGGERS)}
TERMINAL: frozenset[Phase] = frozenset({P.Done, P.Drained})


def role_edges(
    role: str, edges: tuple[ProtocolEdge, ...] | None = None
) -> tuple[ProtocolEdge, ...]:
    """The edges ``role``'s side takes (of ``edges``; None: the declared ones)."""
    return tuple(e for e in (EDGES if edges is None else edges) if role in e.roles)


#: each side's machine: the one graph kernel over the edges it takes
KERNELS: dict[str, Kernel[Phase]] = {r: Kernel(P, role_edges(r), TERMINAL) for r in ROLES}


def compile_polls(edges: tuple[ProtocolEdge, ...]) -> NDArray[np.int8]:
    """POLL of ``edges``: [role, trigger id] -> the KVPoll it implies, -1 for none."""
    ids = {t: i for i, t in enumerate(dict.fromkeys(e.trigger for e in edges))}
    poll = np.full((len(ROLES), len(ids)), -1, dtype=np.int8)
    for r, role in enumerate(ROLES):
        for e in role_edges(role, edges):
            implied = e.poll_for(role)
            poll[r, ids[e.trigger]] = -1 if implied is None else int(implied)
    poll.setflags(write=False)
    return poll


_SILENT = (None, KVPoll.Bootstrapping)


def _bootstrapping() -> NDArray[np.bool_]:
    """[role, phase]: the live phases a side still reports Bootstrapping in: those
    reached from Bootstrap along edges that imply no status on that side."""
    out = np.zeros((len(ROLES), len(Phase)), dtype=bool)
    for r, role in enumerate(ROLES):
        reach = {P.Bootstrap}
        for _ in Phase:
            reach |= {
                e.dest
                for e in role_edges(role)
                if set(e.sources) & reach and e.poll_for(role) in _SILENT and e.dest in _LIVE
            }
        out[r, [int(p) for p in reach]] = True
    out.setflags(write=False)
    return out


def _compile() -> tuple[NDArray[np.int8], NDArray[np.int8], NDArray[np.bool_]]:
    dest = np.full((len(ROLES), len(TRIGGERS), len(Phase)), -1, dtype=np.int8)
    for r, role in enumerate(ROLES):
        k = KERNELS[role]
        for t in k.triggers:
            dest[r, TRIGGER_ID[t]] = k.dest[k.trigger_id[t]]
    terminal = np.zeros(len(Phase), dtype=bool)
    terminal[[int(p) for p in TERMINAL]] = True
    for arr in (dest, terminal):
        arr.setflags(write=False)
    return dest, compile_polls(EDGES), terminal


#: DEST[role, trigger, phase]: the phase it moves to on that side, -1 where
#: it is not declared; POLL[role, trigger]: the KVPoll it implies on that side
#: (ROLE_ID), -1 for none; IS_TERMINAL[phase]; BOOTSTRAPPING[role, phase]: the
#: side still reports Bootstrapping there (its bootstrap timeout runs)
DEST, POLL, IS_TERMINAL = _compile()
BOOTSTRAPPING = _bootstrapping()


class ProtocolError(TransportError):
    """A request was asked to take a protocol step its phase does not allow."""

    def __init__(self, room: int, rank: int, phase: int, trigger: str, role: str = "") -> None:
        self.room, self.rank, self.phase, self.trigger = room, rank, phase, trigger
        sides = [role] if role in KERNELS else list(ROLES)
        allowed = list(dict.fromkeys(t for r in sides for t in KERNELS[r].allowed(phase)))
        side = f"{role} " if role in KERNELS else ""
        super().__init__(
            f"request room={room} on {side}tp rank {rank}: protocol step {trigger!r} is not allowed "
            f"in phase {Phase(phase).name} (allowed there: {', '.join(allowed) or 'none'}). "
            "Follow the connector's order: init, then send_metadata once the handshake is done."
        )


def fire(
    phases: NDArray[np.integer], trigger: str, role: str
) -> tuple[NDArray[np.int8], NDArray[np.bool_]]:
    """Fire ``trigger`` on every row of ``role``'s side: (new phases, illegal
    mask); illegal rows stay put (a trigger the side never takes is illegal)."""
    if trigger not in TRIGGER_ID:
        raise ValueError(f"unknown protocol trigger {trigger!r}; declared: {TRIGGERS}")
    ph = np.asarray(phases)
    dest = DEST[ROLE_ID[role], TRIGGER_ID[trigger], ph]
    illegal = dest < 0
    return np.where(illegal, ph, dest).astype(np.int8, copy=False), illegal


def fire_one(phase: int, trigger: str, role: str) -> int:
    """:func:`fire` of one row, in Python integers: the phase it moves to, -1
    where the trigger is illegal there."""
    t = TRIGGER_ID.get(trigger)
    if t is None:
        raise ValueError(f"unknown protocol trigger {trigger!r}; declared: {TRIGGERS}")
    return _DEST_LISTS[ROLE_ID[role]][t][phase]


#: DEST as nested lists (an element of a list costs less to read than a numpy one)
_DEST_LISTS: list[list[list[int]]] = DEST.tolist()


def build_machine(model: Any, role: str, initial: Phase = Phase.Bootstrap) -> Any:
    """A ``transitions`` machine of ``role``'s side with exactly its declared edges
    (the reference the tables are held to)."""
    return KERNELS[role].machine(model, initial)


def _check_declaration() -> None:
    pairs = [(e.trigger, r) for e in EDGES for r in e.roles]
    if len(set(pairs)) != len(pairs) or not {r for _, r in pairs} <= set(ROLES):
        raise AssertionError("each protocol trigger is declared once per side, for known sides")
    for e in EDGES:
        if any(s in TERMINAL for s in e.sources):
            raise AssertionError(f"{e.trigger}: terminal phases latch")
    for role in ROLES:
        mine = role_edges(role)
        if not {e.dest for e in mine} <= Kernel(P, mine, TERMINAL).reachable(P.Bootstrap):
            raise AssertionError(f"{role}: an edge leads where that side never gets")
    if Kernel(P, EDGES, TERMINAL).reachable(P.Bootstrap) != set(Phase):
        raise AssertionError("unreachable phases")
    if set(READY) != set(ROLES):
        raise AssertionError(f"READY names each of {ROLES} once")
    for role in ROLES:
        _check_role(role)


def _check_role(role: str) -> None:
    """On each side the status only rises along the way to Done, WaitingForInput is
    reported exactly where READY says (prefill: not before every decode leg's page
    list arrived, or the two schedulers can deadlock on their metadata rows)."""
    ready, failed = KVPoll.WaitingForInput, KVPoll.Failed
    mine = role_edges(role)
    for e in mine:
        if e.poll_for(role) == ready and e.dest != READY[role]:
            raise AssertionError(
                f"{e.trigger}: {role} may report WaitingForInput only on reaching "
                f"{READY[role].name}, not {e.dest.name}"
            )
    # the status reported in each phase reached without failing, on this side
    progress = [e for e in mine if e.poll_for(role) != failed]
    level = {P.Bootstrap: KVPoll.Bootstrapping}
    for _ in Phase:
        for e in progress:
            had = [level[s] for s in e.sources if s in level]
            if had and e.dest not in level:
                implied = e.poll_for(role)
                level[e.dest] = max(had) if implied is None else implied
    for e in progress:
        for s in e.sources:
            if s in level and level[e.dest] < level[s]:
                raise AssertionError(f"{e.trigger}: {role}'s status may not fall")
    if level.get(READY[role]) != ready or level.get(P.Done) != KVPoll.Success:
        raise AssertionError(f"{role}: WaitingForInput at {READY[role].name}, Success at Done")
    early = [p for p, s in level.items() if s > KVPoll.Bootstrapping and p < READY[role]]
    if early:
        raise AssertionError(f"{role} leaves Bootstrapping before {READY[role].name}: {early}")


_check_declaration()


def _label(e: ProtocolEdge) -> str:
    """An edge's label: its trigger, the side taking it when only one does, and
    the status it implies ("complete (prefill) / Success")."""
    side = f" ({e.roles[0]})" if len(e.roles) == 1 else ""
    if isinstance(e.poll, ByRole):
        said = [(r, e.poll_for(r)) for r in ROLES]
        parts = [f"{p.name} ({r})" for r, p in said if p is not None]
        return f"{e.trigger}{side}" + (f" / {', '.join(parts)}" if parts else "")
    return f"{e.trigger}{side}" + (f" / {e.poll.name}" if e.poll is not None else "")


def diagram(fmt: str) -> str:
    """The per-request protocol of both sides as a mermaid or dot diagram (an
    edge one side alone takes names it), drawn by the graph kernel."""
    both: Kernel[Phase] = Kernel(P, EDGES, TERMINAL)
    title = "connector per-request protocol (prefill and decode)"
    return both.diagram(fmt, "protocol", title, P.Bootstrap, label=_label)
