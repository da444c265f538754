"""One rank of the simulated PD cluster: its parts composed (buffers, ledger,
queues, requests, soak, stats, the side's scheduler loop of SPEC §3) and
stepped, one consensus step after another, until the side agrees to stop.

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
from pathlib import Path
from typing import Any

import numpy as np

from buffers import SlotAllocator
from lifecycle.core.fingerprint import fingerprint
from lifecycle.drive.collective import Collective, TorchCollective
from lifecycle.errors import LifecycleError, RankFailure
from lifecycle.result import StepResult
from lifecycle.status import KVPoll
from pdlife.cluster.config import SimConfig, Workload
from pdlife.cluster.faults import rank_faults
from pdlife.cluster.topology import place
from pdlife.pause import pause_process
from pdlife.sim.backend import connector_config, kv_args
from pdlife.sim.hooks import DrainPoller, Queues, QueueSteps, StepClock
from pdlife.sim.kv_bytes import RankBytes
from pdlife.sim.ledger import Ledger
from pdlife.sim.loops import DecodeLoop, LoopParts, PrefillLoop
from pdlife.sim.peer import PeerWord, Router
from pdlife.sim.report import (
    close_backend,
    fault_report,
    numbers,
    peer_health,
    pinned_problem,
    standing,
    stopped_problem,
    who_died,
    write_spans,
)
from pdlife.sim.requests import Requests
from pdlife.sim.soak import Soak
from pdlife.sim.stats import RankStats
from pdlife.trace import TraceWriter

__all__ = ["RankRun", "run_rank"]

#: a step's pause when, on a real transport, no request moved on this rank (a
#: scheduler with nothing to run waits too): --max-steps is then worth at least
#: max_steps x IDLE_S of waiting on a peer (30 s at the default 3000), past
#: every wall-clock deadline of a run (bootstrap 20 s, waiting 10 s, drain 3 s),
#: so a request a peer never answers fails by its deadline instead of the run
#: ending at --max-steps
IDLE_S = 0.01


class RankRun:
    """One rank's scheduler: its parts, composed, and the loop that steps them."""

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
        self.rank, self.out = rank, out
        self.place = place(rank, cfg.prefill, cfg.prefill_dp, cfg.decode)
        self.side = self.place.side
        self.coll = coll
        self.store = store
        self.work = Workload(cfg)
        self.mode = cfg.mode
        self.faults, self.faults_for_decode = rank_faults(cfg, rank, self.place, self.work)
        backend = get_backend(cfg.backend)
        self.moves_bytes = cfg.backend != "fake"
        self.clock = StepClock(wall=self.moves_bytes)
        # the KV pool, state and metadata rows: real bytes when the backend moves them
        self.buffers = RankBytes(cfg, self.place, self.moves_bytes)
        self.meta = self.buffers.meta
        if self.moves_bytes:  # every byte-moving backend is a connector over one config
            self.manager = backend.manager(
                kv_args(self.buffers, rank), connector_config(cfg, self.place, store_addr)
            )
        else:
            self.manager = backend.manager()
        self.ledger = Ledger(cfg.kv_pages, SlotAllocator(cfg.metadata_slots, self.meta))
        self.drain_poller = DrainPoller(self.ledger.draining)
        staging = self.manager if cfg.staging and self.moves_bytes else None
        self.queues = Queues(
            cfg,
            rank,
            self.side,
            self.manager,
            self.faults,
            self.clock,
            self.ledger.handles,
            self.meta,
            self.drain_poller,
            staging,
        )
        # the fake backend's word between the sides (pdlife.sim.peer)
        self.peer = PeerWord(cfg, rank, self.place, store, silent=self.moves_bytes)
        self.router = Router(store, self.side, on=cfg.recovery == "retry")
        self.soak = (
            Soak(cfg.soak, rank, self.place, store, self.work.arrival_rate) if cfg.soak else None
        )
        (out / "ranks").mkdir(parents=True, exist_ok=True)
        self.requests = Requests(
            cfg,
            self.place,
            self.work,
            self.faults,
            self.manager,
            self.ledger,
            self.queues,
            self.peer,
            out / "ranks" / f"rank{rank}.outcomes.jsonl",
            self.router,
            self.clock,
        )
        self.stats = RankStats(cfg.rss_every)
        #: the run's id, the same on every rank: its spans' trace ids derive from it
        self.run_id = shared_run_id(store)
        self.trace = TraceWriter(out / "trace" / f"rank{rank}.jsonl", rank, self.run_id)
        self.metrics: Any = None
        if cfg.metrics_port is not None:
            from pdlife.metrics import LifecycleMetrics, serve

            self.metrics = LifecycleMetrics(run=self.run_id)
            base = cfg.metrics_port
            bound = serve(base + rank if base else 0)
            (out / "ranks" / f"rank{rank}.metrics_port").write_text(f"{bound}\n")
        steps = QueueSteps(
            coll, self.side, self.clock, self.manager, self.stats, self.trace, self.metrics
        )
        self.live: Any = None
        if cfg.live_spans:
            from pdlife.spans import Selection
            from pdlife.spans.build import DRAIN_QUEUES
            from pdlife.spans.live import LiveSpans

            every = Selection("every")
            self.live = steps.live = LiveSpans(
                self.side, rank, self.run_id, selection=every, drains=DRAIN_QUEUES
            )
        parts = LoopParts(
            cfg,
            self.clock,
            steps,
            self.queues,
            self.ledger,
            self.buffers,
            self.requests,
            self.stats,
        )
        self.loop: PrefillLoop | DecodeLoop = (
            PrefillLoop(parts, self.faults_for_decode)
            if self.side == "prefill"
            else DecodeLoop(parts, rank, self.faults, self.drain_poller, self.trace, self.metrics)
        )

    @property
    def leads(self) -> bool:
        """Whether this is its side's first rank (it speaks for the side)."""
        return self.rank in (0, self.cfg.prefill_ranks)

    def total(self) -> int | None:
        """The requests of the whole run (None: a soak not yet ended)."""
        return self.work.limit if self.soak is None else self.soak.limit

    # -- the loop ----------------------------------------------------------------
    def _legs_and_pages(self) -> None:
        """What the step does not see: the legs that ended since the last
        iteration, by peer (into the trace, and the metrics), and the side's
        requests and KV pages by what pins them (the metrics)."""
        legs = getattr(self.manager, "peer_legs", None)
        ended = legs.take() if legs is not None else []
        for e in ended:
            seconds = None if e.seconds is None else round(e.seconds, 6)
            self.trace.event(kind="leg", step=self.clock.step, room=e.room, peer=e.peer,
                             outcome=e.outcome, seconds=seconds)  # fmt: skip
        if self.metrics is not None:
            settled = self.drain_poller.settled
            self.metrics.observe_pages(self.side, self.ledger.page_states(settled))
            live = np.concatenate([q.table.states() for q in (self.queues.q1, self.queues.q2)])
            counts = np.bincount(live.astype(np.intp), minlength=len(KVPoll))
            by_state = {s.name: int(counts[s]) for s in KVPoll if s is not KVPoll.Failed}
            self.metrics.observe_requests(
                self.side, by_state | self.ledger.draining_states(settled)
            )
            self.metrics.observe_peer_legs(self.side, ended)

    def _agree_digest(self, results: list[StepResult], done: bool) -> bool:
        """Check the side's ranks agree, and decide together whether to stop
        (a rank-local decision to leave the loop would hang the others). In a
        soak the side's first rank also speaks for the side: prefill's says
        when time is up, decode's how many requests prefill has admitted."""
        parts = [r.rooms for r in results] + [r.statuses.astype(np.uint64) for r in results]
        h = fingerprint(np.concatenate(parts).astype(np.uint64)) & (2**62 - 1) if parts else 0
        extra = (0, 0) if self.soak is None else self.soak.words(self.stats.elapsed())
        # the router's words: each prefill DP group's first rank reads them for its
        # group (the collective is the group's: its first rank is got[0])
        routed = self.router.words(self.place.tp_rank == 0)
        mine = np.array([h >> 31, h & 0x7FFFFFFF, int(done), *extra, *routed], dtype=np.int32)
        got = self.coll.all_gather(mine)
        self.router.agree(int(got[0, 5]), int(got[0, 6]))
        if not (got[:, :2] == got[0, :2]).all():
            self.stats.disagreements += 1
        if self.soak is not None:
            self.soak.agreed(int(got[0, 3]), int(got[0, 4]), self.requests.admitted)
        return bool(got[:, 2].all())

    def run(self) -> dict[str, Any]:
        stats, requests, clock = self.stats, self.requests, self.clock
        stats.begin()
        stats.sample_rss(requests.finished, force=True)
        error = None
        all_done = False
        leads = self.leads
        try:
            while clock.step < self.cfg.max_steps:
                clock.step += 1
                step = clock.step
                if self.faults.kill_at(step):
                    self.trace.event(kind="killed", step=step)
                    self.trace.close()
                    os._exit(17)
                paused = self.faults.pause_at(step)
                if paused:
                    self.trace.event(kind="paused", step=step, seconds=paused)
                    pause_process(paused)
                self.store.set(f"hb/{self.rank}", str(step))
                requests.arrive(step, None if self.soak is None else self.soak.upto(step))
                requests.retries()
                requests.client_aborts(step)
                self.peer.hear(self.ledger.handles)
                results = self.loop.iteration()
                self._legs_and_pages()
                total = self.total()
                done = (
                    total is not None
                    and requests.admitted >= total
                    # prefill: every attempt it was handed; decode: every request's last
                    and requests.finished == (requests.serves(total) or 0) + self._attempts_after()
                    and self.drain_poller.settled.issuperset(self.ledger.draining)
                    and self.router.closed  # prefill serves retries until decode is done
                )
                all_done = self._agree_digest(results, done)
                if not all_done and self.moves_bytes and not any(r.changed.size for r in results):
                    time.sleep(IDLE_S)  # (the side's ranks agree on it: they sleep alike)
                q1, q2 = self.queues.q1, self.queues.q2
                states = np.concatenate([q1.table.states(), q2.table.states()])
                stats.counts.add([*np.bincount(states, minlength=5).tolist(), requests.finished])
                stats.violations += [f"step {step}: {p}" for p in self.ledger.slot_problems()]
                stats.sample_rss(requests.finished)
                if leads and step % 10 == 0:
                    self.store.set(f"progress/{self.side}", str(requests.finished))
                if all_done:
                    if leads:
                        self.store.set(f"progress/{self.side}", str(requests.finished))
                    break
        except RankFailure as e:
            error = who_died(self.store, self.rank, self.place, clock.step, e)
        except LifecycleError as e:
            stats.violations.append(f"step {clock.step}: {type(e).__name__}: {e}")
        finally:
            if leads and self.side == "decode":  # prefill serves retries until this
                self.router.close()
        return self.report(error, all_done)

    def _attempts_after(self) -> int:
        """Prefill: the attempts after a request's first it admitted (each finishes
        once more); decode counts a request once, at its last attempt."""
        if self.side == "prefill":
            return self.requests.readmitted + len(self.requests.handed)
        return 0

    def report(self, error: str | None, all_done: bool) -> dict[str, Any]:
        """Close the rank's files and backend; its outcomes, problems and samples."""
        stats, requests, side = self.stats, self.requests, self.side
        stats.sample_rss(requests.finished, force=True)
        self.trace.close()
        if self.live is not None:
            write_spans(self.out / "ranks" / f"rank{self.rank}.spans.json", self.live.close())
        outcome = requests.close()
        backend_error = getattr(self.manager, "last_error", None)
        stands = ""
        if error is None and not all_done:  # before the backend closes
            stands = standing(self.ledger.handles, self.queues, self.manager)
        close_backend(self.cfg, self.rank, side, self.store, self.manager, self.moves_bytes)
        serves = requests.serves(self.total())
        # a soak that never agreed on its end: what it admitted so far
        seen = requests.serves(requests.admitted) if serves is None else serves
        assert seen is not None
        unfinished = seen + self._attempts_after() - requests.finished
        problems: list[str] = []
        if error is None and not all_done and not stats.violations:
            problems.append(
                stopped_problem(self.rank, side, self.cfg.max_steps, unfinished, stands)
            )
        # held only by a fence, here or on another rank of the group (see DrainPoller)
        settled = self.drain_poller.settled
        pinned = self.ledger.pinned(settled)
        if pinned:
            problems.append(pinned_problem(self.rank, side, pinned, self.manager))
        faults = fault_report(self.faults, self.faults_for_decode, side, self.moves_bytes)
        return {
            "rank": self.rank,
            "side": side,
            "group": self.place.name,  # its TP group: the side, or a prefill DP group
            # the transport's own counters (e.g. bytes_written), to hold against the layout
            "transport_stats": numbers(getattr(self.manager, "stats", None) or {}),
            "steps": self.clock.step,
            "requests": serves,
            "outcome": outcome,
            # when each outcome was recorded, ms since the epoch (this rank's clock)
            "ended_ms": requests.ended_ms,
            "unfinished": unfinished,
            "violations": stats.violations,
            "problems": problems,
            "unfired_faults": faults["unfired_faults"] if error is None else [],
            "disagreements": stats.disagreements,
            **self.ledger.report(settled),
            "drain_failed": stats.drain_failed,
            "bytes_checked": stats.bytes_checked,
            "retried": requests.retried,
            "readmitted": requests.readmitted,
            "recomputed": requests.recomputed,
            "recompute_steps": requests.recompute_steps,
            "corrupted": len(requests.corrupted),
            "corrupt_unseen": stats.corrupt_unseen,
            **peer_health(self.loop),
            "bytes_asked": stats.bytes_asked,
            "bytes_due": stats.bytes_due,
            "staged": stats.staged,
            "latency_us": stats.latency_us.items,
            "counts": stats.counts.items,
            "counts_stride": stats.counts.stride,
            "failure_steps": stats.failure_steps.items,
            "stuck_reports": stats.stuck_reports,
            "faults_fired": faults["faults_fired"],
            "fault_mode": self.mode,
            "decisions": faults["decisions"],
            "fired": faults["fired"],
            "rss_mb": stats.rss.items,
            # an exception the backend's own thread caught (it fails that rank's live requests)
            "backend_error": None if backend_error is None else repr(backend_error)[:300],
            "error": error,
        }


def shared_run_id(store: Any) -> str:
    """The run's id: the wall time of the first rank to ask (the store keeps
    the first proposal: every rank reads the same)."""
    mine = f"{time.time():.6f}".encode()
    return bytes(store.compare_set("pdlife/run_id", b"", mine)).decode()


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
