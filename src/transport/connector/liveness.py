"""The connector's clocks: peers whose heartbeat stopped, the bootstrap,
waiting and drain timeouts, and what a closing connector still owes.

A silent peer may only be paused (a long GC, a starved host) and write again
once it resumes, so its requests fail on the usual path: every leg is told,
the silent one too, and their memory stays quarantined until each sender
said it stopped, or the drain timeout passed. A decode request whose writer
is still silent at the drain timeout is Fenced instead of released: its
memory stays out of reuse while that writer is silent (:func:`fenced` counts
it). When the writer speaks again, every request fenced on it is asked again
to stop and gets a fresh drain timeout. A peer that beats again is live again
for new requests.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lifecycle.reasons import FailureReason
from lifecycle.rules.deadlines import DEADLINES, overdue
from transport.connector.graph import BOOTSTRAPPING, IS_TERMINAL, ROLE_ID, Phase
from transport.connector.legs import Request
from transport.connector.mailbox import NEW, STALE
from transport.connector.messages import Incoming
from transport.connector.port import Port

_REASON = {d.name: d.reason for d in DEADLINES}

__all__ = ["check_peers", "fenced", "heard", "received", "timeouts", "owing"]

logger = logging.getLogger(__name__)

#: the failure reasons whose writer may come back: a decode request failed for
#: one of them, whose writer is still silent at the drain timeout, is Fenced
#: instead of released (a paused process resumes and finishes its writes)
FENCE_REASONS: frozenset[FailureReason] = frozenset({FailureReason.PEER_DEAD})


def _live(m: Port) -> tuple[list[Request[Any]], NDArray[np.int8], NDArray[np.int64]]:
    """The live requests, with their phases and slots."""
    with m._lock:
        reqs = list(m._reqs.values())
        idx = np.fromiter((r.index for r in reqs), dtype=np.int64, count=len(reqs))
        return reqs, m.phase[idx], idx


def check_peers(m: Port, store: Any) -> None:
    """Fail the live requests paired with a peer whose heartbeat stopped."""
    limit = m.config.heartbeat_interval * m.config.heartbeat_misses
    reqs, _, _ = _live(m)
    expected = m.side.expected
    peers = {p for r in reqs for p in r.legs or expected} | m._peer_dead
    silent = m.mail.silent(peers, limit, store)
    restarted(m, store)  # (a heartbeat names its incarnation)
    for p in sorted(silent - m._peer_dead):
        logger.warning("rank %d: peer rank %d has not beaten for %.1f s", m.rank, p, limit)
    for p in sorted(m._peer_dead - silent):
        logger.warning("rank %d: peer rank %d beats again", m.rank, p)
    back = m._peer_dead - silent
    m._peer_dead = silent
    for r in reqs:
        if silent.intersection(r.legs or expected):
            m._fail(r, FailureReason.PEER_DEAD, store)
    if back:
        unfence(m, back, store)


def unfence(m: Port, peers: set[int], store: Any) -> None:
    """Writers in ``peers`` speak again: every request fenced on one of them is
    asked again to stop, and its drain timeout starts afresh."""
    with m._lock:
        fenced_reqs = [
            r
            for r in m._reqs.values()
            if not r.released and m.phase[r.index] == Phase.Fenced and peers.intersection(r.legs)
        ]
    if not fenced_reqs:
        return
    moved = m._fire_many(fenced_reqs, "peer_back")  # (a Failed again: its clock restarts)
    m.stats["unfenced"] += int(moved.sum())
    for r, ok in zip(fenced_reqs, moved.tolist()):
        if ok:
            m.side.ask_stop(r, r.reason, store)
    logger.warning(
        "rank %d: %d request(s) fenced on rank(s) %s asked again to stop",
        m.rank,
        int(moved.sum()),
        sorted(peers),
    )


def fenced(m: Port) -> tuple[int, int]:
    """(requests, pages) this rank holds fenced on writers that stopped beating:
    memory kept out of reuse while they are silent."""
    with m._lock:
        held = [r for r in m._reqs.values() if not r.released and m.phase[r.index] == Phase.Fenced]
        return len(held), sum(max(r.num_pages, 0) for r in held)


def received(m: Port, msg: Incoming, store: Any) -> bool:
    """A message from a peer arrived: False if it comes from an old incarnation
    of a peer that restarted (refused and counted). From a new incarnation,
    every request whose leg to that peer belongs to the old one fails (its
    writer is gone: peer dead); then the peer is heard."""
    peer = msg.peer
    seen = m.mail.incarnation_of(peer, msg.inc, store)
    if seen == STALE:
        m.stats["stale"] += 1
        logger.warning(
            "rank %d: a %r from an old incarnation of rank %d refused (room=%s)",
            m.rank,
            str(msg.msg.KIND),
            peer,
            msg.room,
        )
        return False
    if seen == NEW:
        restarted(m, store)
    heard(m, peer, store)
    return True


def restarted(m: Port, store: Any) -> None:
    """Peers that restarted (a new incarnation in the store): every request
    whose leg to one was registered with its old self fails (peer dead)."""
    peers = m.mail.take_restarted()
    if not peers:
        return
    with m._lock:
        old = [
            r
            for r in m._reqs.values()
            if not r.released
            and any(
                leg.inc is not None and leg.inc != m.mail.incarnation_known(p)
                for p, leg in r.legs.items()
                if p in peers
            )
        ]
    logger.warning(
        "rank %d: rank(s) %s restarted; %d request(s) paired with the old one(s) fail",
        m.rank,
        sorted(peers),
        len(old),
    )
    for r in old:
        m._fail(r, FailureReason.PEER_DEAD, store)


def heard(m: Port, peer: int, store: Any) -> None:
    """A message from ``peer`` arrived: it is alive, even before its next
    heartbeat is seen, and serves new requests again."""
    m.mail.heard(peer)
    if peer in m._peer_dead:
        m._peer_dead = m._peer_dead - {peer}
        logger.warning("rank %d: peer rank %d speaks again", m.rank, peer)
        if m.side.RECEIVES:  # (only a side written into holds fenced requests)
            unfence(m, {peer}, store)


def timeouts(m: Port, now: float, store: Any) -> None:
    cfg, side = m.config, m.side
    reqs, ph, idx = _live(m)
    late = np.zeros(idx.size, dtype=bool)
    if cfg.bootstrap_timeout is not None:  # every phase this side reports Bootstrapping in
        booting = BOOTSTRAPPING[ROLE_ID[cfg.role], ph]
        late = booting & overdue(now, m.born[idx], cfg.bootstrap_timeout)
    for i in np.flatnonzero(late):
        m._fail(reqs[i], _REASON["bootstrap"], store)
    if cfg.waiting_timeout is not None and side.RECEIVES:
        late = (ph == Phase.Metadata) & overdue(now, m.waited[idx], cfg.waiting_timeout)
        for i in np.flatnonzero(late):
            m._fail(reqs[i], _REASON["waiting"], store)
    # last resort, so that a lost peer cannot pin memory forever: writes the
    # engine never finished are given up and a prefill rank's legs hear so (they
    # may still land: a decode rank keeps its pages until its own drain timeout),
    # and a request failed for a dead peer is released on that peer's silence
    stale = (ph == Phase.Aborted) & (now - m.failed_at[idx] > cfg.drain_timeout)
    for i in np.flatnonzero(stale):
        req = reqs[i]
        for tok in req.tokens:
            m._forget(tok)
        req.tokens.clear()
        side.give_up(req, store)
    # on a side written into, a writer still silent may resume and write: fenced, not released
    fence = np.zeros(idx.size, dtype=bool)
    if side.RECEIVES:
        dead = m._peer_dead
        fence = stale & np.isin(m.reason[idx], [int(r) for r in FENCE_REASONS])
        for i in np.flatnonzero(fence):
            fence[i] = bool(dead.intersection(reqs[i].legs))
    m.stats["fenced"] += int(
        m._fire_many([reqs[i] for i in np.flatnonzero(fence)], "peer_dead").sum()
    )
    m._fire_many([reqs[i] for i in np.flatnonzero(stale & ~fence)], "drain")


def owing(m: Port) -> bool:
    """Whether a request still owes a live peer a word (or has writes in flight)."""
    with m._lock:
        reqs = [r for r in m._reqs.values() if not r.released]
    dead = m._peer_dead
    return any(
        (r.tokens or not IS_TERMINAL[m._phase(r)]) and not (r.legs and dead.issuperset(r.legs))
        for r in reqs
    )
