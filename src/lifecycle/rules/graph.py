"""The transition graph of one request, declared once.

Theory of operation
-------------------
A request's *agreed* status is the MIN over ranks of what each rank
observed (see :mod:`lifecycle.core.packing`). Between two steps it may only move
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
of the reference executor (:mod:`lifecycle.rules.reference`), the numpy tables of
the batch executor (:mod:`lifecycle.rules.batch`) and the diagrams
(:mod:`lifecycle.rules.diagram`). Nothing else names an edge.

Beside the edges stand the two other rule tables of a step, executed by
:mod:`lifecycle.core.sources` (where each mask comes from) and
:mod:`lifecycle.core.verdicts` (what a mask does):

- :data:`VERDICTS`: every local reason to fail a request, in reason-code
  order, with where its mask comes from (derived from each reason's row in
  :data:`lifecycle.rules.reasons.REASONS`). The code *is* the priority: on one
  rank the smallest code among the verdicts that hit wins, and across ranks
  MIN keeps the smallest code, so "first verdict wins" and "MIN wins" are
  one rule.
- :data:`GATES`: every gate, in the order they are asked, with the one
  demotion edge it may apply.

Adding a verdict is one row in the reason table, a gate one line here; for a new
source, one entry in :data:`lifecycle.core.sources.SOURCES` or
:data:`~lifecycle.core.sources.GATE_SOURCES`; the import-time check there names
any source one table has and another lacks.
"""

from __future__ import annotations

import enum

import attrs

from lifecycle.reasons import FailureReason
from lifecycle.rules.kernel import Kernel
from lifecycle.rules.reasons import REASONS, agree
from lifecycle.status import B, F, KVPoll, S, T, W

__all__ = [
    "EdgeKind",
    "Edge",
    "EDGES",
    "KERNEL",
    "TRIGGERS",
    "GUARDS",
    "edges_for",
    "FAIL_TRIGGER",
    "Verdict",
    "VERDICTS",
    "GateRule",
    "GATES",
]


class EdgeKind(enum.Enum):
    PROGRESS = "progress"  # agreed status moves forward
    FAIL = "fail"  # agreed status drops to Failed, carrying a reason
    DEMOTE = "demote"  # local observation held back by a gate, before the reduce


@attrs.frozen
class Edge:
    """``trigger`` moves ``sources`` to ``dest``. A gate's edge names its
    ``guard``; a failure edge the ``reasons`` that take it (empty: every
    reason no other failure edge claims)."""

    trigger: str
    sources: tuple[KVPoll, ...]
    dest: KVPoll
    kind: EdgeKind
    guard: str | None = None
    reasons: tuple[FailureReason, ...] = ()


_NON_TERMINAL = (B, W, T)

#: The one declaration. Order matters only for display and trigger ids.
EDGES: tuple[Edge, ...] = (
    Edge("handshake", (B,), W, EdgeKind.PROGRESS),  # rendezvous with the peer done
    Edge("start_transfer", (B, W), T, EdgeKind.PROGRESS),  # chunks are being written
    Edge("complete", _NON_TERMINAL, S, EdgeKind.PROGRESS),  # every rank reports done
    Edge("fail", _NON_TERMINAL, F, EdgeKind.FAIL),  # a rank failed it; the reason travels
    # a client abort reached every rank
    Edge("abort", _NON_TERMINAL, F, EdgeKind.FAIL, reasons=(FailureReason.ABORTED,)),
    # gates: a local Success held back on this rank until its condition holds
    Edge("hold_staging", (S,), T, EdgeKind.DEMOTE, guard="staging_pending"),
    Edge("hold_metadata", (S,), T, EdgeKind.DEMOTE, guard="metadata_pending"),
    Edge("hold_gate", (S,), T, EdgeKind.DEMOTE, guard="gate_closed"),
)

#: the edges compiled (destination table, transitions machine, diagrams)
KERNEL: Kernel[KVPoll] = Kernel(KVPoll, EDGES, (S, F))
TRIGGERS: tuple[str, ...] = KERNEL.triggers
GUARDS: tuple[str, ...] = tuple(sorted({e.guard for e in EDGES if e.guard is not None}))


def _fail_triggers() -> dict[FailureReason, str]:
    claimed = {r: e.trigger for e in EDGES if e.kind is EdgeKind.FAIL for r in e.reasons}
    rest = [e.trigger for e in EDGES if e.kind is EdgeKind.FAIL and not e.reasons]
    if len(rest) != 1:
        raise AssertionError("exactly one failure edge takes the reasons no other claims")
    return {r: claimed.get(r, rest[0]) for r in FailureReason}


#: the failure edge each reason takes (both executors read it)
FAIL_TRIGGER: dict[FailureReason, str] = _fail_triggers()


def edges_for(trigger: str) -> tuple[Edge, ...]:
    return tuple(e for e in EDGES if e.trigger == trigger)


@attrs.frozen
class Verdict:
    """A local reason to fail a request and the sources whose masks carry it."""

    reason: FailureReason
    sources: tuple[str, ...]


R = FailureReason
#: Local verdicts, in priority (= reason code) order: each reason and its verdict
#: sources, read from its row in :data:`lifecycle.rules.reasons.REASONS`.
VERDICTS: tuple[Verdict, ...] = tuple(Verdict(row.reason, row.sources) for row in REASONS)


@attrs.frozen
class GateRule:
    """A gate: while ``source`` says closed, a local Success takes ``trigger``."""

    name: str
    trigger: str
    source: str


#: Gates, in the order they are asked. Each may only apply its demotion edge.
GATES: tuple[GateRule, ...] = (
    GateRule("staging", "hold_staging", "staging_pending"),
    GateRule("metadata", "hold_metadata", "metadata_pending"),
    GateRule("user", "hold_gate", "gate_closed"),
)


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
    fails = [e for e in EDGES if e.kind is EdgeKind.FAIL]
    if len({(e.sources, e.dest) for e in fails}) != 1:
        raise AssertionError("failure edges differ only by reason: the same sources, to Failed")
    claims = [r for e in fails for r in e.reasons]
    if len(claims) != len(set(claims)) or any(
        e.kind is not EdgeKind.FAIL and e.reasons for e in EDGES
    ):
        raise AssertionError("a reason is claimed by one failure edge at most, and only there")
    codes = [int(v.reason) for v in VERDICTS]
    if codes != sorted(codes) or set(codes) != {int(r) for r in R if r is not R.NONE}:
        raise AssertionError("VERDICTS list every reason once, in code (= priority) order")
    agree("VERDICTS", {v.reason: v.sources for v in VERDICTS}, "sources")
    for g in GATES:
        (edge,) = edges_for(g.trigger)
        if edge.kind is not EdgeKind.DEMOTE or edge.guard != g.source:
            raise AssertionError(f"gate {g.name}: {g.trigger} is not a demotion guarded by it")


_check_declaration()
