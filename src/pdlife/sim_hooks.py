"""What the simulated schedulers plug into their steppers: pollers, fault
hooks, gates, the queues, and bounded samples."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from buffers import MetadataBuffers
from lifecycle.config import StepConfig
from lifecycle.errors import PartialPollError
from lifecycle.protocols import StepContext
from lifecycle.reasons import FailureReason
from lifecycle.status import S, T
from lifecycle.stepper import Stepper
from lifecycle.table import RequestTable
from pdlife.plan import FaultPlan, RankFaults

if TYPE_CHECKING:
    from pdlife.sim import RankRun


class SimPoller:
    """The backend's batch poll with the plan's delay and raise-in-poll faults.
    Keeps what it reported, for the phase-keyed fault hook of the same step."""

    def __init__(self, manager: Any, faults: RankFaults, table: RequestTable) -> None:
        self.manager = manager
        self.faults = faults
        self.table = table
        self.step = 0
        self.by_room = getattr(manager, "by_room", False)
        self.observed: tuple[NDArray[np.uint64], NDArray[np.int64]] | None = None

    def poll_many(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> Any:
        out = np.asarray(self.manager.poll_many(rooms, indices)).astype(np.int64)
        errors: dict[int, BaseException] = {}
        if self.faults.mine:
            for i, room in enumerate(rooms.tolist()):
                if self.faults.delayed(room, self.step):
                    out[i] = self.table.state[self.table.slot_of(room)]  # no news this step
                if self.faults.raises(room, self.step):
                    errors[i] = RuntimeError(f"injected poll error for room {room}")
        self.observed = (rooms, out)
        if errors:
            raise PartialPollError(out, errors)
        return out

    def failure_reasons(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> Any:
        return self.manager.failure_reasons(rooms, indices)


class QueueFaults:
    """One queue's fault hook: step-mode draws, targeted faults, and the
    phase-keyed decisions measured against what the backend reported."""

    def __init__(self, faults: RankFaults, poller: SimPoller, table: RequestTable, run: RankRun):
        self.faults = faults
        self.poller = poller
        self.table = table
        self.run = run

    def inject(self, ctx: StepContext) -> NDArray[np.bool_]:
        observed: NDArray[np.int8] | None = None
        got = self.poller.observed
        if got is not None and got[0].size:
            # the poll covers the rows not yet agreed terminal, in row order
            observed = ctx.states.copy()
            observed[np.isin(ctx.rooms, got[0])] = got[1]
        self.poller.observed = None
        return self.faults.inject_phase(ctx, observed, self._abort)

    def _abort(self, room: int) -> None:
        self.run.client_abort(room)


class DrainPoller:
    """Success once no writer can write into a failed request's buffers on
    this rank any more (the backend's ``drained``), Transferring until then.

    ``settled`` holds the rooms that, at the last poll, were drained here or
    fenced here (held for a writer that stopped beating, which may never come
    back): what is left of them waits on a fence, here or on another rank."""

    by_room = True  # drain rows carry no handle index

    def __init__(self, draining: dict[int, tuple[Any, Any, Any]]) -> None:
        self.draining = draining
        self.settled: set[int] = set()

    def poll_many(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.int8]:
        out = np.empty(rooms.size, dtype=np.int8)
        settled = set()
        for i, r in enumerate(rooms.tolist()):
            h = self.draining[r][0]
            drained = getattr(h, "drained", True)
            out[i] = S if drained else T
            if drained or getattr(h, "fenced", False):
                settled.add(r)
        self.settled = settled
        return out

    def failure_reasons(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> Any:
        return np.full(rooms.size, FailureReason.UNKNOWN, dtype=np.int8)


class HoldGate:
    name = "plan"

    def __init__(self, faults: RankFaults) -> None:
        self.faults = faults
        self.step = 0

    def closed(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.bool_]:
        if not self.faults.mine:
            return np.zeros(rooms.size, dtype=bool)
        return np.array([self.faults.gate_held(r, self.step) for r in rooms.tolist()], dtype=bool)


class _Queue:
    def __init__(
        self,
        name: str,
        run: RankRun,
        manager: Any,
        faults: RankFaults | None,
        metadata: MetadataBuffers | None = None,
        staging: Any = None,
    ) -> None:
        cfg = run.cfg
        self.name = name
        self.table = RequestTable(rank=run.rank)
        self.poller = SimPoller(
            manager, faults or RankFaults(FaultPlan(), run.rank, []), self.table
        )
        self.gate = HoldGate(self.poller.faults)
        fake = cfg.backend == "fake"
        self.stepper = Stepper(
            self.table,
            run.rank,
            poller=self.poller,
            staging=staging,
            metadata=metadata,
            gates=[self.gate],
            faults=None if faults is None else QueueFaults(faults, self.poller, self.table, run),
            config=StepConfig(
                bootstrap_timeout=float(cfg.bootstrap_timeout) if fake else cfg.bootstrap_timeout_s,
                waiting_timeout=float(cfg.waiting_timeout) if fake else cfg.waiting_timeout_s,
                stuck_after=cfg.stuck_after,
                initial_capacity=cfg.capacity,
            ),
            clock=run.clock,
        )


def rss_mb() -> float:
    """This process's resident set size (Linux), in MiB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


class _Reservoir:
    """At most ``cap`` samples, evenly thinned as more arrive (bounded memory)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.stride = 1
        self.seen = 0
        self.items: list[Any] = []

    def add(self, x: Any) -> None:
        if self.seen % self.stride == 0:
            self.items.append(x)
            if len(self.items) >= self.cap:
                self.items = self.items[::2]
                self.stride *= 2
        self.seen += 1
