"""The words between the two sides that no transport carries, in the simulator:
the fake backend's failures, and the client's router handing a retried
request to prefill.

A byte-moving backend tells the other side why a request failed (its
connector's messages). The fake backend moves nothing and has no link, so
without this a request failed on decode would stay live on prefill until its
deadline, and the reverse. Here the side that fails a request -- its TP
rank 0 speaks for it -- pushes (room, reason) to a store queue of every rank
of the other side that serves the request; each rank drains its queue at the
start of every step and fails the request with that reason (a room it has
not admitted yet is failed on admission). Each rank of a side may hear at a
different step; the step's reduce makes them agree, as with a real backend.
A notice names the attempt (epoch) it is about: one about another attempt of
the room than the live one is never applied to it.

:class:`Router` stands for the client's router when the recovery table
retries a request: decode decides (it holds the agreed reason), and its
first rank hands the next attempt to a prefill DP group through the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lifecycle.reasons import FailureReason
from pdlife.cluster.config import SimConfig
from pdlife.cluster.topology import Place

__all__ = ["PeerWord", "Router"]

_MOST = 4096  # notices taken per step (the rest wait for the next)
_EARLY = 100_000  # notices held for rooms not admitted yet (the oldest go first)


def _key(rank: int) -> str:
    return f"fakepeer/{rank}"


class PeerWord:
    """What global rank ``rank`` (at ``where``) tells the other side and hears
    from it over ``store``; ``silent``: a byte-moving backend carries the word."""

    def __init__(self, cfg: SimConfig, rank: int, where: Place, store: Any, silent: bool) -> None:
        self.cfg = cfg
        self.rank = rank
        self.where = where
        self.store = store
        self.silent = silent
        self.told: dict[int, int] = {}  # room -> reason the other side gave
        #: room -> {epoch: reason} of attempts not admitted here yet (each attempt's
        #: notice is kept apart: a later attempt's must not hide an earlier one's)
        self.early: dict[int, dict[int, int]] = {}
        self.group: dict[int, int] = {}  # decode: room -> its prefill DP group

    def tell(self, room: int, reason: int, epoch: int = 0) -> None:
        """``room``'s attempt ``epoch`` failed here, for ``reason``: tell the other
        side (fake backend)."""
        if self.silent or self.where.tp_rank != 0 or self.told.pop(room, None) is not None:
            return  # a real backend tells it; another rank of the side does; it told us
        cfg = self.cfg
        if self.where.side == "prefill":
            targets = range(cfg.prefill_ranks, cfg.world)
        else:
            g = self.group.get(room, 0)
            targets = range(g * cfg.prefill, (g + 1) * cfg.prefill)
        word = f"{room} {int(reason)} {epoch}".encode()
        for r in targets:
            self.store.queue_push(_key(r), word)

    def hear(self, handles: Mapping[int, Any]) -> None:
        """Fail every live request (``handles``, by room) the other side said it
        failed (fake backend)."""
        if self.silent:
            return
        key = _key(self.rank)
        for _ in range(min(int(self.store.queue_len(key)), _MOST)):
            room, reason, *rest = (int(x) for x in bytes(self.store.queue_pop(key)).split())
            epoch = rest[0] if rest else 0  # (a word without one is about the first attempt)
            h = handles.get(room)
            live = -1 if h is None else getattr(h, "epoch", 0)
            if epoch < live:
                continue  # about an older attempt than the live one: never applied
            if h is None or epoch > live:  # its attempt not admitted here yet
                if room not in self.early and len(self.early) >= _EARLY:
                    self.early.pop(next(iter(self.early)))
                self.early.setdefault(room, {})[epoch] = reason
                continue
            self.told[room] = reason
            h.fail(FailureReason(reason))

    def on_admit(self, room: int, h: Any) -> None:
        """A room the other side failed before this rank admitted it fails now."""
        if not self.early:
            return
        notices = self.early.get(room)
        if notices is None:
            return
        epoch = getattr(h, "epoch", 0)
        reason = notices.pop(epoch, None)
        for old in [e for e in notices if e < epoch]:  # about attempts before this one
            del notices[old]
        if not notices:
            del self.early[room]
        if reason is not None:
            self.told[room] = reason
            h.fail(FailureReason(reason))


class Router:
    """The client's router, for retried requests: decode's first rank hands
    each next attempt (room, epoch, prefill DP group, pages) to prefill
    through the store, in order; prefill's ranks agree every step how many
    they have seen (the side's first rank speaks for it, :meth:`words`) and
    take them in that order. Decode's first rank also says when decode is
    done: prefill serves retries until then."""

    def __init__(self, store: Any, side: str, on: bool) -> None:
        self.store = store
        self.side = side
        self.on = on
        self.sent = 0  # decode's first rank: attempts handed over
        self.agreed = 0  # prefill: attempts the side agreed it has seen
        self.taken = 0  # prefill: attempts taken into its queue
        self.closed = not on or side != "prefill"  # prefill: decode said it is done

    def dispatch(self, room: int, epoch: int, group: int, pages: int) -> None:
        """Decode's first rank: hand attempt ``epoch`` of ``room`` to prefill ``group``."""
        self.store.set(f"router/{self.sent}", f"{room} {epoch} {group} {pages}")
        self.sent += 1
        self.store.set("router/count", str(self.sent))

    def close(self) -> None:
        """Decode's first rank: decode is done; no attempt comes any more."""
        if self.on:
            self.store.set("router/closed", "1")

    def words(self, leads: bool) -> tuple[int, int]:
        """What this rank saw (``leads``: the first rank of a prefill DP group,
        which speaks for its group; 0s elsewhere): attempts handed over, and
        whether decode is done."""
        if not (self.on and leads and self.side == "prefill"):
            return 0, 0
        closed = int(self.store.check(["router/closed"]))  # (first: it follows the last count)
        count = int(self.store.get("router/count")) if self.store.check(["router/count"]) else 0
        return count, closed

    def agree(self, count: int, closed: int) -> None:
        """The side's agreed view (its first rank's words)."""
        self.agreed = max(self.agreed, count)
        self.closed = self.closed or bool(closed)

    def take(self) -> list[tuple[int, int, int, int]]:
        """Prefill: the attempts agreed and not taken yet, in order."""
        out = []
        for i in range(self.taken, self.agreed):
            word = bytes(self.store.get(f"router/{i}")).decode().split()
            room, epoch, group, pages = (int(x) for x in word)
            out.append((room, epoch, group, pages))
        self.taken = self.agreed
        return out
