"""The batch executor: the graph of :mod:`lifecycle.rules.graph` compiled into
dense numpy tables, so a step over tens of thousands of requests is a handful
of array operations and no Python loop.

Tables (built from :data:`lifecycle.rules.graph.EDGES` at import):

- ``DEST[trigger, state]``: destination, or -1 where the trigger is not
  declared from that state;
- ``GUARDED[trigger]``: whether the trigger has a named guard;
- ``ADVANCE[state, target]``: the progress/fail trigger that moves an agreed
  status from ``state`` to ``target``, ``STAY`` when equal, -1 when no
  declared edge does (a regression, or leaving a terminal state).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from lifecycle.errors import UnknownTrigger
from lifecycle.reasons import REASON_BITS, FailureReason
from lifecycle.rules.graph import EDGES, FAIL_TRIGGER, KERNEL, TRIGGERS, EdgeKind
from lifecycle.status import NUM_STATUSES, KVPoll

__all__ = [
    "DEST",
    "GUARDED",
    "ADVANCE",
    "STAY",
    "TRIGGER_ID",
    "trigger_ids",
    "fire",
    "advance",
    "demote",
    "DEMOTE_SOURCE",
    "WORD_TRIGGER",
    "WORD_STATUS",
    "WORD_REASON",
]

STAY = len(TRIGGERS)  # pseudo trigger id: agreed status unchanged
TRIGGER_ID: dict[str, int] = {t: i for i, t in enumerate(TRIGGERS)}
R = FailureReason
#: per reason code a word can carry, the failure edge it takes (declared on
#: the edges; a code no reason has takes the edge of the unclaimed ones)
FAIL_TRIGGER_ID = np.full(1 << REASON_BITS, TRIGGER_ID[FAIL_TRIGGER[R.UNKNOWN]], np.int16)
for _r in R:
    FAIL_TRIGGER_ID[int(_r)] = TRIGGER_ID[FAIL_TRIGGER[_r]]
FAIL_TRIGGER_ID.setflags(write=False)


def _compile() -> tuple[NDArray[np.int8], NDArray[np.bool_], NDArray[np.int16]]:
    dest = KERNEL.dest  # the one graph kernel's destination table
    guarded = np.zeros(len(TRIGGERS), dtype=bool)
    adv = np.full((NUM_STATUSES, NUM_STATUSES), -1, dtype=np.int16)
    np.fill_diagonal(adv, STAY)
    for edge in EDGES:
        t = TRIGGER_ID[edge.trigger]
        guarded[t] = edge.guard is not None
        for s in edge.sources:
            # the first declared progress/fail edge for (s, dest) is the one
            # advance() takes; a failure's reason picks its edge (below)
            if edge.kind is not EdgeKind.DEMOTE and adv[s, edge.dest] == -1:
                adv[s, edge.dest] = t
    for arr in (guarded, adv):
        arr.setflags(write=False)
    return dest, guarded, adv


DEST, GUARDED, ADVANCE = _compile()


def trigger_ids(triggers: Sequence[str]) -> NDArray[np.int16]:
    """Map trigger names to ids; an unknown name is an :class:`UnknownTrigger`."""
    try:
        return np.fromiter((TRIGGER_ID[t] for t in triggers), dtype=np.int16, count=len(triggers))
    except KeyError as exc:
        raise UnknownTrigger(exc.args[0], TRIGGERS) from None


def fire(
    states: NDArray[np.integer],
    triggers: NDArray[np.integer],
    guard: NDArray[np.bool_] | None = None,
) -> tuple[NDArray[np.int8], NDArray[np.bool_]]:
    """Fire one trigger per request.

    ``guard[i]`` is the value of request *i*'s trigger's named guard (ignored
    for unguarded triggers; all open when None). Returns the new states and
    the mask of illegal moves (trigger not declared from that state); illegal
    rows keep their state, as do rows whose guard is closed.
    """
    trig = np.asarray(triggers)
    if trig.size and (int(trig.min()) < 0 or int(trig.max()) >= len(TRIGGERS)):
        bad = int(trig[(trig < 0) | (trig >= len(TRIGGERS))][0])
        raise UnknownTrigger(bad, TRIGGERS)
    st = np.asarray(states)
    dest = DEST[trig, st]
    illegal = dest < 0
    moves = ~illegal
    if guard is not None:
        moves &= guard | ~GUARDED[trig]
    return np.where(moves, dest, st).astype(np.int8, copy=False), illegal


def _demotions() -> dict[str, tuple[int, int]]:
    out = {}
    for edge in EDGES:
        if edge.kind is EdgeKind.DEMOTE:
            (src,) = edge.sources
            out[edge.trigger] = (int(src), int(edge.dest))
    return out


_DEMOTE = _demotions()
#: every gate edge leaves from this status (checked when the graph is declared)
DEMOTE_SOURCE = next(iter(_DEMOTE.values()))[0]


def demote(
    values: NDArray[np.int8],
    trigger: str,
    closed: NDArray[np.bool_],
    at: NDArray[np.bool_] | None = None,
) -> NDArray[np.int8]:
    """Apply a gate's demotion edge, in place, to local observations where ``closed``.

    Only rows at the edge's source (Success) move: a closed gate has nothing
    to hold back elsewhere, and in particular it can never hide a Failed.
    ``at`` may pass a precomputed subset of ``values == DEMOTE_SOURCE`` (the
    step computes it once for all its gates).
    """
    try:
        src, dst = _DEMOTE[trigger]
    except KeyError:
        raise UnknownTrigger(trigger, tuple(_DEMOTE)) from None
    np.putmask(values, closed & ((values == src) if at is None else at), dst)
    return values


def _fail_trigger(reasons: NDArray[np.int64]) -> NDArray[np.int16]:
    """The failure edge of each reason code; a code outside the table takes the
    edge of the unclaimed reasons (as UNKNOWN does), never another's."""
    size = FAIL_TRIGGER_ID.size
    inside = (reasons >= 0) & (reasons < size)
    out: NDArray[np.int16] = np.where(
        inside, FAIL_TRIGGER_ID[np.where(inside, reasons, 0)], FAIL_TRIGGER_ID[int(R.UNKNOWN)]
    )
    return out


def advance(
    states: NDArray[np.integer],
    targets: NDArray[np.integer],
    reasons: NDArray[np.integer] | None = None,
) -> tuple[NDArray[np.int8], NDArray[np.int16], NDArray[np.bool_]]:
    """Move agreed statuses to their targets along declared edges.

    Returns ``(new_states, trigger_ids, illegal)``; a row with no declared
    edge is illegal and keeps its state. A move to Failed takes the failure
    edge its reason does (:data:`~lifecycle.rules.graph.FAIL_TRIGGER`).
    """
    st = np.asarray(states)
    tg = np.asarray(targets)
    trig = ADVANCE[st, tg]
    if reasons is not None:
        trig = np.where(
            (trig >= 0) & (trig != STAY) & (tg == KVPoll.Failed),
            _fail_trigger(np.asarray(reasons, np.int64)),
            trig,
        )
    illegal = trig < 0
    new = np.where(illegal, st, tg).astype(np.int8, copy=False)
    return new, trig, illegal


def _word_tables() -> tuple[NDArray[np.int16], NDArray[np.int8], NDArray[np.int8]]:
    """What :func:`advance` decides, per (agreed status before, agreed step
    word): a word carries the status in its high bits and, on Failed, the
    reason in its low bits (:mod:`lifecycle.core.packing`)."""
    words = np.arange(256)
    status = words >> REASON_BITS
    valid = status < NUM_STATUSES
    reason = np.where(
        (status == KVPoll.Failed) & valid, words & ((1 << REASON_BITS) - 1), FailureReason.NONE
    )
    trig = np.full((NUM_STATUSES, 256), -1, dtype=np.int16)
    for was in range(NUM_STATUSES):
        states = np.full(int(valid.sum()), was)
        _, t, _ = advance(states, status[valid], reason[valid])
        trig[was, valid] = t
    word_status = np.where(valid, status, -1).astype(np.int8)
    word_reason = reason.astype(np.int8)
    for arr in (trig, word_status, word_reason):
        arr.setflags(write=False)
    return trig, word_status, word_reason


#: ``WORD_TRIGGER[state, word]``: the trigger :func:`advance` takes from agreed
#: ``state`` to the status and reason packed in ``word`` (-1: no declared
#: edge, or no status); ``WORD_STATUS[word]``, ``WORD_REASON[word]``: the two
#: halves of a word (reason NONE unless the status is Failed)
WORD_TRIGGER, WORD_STATUS, WORD_REASON = _word_tables()
