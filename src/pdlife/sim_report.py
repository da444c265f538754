"""What one simulated rank reports when its loop ends (summary.json's per-rank part)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np

from pdlife.plan import KINDS
from pdlife.sim_soak import sample_rss

if TYPE_CHECKING:
    from pdlife.sim import RankRun

__all__ = ["report"]


def _numbers(stats: Any) -> dict[str, float | int]:
    return {
        str(k): int(v) if isinstance(v, (int, np.integer)) else float(v)
        for k, v in dict(stats).items()
    }


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
    close = getattr(run.manager, "close", None)
    if close is not None:
        close()
    requests = run.serves()
    unfinished = (requests if requests is not None else run.admitted) - run.finished
    problems: list[str] = []
    if error is None and not all_done and not run.violations:
        problems.append(
            f"rank {run.rank} ({run.side}) stopped at --max-steps {run.cfg.max_steps} "
            f"with {unfinished} request(s) unfinished: raise --max-steps, or look at the "
            "stuck reports in the trace"
        )
    if run.draining:
        problems.append(
            f"rank {run.rank} ({run.side}): the buffers of {len(run.draining)} failed "
            "request(s) are still pinned (the peer never confirmed it stopped writing), "
            f"e.g. room {next(iter(run.draining))}"
        )
    if run.moves_bytes:
        meta = ("drop_metadata", "corrupt_metadata")
        others = tuple(k for k in KINDS if k not in meta)
        unfired = run.faults.unfired(others if run.side == "decode" else None)
        if run.side == "prefill":
            unfired += run.faults_for_decode.unfired(meta)
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
        "leaked_slots": run.alloc.in_use + run.alloc.quarantined,
        "leaked_kv_pages": run.cfg.kv_pages - len(run.pages_free),
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
        "faults_fired": sum(1 for _, kind, _ in run.faults.fired if kind != "abort"),
        "fault_mode": run.mode,
        "decisions": [[d.room, d.rank, d.phase, d.kind, d.wins] for d in run.faults.decisions],
        "fired": [[st, kind, room] for st, kind, room in run.faults.fired],
        "rss_mb": run.rss.items,
        # an exception the backend's own thread caught (it fails that rank's live requests)
        "backend_error": None if backend_error is None else repr(backend_error)[:300],
        "error": error,
    }
