"""A simulated rank's requests from admission to release: arrivals, the client's
aborts, and finishing with an outcome (recorded, told to the other side),
its buffers given back or, for a failed decode request, quarantined until
every rank agrees its peer has stopped writing. A request the recovery table
retries starts its next attempt (epoch) once the failed one has drained:
decode re-admits it and the router hands it to a prefill DP group."""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from lifecycle.reasons import FailureReason
from lifecycle.recovery import PeerState, PeerView
from lifecycle.result import Retry
from lifecycle.rules.recovery import Where
from lifecycle.status import KVPoll, Role, S, T
from pdlife.cluster.config import SimConfig, Workload
from pdlife.cluster.faults import dp_group_of
from pdlife.cluster.phase_draws import attempt_keys, draw
from pdlife.cluster.plan import RankFaults
from pdlife.cluster.topology import Place
from pdlife.sim.hooks import Queues, StepClock
from pdlife.sim.ledger import Ledger
from pdlife.sim.peer import PeerWord, Router

__all__ = ["Requests"]

_HEALTHY = PeerView(0, PeerState.HEALTHY)  # a group not seen yet


class Requests:
    """The requests of the rank at ``where``; every finished request's (room,
    status, reason, origin) is streamed to ``outcomes``, so that a soak's
    memory does not grow with the requests it has finished."""

    def __init__(
        self,
        cfg: SimConfig,
        where: Place,
        work: Workload,
        faults: RankFaults,
        manager: Any,
        ledger: Ledger,
        queues: Queues,
        peer: PeerWord,
        outcomes: Path,
        router: Router,
        clock: StepClock,
    ) -> None:
        self.cfg = cfg
        self.where = where
        self.work = work
        self.faults = faults
        self.manager = manager
        self.ledger = ledger
        self.queues = queues
        self.peer = peer
        self.abort_due: dict[int, list[int]] = {}  # step -> rooms (step mode)
        self.admitted = 0
        self.finished = 0
        self.router = router
        self.retried = 0  # attempts the recovery table sent round again (decode)
        self.readmitted = 0  # attempts after a request's first, admitted here
        self.recomputed = 0  # requests handed back to be prefilled locally (decode)
        self.recompute_steps = 0  # the local prefills' cost, in scheduler steps
        #: decode: room -> (its next epoch, prefill DP group, pages), once drained
        self.next_attempt: dict[int, tuple[int, int, int]] = {}
        #: decode: drained attempts waiting for their group's health to admit them
        self.held: dict[int, tuple[int, int, int]] = {}
        #: prefill: attempts the router handed to this group, not admitted yet
        self.handed: list[tuple[int, int, int]] = []
        #: prefill: rooms handed a later attempt before their first arrived here
        #: (decode failed the first at once): the first is never admitted
        self.ahead: set[int] = set()
        self.corrupted: set[tuple[int, int]] = set()  # (room, epoch) this rank corrupts
        self.health: Any = None  # decode: the prefill groups' health (PeerHealth)
        self.clock = clock
        self.outcomes_path = outcomes
        self._outcomes = outcomes.open("w")
        #: room -> when (wall clock, ms since the epoch) its outcome was recorded:
        #: the one time both sides' processes share (see :meth:`close`)
        self.ended_ms: dict[str, int] = {}

    def arrive(self, step: int, upto: int | None) -> None:
        """Admit this step's arrivals (this rank's DP group's share on prefill),
        none from ``upto`` on (a soak's)."""
        cfg, ledger, prefill = self.cfg, self.ledger, self.where.side == "prefill"
        # handles are what the side holds live; every rank of a side agrees on them
        new = self.work.arriving(step, self.admitted, cfg.max_live - len(ledger.handles), upto)
        if not new:
            return
        rooms, groups = [], []
        dp = cfg.prefill_dp
        for i in new:
            if prefill and i % dp != self.where.dp_rank:
                continue  # another prefill DP group serves it
            room, pages, abort_at = self.work.request(i)
            if room in self.ahead:  # its next attempt came first: this one is over
                self.ahead.discard(room)
                self.finished += 1
                continue
            self._start(room, 0, i % dp, pages)
            if abort_at:
                self.abort_due.setdefault(abort_at, []).append(room)
            rooms.append(room)
            groups.append(i % dp)
        self.admitted = new.stop
        # the client's aborts reach the decode side (and through the backend, prefill)
        self.faults.admit(
            rooms,
            aborts_here=not prefill,
            groups=groups if dp > 1 else None,
            rank_group=partial(dp_group_of, cfg),
        )

    def _start(self, room: int, epoch: int, group: int, pages: int) -> None:
        """Attempt ``epoch`` of ``room``: its handle, holdings and first queue row."""
        prefill = self.where.side == "prefill"
        if prefill:
            h = self.manager.sender(room, epoch)
        else:
            h = self.manager.receiver(room, epoch)
            h.init(prefill_dp_rank=group)
            self.peer.group[room] = group
            self._corrupt(room, epoch)
        self.ledger.admit(room, h, pages)
        self.peer.on_admit(room, h)
        role = Role.SENDER if prefill else Role.RECEIVER
        self.queues.q1.table.add(room, role=role, handle=h, handle_index=h.index, epoch=epoch)

    def _corrupt(self, room: int, epoch: int) -> None:
        """--corrupt-prob: decode's first rank flips a byte of this attempt's KV."""
        p = self.cfg.corrupt_prob
        if not p or self.where.tp_rank != 0:
            return
        key = attempt_keys(np.array([room], np.uint64), epoch)
        if draw(self.cfg.seed, 7, 0, key)[0] < p:
            self.manager.corrupt(room, epoch=epoch)
            self.corrupted.add((room, epoch))

    def retries(self) -> None:
        """The attempts the router handed to this prefill group, each admitted
        once its room's last attempt has finished here (decode: nothing)."""
        if self.where.side != "prefill" or not self.router.on:
            return
        for room, epoch, group, pages in self.router.take():
            if group == self.where.dp_rank:
                self.handed.append((room, epoch, pages))
                first = Workload.index_of(self.cfg.seed, room)
                if (
                    first is not None
                    and first >= self.admitted
                    and first % self.cfg.prefill_dp == group
                ):
                    self.ahead.add(room)
        waiting = []
        for room, epoch, pages in self.handed:
            if room in self.ledger.handles:
                waiting.append((room, epoch, pages))
                continue
            self._start(room, epoch, self.where.dp_rank, pages)
            self.readmitted += 1
            self._draw(room, epoch, self.where.dp_rank)
        self.handed = waiting

    def drained(self, room: int) -> None:
        """Decode: a failed attempt's buffers are free again; a retried request's
        next attempt waits for its prefill group to admit traffic (see :meth:`resume`)."""
        nxt = self.next_attempt.pop(room, None)
        if nxt is not None:
            self.held[room] = nxt

    def resume(self) -> None:
        """Decode: start the held attempts whose prefill group's health admits
        them (a group open after repeated failures waits out its cooldown, then
        takes one probe); the router hands each to prefill. Decided from the
        agreed health view: every decode rank starts the same ones."""
        for room, (epoch, group, pages) in list(self.held.items()):
            if not self.health.view().get(group, _HEALTHY).admits:
                continue
            self.health.choose([group], room)  # (a half-open group's probe)
            del self.held[room]
            self._start(room, epoch, group, pages)
            self.readmitted += 1
            self._draw(room, epoch, group)
            if self.where.tp_rank == 0:
                self.router.dispatch(room, epoch, group, pages)

    def _draw(self, room: int, epoch: int, group: int) -> None:
        """An attempt's phase-keyed faults, drawn anew (only ranks that see it draw)."""
        dp = self.cfg.prefill_dp
        groups = [group] if dp > 1 else None
        rank_group = partial(dp_group_of, self.cfg)
        self.faults.admit([room], aborts_here=False, groups=groups, rank_group=rank_group,
                          epoch=epoch)  # fmt: skip

    def client_aborts(self, step: int) -> None:
        """The client's aborts due at ``step`` (step mode)."""
        for room in self.abort_due.pop(step, ()):
            self.queues.client_abort(room)

    def finish(
        self, room: int, status: int, reason: int, origin: int, then: Retry | str | None = None
    ) -> None:
        """Record a request's outcome and give back its buffers, or quarantine them
        (a failed decode request) until the ranks agree its peer has drained.
        ``then`` (decode): the recovery table's word for a failure, a Retry, or
        "recompute" (the request is prefilled locally)."""
        h = self.ledger.handles[room]
        epoch = getattr(h, "epoch", 0)
        name = KVPoll(status).name
        if isinstance(then, Retry):
            name = "Retried"
        elif then == "recompute":
            name, self.recomputed = "Recomputed", self.recomputed + 1
            steps = -(-self.ledger.need[room] // self.cfg.chunk_pages)
            self.recompute_steps += steps  # its pages, a chunk per step, as prefill sends them
        # the step it ended at (the same on every rank of the side: they agreed it
        # in that step), then the wall clock, which is this rank's own
        at = f"{self.clock.step},{time.time_ns() // 1_000_000}"
        self._outcomes.write(f'[{room},"{name}",{reason},{origin},{epoch},{at}]\n')
        if isinstance(then, Retry):
            self.retried += 1
            g = self.peer.group.get(room, 0)
            group = g
            if then.where is Where.ANOTHER:  # the next group the groups' health admits
                dp = self.cfg.prefill_dp
                view = self.health.view()
                order = [(g + 1 + k) % dp for k in range(dp)]
                group = next((x for x in order if view.get(x, _HEALTHY).admits), order[0])
            self.next_attempt[room] = (then.epoch, group, self.ledger.need[room])
        else:
            self.finished += 1
        self.faults.forget(room)
        held = self.ledger.end(room)
        if status != S:
            self.peer.tell(room, reason, epoch)
        self.peer.group.pop(room, None)
        if status == S or self.where.side == "prefill":
            # success: every write has landed. prefill: its buffers are only read from
            if status != S:
                getattr(h, "fail", lambda _r: None)(FailureReason(reason))
            self.ledger.release(room, held, quarantined=False)
            return
        # decode failure: the peer may still be writing into our pages and row.
        # Tell it to stop and keep both out of reuse until it has drained.
        getattr(h, "fail", lambda _r: None)(FailureReason(reason))
        self.ledger.quarantine(room, held)
        # when to reuse them is decided together: a rank-local release would let
        # the ranks' allocators, and so their queues, diverge
        self.queues.drain.table.add(room, role=Role.RECEIVER, state=T)

    def serves(self, total: int | None) -> int | None:
        """How many requests this rank sees of the side's ``total`` (None: a
        soak not yet ended): every one on decode, its DP group's share on prefill."""
        if total is None or self.where.side == "decode":
            return total
        return len(range(self.where.dp_rank, total, self.cfg.prefill_dp))

    def close(self) -> dict[str, list[Any]]:
        """Close the outcomes file; every finished request's outcome, by room:
        [status, reason, origin, epoch, step ended]. When each was recorded by
        the wall clock goes to :attr:`ended_ms` (ranks of a side agree on the
        rest, not on that)."""
        self._outcomes.close()
        outcome: dict[str, list[Any]] = {}
        with self.outcomes_path.open() as f:
            for line in f:
                room, *rest, ms = json.loads(line)
                outcome[str(room)] = rest
                self.ended_ms[str(room)] = ms
        return outcome
