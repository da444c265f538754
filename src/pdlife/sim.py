"""One rank of the simulated PD cluster: reference prefill and decode
scheduler loops (the behaviour of SPEC §3) driven by the consensus step.

Ranks ``0..P-1`` are the prefill TP group, ``P..P+D-1`` the decode TP group.
Every rank of a side sees the same requests (same seed), makes the same
queue decisions from the same agreed statuses, and checks the invariants as
it goes. Time is logical (one unit per scheduler iteration) so a seed
reproduces a run exactly.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from numpy.typing import NDArray

from buffers import MetadataBuffers, MetadataLayout, SlotAllocator
from lifecycle.collective import Collective, TorchCollective
from lifecycle.errors import LifecycleError, PartialPollError, RankFailure
from lifecycle.packing import fingerprint
from lifecycle.protocols import StepContext
from lifecycle.reasons import FailureReason
from lifecycle.status import B, F, KVPoll, Role, S, T, W
from lifecycle.step import StepConfig, Stepper, StepResult
from lifecycle.table import RequestTable
from pdlife.plan import KINDS, FaultPlan, RankFaults
from pdlife.trace import TraceWriter

__all__ = ["SimConfig", "Workload", "run_rank"]

SIM_LAYOUT = MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
KV_LAYERS = 2
PAGE_BYTES = 256


@attrs.frozen
class SimConfig:
    prefill: int = 2
    decode: int = 2
    requests: int = 200
    seed: int = 0
    abort_prob: float = 0.02
    arrival: int = 16
    max_pages: int = 32
    chunk_pages: int = 8
    metadata_slots: int = 64
    kv_pages: int = 1024
    max_steps: int = 3000
    # deadlines: the fake backend runs on logical time (scheduler steps), a real
    # transport on the wall clock (seconds), like its heartbeats
    bootstrap_timeout: int = 400  # steps
    waiting_timeout: int = 200  # steps
    bootstrap_timeout_s: float = 20.0
    waiting_timeout_s: float = 10.0
    stuck_after: int = 100
    backend: str = "fake"
    pg_timeout: float = 30.0
    metrics_port: int | None = None  # rank r serves Prometheus metrics on port + r
    plan: FaultPlan = attrs.field(factory=FaultPlan)
    fault_mode: str = "phase"  # phase | step (see pdlife.plan)
    soak: float | None = None  # seconds: keep admitting requests this long
    # admission control, like a real scheduler's: past this many live requests
    # arrivals wait, so a long run holds a bounded backlog, not an ever-growing one
    max_live: int = 256
    rss_every: float = 1.0  # seconds between RSS samples

    @property
    def world(self) -> int:
        return self.prefill + self.decode

    @property
    def mode(self) -> str:
        """The fault mode in force: the plan's, else ``fault_mode``."""
        return self.plan.mode if self.plan.mode is not None else self.fault_mode

    @property
    def capacity(self) -> int:
        """Live requests a queue can hold at once (the step's buffer size)."""
        return max(64, min(self.requests, self.kv_pages, 4096))


_BLOCK = 4096
_M62 = (1 << 62) - 1  # rooms stay within int64 wherever a column holds them


class Workload:
    """The run's requests, made on demand from the seed: request ``i`` has a
    room, a page count, an arrival step and (step mode) an abort step.
    Nothing is kept per request, so a soak can admit requests forever."""

    def __init__(self, cfg: SimConfig) -> None:
        self.seed = cfg.seed
        self.arrival_rate = max(cfg.arrival, 1)
        self.max_pages = cfg.max_pages
        self.abort_prob = cfg.abort_prob if cfg.mode == "step" else 0.0
        self.limit: int | None = None if cfg.soak else cfg.requests
        self._blocks: dict[
            int, tuple[NDArray[np.uint64], NDArray[np.int64], NDArray[np.int64]]
        ] = {}

    @staticmethod
    def rooms_of(seed: int, idx: NDArray[np.int64]) -> NDArray[np.uint64]:
        """Distinct rooms in 1..2**62: a bijection of the 62-bit request index."""
        m = np.uint64(_M62)
        with np.errstate(over="ignore"):
            x = (idx.astype(np.uint64) + np.uint64(seed * 0x632BE59BD9B4E019 & _M62)) & m
            for mul in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9):
                x = (x ^ (x >> np.uint64(29))) & m
                x = (x * np.uint64(mul | 1)) & m
            x = x ^ (x >> np.uint64(32))
        out: NDArray[np.uint64] = x + np.uint64(1)
        return out

    def _block(self, b: int) -> tuple[NDArray[np.uint64], NDArray[np.int64], NDArray[np.int64]]:
        got = self._blocks.get(b)
        if got is None:
            idx = np.arange(b * _BLOCK, (b + 1) * _BLOCK, dtype=np.int64)
            rng = np.random.default_rng([self.seed, 0xC0FFEE, b])
            pages = rng.integers(1, self.max_pages + 1, _BLOCK).astype(np.int64)
            arrival = idx // self.arrival_rate + 1
            aborted = rng.random(_BLOCK) < self.abort_prob
            abort_at = np.where(aborted, arrival + rng.integers(0, 4, _BLOCK), 0)
            got = (self.rooms_of(self.seed, idx), pages, abort_at)
            if len(self._blocks) >= 4:  # requests arrive in order: old blocks are done
                self._blocks.pop(min(self._blocks))
            self._blocks[b] = got
        return got

    def __getitem__(self, i: int) -> int:
        return int(self._block(i // _BLOCK)[0][i % _BLOCK])

    def arriving(self, step: int, start: int, room: int, upto: int | None = None) -> range:
        """Indices from ``start`` that have arrived by ``step``: at most ``room``
        of them, and none from ``upto`` on."""
        hi = min(step * self.arrival_rate, start + max(room, 0))
        cap = self.limit if upto is None else upto
        if cap is not None:
            hi = min(hi, cap)
        return range(start, max(start, hi))

    def request(self, i: int) -> tuple[int, int, int]:
        """(room, pages, abort step or 0) of request ``i``."""
        rooms, pages, abort_at = self._block(i // _BLOCK)
        k = i % _BLOCK
        return int(rooms[k]), int(pages[k]), int(abort_at[k])

    def all_rooms(self, n: int) -> list[int]:
        rooms: list[int] = self.rooms_of(self.seed, np.arange(n, dtype=np.int64)).tolist()
        return rooms


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
    """Success once this rank's peer can no longer write into a failed
    request's buffers (the backend's ``drained``), Transferring until then."""

    by_room = True  # drain rows carry no handle index

    def __init__(self, run: RankRun) -> None:
        self.run = run

    def poll_many(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.int8]:
        d = self.run.draining
        return np.array(
            [S if getattr(d[r][0], "drained", True) else T for r in rooms.tolist()], dtype=np.int8
        )

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


class RankRun:
    """Scheduler loops for one rank."""

    def __init__(
        self,
        cfg: SimConfig,
        rank: int,
        out: Path,
        coll: Collective,
        store: Any,
        store_addr: tuple[str, int] = ("127.0.0.1", 0),
    ) -> None:
        from transport.registry import get_backend

        self.cfg = cfg
        self.rank = rank
        self.side = "prefill" if rank < cfg.prefill else "decode"
        self.coll = coll
        self.store = store
        self.work = Workload(cfg)
        mode = self.mode = cfg.mode
        self.faults = RankFaults(
            cfg.plan, rank, self.work, mode, cfg.world, cfg.abort_prob, cfg.seed
        )
        paired = rank + cfg.prefill if rank < cfg.prefill else rank
        self.faults_for_decode = RankFaults(cfg.plan, paired, self.work)
        backend = get_backend(cfg.backend)
        self.meta = MetadataBuffers(cfg.metadata_slots, SIM_LAYOUT)
        self.side_rank = rank if self.side == "prefill" else rank - cfg.prefill
        # the KV pool: a few layers of pages; real bytes when the backend moves them
        self.kv = [
            torch.zeros((cfg.kv_pages, PAGE_BYTES), dtype=torch.uint8) for _ in range(KV_LAYERS)
        ]
        self.moves_bytes = cfg.backend != "fake"
        if self.moves_bytes:  # every byte-moving backend is a connector over one config
            from transport.connector import ConnectorConfig
            from transport.layout import kv_args_for

            if cfg.prefill != cfg.decode:
                raise ValueError(
                    f"the {cfg.backend} simulation pairs prefill and decode TP ranks 1:1"
                )
            self.manager = backend.manager(
                kv_args_for(self.kv, self.meta.buf_infos(), rank),
                ConnectorConfig(
                    role=self.side,
                    tp_rank=self.side_rank,
                    store_host=store_addr[0],
                    store_port=store_addr[1],
                    namespace=f"sim{cfg.seed}",
                    bootstrap_timeout=float(cfg.pg_timeout) * 4,
                    waiting_timeout=float(cfg.pg_timeout) * 4,
                ),
            )
        else:
            self.manager = backend.manager()
        self.alloc = SlotAllocator(cfg.metadata_slots, self.meta)
        self.step_no = 0
        if self.side == "prefill":
            self.q1 = _Queue("bootstrap", self, self.manager, self.faults)
            self.q2 = _Queue("inflight", self, self.manager, self.faults)
        else:
            self.q1 = _Queue("handshake", self, self.manager, self.faults)
            self.q2 = _Queue("transfer", self, self.manager, self.faults, self.meta)
            # draining is bookkeeping, not a transfer: no faults there
            self.q3 = _Queue("drain", self, DrainPoller(self), None)
        self.handles: dict[int, Any] = {}
        self.need: dict[int, int] = {}  # room -> pages, while live
        self.abort_due: dict[int, list[int]] = {}  # step -> rooms (step mode)
        self.admitted = 0
        self.soak_limit: int | None = None
        self.sent: dict[int, int] = {}
        self.pages_free: deque[int] = deque(range(cfg.kv_pages))
        self.draining: dict[int, tuple[Any, int | None, NDArray[np.int64] | None]] = {}
        self.pages_of: dict[int, NDArray[np.int64]] = {}
        self._slot: dict[int, int] = {}
        self.bytes_checked = 0
        self.ready: deque[int] = deque()
        self.finished = 0
        # every finished request's (room, status, reason, origin), streamed to disk
        # so that a soak's memory does not grow with the requests it has finished
        (out / "ranks").mkdir(parents=True, exist_ok=True)
        self._outcomes_path = out / "ranks" / f"rank{rank}.outcomes.jsonl"
        self._outcomes = self._outcomes_path.open("w")
        self.violations: list[str] = []
        self.disagreements = 0
        self.latency_us = _Reservoir(20_000)
        self.counts = _Reservoir(4_000)
        self.failure_steps = _Reservoir(2_000)
        self.rss = _Reservoir(2_000)
        self.drain_failed = 0
        self._start = self._last_rss = time.monotonic()
        self._decode_allowed = 0
        self.stuck_reports = 0
        self.trace = TraceWriter(out / "trace" / f"rank{rank}.jsonl", rank)
        self.metrics: Any = None
        if cfg.metrics_port is not None:
            from pdlife.metrics import LifecycleMetrics, serve

            self.metrics = LifecycleMetrics()
            serve(cfg.metrics_port + rank)

    def clock(self) -> float:
        # logical time (one unit per iteration) keeps fake runs reproducible;
        # a real transport runs on the wall clock, like its heartbeats
        return time.monotonic() if self.moves_bytes else float(self.step_no)

    # -- request lifecycle -------------------------------------------------------
    def _arrive(self) -> None:
        upto = self.soak_limit if self.cfg.soak else None
        if self.cfg.soak and upto is None:
            upto = self._soak_allowed()
        # handles are what the side holds live; every rank of a side agrees on them
        new = self.work.arriving(
            self.step_no, self.admitted, self.cfg.max_live - len(self.handles), upto
        )
        if not new:
            return
        role = Role.SENDER if self.side == "prefill" else Role.RECEIVER
        rooms = []
        for i in new:
            room, pages, abort_at = self.work.request(i)
            if self.side == "prefill":
                h = self.manager.sender(room)
            else:
                h = self.manager.receiver(room)
                h.init(prefill_dp_rank=0)
            self.handles[room] = h
            self.need[room] = pages
            if abort_at:
                self.abort_due.setdefault(abort_at, []).append(room)
            self.q1.table.add(room, role=role, handle=h, handle_index=h.index)
            rooms.append(room)
        self.admitted = new.stop
        # the client's aborts reach the decode side (and through the backend, prefill)
        self.faults.admit(rooms, aborts_here=self.side == "decode")

    def _soak_allowed(self) -> int:
        """How many requests this side may have admitted by now in a soak: prefill
        admits on schedule; decode only what prefill has (agreed in the digest)."""
        if self.side == "prefill":
            return self.step_no * self.work.arrival_rate
        return self._decode_allowed

    def client_abort(self, room: int) -> None:
        h = self.handles.get(room)
        if h is None:
            return
        h.abort()
        for q in (self.q1, self.q2):
            if room in q.table:
                q.table.request_abort(room)

    def _client_aborts(self) -> None:
        for room in self.abort_due.pop(self.step_no, ()):
            self.client_abort(room)

    def _finish(self, room: int, status: int, reason: int, origin: int) -> None:
        self._outcomes.write(f'[{room},"{KVPoll(status).name}",{reason},{origin}]\n')
        self.finished += 1
        self.faults.forget(room)
        self.need.pop(room, None)
        h = self.handles.pop(room)
        slot = self._slot.pop(room, None)
        pages = self.pages_of.pop(room, None)
        if status == S or self.side == "prefill":
            # success: every write has landed. prefill: its buffers are only read from
            if status != S:
                getattr(h, "fail", lambda _r: None)(FailureReason(reason))
            self._release(room, h, slot, pages, quarantined=False)
            return
        # decode failure: the peer may still be writing into our pages and row.
        # Tell it to stop and keep both out of reuse until it has drained.
        getattr(h, "fail", lambda _r: None)(FailureReason(reason))
        if slot is not None:
            self.alloc.free(slot, room, quarantine=True)
        self.draining[room] = (h, slot, pages)
        # when to reuse them is decided together: a rank-local release would let
        # the ranks' allocators, and so their queues, diverge
        self.q3.table.add(room, role=Role.RECEIVER, state=T)

    def _release(
        self,
        room: int,
        h: Any,
        slot: int | None,
        pages: NDArray[np.int64] | None,
        quarantined: bool,
    ) -> None:
        if slot is not None:
            if quarantined:
                self.alloc.release(slot)
            else:
                self.alloc.free(slot, room)  # zeroes the room row
        if pages is not None:
            self.pages_free.extend(pages.tolist())
        h.clear()

    def _drain(self) -> StepResult:
        """Release quarantined buffers once every rank's peer has stopped writing.

        An entry the ranks agreed Failed (its drain poll raised, or it sat past
        a deadline) is released as well: the backend's own drain deadline has
        bounded the peer's writes by then, and keeping it would pin its slot
        and pages for the rest of the run.
        """
        res = self._step_queue(self.q3)
        for room in res.succeeded.tolist():
            h, slot, pages = self.draining.pop(room)
            self.q3.table.remove(room)
            self._release(room, h, slot, pages, quarantined=True)
        for room in res.failed.tolist():
            h, slot, pages = self.draining.pop(room)
            self.q3.table.remove(room)
            self.drain_failed += 1
            self.trace.event(kind="drain_failed", step=self.step_no, room=room)
            self._release(room, h, slot, pages, quarantined=True)
        return res

    def _step_queue(self, q: _Queue) -> StepResult:
        q.poller.step = self.step_no
        q.gate.step = self.step_no
        t0 = time.perf_counter()
        res = q.stepper.step(self.coll)
        self.latency_us.add((time.perf_counter() - t0) * 1e6)
        _, local, reason = q.stepper.last_local
        self.trace.step(self.side, q.name, res, local, reason)
        if self.metrics is not None:
            self.metrics.observe(f"{self.side}/{q.name}", res)
        if res.stuck:
            self.stuck_reports += len(res.stuck)
            for s in res.stuck:
                self.trace.event(
                    kind="stuck",
                    step=self.step_no,
                    room=s.room,
                    status=s.status.name,
                    holders=list(s.holders),
                )
        if res.failed.size:
            self.failure_steps.add(self.step_no)
        return res

    def _take_pages(self, need: int) -> NDArray[np.int64]:
        return np.array([self.pages_free.popleft() for _ in range(need)], dtype=np.int64)

    def _prefill_iteration(self) -> list[StepResult]:
        r1 = self._step_queue(self.q1)
        for room, st, reason, origin in zip(
            r1.rooms.tolist(), r1.statuses.tolist(), r1.reasons.tolist(), r1.origins.tolist()
        ):
            if st == W:
                need = self.need[room]
                if need > len(self.pages_free):
                    continue  # wait for KV pages
                slot = self.alloc.alloc(room)
                if slot is None:
                    continue  # wait for a metadata slot
                self._slot[room] = slot
                pages = self._take_pages(need)
                self.pages_of[room] = pages
                if self.moves_bytes:
                    self._fill_pages(room, pages)
                    self._write_first_token(room, slot)
                h = self.handles[room]
                h.init(need, slot)
                self.sent[room] = 0
                self.q1.table.remove(room)
                self.q2.table.add(room, state=W, handle=h, handle_index=h.index)
            elif st == F:
                self.q1.table.remove(room)
                self._finish(room, st, reason, origin)
            elif st in (T, S):
                self.violations.append(
                    f"step {self.step_no}: room {room} {KVPoll(st).name} in bootstrap queue"
                )
        # the forward pass: send the next chunk of every in-flight request
        for room in self.q2.table.rooms().tolist():
            total = self.need[room]
            k = min(self.cfg.chunk_pages, total - self.sent[room])
            if k > 0:
                chunk = self.pages_of[room][self.sent[room] : self.sent[room] + k]
                self.handles[room].send(chunk)
                self.sent[room] += k
        r2 = self._step_queue(self.q2)
        for room, st, reason, origin in zip(
            r2.rooms.tolist(), r2.statuses.tolist(), r2.reasons.tolist(), r2.origins.tolist()
        ):
            if st in (S, F):
                self.q2.table.remove(room)
                self.sent.pop(room, None)
                self._finish(room, st, reason, origin)
            elif st == B:
                self.violations.append(f"step {self.step_no}: room {room} Bootstrapping in flight")
        return [r1, r2]

    def _decode_iteration(self) -> list[StepResult]:
        r1 = self._step_queue(self.q1)
        for room, st, reason, origin in zip(
            r1.rooms.tolist(), r1.statuses.tolist(), r1.reasons.tolist(), r1.origins.tolist()
        ):
            if st == F:
                self.q1.table.remove(room)
                if room in self.ready:
                    self.ready.remove(room)
                self._finish(room, st, reason, origin)
            elif st == W and room not in self.ready:
                self.ready.append(room)
            elif st in (T, S):
                self.violations.append(
                    f"step {self.step_no}: room {room} {KVPoll(st).name} in handshake"
                )
        # allocation: in order, head-of-line blocking on slot or KV pages
        while self.ready:
            room = self.ready[0]
            need = self.need[room]
            if need > len(self.pages_free) or self.alloc.available == 0:
                break
            slot = self.alloc.alloc(room)
            assert slot is not None
            self.ready.popleft()
            self._slot[room] = slot
            pages = self._take_pages(need)
            self.pages_of[room] = pages
            h = self.handles[room]
            h.send_metadata(pages, slot)
            if not self.moves_bytes:
                self._simulate_remote_write(room, slot)
            self.q1.table.remove(room)
            self.q2.table.add(
                room,
                role=Role.RECEIVER,
                state=W,
                handle=h,
                handle_index=h.index,
                metadata_slot=slot,
            )
            self.q2.table.mark_metadata_sent(room, self.clock())
        r2 = self._step_queue(self.q2)
        for room, st, reason, origin in zip(
            r2.rooms.tolist(), r2.statuses.tolist(), r2.reasons.tolist(), r2.origins.tolist()
        ):
            if st == S:
                slot = self._slot[room]
                got = self.meta.room_of(slot)
                if got != room:
                    self.violations.append(
                        f"step {self.step_no}: room {room} committed with metadata row room {got}"
                    )
                elif self.meta.read(slot).first_token != room % 50000:
                    self.violations.append(f"step {self.step_no}: room {room} first token corrupt")
                if self.moves_bytes:
                    self._verify_pages(room)
                self.q2.table.remove(room)
                self._finish(room, st, reason, origin)
            elif st == F:
                self.q2.table.remove(room)
                self._finish(room, st, reason, origin)
        return [r1, r2]

    def _pattern(self, room: int, n: int, layer: int, tp: int) -> NDArray[np.uint8]:
        """What prefill TP rank ``tp`` writes into page ``j`` of ``room`` (deterministic)."""
        seed = np.uint64((room * 1_000_003 + layer * 7919 + tp * 104729) & 0xFFFFFFFFFFFFFFFF)
        words = PAGE_BYTES // 8
        grid = np.arange(n * words, dtype=np.uint64).reshape(n, words)
        with np.errstate(over="ignore"):
            vals = (grid + seed) * np.uint64(0x9E3779B97F4A7C15)
        out: NDArray[np.uint8] = vals.view(np.uint8).reshape(n, PAGE_BYTES)
        return out

    def _fill_pages(self, room: int, pages: NDArray[np.int64]) -> None:
        for layer, t in enumerate(self.kv):
            t.numpy()[pages] = self._pattern(room, pages.size, layer, self.side_rank)

    def _write_first_token(self, room: int, slot: int) -> None:
        """The prefill's metadata row (sent to decode): the plan may drop or corrupt it."""
        fault = self.faults_for_decode.metadata_fault(room)
        if fault == "drop_metadata":
            self.meta.clear_room(slot)
            self.meta.tensors["output_ids"][slot, 0] = room % 50000
            return
        owner = room if fault is None else (room ^ 0x5A5A5A5A) or 1
        self.meta.write(slot, owner, {"output_ids": [room % 50000]})

    def _verify_pages(self, room: int) -> None:
        pages = self.pages_of[room]
        for layer, t in enumerate(self.kv):
            got = t.numpy()[pages]
            want = self._pattern(room, pages.size, layer, self.side_rank)
            if not np.array_equal(got, want):
                bad = int(np.flatnonzero((got != want).any(axis=1))[0])
                self.violations.append(
                    f"step {self.step_no}: room {room} layer {layer} page {bad}: "
                    "decode bytes differ from what prefill wrote"
                )
                return
            self.bytes_checked += got.nbytes

    def _simulate_remote_write(self, room: int, slot: int) -> None:
        """What prefill's metadata write would land (the fake backend moves no bytes)."""
        fault = self.faults.metadata_fault(room)
        if fault == "drop_metadata":
            return
        owner = room if fault is None else (room ^ 0x5A5A5A5A) or 1
        self.meta.write(slot, owner, {"output_ids": [room % 50000]})

    # -- the loop ----------------------------------------------------------------
    def _agree_digest(self, results: list[StepResult], done: bool) -> bool:
        """Check the side's ranks agree, and decide together whether to stop
        (a rank-local decision to leave the loop would hang the others). In a
        soak the side's first rank also speaks for the side: prefill's says
        when time is up, decode's how many requests prefill has admitted."""
        parts = [r.rooms for r in results] + [r.statuses.astype(np.uint64) for r in results]
        h = fingerprint(np.concatenate(parts).astype(np.uint64)) & (2**62 - 1) if parts else 0
        extra = self._soak_words() if self.cfg.soak else (0, 0)
        mine = np.array([h >> 31, h & 0x7FFFFFFF, int(done), *extra], dtype=np.int32)
        got = self.coll.all_gather(mine)
        if not (got[:, :2] == got[0, :2]).all():
            self.disagreements += 1
        if self.cfg.soak:
            self._soak_agreed(int(got[0, 3]), int(got[0, 4]))
        return bool(got[:, 2].all())

    def _soak_words(self) -> tuple[int, int]:
        leader = self.rank in (0, self.cfg.prefill)
        if self.side == "prefill":
            up = time.monotonic() - self._start >= (self.cfg.soak or 0.0)
            return int(up and leader), 0
        if not leader:
            return 0, -1

        def get(key: str, default: int) -> int:
            try:
                return int(self.store.get(key).decode()) if self.store.check([key]) else default
            except Exception:
                return default

        return get("soak/admitted", 0), get("soak/limit", -1)

    def _soak_agreed(self, a: int, b: int) -> None:
        if self.side == "prefill":
            if self.soak_limit is None and a:
                self.soak_limit = self.admitted
                if self.rank == 0:
                    self.store.set("soak/limit", str(self.soak_limit))
            if self.rank == 0:
                self.store.set("soak/admitted", str(self.admitted))
        else:
            self._decode_allowed = a
            if b >= 0 and self.admitted >= b:
                self.soak_limit = b

    def _sample_rss(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_rss >= self.cfg.rss_every:
            self._last_rss = now
            # the Python heap beside the RSS: growth in one but not the other is native
            blocks = sys.getallocatedblocks()
            self.rss.add((round(now - self._start, 2), self.finished, round(rss_mb(), 2), blocks))

    def run(self) -> dict[str, Any]:
        self._start = self._last_rss = time.monotonic()
        self._sample_rss(force=True)
        error = None
        all_done = False
        try:
            while self.step_no < self.cfg.max_steps:
                self.step_no += 1
                if self.faults.kill_at(self.step_no):
                    self.trace.event(kind="killed", step=self.step_no)
                    self.trace.close()
                    os._exit(17)
                self.store.set(f"hb/{self.rank}", str(self.step_no))
                self._arrive()
                self._client_aborts()
                results = (
                    self._prefill_iteration()
                    if self.side == "prefill"
                    else self._decode_iteration()
                )
                if self.side == "decode":
                    results.append(self._drain())
                n = self.work.limit if not self.cfg.soak else self.soak_limit
                done = (
                    n is not None
                    and self.admitted >= n
                    and self.finished == n
                    and not self.draining
                )
                all_done = self._agree_digest(results, done)
                states = np.concatenate([self.q1.table.states(), self.q2.table.states()])
                self.counts.add([*np.bincount(states, minlength=5).tolist(), self.finished])
                self._check_slots()
                self._sample_rss()
                if self.rank in (0, self.cfg.prefill) and self.step_no % 10 == 0:
                    self.store.set(f"progress/{self.side}", str(self.finished))
                if all_done:
                    if self.rank in (0, self.cfg.prefill):
                        self.store.set(f"progress/{self.side}", str(self.finished))
                    break
        except RankFailure as e:
            error = self._who_died(e)
        except LifecycleError as e:
            self.violations.append(f"step {self.step_no}: {type(e).__name__}: {e}")
        self._sample_rss(force=True)
        self.trace.close()
        self._outcomes.close()
        outcome: dict[str, list[Any]] = {}
        with self._outcomes_path.open() as f:
            for line in f:
                room, *rest = json.loads(line)
                outcome[str(room)] = rest
        backend_error = getattr(self.manager, "last_error", None)
        close = getattr(self.manager, "close", None)
        if close is not None:
            close()
        requests = self.work.limit if not self.cfg.soak else self.soak_limit
        unfinished = (requests if requests is not None else self.admitted) - self.finished
        problems: list[str] = []
        if error is None and not all_done and not self.violations:
            problems.append(
                f"rank {self.rank} ({self.side}) stopped at --max-steps {self.cfg.max_steps} "
                f"with {unfinished} request(s) unfinished: raise --max-steps, or look at the "
                "stuck reports in the trace"
            )
        if self.draining:
            problems.append(
                f"rank {self.rank} ({self.side}): the buffers of {len(self.draining)} failed "
                "request(s) are still pinned (the peer never confirmed it stopped writing), "
                f"e.g. room {next(iter(self.draining))}"
            )
        if self.moves_bytes:
            meta = ("drop_metadata", "corrupt_metadata")
            others = tuple(k for k in KINDS if k not in meta)
            unfired = self.faults.unfired(others if self.side == "decode" else None)
            if self.side == "prefill":
                unfired += self.faults_for_decode.unfired(meta)
        else:
            unfired = self.faults.unfired()
        return {
            "rank": self.rank,
            "side": self.side,
            "steps": self.step_no,
            "requests": requests,
            "outcome": outcome,
            "unfinished": unfinished,
            "violations": self.violations,
            "problems": problems,
            "unfired_faults": unfired if error is None else [],
            "disagreements": self.disagreements,
            "leaked_slots": self.alloc.in_use + self.alloc.quarantined,
            "leaked_kv_pages": self.cfg.kv_pages - len(self.pages_free),
            "drain_failed": self.drain_failed,
            "bytes_checked": self.bytes_checked,
            "latency_us": self.latency_us.items,
            "counts": self.counts.items,
            "counts_stride": self.counts.stride,
            "failure_steps": self.failure_steps.items,
            "stuck_reports": self.stuck_reports,
            "faults_fired": sum(1 for _, kind, _ in self.faults.fired if kind != "abort"),
            "fault_mode": self.mode,
            "decisions": [[d.room, d.rank, d.phase, d.kind, d.wins] for d in self.faults.decisions],
            "fired": [[st, kind, room] for st, kind, room in self.faults.fired],
            "rss_mb": self.rss.items,
            # an exception the backend's own thread caught (it fails that rank's live requests)
            "backend_error": None if backend_error is None else repr(backend_error)[:300],
            "error": error,
        }

    def _check_slots(self) -> None:
        a = self.alloc
        if a.in_use + a.available + a.quarantined != a.size:
            self.violations.append(f"step {self.step_no}: slot accounting broken")
        if len(self._slot) != a.in_use:
            self.violations.append(
                f"step {self.step_no}: {a.in_use} slots in use but {len(self._slot)} requests hold one"
            )

    def _who_died(self, e: RankFailure) -> str:
        """Name the ranks of this side whose heartbeat stopped (read twice, a beat apart)."""
        cfg = self.cfg
        side = range(cfg.prefill) if self.side == "prefill" else range(cfg.prefill, cfg.world)

        def beats() -> dict[int, int]:
            out = {}
            for r in side:
                try:
                    out[r] = int(self.store.get(f"hb/{r}").decode())
                except Exception:
                    out[r] = -1
            return out

        first = beats()
        time.sleep(1.0)
        second = beats()
        dead = sorted(
            r for r in side if r != self.rank and second[r] == first[r] and second[r] < self.step_no
        )
        cause = str(e.__cause__ or e).splitlines()[0][:160]
        return (
            f"rank {self.rank} ({self.side}) at step {self.step_no}: the collective failed; "
            f"dead rank(s) {dead or 'unknown'} (last heartbeat step per rank {second}); "
            f"gloo said: {cause}"
        )


def run_rank(
    cfg: SimConfig,
    rank: int,
    out: Path,
    store: Any,
    groups: dict[str, Any],
    store_addr: tuple[str, int] = ("127.0.0.1", 0),
) -> dict[str, Any]:
    side = "prefill" if rank < cfg.prefill else "decode"
    run = RankRun(cfg, rank, out, TorchCollective(groups[side]), store, store_addr)
    result = run.run()
    (out / "ranks").mkdir(parents=True, exist_ok=True)
    (out / "ranks" / f"rank{rank}.json").write_text(json.dumps(result))
    return result
