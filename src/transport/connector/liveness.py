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
from lifecycle.rules.deadlines import DEADLINES, Clock, late, limit_of
from lifecycle.rules.reasons import FENCES
from transport.connector.graph import IS_TERMINAL, Phase
from transport.connector.legs import Request
from transport.connector.mailbox import NEW, STALE
from transport.connector.port import Port

__all__ = ["check_peers", "fenced", "heard", "received", "timeouts", "owing"]

logger = logging.getLogger(__name__)

#: the failure reasons whose writer may come back: a decode request failed for
#: one of them, whose writer is still silent at the drain timeout, is Fenced
#: instead of released (a paused process resumes and finishes its writes); the
#: reason table (lifecycle.rules.reasons) says which
FENCE_REASONS: frozenset[FailureReason] = FENCES


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


def received(m: Port, msg: dict[str, Any], store: Any) -> bool:
    """A message from a peer arrived: False if it comes from an old incarnation
    of a peer that restarted (refused and counted). From a new incarnation,
    every request whose leg to that peer belongs to the old one fails (its
    writer is gone: peer dead); then the peer is heard."""
    peer = int(msg["from"])
    seen = m.mail.incarnation_of(peer, msg.get("inc"), store)
    if seen == STALE:
        m.stats["stale"] += 1
        logger.warning(
            "rank %d: a %r from an old incarnation of rank %d refused (room=%s)",
            m.rank,
            msg.get("kind"),
            peer,
            msg.get("room"),
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
    # the status this side reports is what a deadline runs in; only decode's
    # waiting clock ever starts (when it tells prefill where to write)
    status, clocks = m.status[idx], {Clock.BORN: m.born, Clock.WAITED: m.waited}
    for d in DEADLINES:
        if (limit := limit_of(d, cfg)) is not None:
            for i in np.flatnonzero(late(d, now, limit, status, clocks, idx)):
                m._fail(reqs[i], d.reason, store)
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
