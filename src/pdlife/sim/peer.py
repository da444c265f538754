"""The fake backend's word to the other side, in the simulator.

A byte-moving backend tells the other side why a request failed (its
connector's messages). The fake backend moves nothing and has no link, so
without this a request failed on decode would stay live on prefill until its
deadline, and the reverse. Here the side that fails a request -- its TP
rank 0 speaks for it -- pushes (room, reason) to a store queue of every rank
of the other side that serves the request; each rank drains its queue at the
start of every step and fails the request with that reason (a room it has
not admitted yet is failed on admission). Each rank of a side may hear at a
different step; the step's reduce makes them agree, as with a real backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lifecycle.reasons import FailureReason
from pdlife.cluster.config import SimConfig
from pdlife.cluster.topology import Place

__all__ = ["PeerWord"]

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
        self.early: dict[int, int] = {}  # the same, for rooms not admitted yet
        self.group: dict[int, int] = {}  # decode: room -> its prefill DP group

    def tell(self, room: int, reason: int) -> None:
        """``room`` failed here, for ``reason``: tell the other side (fake backend)."""
        if self.silent or self.where.tp_rank != 0 or self.told.pop(room, None) is not None:
            return  # a real backend tells it; another rank of the side does; it told us
        cfg = self.cfg
        if self.where.side == "prefill":
            targets = range(cfg.prefill_ranks, cfg.world)
        else:
            g = self.group.get(room, 0)
            targets = range(g * cfg.prefill, (g + 1) * cfg.prefill)
        word = f"{room} {int(reason)}".encode()
        for r in targets:
            self.store.queue_push(_key(r), word)

    def hear(self, handles: Mapping[int, Any]) -> None:
        """Fail every live request (``handles``, by room) the other side said it
        failed (fake backend)."""
        if self.silent:
            return
        key = _key(self.rank)
        for _ in range(min(int(self.store.queue_len(key)), _MOST)):
            room, reason = (int(x) for x in bytes(self.store.queue_pop(key)).split())
            h = handles.get(room)
            if h is None:  # not admitted here yet (or failed here too, and finished)
                if len(self.early) >= _EARLY:
                    self.early.pop(next(iter(self.early)))
                self.early[room] = reason
                continue
            self.told[room] = reason
            h.fail(FailureReason(reason))

    def on_admit(self, room: int, h: Any) -> None:
        """A room the other side failed before this rank admitted it fails now."""
        if not self.early:
            return
        reason = self.early.pop(room, None)
        if reason is not None:
            self.told[room] = reason
            h.fail(FailureReason(reason))
