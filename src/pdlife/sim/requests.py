"""A simulated rank's requests from admission to release: arrivals, the client's
aborts, and finishing with an outcome (recorded, told to the other side),
its buffers given back or, for a failed decode request, quarantined until
every rank agrees its peer has stopped writing."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll, Role, S, T
from pdlife.cluster.config import SimConfig, Workload
from pdlife.cluster.faults import dp_group_of
from pdlife.cluster.plan import RankFaults
from pdlife.cluster.topology import Place
from pdlife.sim.hooks import Queues
from pdlife.sim.ledger import Ledger
from pdlife.sim.peer import PeerWord

__all__ = ["Requests"]


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
        self.outcomes_path = outcomes
        self._outcomes = outcomes.open("w")

    def arrive(self, step: int, upto: int | None) -> None:
        """Admit this step's arrivals (this rank's DP group's share on prefill),
        none from ``upto`` on (a soak's)."""
        cfg, ledger, prefill = self.cfg, self.ledger, self.where.side == "prefill"
        # handles are what the side holds live; every rank of a side agrees on them
        new = self.work.arriving(step, self.admitted, cfg.max_live - len(ledger.handles), upto)
        if not new:
            return
        role = Role.SENDER if prefill else Role.RECEIVER
        rooms, groups = [], []
        dp = cfg.prefill_dp
        for i in new:
            if prefill and i % dp != self.where.dp_rank:
                continue  # another prefill DP group serves it
            room, pages, abort_at = self.work.request(i)
            if prefill:
                h = self.manager.sender(room)
            else:
                h = self.manager.receiver(room)
                h.init(prefill_dp_rank=i % dp)
                self.peer.group[room] = i % dp
            ledger.admit(room, h, pages)
            self.peer.on_admit(room, h)
            if abort_at:
                self.abort_due.setdefault(abort_at, []).append(room)
            self.queues.q1.table.add(room, role=role, handle=h, handle_index=h.index)
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

    def client_aborts(self, step: int) -> None:
        """The client's aborts due at ``step`` (step mode)."""
        for room in self.abort_due.pop(step, ()):
            self.queues.client_abort(room)

    def finish(self, room: int, status: int, reason: int, origin: int) -> None:
        """Record a request's outcome and give back its buffers, or quarantine them
        (a failed decode request) until the ranks agree its peer has drained."""
        self._outcomes.write(f'[{room},"{KVPoll(status).name}",{reason},{origin}]\n')
        self.finished += 1
        self.faults.forget(room)
        held = self.ledger.end(room)
        h = held[0]
        if status != S:
            self.peer.tell(room, reason)
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
        """Close the outcomes file; every finished request's outcome, by room."""
        self._outcomes.close()
        outcome: dict[str, list[Any]] = {}
        with self.outcomes_path.open() as f:
            for line in f:
                room, *rest = json.loads(line)
                outcome[str(room)] = rest
        return outcome
