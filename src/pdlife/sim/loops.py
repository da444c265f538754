"""The reference prefill and decode scheduler iterations (SPEC §3), over a
rank's queues, holdings (the ledger) and buffers."""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs
import numpy as np

from lifecycle.recovery import PeerHealth
from lifecycle.result import Retry, StepResult
from lifecycle.status import B, F, KVPoll, Role, S, T, W
from pdlife.cluster.config import SimConfig
from pdlife.cluster.plan import RankFaults
from pdlife.sim.hooks import DrainPoller, Queues, QueueSteps, StepClock
from pdlife.sim.kv_bytes import RankBytes
from pdlife.sim.ledger import Ledger
from pdlife.sim.requests import Requests
from pdlife.sim.stats import RankStats
from pdlife.trace import TraceWriter

__all__ = ["DecodeLoop", "LoopParts", "PrefillLoop"]


def _rows(res: StepResult) -> Any:
    return zip(
        res.rooms.tolist(), res.statuses.tolist(), res.reasons.tolist(), res.origins.tolist()
    )


def _then(res: StepResult) -> dict[int, Retry | str]:
    """What the recovery table decided for each request that failed in ``res``
    (decided from agreed reasons and epochs: the same on every rank)."""
    if not res.failed.size:
        return {}
    out: dict[int, Retry | str] = {r.room: r for r in res.retries()}
    out.update((room, "recompute") for room in res.recomputed.tolist())
    return out


@attrs.frozen
class LoopParts:
    """What both sides' iterations run over."""

    cfg: SimConfig
    clock: StepClock
    steps: QueueSteps
    queues: Queues
    ledger: Ledger
    buffers: RankBytes
    requests: Requests
    stats: RankStats


class _Loop:
    def __init__(self, parts: LoopParts) -> None:
        self.cfg = parts.cfg
        self.clock = parts.clock
        self.steps = parts.steps
        self.queues = parts.queues
        self.ledger = parts.ledger
        self.buffers = parts.buffers
        self.requests = parts.requests
        self.stats = parts.stats

    def violation(self, what: str) -> None:
        self.stats.violations.append(f"step {self.clock.step}: {what}")


class PrefillLoop(_Loop):
    """Prefill: bootstrap, then allocate and send each request's KV in chunks.
    ``faults_for_decode``: the decode ranks' plans whose metadata faults this
    rank carries out as it writes their metadata row."""

    def __init__(self, parts: LoopParts, faults_for_decode: list[RankFaults]) -> None:
        super().__init__(parts)
        self.faults_for_decode = faults_for_decode
        self.sent: dict[int, int] = {}  # room -> pages sent so far

    def iteration(self) -> list[StepResult]:
        q1, q2, ledger, buffers = self.queues.q1, self.queues.q2, self.ledger, self.buffers
        r1 = self.steps.step(q1)
        for room, st, reason, origin in _rows(r1):
            if st == W:
                if not ledger.fits(room):
                    continue  # wait for KV pages
                slot = ledger.alloc.alloc(room)
                if slot is None:
                    continue  # wait for a metadata slot
                pages = ledger.hold(room, slot)
                if buffers.state_tensors:
                    ledger.state_row_of[room] = buffers.state_row(slot)
                if buffers.moves_bytes:
                    buffers.fill_pages(room, pages)
                    # every decode rank's plan is asked, so that each of its faults fires
                    kinds = [f.metadata_fault(room) for f in self.faults_for_decode]
                    fault = next((k for k in kinds if k is not None), None)
                    buffers.write_first_token(room, slot, fault)
                    if buffers.state_tensors:
                        buffers.fill_state(room, ledger.state_row_of[room])
                h = ledger.handles[room]
                h.init(ledger.need[room], slot)
                self.sent[room] = 0
                q1.table.remove(room)
                q2.table.add(room, state=W, handle=h, handle_index=h.index, epoch=h.epoch)
            elif st == F:
                q1.table.remove(room)
                self.requests.finish(room, st, reason, origin)
            elif st in (T, S):
                self.violation(f"room {room} {KVPoll(st).name} in bootstrap queue")
        # the forward pass: send the next chunk of every in-flight request; one
        # this rank or a decode rank is to fail (a phase-keyed or targeted ``at``
        # fault) goes no further until it has ended here: its data must not
        # complete on decode before the fault fires, here or there
        holds = self.requests.faults.holds
        for room in q2.table.rooms().tolist():
            if holds(room):
                continue
            total = ledger.need[room]
            k = min(self.cfg.chunk_pages, total - self.sent[room])
            if k > 0:
                chunk = ledger.pages_of[room][self.sent[room] : self.sent[room] + k]
                self.sent[room] += k
                # the state rides with the last chunk, as a model's final state does
                last = self.sent[room] == total and room in ledger.state_row_of
                state = [np.array([ledger.state_row_of[room]], dtype=np.int64)] if last else None
                ledger.handles[room].send(chunk, state_indices=state)
        r2 = self.steps.step(q2)
        for room, st, reason, origin in _rows(r2):
            if st in (S, F):
                q2.table.remove(room)
                self.sent.pop(room, None)
                self.requests.finish(room, st, reason, origin)
            elif st == B:
                self.violation(f"room {room} Bootstrapping in flight")
        return [r1, r2]


class DecodeLoop(_Loop):
    """Decode: handshake, allocate in order, receive and check each request,
    then release the buffers of failed ones once their peer has drained.
    ``faults``: this rank's plan (the fake backend's metadata faults land here)."""

    def __init__(
        self,
        parts: LoopParts,
        rank: int,
        faults: RankFaults,
        drain_poller: DrainPoller,
        trace: TraceWriter,
        metrics: Any,
    ) -> None:
        super().__init__(parts)
        self.rank = rank
        self.faults = faults
        self.drain_poller = drain_poller
        self.trace = trace
        self.metrics = metrics
        self.ready: deque[int] = deque()  # rooms handshaken, waiting for buffers
        #: each prefill DP group's health, from agreed outcomes only: the same view
        #: on every decode rank (a retry sent "another" way is routed by it)
        self.health = PeerHealth()
        self.requests.health = self.health

    def iteration(self) -> list[StepResult]:
        out = [*self.receive(), self.drain()]
        self.health.tick()
        self.requests.resume()
        return out

    def receive(self) -> list[StepResult]:
        q1, q2, ledger, buffers = self.queues.q1, self.queues.q2, self.ledger, self.buffers
        cfg, stats = self.cfg, self.stats
        r1 = self.steps.step(q1)
        self.health.observe_result(r1, self.requests.peer.group)
        then = _then(r1)
        for room, st, reason, origin in _rows(r1):
            if st == F:
                q1.table.remove(room)
                if room in self.ready:
                    self.ready.remove(room)
                self.requests.finish(room, st, reason, origin, then.get(room))
            elif st == W and room not in self.ready:
                self.ready.append(room)
            elif st in (T, S):
                self.violation(f"room {room} {KVPoll(st).name} in handshake")
        # allocation: in order, head-of-line blocking on slot or KV pages
        for room in self._allocatable():
            need = ledger.need[room]
            if not ledger.fits(room) or ledger.alloc.available == 0:
                break
            slot = ledger.alloc.alloc(room)
            assert slot is not None
            self.ready.remove(room)
            pages = ledger.hold(room, slot)
            h = ledger.handles[room]
            # a cached prefix: decode holds the first pages already, prefill skips them
            cached = cfg.prefix_pages if need > cfg.prefix_pages else 0
            if cached and buffers.moves_bytes:
                buffers.fill_prefix(room, pages[:cached])
            state = None
            if buffers.state_tensors:
                ledger.state_row_of[room] = buffers.state_row(slot)
                state = [np.array([ledger.state_row_of[room]], dtype=np.int64)]
            # what must come over the network for this rank: the uncached pages of its
            # heads, its state row and its metadata row
            due = (need - cached) * buffers.page_bytes + buffers.row_bytes
            stats.bytes_asked += due
            ledger.due_of[room] = due
            h.send_metadata(
                pages[cached:],
                slot,
                state_indices=state,
                decode_prefix_len=cached * cfg.page_size,
            )
            # known once registered: whether its head slices land via the staging buffer
            stats.staged += bool(getattr(h, "require_staging", False))
            if not buffers.moves_bytes:
                buffers.simulate_remote_write(room, slot, self.faults.metadata_fault(room))
            q1.table.remove(room)
            q2.table.add(
                room,
                role=Role.RECEIVER,
                state=W,
                handle=h,
                handle_index=h.index,
                metadata_slot=slot,
                epoch=h.epoch,
            )
            q2.table.mark_metadata_sent(room, self.clock())
        r2 = self.steps.step(q2)
        self.health.observe_result(r2, self.requests.peer.group)
        then = _then(r2)
        for room, st, reason, origin in _rows(r2):
            if st == S:
                self.check(room)
                stats.bytes_due += ledger.due_of.get(room, 0)
                q2.table.remove(room)
                self.requests.finish(room, st, reason, origin)
            elif st == F:
                q2.table.remove(room)
                self.requests.finish(room, st, reason, origin, then.get(room))
        return [r1, r2]

    def _allocatable(self) -> list[int]:
        """The ready rooms to allocate, in order. On the fake backend, which has no
        link between the sides, a room a prefill rank is to fail is left out
        until its failure is heard here: the fake receiver would otherwise
        succeed at once, where a real one waits for data that never comes.
        (It waits before its metadata is sent, where no deadline runs: the
        wait is on the other side's processes, whose steps are not this side's.)"""
        if self.buffers.moves_bytes:
            return list(self.ready)
        peer = self.faults.peer_fail
        return [r for r in self.ready if r not in peer]

    def check(self, room: int) -> None:
        """A committed request's metadata row, first token and bytes."""
        meta = self.buffers.meta
        slot = self.ledger.slot_of[room]
        got = meta.room_of(slot)
        if got != room:
            self.violation(f"room {room} committed with metadata row room {got}")
            return
        if meta.read(slot).first_token != room % 50000:
            self.violation(f"room {room} first token corrupt")
            return
        pages = self.ledger.pages_of[room]
        problem, checked = self.buffers.verify(
            room, pages, slot, self.ledger.state_row_of.get(room)
        )
        epoch = getattr(self.ledger.handles[room], "epoch", 0)
        if problem is not None and (room, epoch) in self.requests.corrupted:
            self.stats.corrupt_unseen += 1  # --corrupt-prob's flip, past a check that is off
            return
        if problem is not None:
            self.violation(
                f"room {room} on decode rank {self.rank}: {problem} "
                "(decode bytes differ from what prefill wrote)"
            )
            return
        self.stats.bytes_checked += checked

    def drain(self) -> StepResult:
        """Release quarantined buffers once every rank's peer has stopped writing.

        An entry the ranks agreed Failed (its drain poll raised, or it sat past
        a deadline) is released as well: the backend's own drain deadline has
        bounded the peer's writes by then, and keeping it would pin its slot
        and pages for the rest of the run.
        """
        q3 = self.queues.drain
        res = self.steps.step(q3)
        for room in res.succeeded.tolist():
            q3.table.remove(room)
            self.ledger.drained(room)
            self.requests.drained(room)
        for room in res.failed.tolist():
            q3.table.remove(room)
            self.stats.drain_failed += 1
            self.trace.event(kind="drain_failed", step=self.clock.step, room=room)
            self.ledger.drained(room)
            self.requests.drained(room)
        if self.metrics is not None:
            self.metrics.fenced.set(self.ledger.fenced_pages(self.drain_poller.settled))
        return res
