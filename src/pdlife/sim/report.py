"""What one simulated rank says when its loop ends (summary.json's per-rank
part): how its backend is closed, where its unfinished requests stand, which
faults fired, what is wrong, and which rank died when a collective failed."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from lifecycle.errors import RankFailure
from lifecycle.status import KVPoll
from pdlife.cluster.config import SimConfig
from pdlife.cluster.plan import RankFaults
from pdlife.cluster.plan_doc import KINDS
from pdlife.cluster.topology import Place
from pdlife.sim.hooks import Queues

__all__ = [
    "peer_health",
    "close_backend",
    "fault_report",
    "linger",
    "numbers",
    "pinned_problem",
    "standing",
    "stopped_problem",
    "who_died",
    "write_spans",
]


logger = logging.getLogger(__name__)


def numbers(stats: Any) -> dict[str, float | int]:
    """A transport's counters, as JSON numbers."""
    return {
        str(k): int(v) if isinstance(v, (int, np.integer)) else float(v)
        for k, v in dict(stats).items()
    }


def linger(cfg: SimConfig, store: Any) -> None:
    """A prefill server keeps serving after its own requests end: a decode rank
    may still need its word (a failure told once its writes drained, a "stopped"
    after a pause). Its connector stays up until every decode rank has said it
    finished, or --pg-timeout passed (a decode rank that died never says so)."""
    decode = [f"decode_done/{r}" for r in range(cfg.world - cfg.decode, cfg.world)]
    deadline = time.monotonic() + cfg.pg_timeout
    try:
        while time.monotonic() < deadline and not store.check(decode):
            time.sleep(0.02)
    except Exception:  # the store is gone: so is the job
        return


def close_backend(
    cfg: SimConfig, rank: int, side: str, store: Any, manager: Any, moves_bytes: bool
) -> None:
    """Close the backend of global rank ``rank``; a byte-moving prefill rank
    first waits for decode to finish (:func:`linger`), a decode rank then says
    it has finished."""
    if moves_bytes and side == "prefill":
        linger(cfg, store)
    close = getattr(manager, "close", None)
    if close is not None:
        close()
    if moves_bytes and side == "decode":
        try:  # finished, however it ended: no prefill rank need wait for it
            store.set(f"decode_done/{rank}", "1")
        except Exception:
            logger.debug("decode_done not written: the store is gone", exc_info=True)


def standing(handles: Mapping[int, Any], queues: Queues, manager: Any, most: int = 3) -> str:
    """Where the first unfinished requests stand: queue, agreed status, and
    the transport's view of each peer (read before the backend closes)."""
    out = []
    for room in list(handles)[:most]:
        q = next((q for q in (queues.q1, queues.q2) if room in q.table), None)
        status = "-" if q is None else KVPoll(int(q.table.state[q.table.slot_of(room)])).name
        wire = getattr(manager, "describe", None)
        out.append(
            f"room {room} in {q.name if q else 'no queue'} at {status}"
            + (f" [{wire(room)}]" if wire is not None else "")
        )
    return ("; " + "; ".join(out)) if out else ""


def stopped_problem(rank: int, side: str, max_steps: int, unfinished: int, stands: str) -> str:
    """The run reached --max-steps with requests unfinished."""
    return (
        f"rank {rank} ({side}) stopped at --max-steps {max_steps} "
        f"with {unfinished} request(s) unfinished: raise --max-steps, or look at the "
        "stuck reports in the trace" + stands
    )


def pinned_problem(rank: int, side: str, pinned: list[int], manager: Any) -> str:
    """Failed requests whose buffers are still pinned (their peer never
    confirmed it stopped writing)."""
    describe = getattr(manager, "describe", None)  # the transport's view, when it has one
    wire = "" if describe is None else f" ({describe(pinned[0])})"
    return (
        f"rank {rank} ({side}): the buffers of {len(pinned)} failed "
        "request(s) are still pinned (the peer never confirmed it stopped writing), "
        f"e.g. room {pinned[0]}{wire}"
    )


def fault_report(
    faults: RankFaults, faults_for_decode: list[RankFaults], side: str, moves_bytes: bool
) -> dict[str, Any]:
    """The faults a rank fired and the ones that never fired."""
    if moves_bytes:
        meta = ("drop_metadata", "corrupt_metadata")
        others = tuple(k for k in KINDS if k not in meta)
        unfired = faults.unfired(others if side == "decode" else None)
        if side == "prefill":
            unfired += [u for f in faults_for_decode for u in f.unfired(meta)]
    else:
        unfired = faults.unfired()
    return {
        "unfired_faults": unfired,
        # a byte-moving backend's metadata faults fire on the prefill rank writing the row
        "faults_fired": sum(1 for _, kind, _ in faults.fired if kind != "abort")
        + sum(len(f.fired) for f in faults_for_decode if side == "prefill"),
        "decisions": [[d.room, d.rank, d.phase, d.kind, d.wins] for d in faults.decisions],
        "fired": [[st, kind, room] for st, kind, room in faults.fired],
    }


def who_died(store: Any, rank: int, where: Place, step: int, e: RankFailure) -> str:
    """Name the ranks of this side whose heartbeat stopped (read twice, a beat apart)."""
    side = where.group

    def beats() -> dict[int, int]:
        out = {}
        for r in side:
            try:
                out[r] = int(store.get(f"hb/{r}").decode())
            except Exception:
                out[r] = -1
        return out

    first = beats()
    time.sleep(1.0)
    second = beats()
    dead = sorted(r for r in side if r != rank and second[r] == first[r] and second[r] < step)
    cause = str(e.__cause__ or e).splitlines()[0][:160]
    return (
        f"rank {rank} ({where.side}) at step {step}: the collective failed; "
        f"dead rank(s) {dead or 'unknown'} (last heartbeat step per rank {second}); "
        f"gloo said: {cause}"
    )


def peer_health(loop: Any) -> dict[str, Any]:
    """Decode: each prefill DP group's health at the end, and its fingerprint
    (every decode rank must hold the same view)."""
    health = getattr(loop, "health", None)
    if health is None:
        return {}
    view = {str(p): v.state.name.lower() for p, v in sorted(health.view().items())}
    return {"peer_health": view, "peer_health_fp": health.fingerprint()}


def write_spans(path: Path, items: list[Any]) -> None:
    """Live spans as JSON (one object per span: what a test compares)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    out = [
        {
            "kind": i.span.kind,
            "name": i.span.name,
            "room": i.span.room,
            "side": i.span.side,
            "rank": i.span.rank,
            "attempt": i.span.attempt,
            "index": i.span.index,
            "start": i.span.start,
            "end": i.span.end,
            "error": i.span.error,
            "attributes": dict(i.span.attributes),
            "events": [e.name for e in i.span.events],
            "trace_id": f"{i.trace_id:032x}",
        }
        for i in items
    ]
    path.write_text(json.dumps(out))
