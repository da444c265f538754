"""A finished run's traces as a Chrome/Perfetto trace (the trace-event JSON
format that ui.perfetto.dev opens, and :mod:`pdlife.trace_picture` draws).

- one process per rank ("prefill rank 0", ...), one thread per queue;
- per request and queue on each rank, an async slice from its first
  observation to its agreed end, its agreed statuses nested inside it (one
  child slice per status it dwelt in); a request still live when the trace
  ends is closed there;
- instants: a gate holding a request on the rank whose gate held it (as the
  hold begins), an agreed failure on its origin rank (reason and origin), a
  stuck report with its holders;
- flows: from prefill's step that learned where to write a request (agreed
  WaitingForInput: its writes begin next) to decode's step where it landed
  (agreed Success); a retried request's flow starts at its last attempt;
- counters: live requests per agreed status, per rank and queue.

Times come from the traces' time base (each observation's ``ts``, the ranks'
shared monotonic clock), in microseconds from the run's first observation.
A trace from before the time base cannot be exported (:class:`TraceError`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll

__all__ = ["QUEUES", "export", "events_of"]

#: each queue's thread id within its rank's process (the order they are shown in)
QUEUES = {"bootstrap": 1, "inflight": 2, "handshake": 1, "transfer": 2, "drain": 3, "reports": 9}
_ENDS = (int(KVPoll.Success), int(KVPoll.Failed))


class _Request:
    """One request's open slices on one rank and queue."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.gate: str | None = None


class _Converter:
    """Turns each observation, with the moves recorded beside it, into events."""

    def __init__(self) -> None:
        self.out: list[dict[str, Any]] = []
        self.t0: float | None = None
        self.open: dict[tuple[int, str, int], _Request] = {}  # (rank, queue, room)
        self.step_ts: dict[tuple[int, int], float] = {}  # (rank, step) -> its last ts
        self.rank_end: dict[int, float] = {}
        self.named: dict[int, str] = {}
        self.threads: set[tuple[int, str]] = set()
        self.flows: dict[int, int] = {}  # room -> flow id, started on prefill
        self.dead: set[int] = set()  # flows that never ended
        self.next_flow = 1

    def us(self, ts: float) -> float:
        return round((ts - (self.t0 or 0.0)) * 1e6, 3)

    def slice_(
        self, ph: str, where: tuple[int, int, float], name: str, room: int, **a: Any
    ) -> None:
        pid, tid, ts = where
        ev = {"ph": ph, "cat": "request", "name": name, "pid": pid, "tid": tid, "ts": self.us(ts)}
        ev["id2"] = {"local": hex(room)}
        if a:
            ev["args"] = a
        self.out.append(ev)

    def step(self, rec: dict[str, Any], moves: list[dict[str, Any]]) -> None:
        from pdlife.trace import TraceError

        if "ts" not in rec:
            raise TraceError(
                "the trace has no time base (an observation without ts): rerun the "
                "simulation with this version to export it"
            )
        ts, rank = float(rec["ts"]), rec["rank"]
        self.t0 = ts if self.t0 is None else min(self.t0, ts)
        side, queue, step = rec["side"], rec["queue"], rec["step"]
        where = (rank, QUEUES.get(queue, 9), ts)
        self.named[rank] = f"{side} rank {rank}"
        self.threads.add((rank, queue))
        self.step_ts[(rank, step)] = max(self.step_ts.get((rank, step), ts), ts)
        self.rank_end[rank] = max(self.rank_end.get(rank, ts), ts)
        held = {r: g for g, rs in (rec.get("held") or {}).items() for r in rs}
        by_room = {m["room"]: m for m in moves}
        counts: dict[str, int] = defaultdict(int)
        for room, agreed in zip(rec["rooms"], rec["agreed"]):
            counts[KVPoll(agreed).name] += 1
            move = by_room.pop(room, None)
            before = int(move["from"]) if move is not None else agreed  # (agreed: after it)
            key = (rank, queue, room)
            req = self.open.get(key)
            if req is None and before not in _ENDS:
                req = self.open[key] = _Request(before)
                self.slice_("b", where, f"room {room}", room, side=side, queue=queue)
                self.slice_("b", where, KVPoll(before).name, room)
            if req is None:
                continue
            gate = held.get(room)
            if gate is not None and gate != req.gate:
                self.out.append(_instant(where, self.us(ts), f"held by {gate} gate", room))
            req.gate = gate
            if move is not None:
                self._move(key, req, move, where, side)
        self.out.append(
            {"ph": "C", "name": f"{queue} requests", "pid": rank, "ts": self.us(ts), "args": counts}
        )

    def _move(
        self,
        key: tuple[int, str, int],
        req: _Request,
        move: dict[str, Any],
        where: tuple[int, int, float],
        side: str,
    ) -> None:
        rank, queue, room = key
        new, at = int(move["to"]), self.us(where[2])
        self.slice_("e", where, KVPoll(req.status).name, room)
        if new in _ENDS:
            self.slice_("e", where, f"room {room}", room, outcome=KVPoll(new).name)
            del self.open[key]
        else:
            self.slice_("b", where, KVPoll(new).name, room)
            req.status = new
        if new == int(KVPoll.Failed) and move["origin"] == rank:
            why = FailureReason(move["reason"]).name.lower()
            self.out.append(_instant(where, at, f"failed: {why}", room, origin=rank))
        if side == "prefill" and queue == "bootstrap" and new == int(KVPoll.WaitingForInput):
            if room in self.flows:  # an earlier attempt's, that never landed
                self.dead.add(self.flows[room])
            self.flows[room] = self.next_flow
            self.next_flow += 1
            self.out.extend(_flow("s", self.flows[room], where[0], where[1], at))
        if (
            side == "decode"
            and queue == "transfer"
            and new == int(KVPoll.Success)
            and room in self.flows
        ):
            self.out.extend(_flow("f", self.flows.pop(room), where[0], where[1], at))

    def stuck(self, rec: dict[str, Any]) -> None:
        ts = self.step_ts.get((rec["rank"], rec["step"]))
        if ts is not None:
            self.threads.add((rec["rank"], "reports"))
            a = {"holders": rec.get("holders"), "status": rec.get("status")}
            self.out.append(_instant((rec["rank"], 9, ts), self.us(ts), "stuck", rec["room"], **a))

    def finish(self) -> list[dict[str, Any]]:
        for (rank, queue, room), req in sorted(self.open.items()):  # still live: closed at the end
            where = (rank, QUEUES.get(queue, 9), self.rank_end[rank])
            self.slice_("e", where, KVPoll(req.status).name, room)
            self.slice_("e", where, f"room {room}", room, outcome="live")
        dead = self.dead | set(self.flows.values())  # never landed: a start alone draws nothing
        out = [e for e in self.out if not (e.get("cat") == "kv" and e.get("id") in dead)]
        meta: list[dict[str, Any]] = []
        for rank, name in sorted(self.named.items()):
            meta.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": name}})
            sort = {"sort_index": rank}
            meta.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": sort})
        for rank, queue in sorted(self.threads):
            thread = {"name": queue}
            tid = QUEUES.get(queue, 9)
            meta.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": thread})
        return meta + out


def events_of(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trace events of a run's records (:func:`pdlife.trace.read_trace`):
    each observation with the moves recorded right after it (the same rank,
    queue and step)."""
    conv = _Converter()
    obs: dict[str, Any] | None = None
    moves: list[dict[str, Any]] = []
    for rec in records:
        kind = rec["t"]
        if kind == "tr":
            if obs is not None and (obs["rank"], obs["queue"], obs["step"]) == (
                rec["rank"],
                rec["queue"],
                rec["step"],
            ):
                moves.append(rec)
            continue
        if obs is not None:
            conv.step(obs, moves)
            obs, moves = None, []
        if kind == "obs":
            obs = rec
        elif kind == "event" and rec.get("kind") == "stuck":
            conv.stuck(rec)
    if obs is not None:
        conv.step(obs, moves)
    return conv.finish()


def _instant(
    where: tuple[int, int, float], ts: float, name: str, room: int, **args: Any
) -> dict[str, Any]:
    pid, tid, _ = where
    return {
        "ph": "i",
        "s": "t",
        "cat": "lifecycle",
        "name": name,
        "pid": pid,
        "tid": tid,
        "ts": ts,
        "args": {"room": room, **args},
    }


def _flow(ph: str, fid: int, pid: int, tid: int, ts: float) -> list[dict[str, Any]]:
    """A flow's end, bound to a slice of its own (a flow binds to the thread
    slice enclosing it: the request's async slices are not thread slices)."""
    name = "writes begin" if ph == "s" else "landed"
    mark = {"ph": "X", "cat": "kv", "name": name, "id": fid, "pid": pid, "tid": tid, "ts": ts}
    mark["dur"] = 1
    ev = {"ph": ph, "cat": "kv", "name": "kv", "id": fid, "pid": pid, "tid": tid, "ts": ts}
    if ph == "f":
        ev["bp"] = "e"  # binds to the slice enclosing it
    return [mark, ev]


def export(directory: Path) -> dict[str, Any]:
    """The Chrome/Perfetto trace of the run in ``directory``."""
    from pdlife.trace import read_trace

    return {"traceEvents": events_of(read_trace(directory)), "displayTimeUnit": "ms"}
