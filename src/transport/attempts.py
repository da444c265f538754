"""Which request a message is about: a connector's live requests by room and
attempt (epoch), the words that came before their request, and the rooms
released here.

A retried request is the same room at the next epoch. Every message about a
request carries its epoch, and is applied only to that attempt: a word of
an older attempt whose request is gone is refused and counted (``stale``),
never applied to the newer one; a word of a newer attempt than any here is
held until the scheduler starts that attempt (the peer is ahead of us). An
older attempt may still be draining its writes when the next one starts:
both are live, each hears only its own words.
"""

from __future__ import annotations

import enum
from typing import Generic, TypeVar

__all__ = ["Attempts", "Route"]

Q = TypeVar("Q")
M = TypeVar("M")

#: words held for rooms whose request has not started here (a restart's never come)
_MOST_EARLY = 100_000
#: rooms released here that a late word may still ask about
_MOST_CLEARED = 100_000


class Route(enum.Enum):
    DELIVER = "deliver"  # to its live attempt
    EARLY = "early"  # held for an attempt not started here yet
    LATE = "late"  # its attempt was released here: the side answers
    STALE = "stale"  # an older attempt's, gone: refused


class Attempts(Generic[Q, M]):
    """The live requests (``Q``) by (room, epoch), and the words (``M``) held for
    attempts not started here yet; the caller holds the connector's lock."""

    def __init__(self) -> None:
        self.reqs: dict[tuple[int, int], Q] = {}
        self.latest: dict[int, int] = {}  # room -> the epoch of its newest live attempt
        self.older: dict[int, set[int]] = {}  # room -> its older attempts still live
        self.early: dict[int, list[tuple[int, M]]] = {}  # room -> (epoch, word)
        #: rooms released here -> (the attempt, its failure reason)
        self.cleared: dict[int, tuple[int, int]] = {}
        self.stale = 0  # words of older attempts refused

    def taken(self, room: int, epoch: int) -> bool:
        """Whether ``room`` has had an attempt at ``epoch`` or later while one of
        it is live (a duplicate). A room whose attempts were all released may
        start again at any epoch
        (a scheduler that reuses rooms should start the next at a later one,
        or a late word of the old request could reach the new)."""
        if room not in self.latest:
            return False
        cleared = self.cleared.get(room)
        return max(self.latest[room], -1 if cleared is None else cleared[0]) >= epoch

    def add(self, room: int, epoch: int, req: Q) -> list[M]:
        """Start attempt ``epoch`` of ``room``; the words that came before it."""
        self.reqs[room, epoch] = req
        if room in self.latest:  # the older one still drains
            self.older.setdefault(room, set()).add(self.latest[room])
        self.latest[room] = epoch
        self.cleared.pop(room, None)
        held = self.early.pop(room, [])
        later = [(e, m) for e, m in held if e > epoch]
        if later:
            self.early[room] = later
        due = [m for e, m in held if e == epoch]
        self.stale += len(held) - len(later) - len(due)
        return due

    def live(self, room: int) -> Q | None:
        """The newest live attempt of ``room`` (None: none)."""
        epoch = self.latest.get(room)
        return None if epoch is None else self.reqs.get((room, epoch))

    def release(self, room: int, epoch: int, reason: int) -> None:
        """Attempt ``epoch`` of ``room`` is released (``reason``: why it ended)."""
        del self.reqs[room, epoch]
        older = self.older.get(room)
        if self.latest.get(room) != epoch:  # an older one: a newer attempt is live
            if older is not None:
                older.discard(epoch)
                if not older:
                    del self.older[room]
            return
        # the room's newest attempt is gone: a late word of it gets an answer
        self.cleared[room] = (epoch, reason)
        if older:  # an older attempt still drains: now the room's newest live one
            self.latest[room] = max(older)
            older.discard(self.latest[room])
            if not older:
                del self.older[room]
            return
        del self.latest[room]
        if len(self.cleared) > _MOST_CLEARED:
            self.cleared.clear()

    def route(self, room: int, epoch: int, msg: M) -> tuple[Route, Q | None, int]:
        """Where ``msg``, a word about attempt ``epoch`` of ``room``, goes: (route,
        its live attempt, the released one's reason). An early word is held."""
        req = self.reqs.get((room, epoch))
        if req is not None:
            return Route.DELIVER, req, 0
        cleared = self.cleared.get(room)
        if epoch < max(self.latest.get(room, -1), -1 if cleared is None else cleared[0]):
            self.stale += 1
            return Route.STALE, None, 0
        if cleared is None or epoch > cleared[0]:
            if len(self.early) > _MOST_EARLY:
                self.early.clear()
            self.early.setdefault(room, []).append((epoch, msg))
            return Route.EARLY, None, 0
        return Route.LATE, None, cleared[1]
