"""The transition graph of one request, declared once.

Theory of operation
-------------------
A request's *agreed* status is the MIN over ranks of what each rank
observed (see :mod:`lifecycle.packing`). Between two steps it may only move
forward along the lattice (jumps of several levels allowed, because a rank
may observe nothing for a while and then see Success), or fall to Failed from
any non-terminal status. Success and Failed have no outgoing progress or
failure edges: they latch.

Gates are the one exception to "forward only", and they act on a rank's
*local observation* before the reduce, never on the agreed status: a gate may
turn an observed Success into Transferring while some local condition
(staging scatter, metadata row, a user's check) is not yet met. Declaring them
here, as edges ``Success -> Transferring`` with a named guard, is what makes
"a gate can only demote Success" a property of the graph rather than a promise
of each gate.

Everything below is derived from :data:`EDGES`: the ``transitions`` machines
of the reference executor (:mod:`lifecycle.reference`), the numpy tables of
the batch executor (:mod:`lifecycle.batch`) and the diagrams
(:mod:`lifecycle.diagram`). Nothing else names an edge.
"""

from __future__ import annotations

import enum

import attrs

from lifecycle.status import KVPoll

__all__ = ["EdgeKind", "Edge", "EDGES", "TRIGGERS", "GUARDS", "edges_for"]

B, W, T, S, F = (
    KVPoll.Bootstrapping,
    KVPoll.WaitingForInput,
    KVPoll.Transferring,
    KVPoll.Success,
    KVPoll.Failed,
)


class EdgeKind(enum.Enum):
    PROGRESS = "progress"  # agreed status moves forward
    FAIL = "fail"  # agreed status drops to Failed, carrying a reason
    DEMOTE = "demote"  # local observation held back by a gate, before the reduce


@attrs.frozen
class Edge:
    trigger: str
    sources: tuple[KVPoll, ...]
    dest: KVPoll
    kind: EdgeKind
    guard: str | None = None
    doc: str = ""


_NON_TERMINAL = (B, W, T)

#: The one declaration. Order matters only for display and trigger ids.
EDGES: tuple[Edge, ...] = (
    Edge("handshake", (B,), W, EdgeKind.PROGRESS, doc="rendezvous with the peer done"),
    Edge("start_transfer", (B, W), T, EdgeKind.PROGRESS, doc="chunks are being written"),
    Edge("complete", _NON_TERMINAL, S, EdgeKind.PROGRESS, doc="every rank reports done"),
    Edge("fail", _NON_TERMINAL, F, EdgeKind.FAIL, doc="a rank failed it; reason travels"),
    Edge("abort", _NON_TERMINAL, F, EdgeKind.FAIL, doc="a client abort reached every rank"),
    Edge(
        "hold_staging",
        (S,),
        T,
        EdgeKind.DEMOTE,
        guard="staging_pending",
        doc="staging scatter not finished on this rank",
    ),
    Edge(
        "hold_metadata",
        (S,),
        T,
        EdgeKind.DEMOTE,
        guard="metadata_pending",
        doc="first-token metadata row not landed on this rank",
    ),
    Edge(
        "hold_gate",
        (S,),
        T,
        EdgeKind.DEMOTE,
        guard="gate_closed",
        doc="a user gate is closed on this rank",
    ),
)

TRIGGERS: tuple[str, ...] = tuple(e.trigger for e in EDGES)
GUARDS: tuple[str, ...] = tuple(sorted({e.guard for e in EDGES if e.guard is not None}))


def edges_for(trigger: str) -> tuple[Edge, ...]:
    return tuple(e for e in EDGES if e.trigger == trigger)


def _check_declaration() -> None:
    if len(set(TRIGGERS)) != len(TRIGGERS):
        raise AssertionError("each trigger is declared once")
    for e in EDGES:
        if e.kind is EdgeKind.DEMOTE and (e.sources != (S,) or e.dest is not T):
            raise AssertionError(f"{e.trigger}: a gate may only demote Success -> Transferring")
        if e.kind is EdgeKind.PROGRESS and any(e.dest <= s for s in e.sources):
            raise AssertionError(f"{e.trigger}: progress must move forward")
        if e.kind is not EdgeKind.DEMOTE and any(s.terminal for s in e.sources):
            raise AssertionError(f"{e.trigger}: terminal states latch")


_check_declaration()
