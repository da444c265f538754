"""Per-rank JSONL traces of a run, and their deterministic offline replay.

Each rank writes ``trace/rank{R}.jsonl`` with two kinds of record:

- ``{"t": "obs", "step", "side", "queue", "rooms", "local", "reason", "agreed"}``:
  what the rank contributed to one collective step (its gated local statuses
  and reasons) and the agreed statuses it got back;
- ``{"t": "tr", "step", "side", "queue", "room", "from", "to", "trigger",
  "reason", "origin"}``: one transition of an agreed status.

An observation also carries ``ts``, the rank's monotonic clock when it was
recorded (seconds), and ``held`` when a gate held some of its rows at
Transferring on this rank (gate name -> rooms); the first record of a trace,
``{"t": "clock", "mono", "wall"}``, ties the rank's monotonic clock to wall
time (every rank of a machine shares the monotonic one).

:func:`replay` recomputes every step from the recorded local observations
alone (pack, MIN over the side's ranks, the declared transitions) and
reports the first step whose recorded outcome differs. It needs a trace from
every rank of the run (their number is the ``ranks`` of ``summary.json``):
without one rank's observations a step's MIN cannot be recomputed, and the
other ranks' records would be checked against a reduce they did not take.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import attrs
import numpy as np

from lifecycle.core.packing import pack, unpack
from lifecycle.result import StepResult
from lifecycle.rules import batch
from lifecycle.rules.graph import TRIGGERS

__all__ = [
    "TraceWriter",
    "TraceError",
    "ReplayReport",
    "replay",
    "read_trace",
    "run_ranks",
    "trace_paths",
]

_OBS_KEYS = ("step", "rank", "side", "queue", "rooms", "local", "reason", "agreed")


class TraceError(ValueError):
    """A run directory without traces, or a trace that cannot be read back."""


class TraceWriter:
    def __init__(self, path: Path, rank: int, run: str | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._f: IO[str] = path.open("w")
        clock: dict[str, Any] = {"t": "clock", "rank": rank, "mono": time.monotonic()}
        clock["wall"] = time.time()
        if run is not None:  # the run's id, the same on every rank (its spans' trace ids)
            clock["run"] = run
        self._f.write(json.dumps(clock) + "\n")

    def step(
        self,
        side: str,
        queue: str,
        result: StepResult,
        local: Any,
        reason: Any,
        held: Mapping[str, Any] | None = None,
    ) -> None:
        rooms = result.rooms.tolist()
        rec: dict[str, Any] = {
            "t": "obs",
            "step": result.step,
            "ts": round(time.monotonic(), 6),
            "rank": self.rank,
            "side": side,
            "queue": queue,
            # the rows that took part in the reduce, with this rank's values
            "rooms": result.rooms[result.active].tolist(),
            "local": np.asarray(local).tolist(),
            "reason": np.asarray(reason).tolist(),
            "agreed": result.statuses[result.active].tolist(),
        }
        if held:
            rec["held"] = {gate: np.asarray(r).tolist() for gate, r in held.items()}
        lines = [json.dumps(rec, separators=(",", ":"))]
        for i, prev, trig in zip(
            result.changed.tolist(), result.previous.tolist(), result.triggers.tolist()
        ):
            lines.append(
                json.dumps(
                    {
                        "t": "tr",
                        "step": result.step,
                        "rank": self.rank,
                        "side": side,
                        "queue": queue,
                        "room": rooms[i],
                        "from": prev,
                        "to": int(result.statuses[i]),
                        "trigger": TRIGGERS[trig],
                        "reason": int(result.reasons[i]),
                        "origin": int(result.origins[i]),
                    },
                    separators=(",", ":"),
                )
            )
        self._f.write("\n".join(lines) + "\n")

    def event(self, **fields: Any) -> None:
        self._f.write(json.dumps({"t": "event", "rank": self.rank, **fields}) + "\n")

    def close(self) -> None:
        self._f.close()


def run_ranks(directory: Path) -> int:
    """How many ranks the run in ``directory`` had (``ranks`` of its ``summary.json``)."""
    path = directory / "summary.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TraceError(
            f"no summary.json under {directory}, so the run's rank count is unknown and "
            "replay cannot tell whether a rank's trace is missing; give the --out directory "
            "of a finished simulate run"
        ) from None
    except OSError as e:
        raise TraceError(f"cannot read {path} ({e.strerror})") from None
    except (ValueError, RecursionError) as e:
        raise TraceError(f"{path} is not JSON ({e}); the run's summary is corrupt") from None
    sides = doc.get("ranks") if isinstance(doc, dict) else None
    got = [sides.get(k) for k in ("prefill", "decode")] if isinstance(sides, dict) else []
    counts = [n for n in got if type(n) is int and n >= 1]
    if len(counts) != 2:
        raise TraceError(
            f"{path} does not say how many ranks the run had (its 'ranks' is "
            f"{sides!r}, expected {{'prefill': P, 'decode': D}}); rerun it with this version"
        )
    return sum(counts)


def trace_paths(directory: Path) -> list[Path]:
    """Every rank's trace file, in rank order; :class:`TraceError` naming the
    first one missing (or a file from no rank of the run)."""
    if not directory.is_dir():
        raise TraceError(f"{directory} is not a directory; give a run's --out directory")
    found = sorted((directory / "trace").glob("rank*.jsonl"))
    if not found:
        raise TraceError(
            f"no trace/rank*.jsonl under {directory}; give the --out directory of a simulate run"
        )
    world = run_ranks(directory)
    paths = [directory / "trace" / f"rank{r}.jsonl" for r in range(world)]
    for r, path in enumerate(paths):
        if not path.is_file():
            raise TraceError(
                f"{path} is missing: the run had {world} ranks (summary.json) and replay "
                f"needs every rank's trace to recompute a step; copy rank {r}'s trace there"
            )
    extra = sorted(set(found) - set(paths))
    if extra:
        raise TraceError(
            f"{extra[0]} is from no rank of this run (it had {world} ranks, "
            f"rank0..rank{world - 1}); it is left from another run: remove it"
        )
    return paths


def read_trace(directory: Path) -> Iterator[dict[str, Any]]:
    """Every record of a run's traces; :class:`TraceError` if a rank's trace
    is missing (see :func:`trace_paths`), or a line is not a well-formed record."""
    for path in trace_paths(directory):
        with path.open("rb") as f:  # a line that is not UTF-8 is corrupt, not a crash
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except (ValueError, RecursionError) as e:
                    raise TraceError(f"{path}:{n}: not JSON ({e}); the trace is corrupt") from None
                if not isinstance(rec, dict) or "t" not in rec:
                    raise TraceError(f"{path}:{n}: not a trace record; the trace is corrupt")
                if rec["t"] == "obs":
                    missing = [k for k in _OBS_KEYS if k not in rec]
                    sizes = {len(rec.get(k) or []) for k in ("rooms", "local", "reason", "agreed")}
                    if missing or len(sizes) != 1:
                        what = (
                            f"lacks {', '.join(missing)}"
                            if missing
                            else "has lists of different lengths"
                        )
                        raise TraceError(
                            f"{path}:{n}: an observation record {what}; the trace is corrupt"
                        )
                yield rec


@attrs.frozen
class ReplayReport:
    steps_checked: int
    first_difference: dict[str, Any] | None
    #: every move of an agreed status the replay recomputed, in step order:
    #: (side, queue, step, room, from, to), once per side (its ranks agree)
    moves: tuple[tuple[str, str, int, int, int, int], ...] = ()

    @property
    def ok(self) -> bool:
        return self.first_difference is None


def replay(directory: Path) -> ReplayReport:
    """Recompute every recorded step from the ranks' local observations."""
    groups: dict[tuple[str, str, int], dict[int, dict[str, Any]]] = defaultdict(dict)
    for rec in read_trace(directory):
        if rec.get("t") == "obs":
            groups[(rec["side"], rec["queue"], rec["step"])][rec["rank"]] = rec
    if not groups:
        raise TraceError(f"the traces under {directory} hold no collective step")
    prev_agreed: dict[tuple[str, str, int], int] = {}
    checked = 0
    moves: list[tuple[str, str, int, int, int, int]] = []
    for key in sorted(groups, key=lambda k: (k[2], k[0], k[1])):
        side, queue, step = key
        ranks = groups[key]
        first = next(iter(ranks.values()))
        rooms = first["rooms"]
        diff = None
        for r, rec in ranks.items():
            if rec["rooms"] != rooms:
                diff = f"rank {r} stepped a different request list"
        words = []
        for _, rec in sorted(ranks.items()):
            w = np.empty(len(rooms), dtype=np.uint8)
            pack(np.asarray(rec["local"], np.int8), np.asarray(rec["reason"], np.int8), w)
            words.append(w)
        agreed, _ = unpack(np.minimum.reduce(words)) if rooms else (np.empty(0, np.int8),) * 2
        prev = np.array([prev_agreed.get((side, queue, room), 1) for room in rooms], np.int8)
        # a request entering this queue carries its status from the previous queue
        new, _, illegal = batch.advance(prev, agreed)
        for r, rec in sorted(ranks.items()):
            if diff is None and rec["agreed"] != agreed.tolist():
                i = next(
                    j for j, (a, b) in enumerate(zip(rec["agreed"], agreed.tolist())) if a != b
                )
                diff = (
                    f"rank {r}: recorded agreed status {rec['agreed'][i]} for room {rooms[i]} "
                    f"but the ranks' local values reduce to {int(agreed[i])}"
                )
        if diff is None and illegal.any():
            i = int(np.flatnonzero(illegal)[0])
            diff = (
                f"room {rooms[i]}: {int(prev[i])} -> {int(agreed[i])} is not a declared transition"
            )
        checked += 1
        if diff is not None:
            return ReplayReport(
                checked, {"step": step, "side": side, "queue": queue, "detail": diff}, tuple(moves)
            )
        for room, before, s in zip(rooms, prev.tolist(), new.tolist()):
            prev_agreed[(side, queue, room)] = s
            if s != before:
                moves.append((side, queue, step, room, before, s))
    return ReplayReport(checked, None, tuple(moves))
