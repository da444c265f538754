"""A simulated rank's queues and what their steppers plug in: pollers, fault
hooks, gates, the step clock, and the stepping of one queue (timed, traced
and counted)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from buffers import MetadataBuffers
from lifecycle.config import StepConfig
from lifecycle.drive.collective import Collective
from lifecycle.drive.stepper import Stepper
from lifecycle.errors import PartialPollError
from lifecycle.protocols import StepContext
from lifecycle.reasons import FailureReason
from lifecycle.result import StepResult
from lifecycle.rules.recovery import preset
from lifecycle.status import F, S, T
from lifecycle.table import RequestTable
from pdlife.cluster.config import SimConfig
from pdlife.cluster.plan import RankFaults
from pdlife.cluster.plan_doc import FaultPlan
from pdlife.sim.stats import RankStats
from pdlife.trace import TraceWriter

__all__ = [
    "DrainPoller",
    "HoldGate",
    "QueueFaults",
    "QueueSteps",
    "Queues",
    "SimPoller",
    "SimQueue",
    "StepClock",
]


class StepClock:
    """The scheduler's step count, and the time its deadlines run on: logical
    time (one unit per iteration) keeps fake runs reproducible; a real
    transport runs on the wall clock (``wall``), like its heartbeats."""

    def __init__(self, wall: bool) -> None:
        self.wall = wall
        self.step = 0

    def __call__(self) -> float:
        return time.monotonic() if self.wall else float(self.step)


class SimPoller:
    """The backend's batch poll with the plan's delay, raise-in-poll and
    transfer-error faults. Keeps what it reported, for the phase-keyed fault
    hook of the same step."""

    def __init__(self, manager: Any, faults: RankFaults, table: RequestTable) -> None:
        self.manager = manager
        self.faults = faults
        self.table = table
        self.step = 0
        self.by_room = getattr(manager, "by_room", False)
        self.observed: tuple[NDArray[np.uint64], NDArray[np.int64]] | None = None
        #: rooms a transfer-error fault failed here: their reason is a transfer error
        self.errored: set[int] = set()

    def poll_many(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> Any:
        out = np.asarray(self.manager.poll_many(rooms, indices)).astype(np.int64)
        errors: dict[int, BaseException] = {}
        if self.faults.mine:
            for i, room in enumerate(rooms.tolist()):
                if self.faults.delayed(room, self.step):
                    out[i] = self.table.state[self.table.slot_of(room)]  # no news this step
                if self.faults.raises(room, self.step):
                    errors[i] = RuntimeError(f"injected poll error for room {room}")
                if self.faults.transfer_fails(room, self.step):
                    out[i] = F
                    self.errored.add(room)
        self.observed = (rooms, out)
        if errors:
            raise PartialPollError(out, errors)
        return out

    def failure_reasons(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> Any:
        out = self.manager.failure_reasons(rooms, indices)
        if not self.errored:
            return out
        out = np.array(out, dtype=np.int8)
        for i, room in enumerate(rooms.tolist()):
            if room in self.errored:
                out[i] = FailureReason.TRANSFER_ERROR
                self.errored.discard(room)
        return out


class QueueFaults:
    """One queue's fault hook: step-mode draws, targeted faults, and the
    phase-keyed decisions measured against what the backend reported.

    ``floor``: the phase every live row of the queue has reached whatever the
    backend says. Decode's transfer queue holds requests it has told prefill
    where to write: they are Transferring, though a receiver reports
    WaitingForInput until every byte has landed (SPEC §1: backends rarely
    report it), so that a fault at Transferring fires there while the data
    is still on its way, not once it has all landed."""

    def __init__(
        self,
        faults: RankFaults,
        poller: SimPoller,
        table: RequestTable,
        abort: Callable[[int], None],
        floor: int | None = None,
    ) -> None:
        self.faults = faults
        self.poller = poller
        self.table = table
        self.abort = abort
        self.floor = floor

    def inject(self, ctx: StepContext) -> NDArray[np.bool_]:
        observed: NDArray[np.int8] | None = None
        got = self.poller.observed
        if got is not None and got[0].size:
            # the poll covers the rows not yet agreed terminal, in row order
            observed = ctx.states.copy()
            observed[np.isin(ctx.rooms, got[0])] = got[1]
        self.poller.observed = None
        if self.floor is not None and ctx.rooms.size:
            seen = ctx.states.copy() if observed is None else observed
            observed = np.where(seen == F, seen, np.maximum(seen, self.floor)).astype(np.int8)
        return self.faults.inject_phase(ctx, observed, self.abort)


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


class HoldStaging:
    """A queue's staging gate with the plan's ``hold_staging`` faults of this
    rank: a held request's scatter is pending (as one still running from the
    staging buffer would be), besides what the backend's own gate says."""

    def __init__(self, gate: HoldGate, inner: Any = None) -> None:
        self.gate, self.inner = gate, inner

    def advance(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> None:
        if self.inner is not None:
            self.inner.advance(rooms, indices)

    def pending(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.bool_]:
        faults, step = self.gate.faults, self.gate.step
        held = np.array([faults.staging_held(r, step) for r in rooms.tolist()], dtype=bool)
        if self.inner is not None:
            held |= np.asarray(self.inner.pending(rooms, indices), dtype=bool)
        return held


class SimQueue:
    """One queue of a rank: its request table and the stepper that moves it."""

    def __init__(
        self,
        name: str,
        cfg: SimConfig,
        rank: int,
        manager: Any,
        faults: RankFaults | None,
        clock: Callable[[], float],
        abort: Callable[[int], None],
        metadata: MetadataBuffers | None = None,
        staging: Any = None,
    ) -> None:
        self.name = name
        self.table = RequestTable(rank=rank)
        self.poller = SimPoller(manager, faults or RankFaults(FaultPlan(), rank, []), self.table)
        self.gate = HoldGate(self.poller.faults)
        if any(f.kind == "hold_staging" for f in self.poller.faults.mine):
            staging = HoldStaging(self.gate, staging)
        fake = cfg.backend == "fake"
        floor = T if name == "transfer" else None  # (decode's: see QueueFaults)
        hook = (
            None if faults is None else QueueFaults(faults, self.poller, self.table, abort, floor)
        )
        self.stepper = Stepper(
            self.table,
            rank,
            poller=self.poller,
            staging=staging,
            metadata=metadata,
            gates=[self.gate],
            faults=hook,
            config=StepConfig(
                bootstrap_timeout=float(cfg.bootstrap_timeout) if fake else cfg.bootstrap_timeout_s,
                waiting_timeout=float(cfg.waiting_timeout) if fake else cfg.waiting_timeout_s,
                stuck_after=cfg.stuck_after,
                initial_capacity=cfg.capacity,
                recovery=preset(cfg.recovery, cfg.max_attempts),
            ),
            clock=clock,
        )
        self.stepper.record_holds = True  # the trace says which gate held what (pdlife why)


class Queues:
    """A side's queues: prefill's bootstrap and inflight ones; decode's
    handshake and transfer ones, and the drain queue of failed requests whose
    buffers wait for their peer to stop writing. ``handles``: the live
    requests' handles, by room (a client's abort goes through them)."""

    def __init__(
        self,
        cfg: SimConfig,
        rank: int,
        side: str,
        manager: Any,
        faults: RankFaults,
        clock: Callable[[], float],
        handles: Mapping[int, Any],
        meta: MetadataBuffers,
        drain_poller: DrainPoller,
        staging: Any = None,
    ) -> None:
        self.handles = handles
        self.q3: SimQueue | None = None
        abort = self.client_abort

        def queue(name: str, *more: Any) -> SimQueue:
            return SimQueue(name, cfg, rank, manager, faults, clock, abort, *more)

        if side == "prefill":
            self.q1 = queue("bootstrap")
            self.q2 = queue("inflight")
        else:
            self.q1 = queue("handshake")
            self.q2 = queue("transfer", meta, staging)
            # draining is bookkeeping, not a transfer: no faults there
            self.q3 = SimQueue("drain", cfg, rank, drain_poller, None, clock, abort)

    @property
    def drain(self) -> SimQueue:
        """The drain queue (decode only)."""
        assert self.q3 is not None, "only decode drains"
        return self.q3

    def client_abort(self, room: int) -> None:
        """The client gave up on ``room``: abort its handle and its queue row."""
        h = self.handles.get(room)
        if h is None:
            return
        h.abort()
        for q in (self.q1, self.q2):
            if room in q.table:
                q.table.request_abort(room)


class QueueSteps:
    """Steps one queue of a side over its collective: the step's latency,
    trace, metrics, stuck reports and failures are recorded as it goes."""

    def __init__(
        self,
        coll: Collective,
        side: str,
        clock: StepClock,
        manager: Any,
        stats: RankStats,
        trace: TraceWriter,
        metrics: Any,
    ) -> None:
        self.coll = coll
        self.side = side
        self.clock = clock
        self.manager = manager
        self.stats = stats
        self.trace = trace
        self.metrics = metrics
        #: live spans fed each step, as a host engine feeds them (None: off)
        self.live: Any = None

    def step(self, q: SimQueue) -> StepResult:
        step = self.clock.step
        q.poller.step = step
        q.gate.step = step
        t0 = time.perf_counter()
        res = q.stepper.step(self.coll)
        took = time.perf_counter() - t0
        self.stats.latency_us.add(took * 1e6)
        _, local, reason = q.stepper.last_local
        holds = q.stepper.last_holds()
        self.trace.step(self.side, q.name, res, local, reason, holds)
        if self.live is not None:
            self.live.observe(q.name, res, holds)
        if self.metrics is not None:
            name = f"{self.side}/{q.name}"
            self.metrics.observe(name, res)
            self.metrics.observe_holds(name, q.stepper.rank, holds)
            self.metrics.observe_step_time(name, took)
        if res.stuck:
            self.stats.stuck_reports += len(res.stuck)
            wire = getattr(self.manager, "describe", None)  # the transport's view
            for s in res.stuck:
                self.trace.event(
                    kind="stuck",
                    step=step,
                    room=s.room,
                    status=s.status.name,
                    holders=list(s.holders),
                    **({"wire": wire(s.room)} if wire is not None else {}),
                )
        if res.failed.size:
            self.stats.failure_steps.add(step)
        return res
