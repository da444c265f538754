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
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from buffers import MetadataBuffers, SlotAllocator
from lifecycle.collective import Collective, TorchCollective
from lifecycle.errors import LifecycleError, RankFailure
from lifecycle.packing import fingerprint
from lifecycle.status import T as T  # the tests' pollers answer with sim.T
from lifecycle.step import StepResult
from pdlife.pause import pause_process
from pdlife.sim_backend import connector_config, kv_args
from pdlife.sim_bytes import STATE_ROW_BYTES
from pdlife.sim_config import KV_LAYERS, SIM_LAYOUT, SimConfig, Workload
from pdlife.sim_faults import rank_faults
from pdlife.sim_hooks import (
    DrainPoller,
    _Queue,
    _Reservoir,
)
from pdlife.sim_loops import decode_iteration, prefill_iteration
from pdlife.sim_peer import hear
from pdlife.sim_report import report
from pdlife.sim_requests import arrive, client_aborts, drain
from pdlife.sim_soak import check_slots, sample_rss, soak_agreed, soak_words, who_died
from pdlife.sim_topology import HEAD_BYTES, heads_of, place
from pdlife.trace import TraceWriter

__all__ = ["SimConfig", "Workload", "RankRun", "SIM_LAYOUT", "run_rank", "connector_config"]

#: a step's pause when, on a real transport, no request moved on this rank (a
#: scheduler with nothing to run waits too): --max-steps is then worth at least
#: max_steps x IDLE_S of waiting on a peer (30 s at the default 3000), past
#: every wall-clock deadline of a run (bootstrap 20 s, waiting 10 s, drain 3 s),
#: so a request a peer never answers fails by its deadline instead of the run
#: ending at --max-steps
IDLE_S = 0.01


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
        self.place = place(rank, cfg.prefill, cfg.prefill_dp, cfg.decode)
        self.side = self.place.side
        self.side_rank = self.place.tp_rank
        self.coll = coll
        self.store = store
        self.work = Workload(cfg)
        self.mode = cfg.mode
        self.faults, self.faults_for_decode = rank_faults(cfg, rank, self.place, self.work)
        backend = get_backend(cfg.backend)
        self.meta = MetadataBuffers(cfg.metadata_slots, SIM_LAYOUT)
        #: the global KV heads this rank holds (MLA: the one latent head, everywhere)
        self.heads = (
            range(1) if cfg.mla else heads_of(self.place.tp_size, self.side_rank, cfg.total_heads)
        )
        # the KV pool: a few layers of pages; real bytes when the backend moves them
        self.kv = [
            torch.zeros(
                (cfg.kv_pages, cfg.page_size, len(self.heads), HEAD_BYTES), dtype=torch.uint8
            )
            for _ in range(KV_LAYERS)
        ]
        # a mamba-like state component: one row per request, held whole on every
        # rank, or (--state-split) this rank's share of each row
        self.state_share = (self.side_rank, self.place.tp_size) if cfg.state_split else (0, 1)
        self.state_tensors = (
            [
                torch.zeros((cfg.metadata_slots, n // self.state_share[1]), dtype=torch.uint8)
                for n in STATE_ROW_BYTES
            ]
            if cfg.state
            else []
        )
        self.state_row_of: dict[int, int] = {}
        self.moves_bytes = cfg.backend != "fake"
        if self.moves_bytes:  # every byte-moving backend is a connector over one config
            self.manager = backend.manager(
                kv_args(self), connector_config(cfg, self.place, store_addr)
            )
        else:
            self.manager = backend.manager()
        self.alloc = SlotAllocator(cfg.metadata_slots, self.meta)
        self.step_no = 0
        self.draining: dict[int, tuple[Any, int | None, NDArray[np.int64] | None]] = {}
        self.drain_poller = DrainPoller(self.draining)
        if self.side == "prefill":
            self.q1 = _Queue("bootstrap", self, self.manager, self.faults)
            self.q2 = _Queue("inflight", self, self.manager, self.faults)
        else:
            self.q1 = _Queue("handshake", self, self.manager, self.faults)
            staging = self.manager if cfg.staging and self.moves_bytes else None
            self.q2 = _Queue("transfer", self, self.manager, self.faults, self.meta, staging)
            # draining is bookkeeping, not a transfer: no faults there
            self.q3 = _Queue("drain", self, self.drain_poller, None)
        self.handles: dict[int, Any] = {}
        # the fake backend's word between the sides (pdlife.sim_peer)
        self.peer_told: dict[int, int] = {}  # room -> reason the other side gave
        self.peer_early: dict[int, int] = {}  # the same, for rooms not admitted yet
        self.peer_group: dict[int, int] = {}  # decode: room -> its prefill DP group
        self.need: dict[int, int] = {}  # room -> pages, while live
        self.abort_due: dict[int, list[int]] = {}  # step -> rooms (step mode)
        self.admitted = 0
        self.soak_limit: int | None = None
        self.sent: dict[int, int] = {}
        self.pages_free: deque[int] = deque(range(cfg.kv_pages))
        self.pages_of: dict[int, NDArray[np.int64]] = {}
        self._slot: dict[int, int] = {}
        self.bytes_checked = 0
        # decode: bytes asked of prefill (uncached pages of this rank's heads, the
        # state and metadata rows), in all and for the requests that succeeded, to
        # hold prefill's bytes_written against
        self.bytes_asked = self.bytes_due = 0
        self.row_bytes = sum(self.meta.buf_infos()[2]) + sum(
            t[0].nbytes for t in self.state_tensors
        )
        self.due_of: dict[int, int] = {}
        self.staged = 0  # decode: requests whose KV landed via the staging buffer
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
            base = cfg.metrics_port
            bound = serve(base + rank if base else 0)
            (out / "ranks" / f"rank{rank}.metrics_port").write_text(f"{bound}\n")

    def state_row(self, slot: int) -> int:
        """The state row a request holding metadata ``slot`` uses: the slot on
        prefill, mirrored on decode, so that a transfer that confused state rows
        with metadata slots lands in the wrong row."""
        return slot if self.side == "prefill" else self.cfg.metadata_slots - 1 - slot

    def serves(self) -> int | None:
        """How many requests this rank sees in all (None: a soak not yet ended):
        every one on decode, its DP group's share on prefill."""
        n = self.work.limit if not self.cfg.soak else self.soak_limit
        if n is None or self.side == "decode":
            return n
        return len(range(self.place.dp_rank, n, self.cfg.prefill_dp))

    def clock(self) -> float:
        # logical time (one unit per iteration) keeps fake runs reproducible;
        # a real transport runs on the wall clock, like its heartbeats
        return time.monotonic() if self.moves_bytes else float(self.step_no)

    # -- request lifecycle -------------------------------------------------------
    def client_abort(self, room: int) -> None:
        h = self.handles.get(room)
        if h is None:
            return
        h.abort()
        for q in (self.q1, self.q2):
            if room in q.table:
                q.table.request_abort(room)

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
            wire = getattr(self.manager, "describe", None)  # the transport's view
            for s in res.stuck:
                self.trace.event(
                    kind="stuck",
                    step=self.step_no,
                    room=s.room,
                    status=s.status.name,
                    holders=list(s.holders),
                    **({"wire": wire(s.room)} if wire is not None else {}),
                )
        if res.failed.size:
            self.failure_steps.add(self.step_no)
        return res

    # -- the loop ----------------------------------------------------------------
    def _agree_digest(self, results: list[StepResult], done: bool) -> bool:
        """Check the side's ranks agree, and decide together whether to stop
        (a rank-local decision to leave the loop would hang the others). In a
        soak the side's first rank also speaks for the side: prefill's says
        when time is up, decode's how many requests prefill has admitted."""
        parts = [r.rooms for r in results] + [r.statuses.astype(np.uint64) for r in results]
        h = fingerprint(np.concatenate(parts).astype(np.uint64)) & (2**62 - 1) if parts else 0
        extra = soak_words(self) if self.cfg.soak else (0, 0)
        mine = np.array([h >> 31, h & 0x7FFFFFFF, int(done), *extra], dtype=np.int32)
        got = self.coll.all_gather(mine)
        if not (got[:, :2] == got[0, :2]).all():
            self.disagreements += 1
        if self.cfg.soak:
            soak_agreed(self, int(got[0, 3]), int(got[0, 4]))
        return bool(got[:, 2].all())

    def run(self) -> dict[str, Any]:
        self._start = self._last_rss = time.monotonic()
        sample_rss(self, force=True)
        error = None
        all_done = False
        try:
            while self.step_no < self.cfg.max_steps:
                self.step_no += 1
                if self.faults.kill_at(self.step_no):
                    self.trace.event(kind="killed", step=self.step_no)
                    self.trace.close()
                    os._exit(17)
                paused = self.faults.pause_at(self.step_no)
                if paused:
                    self.trace.event(kind="paused", step=self.step_no, seconds=paused)
                    pause_process(paused)
                self.store.set(f"hb/{self.rank}", str(self.step_no))
                arrive(self)
                client_aborts(self)
                hear(self)
                results = (
                    prefill_iteration(self) if self.side == "prefill" else decode_iteration(self)
                )
                if self.side == "decode":
                    results.append(drain(self))
                total = self.work.limit if not self.cfg.soak else self.soak_limit
                done = (
                    total is not None
                    and self.admitted >= total
                    and self.finished == self.serves()
                    and self.drain_poller.settled.issuperset(self.draining)
                )
                all_done = self._agree_digest(results, done)
                if not all_done and self.moves_bytes and not any(r.changed.size for r in results):
                    time.sleep(IDLE_S)  # (the side's ranks agree on it: they sleep alike)
                states = np.concatenate([self.q1.table.states(), self.q2.table.states()])
                self.counts.add([*np.bincount(states, minlength=5).tolist(), self.finished])
                check_slots(self)
                sample_rss(self)
                if self.rank in (0, self.cfg.prefill_ranks) and self.step_no % 10 == 0:
                    self.store.set(f"progress/{self.side}", str(self.finished))
                if all_done:
                    if self.rank in (0, self.cfg.prefill_ranks):
                        self.store.set(f"progress/{self.side}", str(self.finished))
                    break
        except RankFailure as e:
            error = who_died(self, e)
        except LifecycleError as e:
            self.violations.append(f"step {self.step_no}: {type(e).__name__}: {e}")
        return report(self, error, all_done)


def run_rank(
    cfg: SimConfig,
    rank: int,
    out: Path,
    store: Any,
    groups: dict[str, Any],
    store_addr: tuple[str, int] = ("127.0.0.1", 0),
) -> dict[str, Any]:
    side = place(rank, cfg.prefill, cfg.prefill_dp, cfg.decode).side
    run = RankRun(cfg, rank, out, TorchCollective(groups[side]), store, store_addr)
    result = run.run()
    (out / "ranks").mkdir(parents=True, exist_ok=True)
    (out / "ranks" / f"rank{rank}.json").write_text(json.dumps(result))
    return result
