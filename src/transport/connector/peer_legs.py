"""A rank's legs by peer (decode's by prefill peer, prefill's by decode peer):
how many were asked for (a page list sent, or received), how many ended done
and how long each took, and which failed and why. No I/O, no clock: times come
with the calls (the core's ``now``).

A failure counts against a peer only for a reason the peer table counts
(:data:`lifecycle.rules.peers.COUNTS`: not a client's abort, not a hook's
error), and only against the legs :data:`BLAME` names for it: a dead peer's,
the legs whose digest differed, the peer that said it failed, or else the
legs still open (the ones the request waited on). A reader takes what
happened since its last look (:meth:`PeerLegs.take`); what it does not take
is kept up to a bound, the oldest dropped first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

import attrs

from lifecycle.reasons import FailureReason
from lifecycle.rules.peers import COUNTS

__all__ = ["BLAME", "LegEnded", "PeerLegs"]

R = FailureReason

#: which legs of a failed request a counted reason is blamed on: "dead" (the
#: legs to peers declared dead), "named" (the ones the caller names: a digest
#: that differed, a peer's own word), "open" (the legs not done: the ones it
#: waited on). A reason not listed is "open".
BLAME: Mapping[FailureReason, str] = {
    R.PEER_DEAD: "dead",
    R.CHECKSUM_MISMATCH: "named",
}
_WHO = ("dead", "named", "open")
if not set(BLAME.values()) <= set(_WHO) or not set(BLAME) <= COUNTS:
    raise AssertionError("BLAME names a reason the peer table does not count, or no rule")

#: the most ended legs kept for a reader that has not taken them
KEPT = 65536


@attrs.frozen
class LegEnded:
    """One leg's end: its peer, ``done`` or the reason it failed, its time."""

    peer: int
    #: "done", or the failure's reason label
    outcome: str
    #: seconds from its page list to its end (None: it never got one)
    seconds: float | None
    room: int


class PeerLegs:
    """The legs of one rank, by peer (see the module)."""

    def __init__(self) -> None:
        self._open: dict[
            tuple[int, int], dict[int, float]
        ] = {}  # (room, epoch) -> peer -> asked at
        self._ended: deque[LegEnded] = deque(maxlen=KEPT)
        #: per peer: legs asked, done, failed (every one since the start)
        self.totals: dict[int, dict[str, int]] = {}

    def _count(self, peer: int, what: str) -> None:
        t = self.totals.setdefault(peer, {"asked": 0, "done": 0, "failed": 0})
        t[what] += 1

    def asked(self, room: int, epoch: int, peers: Iterable[int], now: float) -> None:
        """A page list went to each of ``peers``: their legs open."""
        legs = self._open.setdefault((room, epoch), {})
        for p in peers:
            legs[p] = now
            self._count(p, "asked")

    def done(self, room: int, epoch: int, peer: int, now: float) -> None:
        """``peer`` said every write of its leg landed."""
        legs = self._open.get((room, epoch))
        since = None if legs is None else legs.pop(peer, None)
        if since is not None:
            self._count(peer, "done")
            self._ended.append(LegEnded(peer, "done", now - since, room))

    def failed(
        self,
        room: int,
        epoch: int,
        reason: FailureReason,
        now: float,
        *,
        dead: Iterable[int] = (),
        named: Iterable[int] = (),
        open_blamed: bool = True,
    ) -> None:
        """The request failed for ``reason``: the legs :data:`BLAME` names fail,
        the others close uncounted. ``open_blamed`` False: a reason blamed on
        the open legs is blamed on the ``named`` ones alone (prefill: a
        failure its own side agreed on, a transfer error of another prefill
        rank say, is not its decode peers' doing)."""
        mine = self._open.pop((room, epoch), {})
        who = BLAME.get(reason, "open")
        if who == "open" and not open_blamed:
            who = "named"
        blamed = set(dead) if who == "dead" else set(named) if who == "named" else None
        for peer, since in mine.items():
            if reason in COUNTS and (blamed is None or peer in blamed):
                self._count(peer, "failed")
                self._ended.append(LegEnded(peer, reason.label, now - since, room))
        if who == "named" and reason in COUNTS:  # legs done already (a digest differs after)
            for peer in set(named) - set(mine):
                self._count(peer, "failed")
                self._ended.append(LegEnded(peer, reason.label, None, room))

    def forget(self, room: int, epoch: int) -> None:
        """The request was released: its legs still open close uncounted."""
        self._open.pop((room, epoch), None)

    def take(self) -> list[LegEnded]:
        """The legs that ended since the last call, oldest first (one reader may
        take while the connector's thread adds: each is taken once)."""
        out = []
        while self._ended:
            out.append(self._ended.popleft())
        return out
