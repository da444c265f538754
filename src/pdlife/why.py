"""``pdlife why ROOM RUN``: what held one request back, step by step, in a
finished run (from its ranks' traces and summary; no torch, no process group).

For each queue the request went through, on each side, the steps are grouped
into spans where the same thing held it: the agreed status, the ranks whose
own value was that status while another rank's was ahead (the holders: the
MIN is theirs), and on a holder whose poll said Success, the gate that held
it at Transferring (the trace's ``held``). Then how it ended: each agreed
failure with its reason and origin rank, the faults the run's plan injected
into it (where, when, what), the stuck reports that named its holders (and
the transport's view of it), and its outcome with the attempts it took.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import attrs

from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll
from pdlife.args import UsageError

__all__ = ["Hold", "Why", "add_parser", "explain", "why"]


@attrs.frozen
class Hold:
    """Steps ``first``..``last`` of one queue where the same thing held the request."""

    side: str
    queue: str
    first: int
    last: int
    status: str  # the agreed status
    holders: tuple[int, ...]  # ranks at the agreed status while another was ahead
    ahead: tuple[int, ...]  # ranks whose own value was past it
    gates: tuple[tuple[int, str], ...]  # (holder rank, gate) where a gate held a Success


@attrs.frozen
class Why:
    room: int
    holds: tuple[Hold, ...]
    #: agreed moves: (step, side, queue, from, to, trigger, reason, origin)
    moves: tuple[tuple[int, str, str, str, str, str, str, int], ...]
    faults: tuple[dict[str, Any], ...]  # the plan's faults that named the request
    stuck: tuple[dict[str, Any], ...]  # stuck reports about it
    #: its legs that ended, by peer (decode's by prefill peer, prefill's by
    #: decode peer; a byte-moving backend's)
    legs: tuple[dict[str, Any], ...]
    outcome: tuple[str, str, int] | None  # (status, reason, attempts)
    sides: dict[int, str]  # rank -> its side


def _status(v: int) -> str:
    return KVPoll(v).name


def _reason(v: int) -> str:
    return FailureReason(v).name.lower().replace("_", " ")


def why(directory: Path, room: int) -> Why:
    """Everything the run's traces and summary say about ``room``;
    :class:`~pdlife.trace.TraceError` for a run that cannot be read."""
    from pdlife.trace import read_trace

    steps: dict[tuple[str, str], dict[int, dict[int, tuple[int, int, str | None]]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    moves, stuck, legs, sides = [], [], [], {}
    for rec in read_trace(directory):
        kind = rec["t"]
        if kind == "obs":
            sides[rec["rank"]] = rec["side"]
            try:
                i = rec["rooms"].index(room)
            except ValueError:
                continue
            gate = next((g for g, rs in (rec.get("held") or {}).items() if room in rs), None)
            where = steps[(rec["side"], rec["queue"])][rec["step"]]
            where[rec["rank"]] = (rec["local"][i], rec["agreed"][i], gate)
        elif kind == "tr" and rec["room"] == room:
            moves.append(
                (
                    rec["step"],
                    rec["side"],
                    rec["queue"],
                    _status(rec["from"]),
                    _status(rec["to"]),
                    rec["trigger"],
                    _reason(rec["reason"]),
                    rec["origin"],
                )
            )
        elif kind == "event" and rec.get("kind") == "stuck" and rec.get("room") == room:
            stuck.append(rec)
        elif kind == "event" and rec.get("kind") == "leg" and rec.get("room") == room:
            legs.append(rec)
    holds: list[Hold] = []
    for (side, queue), by_step in steps.items():
        for step in sorted(by_step):
            ranks = by_step[step]
            agreed = min(a for _, a, _ in ranks.values())
            low = min(v for v, _, _ in ranks.values())  # the MIN: the holders' value
            holders = tuple(sorted(r for r, (v, _, _) in ranks.items() if v == low))
            ahead = tuple(sorted(r for r, (v, _, _) in ranks.items() if v > low))
            if not ahead:
                holders = ()
            gates = tuple(sorted((r, g) for r, (_, _, g) in ranks.items() if g is not None))
            h = Hold(side, queue, step, step, _status(agreed), holders, ahead, gates)
            last = holds[-1] if holds else None
            if (
                last is not None
                and (last.side, last.queue, last.status) == (side, queue, h.status)
                and (last.holders, last.ahead, last.gates) == (holders, ahead, gates)
                and last.last + 1 == step
            ):
                holds[-1] = attrs.evolve(last, last=step)
            else:
                holds.append(h)
    summary = _summary(directory)
    out = summary.get("outcomes", {}).get(str(room))
    faults = tuple(f for f in summary.get("fault_decisions", ()) if f.get("room") == room)
    faults += _fired(directory, room)
    moves = sorted(set(moves))  # (every rank records the same agreed move)
    holds.sort(key=lambda h: (h.first, h.side, h.queue))
    outcome = (out[0], out[1], int(out[2])) if out else None
    return Why(room, tuple(holds), tuple(moves), faults, tuple(stuck), tuple(legs), outcome, sides)


def _fired(directory: Path, room: int) -> tuple[dict[str, Any], ...]:
    """The plan's targeted faults that fired on ``room``, from each rank's report."""
    out = []
    for path in sorted((directory / "ranks").glob("rank*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for step, kind, r in doc.get("fired", ()) if isinstance(doc, dict) else ():
            if r == room and kind != "abort":
                out.append({"kind": kind, "rank": doc.get("rank"), "step": step})
    return tuple(out)


def _summary(directory: Path) -> dict[str, Any]:
    try:
        doc = json.loads((directory / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _rank(r: int, sides: dict[int, str]) -> str:
    return f"rank {r} ({sides.get(r, '?')})"


def _hold_text(h: Hold, sides: dict[int, str]) -> str:
    when = f"step {h.first}" if h.first == h.last else f"steps {h.first}-{h.last}"
    where = f"{when} {h.side} {h.queue}"
    if not h.holders:
        return f"{where}: {h.status} on every rank"
    who = ", ".join(_rank(r, sides) for r in h.holders)
    if h.status == "Failed":
        return f"{where}: Failed on {who} (ahead: {', '.join(map(str, h.ahead))})"
    text = f"{where}: held at {h.status} by {who} (ahead: {', '.join(map(str, h.ahead))})"
    for r, gate in h.gates:
        text += f"; rank {r}'s poll said Success, its {gate} gate held it"
    return text


def _leg_text(leg: dict[str, Any], sides: dict[int, str]) -> str:
    """A leg's end: whose, to which peer, how it ended and after how long."""
    r = int(leg.get("rank", -1))
    rank, other = _rank(r, sides), "decode" if sides.get(r) == "prefill" else "prefill"
    took = leg.get("seconds")
    after = "" if took is None else f" after {float(took) * 1e3:.1f} ms"
    outcome = str(leg.get("outcome"))
    how = f"done{after}" if outcome == "done" else f"failed ({outcome}), blamed on it{after}"
    return f"step {leg.get('step')}: {rank}'s leg to {other} rank {leg.get('peer')}: {how}"


def explain(w: Why) -> list[str]:
    """``w`` as lines a person reads, in step order, then the plan's faults and
    the outcome."""
    if not w.holds and not w.moves:
        return [f"room {w.room}: not in this run's traces (no step saw it)"]
    timeline: list[tuple[int, int, str]] = [(h.first, 0, _hold_text(h, w.sides)) for h in w.holds]
    for step, side, queue, old, new, _, reason, origin in w.moves:
        if new == "Failed":
            at = "" if origin < 0 else f", origin {_rank(origin, w.sides)}"
            timeline.append(
                (step, 1, f"step {step} {side} {queue}: {old} -> Failed ({reason}{at})")
            )
    for s in w.stuck:
        wire = f"; transport: {s['wire']}" if s.get("wire") else ""
        text = f"step {s.get('step')}: stuck at {s.get('status')}, held by ranks {s.get('holders')}"
        timeline.append((int(s.get("step", 0)), 2, text + wire))
    for leg in w.legs:
        timeline.append((int(leg.get("step", 0)), 3, _leg_text(leg, w.sides)))
    lines = [f"room {w.room}:"] + [f"  {text}" for _, _, text in sorted(timeline)]
    for f in w.faults:
        on = _rank(int(f.get("rank", -1)), w.sides)
        if "step" in f:  # a targeted fault of the plan, as it fired
            lines.append(f"  fault fired: {f.get('kind')} on {on} at its step {f['step']}")
            continue
        won = "" if f.get("wins", True) else " (another failure came first)"
        lines.append(
            f"  fault injected: {f.get('kind')} at {f.get('phase')} on {on}, "
            f"reason {f.get('reason')}{won}"
        )
    if w.outcome is not None:
        status, reason, attempts = w.outcome
        tail = "" if status == "Success" else f" ({reason})"
        lines.append(f"  outcome: {status}{tail} after {attempts} attempt(s)")
    return lines


def _why(args: argparse.Namespace) -> int:
    from pdlife.trace import TraceError

    try:
        w = why(Path(args.run), args.room)
    except TraceError as e:
        raise UsageError(f"why {args.room} {args.run}", str(e)) from None
    if args.json:
        print(json.dumps(attrs.asdict(w), default=str))
    else:
        print("\n".join(explain(w)))
    return 0 if (w.holds or w.moves) else 1


def _room(text: str) -> int:
    try:
        room = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a room (an integer)") from None
    if not 0 <= room < 1 << 64:
        raise argparse.ArgumentTypeError(f"{text} is not a room (0..2**64-1)")
    return room


def add_parser(sub: Any) -> None:
    p = sub.add_parser("why", help="what held one request back in a finished run, step by step")
    p.add_argument("room", type=_room, help="the request's bootstrap room")
    p.add_argument("run", help="the run's --out directory (pdlife simulate)")
    p.add_argument("--json", action="store_true", help="the findings as JSON")
    p.set_defaults(func=_why)
