"""The reference prefill and decode scheduler iterations (SPEC §3)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from lifecycle.result import StepResult
from lifecycle.status import B, F, KVPoll, Role, S, T, W
from pdlife.sim_bytes import (
    fill_pages,
    fill_prefix,
    fill_state,
    simulate_remote_write,
    verify_pages,
    write_first_token,
)
from pdlife.sim_requests import finish

if TYPE_CHECKING:
    from pdlife.sim import RankRun


def take_pages(run: RankRun, need: int) -> NDArray[np.int64]:
    return np.array([run.pages_free.popleft() for _ in range(need)], dtype=np.int64)


def prefill_iteration(run: RankRun) -> list[StepResult]:
    r1 = run._step_queue(run.q1)
    for room, st, reason, origin in zip(
        r1.rooms.tolist(), r1.statuses.tolist(), r1.reasons.tolist(), r1.origins.tolist()
    ):
        if st == W:
            need = run.need[room]
            if need > len(run.pages_free):
                continue  # wait for KV pages
            slot = run.alloc.alloc(room)
            if slot is None:
                continue  # wait for a metadata slot
            run._slot[room] = slot
            pages = take_pages(run, need)
            run.pages_of[room] = pages
            if run.state_tensors:
                run.state_row_of[room] = run.state_row(slot)
            if run.moves_bytes:
                fill_pages(run, room, pages)
                write_first_token(run, room, slot)
                if run.state_tensors:
                    fill_state(run, room, run.state_row_of[room])
            h = run.handles[room]
            h.init(need, slot)
            run.sent[room] = 0
            run.q1.table.remove(room)
            run.q2.table.add(room, state=W, handle=h, handle_index=h.index)
        elif st == F:
            run.q1.table.remove(room)
            finish(run, room, st, reason, origin)
        elif st in (T, S):
            run.violations.append(
                f"step {run.step_no}: room {room} {KVPoll(st).name} in bootstrap queue"
            )
    # the forward pass: send the next chunk of every in-flight request
    for room in run.q2.table.rooms().tolist():
        total = run.need[room]
        k = min(run.cfg.chunk_pages, total - run.sent[room])
        if k > 0:
            chunk = run.pages_of[room][run.sent[room] : run.sent[room] + k]
            run.sent[room] += k
            # the state rides with the last chunk, as a model's final state does
            last = run.sent[room] == total and room in run.state_row_of
            state = [np.array([run.state_row_of[room]], dtype=np.int64)] if last else None
            run.handles[room].send(chunk, state_indices=state)
    r2 = run._step_queue(run.q2)
    for room, st, reason, origin in zip(
        r2.rooms.tolist(), r2.statuses.tolist(), r2.reasons.tolist(), r2.origins.tolist()
    ):
        if st in (S, F):
            run.q2.table.remove(room)
            run.sent.pop(room, None)
            finish(run, room, st, reason, origin)
        elif st == B:
            run.violations.append(f"step {run.step_no}: room {room} Bootstrapping in flight")
    return [r1, r2]


def decode_iteration(run: RankRun) -> list[StepResult]:
    r1 = run._step_queue(run.q1)
    for room, st, reason, origin in zip(
        r1.rooms.tolist(), r1.statuses.tolist(), r1.reasons.tolist(), r1.origins.tolist()
    ):
        if st == F:
            run.q1.table.remove(room)
            if room in run.ready:
                run.ready.remove(room)
            finish(run, room, st, reason, origin)
        elif st == W and room not in run.ready:
            run.ready.append(room)
        elif st in (T, S):
            run.violations.append(f"step {run.step_no}: room {room} {KVPoll(st).name} in handshake")
    # allocation: in order, head-of-line blocking on slot or KV pages
    while run.ready:
        room = run.ready[0]
        need = run.need[room]
        if need > len(run.pages_free) or run.alloc.available == 0:
            break
        slot = run.alloc.alloc(room)
        assert slot is not None
        run.ready.popleft()
        run._slot[room] = slot
        pages = take_pages(run, need)
        run.pages_of[room] = pages
        h = run.handles[room]
        # a cached prefix: decode holds the first pages already, prefill skips them
        cached = run.cfg.prefix_pages if need > run.cfg.prefix_pages else 0
        if cached and run.moves_bytes:
            fill_prefix(run, room, pages[:cached])
        state = None
        if run.state_tensors:
            run.state_row_of[room] = run.state_row(slot)
            state = [np.array([run.state_row_of[room]], dtype=np.int64)]
        # what must come over the network for this rank: the uncached pages of its
        # heads, its state row and its metadata row
        due = (need - cached) * sum(t[0].nbytes for t in run.kv) + run.row_bytes
        run.bytes_asked += due
        run.due_of[room] = due
        h.send_metadata(
            pages[cached:],
            slot,
            state_indices=state,
            decode_prefix_len=cached * run.cfg.page_size,
        )
        # known once registered: whether its head slices land via the staging buffer
        run.staged += bool(getattr(h, "require_staging", False))
        if not run.moves_bytes:
            simulate_remote_write(run, room, slot)
        run.q1.table.remove(room)
        run.q2.table.add(
            room,
            role=Role.RECEIVER,
            state=W,
            handle=h,
            handle_index=h.index,
            metadata_slot=slot,
        )
        run.q2.table.mark_metadata_sent(room, run.clock())
    r2 = run._step_queue(run.q2)
    for room, st, reason, origin in zip(
        r2.rooms.tolist(), r2.statuses.tolist(), r2.reasons.tolist(), r2.origins.tolist()
    ):
        if st == S:
            slot = run._slot[room]
            got = run.meta.room_of(slot)
            if got != room:
                run.violations.append(
                    f"step {run.step_no}: room {room} committed with metadata row room {got}"
                )
            elif run.meta.read(slot).first_token != room % 50000:
                run.violations.append(f"step {run.step_no}: room {room} first token corrupt")
            else:
                verify_pages(run, room)
            run.bytes_due += run.due_of.get(room, 0)
            run.q2.table.remove(room)
            finish(run, room, st, reason, origin)
        elif st == F:
            run.q2.table.remove(room)
            finish(run, room, st, reason, origin)
    return [r1, r2]
