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

from typing import TYPE_CHECKING, Any

from lifecycle.reasons import FailureReason

if TYPE_CHECKING:
    from pdlife.sim import RankRun

__all__ = ["tell", "hear", "on_admit"]

_MOST = 4096  # notices taken per step (the rest wait for the next)
_EARLY = 100_000  # notices held for rooms not admitted yet (the oldest go first)


def _key(rank: int) -> str:
    return f"fakepeer/{rank}"


def tell(run: RankRun, room: int, reason: int) -> None:
    """``room`` failed here, for ``reason``: tell the other side (fake backend)."""
    if run.moves_bytes or run.side_rank != 0 or run.peer_told.pop(room, None) is not None:
        return  # a real backend tells it; another rank of the side does; it told us
    cfg = run.cfg
    if run.side == "prefill":
        targets = range(cfg.prefill_ranks, cfg.world)
    else:
        g = run.peer_group.get(room, 0)
        targets = range(g * cfg.prefill, (g + 1) * cfg.prefill)
    word = f"{room} {int(reason)}".encode()
    for r in targets:
        run.store.queue_push(_key(r), word)


def hear(run: RankRun) -> None:
    """Fail every live request the other side said it failed (fake backend)."""
    if run.moves_bytes:
        return
    key = _key(run.rank)
    for _ in range(min(int(run.store.queue_len(key)), _MOST)):
        room, reason = (int(x) for x in bytes(run.store.queue_pop(key)).split())
        h = run.handles.get(room)
        if h is None:  # not admitted here yet (or failed here too, and finished)
            if len(run.peer_early) >= _EARLY:
                run.peer_early.pop(next(iter(run.peer_early)))
            run.peer_early[room] = reason
            continue
        run.peer_told[room] = reason
        h.fail(FailureReason(reason))


def on_admit(run: RankRun, room: int, h: Any) -> None:
    """A room the other side failed before this rank admitted it fails now."""
    reason = run.peer_early.pop(room, None)
    if reason is not None:
        run.peer_told[room] = reason
        h.fail(FailureReason(reason))
