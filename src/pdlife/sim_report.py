"""What one simulated rank reports when its loop ends (summary.json's per-rank part)."""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from lifecycle.status import KVPoll
from pdlife.plan import KINDS
from pdlife.sim_requests import fenced_pages
from pdlife.sim_soak import sample_rss

if TYPE_CHECKING:
    from pdlife.sim import RankRun

__all__ = ["report"]


logger = logging.getLogger(__name__)


def _numbers(stats: Any) -> dict[str, float | int]:
    return {
        str(k): int(v) if isinstance(v, (int, np.integer)) else float(v)
        for k, v in dict(stats).items()
    }


def linger(run: RankRun) -> None:
    """A prefill server keeps serving after its own requests end: a decode rank
    may still need its word (a failure told once its writes drained, a "stopped"
    after a pause). Its connector stays up until every decode rank has said it
    finished, or --pg-timeout passed (a decode rank that died never says so)."""
    decode = [f"decode_done/{r}" for r in range(run.cfg.world - run.cfg.decode, run.cfg.world)]
    deadline = time.monotonic() + run.cfg.pg_timeout
    try:
        while time.monotonic() < deadline and not run.store.check(decode):
            time.sleep(0.02)
    except Exception:  # the store is gone: so is the job
        return


def _where(run: RankRun, most: int = 3) -> str:
    """Where the first unfinished requests stand: queue, agreed status, and
    the transport's view of each peer (read before the backend closes)."""
    out = []
    for room in list(run.handles)[:most]:
        q = next((q for q in (run.q1, run.q2) if room in q.table), None)
        status = "-" if q is None else KVPoll(int(q.table.state[q.table.slot_of(room)])).name
        wire = getattr(run.manager, "describe", None)
        out.append(
            f"room {room} in {q.name if q else 'no queue'} at {status}"
            + (f" [{wire(room)}]" if wire is not None else "")
        )
    return ("; " + "; ".join(out)) if out else ""


def report(run: RankRun, error: str | None, all_done: bool) -> dict[str, Any]:
    """Close the rank's files and backend; its outcomes, problems and samples."""
    sample_rss(run, force=True)
    run.trace.close()
    run._outcomes.close()
    outcome: dict[str, list[Any]] = {}
    with run._outcomes_path.open() as f:
        for line in f:
            room, *rest = json.loads(line)
            outcome[str(room)] = rest
    backend_error = getattr(run.manager, "last_error", None)
    where = _where(run) if error is None and not all_done else ""  # before the backend closes
    if run.moves_bytes and run.side == "prefill":
        linger(run)
    close = getattr(run.manager, "close", None)
    if close is not None:
        close()
    if run.moves_bytes and run.side == "decode":
        try:  # finished, however it ended: no prefill rank need wait for it
            run.store.set(f"decode_done/{run.rank}", "1")
        except Exception:
            logger.debug("decode_done not written: the store is gone", exc_info=True)
    requests = run.serves()
    seen = requests
    if seen is None:  # a soak that never agreed on its end: what it admitted so far
        share = range(run.place.dp_rank, run.admitted, run.cfg.prefill_dp)
        seen = run.admitted if run.side == "decode" else len(share)
    unfinished = seen - run.finished
    problems: list[str] = []
    if error is None and not all_done and not run.violations:
        problems.append(
            f"rank {run.rank} ({run.side}) stopped at --max-steps {run.cfg.max_steps} "
            f"with {unfinished} request(s) unfinished: raise --max-steps, or look at the "
            "stuck reports in the trace" + where
        )
    # held only by a fence, here or on another rank of the group (see DrainPoller)
    fence = {r: e for r, e in run.draining.items() if r in run.drain_poller.settled}
    pinned = [r for r in run.draining if r not in fence]
    if pinned:
        problems.append(
            f"rank {run.rank} ({run.side}): the buffers of {len(pinned)} failed "
            "request(s) are still pinned (the peer never confirmed it stopped writing), "
            f"e.g. room {pinned[0]}{_wire(run, pinned[0])}"
        )
    fenced_slots = sum(s is not None for _, s, _ in fence.values())
    fenced = fenced_pages(run.draining, run.drain_poller.settled)
    if run.moves_bytes:
        meta = ("drop_metadata", "corrupt_metadata")
        others = tuple(k for k in KINDS if k not in meta)
        unfired = run.faults.unfired(others if run.side == "decode" else None)
        if run.side == "prefill":
            unfired += [u for f in run.faults_for_decode for u in f.unfired(meta)]
    else:
        unfired = run.faults.unfired()
    return {
        "rank": run.rank,
        "side": run.side,
        "group": run.place.name,  # its TP group: the side, or a prefill DP group
        # the transport's own counters (e.g. bytes_written), to hold against the layout
        "transport_stats": _numbers(getattr(run.manager, "stats", None) or {}),
        "steps": run.step_no,
        "requests": requests,
        "outcome": outcome,
        "unfinished": unfinished,
        "violations": run.violations,
        "problems": problems,
        "unfired_faults": unfired if error is None else [],
        "disagreements": run.disagreements,
        # fenced buffers are not leaks: they wait for a writer that stopped
        # beating (a killed rank's never come back), and are counted apart
        "leaked_slots": run.alloc.in_use + run.alloc.quarantined - fenced_slots,
        "leaked_kv_pages": run.cfg.kv_pages - len(run.pages_free) - fenced,
        "fenced_slots": fenced_slots,
        "fenced_kv_pages": fenced,
        # what of that requests not finished (or still draining) hold: a rank
        # that stopped on an error keeps those, and should hold nothing else
        "held_slots": len(run._slot) + sum(s is not None for _, s, _ in run.draining.values()),
        "held_kv_pages": sum(p.size for p in run.pages_of.values())
        + sum(p.size for _, _, p in run.draining.values() if p is not None),
        "drain_failed": run.drain_failed,
        "bytes_checked": run.bytes_checked,
        "bytes_asked": run.bytes_asked,
        "bytes_due": run.bytes_due,
        "staged": run.staged,
        "latency_us": run.latency_us.items,
        "counts": run.counts.items,
        "counts_stride": run.counts.stride,
        "failure_steps": run.failure_steps.items,
        "stuck_reports": run.stuck_reports,
        # a byte-moving backend's metadata faults fire on the prefill rank writing the row
        "faults_fired": sum(1 for _, kind, _ in run.faults.fired if kind != "abort")
        + sum(len(f.fired) for f in run.faults_for_decode if run.side == "prefill"),
        "fault_mode": run.mode,
        "decisions": [[d.room, d.rank, d.phase, d.kind, d.wins] for d in run.faults.decisions],
        "fired": [[st, kind, room] for st, kind, room in run.faults.fired],
        "rss_mb": run.rss.items,
        # an exception the backend's own thread caught (it fails that rank's live requests)
        "backend_error": None if backend_error is None else repr(backend_error)[:300],
        "error": error,
    }


def _wire(run: RankRun, room: int) -> str:
    """Where ``room`` stands with the transport, when it can say (else nothing)."""
    describe = getattr(run.manager, "describe", None)
    return "" if describe is None else f" ({describe(room)})"
