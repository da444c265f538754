"""The connector's clocks: peers whose heartbeat stopped, peers that restarted,
the bootstrap, waiting and drain timeouts, and what a closing connector still
owes. Functions of the core's state and the time they are given: the driver
looks at the heartbeats and the store, and tells the core what it saw.

A silent peer may only be paused (a long GC, a starved host) and write again
once it resumes, so its requests fail on the usual path: every leg is told,
the silent one too, and their memory stays quarantined until each sender
said it stopped, or the drain timeout passed. A decode request whose writer
is still silent at the drain timeout is Fenced instead of released, whatever
it failed for (a scheduler's abort that a paused writer never heard too): its
memory stays out of reuse while that writer is silent (:func:`fenced` counts
it). When the writer speaks again, every request fenced on it is asked again
to stop and gets a fresh drain timeout. A peer that beats again is live again
for new requests.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from buffers.kv_args import KVArgs
from lifecycle.reasons import FailureReason
from lifecycle.rules.deadlines import DEADLINES, late, limit_of
from lifecycle.rules.reasons import Clock
from transport.connector.config import ConnectorConfig
from transport.connector.core.graph import IS_TERMINAL, Phase
from transport.connector.core.legs import Request
from transport.connector.core.messages import Incoming

__all__ = [
    "Clocked",
    "silence",
    "restarted",
    "stale",
    "heard",
    "timeouts",
    "fenced",
    "owing",
    "silent_writers",
]

logger = logging.getLogger(__name__)


class _Side(Protocol):
    @property
    def RECEIVES(self) -> bool: ...  # noqa: N802 (the side's class constant)

    @property
    def expected(self) -> frozenset[int]: ...

    def give_up(self, req: Any) -> None: ...

    def ask_stop(self, req: Any, reason: FailureReason) -> None: ...


class Clocked(Protocol):
    """What the clocks read and move of the core."""

    config: ConnectorConfig
    kv_args: KVArgs
    rank: int
    reqs: dict[tuple[int, int], Request[Any]]
    peer_dead: set[int]
    peers: dict[int, dict[str, Any]]
    stats: dict[str, int]
    phase: NDArray[np.int8]
    status: NDArray[np.int8]
    reason: NDArray[np.int8]
    born: NDArray[np.float64]
    waited: NDArray[np.float64]
    failed_at: NDArray[np.float64]

    @property
    def side(self) -> _Side: ...

    def fail(self, req: Request[Any], reason: FailureReason) -> None: ...

    def forget(self, req: Request[Any]) -> None: ...

    def phase_of(self, req: Request[Any]) -> int: ...

    def fire_many(
        self, reqs: Sequence[Request[Any]], trigger: str, reason: FailureReason = ...
    ) -> NDArray[np.bool_]: ...


def _live(m: Clocked) -> tuple[list[Request[Any]], NDArray[np.int8], NDArray[np.int64]]:
    """The live requests, with their phases and slots."""
    reqs = list(m.reqs.values())
    idx = np.fromiter((r.index for r in reqs), dtype=np.int64, count=len(reqs))
    return reqs, m.phase[idx], idx


def silence(m: Clocked, silent: frozenset[int]) -> None:
    """The peers whose heartbeat stopped, as of the driver's last look (the
    others beat): fail the live requests paired with one; those that beat
    again serve new requests, and what was fenced on them is asked again."""
    limit = m.config.heartbeat_interval * m.config.heartbeat_misses
    reqs, _, _ = _live(m)
    expected = m.side.expected
    for p in sorted(silent - m.peer_dead):
        logger.warning("rank %d: peer rank %d has not beaten for %.1f s", m.rank, p, limit)
    for p in sorted(m.peer_dead - silent):
        logger.warning("rank %d: peer rank %d beats again", m.rank, p)
    back = m.peer_dead - silent
    m.peer_dead = set(silent)
    for r in reqs:
        if silent.intersection(r.legs or expected):
            m.fail(r, FailureReason.PEER_DEAD)
    if back:
        _unfence(m, back)


def _unfence(m: Clocked, peers: set[int]) -> None:
    """Writers in ``peers`` speak again: every request fenced on one of them is
    asked again to stop, and its drain timeout starts afresh."""
    fenced_reqs = [
        r
        for r in m.reqs.values()
        if not r.released and m.phase[r.index] == Phase.Fenced and peers.intersection(r.legs)
    ]
    if not fenced_reqs:
        return
    moved = m.fire_many(fenced_reqs, "peer_back")  # (a Failed again: its clock restarts)
    m.stats["unfenced"] += int(moved.sum())
    for r, ok in zip(fenced_reqs, moved.tolist()):
        if ok:
            m.side.ask_stop(r, r.reason)
    logger.warning(
        "rank %d: %d request(s) fenced on rank(s) %s asked again to stop",
        m.rank,
        int(moved.sum()),
        sorted(peers),
    )


def fenced(m: Clocked) -> tuple[int, int]:
    """(requests, pages) this rank holds fenced on writers that stopped beating:
    memory kept out of reuse while they are silent."""
    held = [r for r in m.reqs.values() if not r.released and m.phase[r.index] == Phase.Fenced]
    return len(held), sum(max(r.num_pages, 0) for r in held)


def stale(m: Clocked, msg: Incoming) -> None:
    """A message from an old incarnation of a peer that restarted: refused and counted."""
    m.stats["stale"] += 1
    logger.warning(
        "rank %d: a %r from an old incarnation of rank %d refused (room=%s)",
        m.rank,
        str(msg.msg.KIND),
        msg.peer,
        msg.room,
    )


def restarted(m: Clocked, incarnations: dict[int, Any]) -> None:
    """Peers that restarted (peer -> its new incarnation): every request whose
    leg to one was registered with its old self fails (peer dead), and the
    peer's record is asked for again."""
    if not incarnations:
        return
    for p in incarnations:
        m.peers.pop(p, None)  # (connected to anew when next needed)
    old = [
        r
        for r in m.reqs.values()
        if not r.released
        and any(
            leg.inc is not None and leg.inc != incarnations[p]
            for p, leg in r.legs.items()
            if p in incarnations
        )
    ]
    logger.warning(
        "rank %d: rank(s) %s restarted; %d request(s) paired with the old one(s) fail",
        m.rank,
        sorted(incarnations),
        len(old),
    )
    for r in old:
        m.fail(r, FailureReason.PEER_DEAD)


def heard(m: Clocked, peer: int) -> None:
    """A message from ``peer`` arrived: it is alive, even before its next
    heartbeat is seen, and serves new requests again."""
    if peer in m.peer_dead:
        m.peer_dead = m.peer_dead - {peer}
        logger.warning("rank %d: peer rank %d speaks again", m.rank, peer)
        if m.side.RECEIVES:  # (only a side written into holds fenced requests)
            _unfence(m, {peer})


def timeouts(m: Clocked, now: float) -> None:
    cfg, side = m.config, m.side
    reqs, ph, idx = _live(m)
    # the status this side reports is what a deadline runs in; only decode's
    # waiting clock ever starts (when it tells prefill where to write)
    status, clocks = m.status[idx], {Clock.BORN: m.born, Clock.WAITED: m.waited}
    for d in DEADLINES:
        if (limit := limit_of(d, cfg)) is not None:
            for i in np.flatnonzero(late(d, now, limit, status, clocks, idx)):
                m.fail(reqs[i], d.reason)
    # last resort, so that a lost peer cannot pin memory forever: writes the
    # engine never finished are given up and a prefill rank's legs hear so (they
    # may still land: a decode rank keeps its pages until its own drain timeout),
    # and a request failed for a dead peer is released on that peer's silence
    stale_ = (ph == Phase.Aborted) & (now - m.failed_at[idx] > cfg.drain_timeout)
    if not stale_.any():
        return
    for i in np.flatnonzero(stale_):
        req = reqs[i]
        m.forget(req)
        side.give_up(req)
    # on a side written into, a writer still silent may resume and write: fenced, not released
    fence = np.zeros(idx.size, dtype=bool)
    if side.RECEIVES:
        for i in np.flatnonzero(stale_):
            fence[i] = bool(silent_writers(m.peer_dead, reqs[i]))
    m.stats["fenced"] += int(
        m.fire_many([reqs[i] for i in np.flatnonzero(fence)], "peer_dead").sum()
    )
    m.fire_many([reqs[i] for i in np.flatnonzero(stale_ & ~fence)], "drain")


def silent_writers(dead: set[int], req: Request[Any]) -> set[int]:
    """The peers paired with ``req`` that are silent now: any of them may resume
    and write, so past the drain timeout its memory stays fenced (whatever the
    request failed for)."""
    return dead.intersection(req.legs)


def owing(m: Clocked) -> bool:
    """Whether a request still owes a live peer a word (or has writes in flight)."""
    reqs = [r for r in m.reqs.values() if not r.released]
    dead = m.peer_dead
    return any(
        (r.tokens or not IS_TERMINAL[m.phase_of(r)]) and not (r.legs and dead.issuperset(r.legs))
        for r in reqs
    )
