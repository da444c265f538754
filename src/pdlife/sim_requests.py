"""A simulated rank's requests from admission to release: arrivals, the client's
aborts, finishing with an outcome, and the quarantine a failed decode request's
buffers wait in until every rank agrees its peer has stopped writing."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll, Role, S, T
from lifecycle.step import StepResult
from pdlife.sim_faults import dp_group_of
from pdlife.sim_peer import on_admit, tell
from pdlife.sim_soak import soak_allowed

if TYPE_CHECKING:
    from pdlife.sim import RankRun

__all__ = ["arrive", "client_aborts", "finish", "release", "drain"]


def arrive(run: RankRun) -> None:
    """Admit this step's arrivals (this rank's DP group's share on prefill)."""
    upto = run.soak_limit if run.cfg.soak else None
    if run.cfg.soak and upto is None:
        upto = soak_allowed(run)
    # handles are what the side holds live; every rank of a side agrees on them
    new = run.work.arriving(run.step_no, run.admitted, run.cfg.max_live - len(run.handles), upto)
    if not new:
        return
    role = Role.SENDER if run.side == "prefill" else Role.RECEIVER
    rooms, groups = [], []
    dp = run.cfg.prefill_dp
    for i in new:
        if run.side == "prefill" and i % dp != run.place.dp_rank:
            continue  # another prefill DP group serves it
        room, pages, abort_at = run.work.request(i)
        if run.side == "prefill":
            h = run.manager.sender(room)
        else:
            h = run.manager.receiver(room)
            h.init(prefill_dp_rank=i % dp)
            run.peer_group[room] = i % dp
        run.handles[room] = h
        if run.peer_early:
            on_admit(run, room, h)
        run.need[room] = pages
        if abort_at:
            run.abort_due.setdefault(abort_at, []).append(room)
        run.q1.table.add(room, role=role, handle=h, handle_index=h.index)
        rooms.append(room)
        groups.append(i % dp)
    run.admitted = new.stop
    # the client's aborts reach the decode side (and through the backend, prefill)
    run.faults.admit(
        rooms,
        aborts_here=run.side == "decode",
        groups=groups if dp > 1 else None,
        rank_group=partial(dp_group_of, run.cfg),
    )


def client_aborts(run: RankRun) -> None:
    for room in run.abort_due.pop(run.step_no, ()):
        run.client_abort(room)


def finish(run: RankRun, room: int, status: int, reason: int, origin: int) -> None:
    """Record a request's outcome and give back its buffers, or quarantine them
    (a failed decode request) until the ranks agree its peer has drained."""
    run._outcomes.write(f'[{room},"{KVPoll(status).name}",{reason},{origin}]\n')
    run.finished += 1
    run.faults.forget(room)
    run.need.pop(room, None)
    h = run.handles.pop(room)
    slot = run._slot.pop(room, None)
    pages = run.pages_of.pop(room, None)
    run.state_row_of.pop(room, None)  # the row goes with the metadata slot
    run.due_of.pop(room, None)
    if status != S:
        tell(run, room, reason)
    run.peer_group.pop(room, None)
    if status == S or run.side == "prefill":
        # success: every write has landed. prefill: its buffers are only read from
        if status != S:
            getattr(h, "fail", lambda _r: None)(FailureReason(reason))
        release(run, room, h, slot, pages, quarantined=False)
        return
    # decode failure: the peer may still be writing into our pages and row.
    # Tell it to stop and keep both out of reuse until it has drained.
    getattr(h, "fail", lambda _r: None)(FailureReason(reason))
    if slot is not None:
        run.alloc.free(slot, room, quarantine=True)
    run.draining[room] = (h, slot, pages)
    # when to reuse them is decided together: a rank-local release would let
    # the ranks' allocators, and so their queues, diverge
    run.q3.table.add(room, role=Role.RECEIVER, state=T)


def release(
    run: RankRun,
    room: int,
    h: Any,
    slot: int | None,
    pages: NDArray[np.int64] | None,
    quarantined: bool,
) -> None:
    if slot is not None:
        if quarantined:
            run.alloc.release(slot)
        else:
            run.alloc.free(slot, room)  # zeroes the room row
    if pages is not None:
        run.pages_free.extend(pages.tolist())
    h.clear()


def fenced_pages(draining: dict[int, Any], settled: set[int]) -> int:
    """KV pages of draining requests held only by a fence (here or on another
    rank of the group): their writer stopped beating."""
    return sum(e[2].size for r, e in draining.items() if r in settled and e[2] is not None)


def drain(run: RankRun) -> StepResult:
    """Release quarantined buffers once every rank's peer has stopped writing.

    An entry the ranks agreed Failed (its drain poll raised, or it sat past
    a deadline) is released as well: the backend's own drain deadline has
    bounded the peer's writes by then, and keeping it would pin its slot
    and pages for the rest of the run.
    """
    res = run._step_queue(run.q3)
    for room in res.succeeded.tolist():
        h, slot, pages = run.draining.pop(room)
        run.q3.table.remove(room)
        release(run, room, h, slot, pages, quarantined=True)
    for room in res.failed.tolist():
        h, slot, pages = run.draining.pop(room)
        run.q3.table.remove(room)
        run.drain_failed += 1
        run.trace.event(kind="drain_failed", step=run.step_no, room=room)
        release(run, room, h, slot, pages, quarantined=True)
    if run.metrics is not None:
        run.metrics.fenced.set(fenced_pages(run.draining, run.drain_poller.settled))
    return res
