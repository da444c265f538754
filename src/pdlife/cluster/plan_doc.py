"""Fault plan documents: the kinds, fields and validation (see :mod:`pdlife.cluster.plan`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from lifecycle.errors import FaultPlanError
from pdlife.cluster.phase_draws import PHASES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "FaultKind",
    "TargetedFault",
    "FaultPlan",
    "load_plan",
    "parse_plan",
    "KINDS",
    "MODES",
]


KINDS = (
    "fail",
    "transfer_error",
    "delay",
    "hold_gate",
    "hold_staging",
    "drop_metadata",
    "corrupt_metadata",
    "raise_in_poll",
    "kill_rank",
    "pause_rank",
)
FaultKind = str
#: a whole rank's faults: they take a rank and a step, not a request
_RANK_WIDE = {"kill_rank", "pause_rank"}
_NEEDS_REQUEST = set(KINDS) - _RANK_WIDE
_NEEDS_STEPS = {"delay", "hold_gate", "hold_staging"}
_TIMED = {"fail", "transfer_error", "delay", "hold_gate", "hold_staging", "raise_in_poll"}
_FIELDS = {"kind", "request", "room", "rank", "step", "steps", "at", "seconds"}
#: the longest pause_rank: a stall of an hour is a dead rank
MAX_PAUSE_S = 3600.0
MODES = ("phase", "step")


@attrs.frozen
class TargetedFault:
    kind: FaultKind
    rank: int
    request: int | None = None
    room: int | None = None
    step: int | None = None
    steps: int = 1
    at: str | None = None  # a phase: fire when the request reaches it on this rank
    seconds: float = 0.0  # pause_rank: how long the whole process stops


@attrs.frozen
class FaultPlan:
    seed: int = 0
    prob: float = 0.0
    prob_ranks: tuple[int, ...] | None = None
    faults: tuple[TargetedFault, ...] = ()
    mode: str | None = None  # None: the command line's --fault-mode decides

    def for_rank(self, rank: int) -> tuple[TargetedFault, ...]:
        return tuple(f for f in self.faults if f.rank == rank)

    def validate_against(self, world: int, requests: int) -> None:
        """Check ranks and request indices against an actual run."""
        for i, f in enumerate(self.faults):
            if not 0 <= f.rank < world:
                raise FaultPlanError(
                    f"faults[{i}].rank", f"{f.rank} is not a rank of 0..{world - 1}"
                )
            if f.request is not None and not 0 <= f.request < requests:
                raise FaultPlanError(
                    f"faults[{i}].request",
                    f"{f.request} is not a request index of 0..{requests - 1}",
                )
        for r in self.prob_ranks or ():
            if not 0 <= r < world:
                raise FaultPlanError("probabilistic.ranks", f"{r} is not a rank of 0..{world - 1}")


def _int(entry: Mapping[str, Any], key: str, where: str, minimum: int = 0) -> int | None:
    if key not in entry:
        return None
    v = entry[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise FaultPlanError(f"{where}.{key}", f"must be an integer >= {minimum}, got {v!r}")
    return v


def _seconds(entry: Mapping[str, Any], kind: str, where: str) -> float:
    """A pause_rank's length: required there, refused elsewhere."""
    v = entry.get("seconds")
    if kind != "pause_rank":
        if v is not None:
            raise FaultPlanError(f"{where}.seconds", f"only pause_rank takes seconds, not {kind}")
        return 0.0
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= MAX_PAUSE_S:
        raise FaultPlanError(
            f"{where}.seconds",
            f"pause_rank needs how long the rank stops: a number of seconds in "
            f"(0, {MAX_PAUSE_S:g}], got {v!r}",
        )
    return float(v)


def parse_plan(doc: Mapping[str, Any]) -> FaultPlan:
    if not isinstance(doc, Mapping):
        raise FaultPlanError("<root>", "a plan is a table/object")
    unknown = set(doc) - {"seed", "probabilistic", "faults", "mode"}
    if unknown:
        raise FaultPlanError(sorted(unknown)[0], "unknown top-level field")
    seed = _int(doc, "seed", "<root>") or 0
    mode = doc.get("mode")
    if mode is not None and mode not in MODES:
        raise FaultPlanError("mode", f"must be one of {', '.join(MODES)}; got {mode!r}")
    prob, prob_ranks = 0.0, None
    if "probabilistic" in doc:
        p = doc["probabilistic"]
        if not isinstance(p, Mapping):
            raise FaultPlanError("probabilistic", "must be a table with 'prob'")
        bad = set(p) - {"prob", "ranks"}
        if bad:
            raise FaultPlanError(f"probabilistic.{sorted(bad)[0]}", "unknown field")
        raw = p.get("prob")
        if isinstance(raw, bool) or not isinstance(raw, int | float) or not 0 <= raw <= 1:
            raise FaultPlanError("probabilistic.prob", f"must be a number in [0, 1], got {raw!r}")
        prob = float(raw)
        if "ranks" in p:
            ranks = p["ranks"]
            if not isinstance(ranks, Sequence) or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks
            ):
                raise FaultPlanError("probabilistic.ranks", "must be a list of ranks >= 0")
            prob_ranks = tuple(ranks)
    faults = []
    entries = doc.get("faults", [])
    if not isinstance(entries, Sequence) or isinstance(entries, str):
        raise FaultPlanError("faults", "must be a list of tables")
    for i, e in enumerate(entries):
        where = f"faults[{i}]"
        if not isinstance(e, Mapping):
            raise FaultPlanError(where, "must be a table")
        bad = set(e) - _FIELDS
        if bad:
            raise FaultPlanError(f"{where}.{sorted(bad)[0]}", "unknown field")
        kind = e.get("kind")
        if kind not in KINDS:
            raise FaultPlanError(
                f"{where}.kind", f"must be one of {', '.join(KINDS)}; got {kind!r}"
            )
        rank = _int(e, "rank", where)
        if rank is None:
            raise FaultPlanError(f"{where}.rank", "is required (the global rank that misbehaves)")
        request, room = _int(e, "request", where), _int(e, "room", where, minimum=1)
        if kind in _NEEDS_REQUEST and (request is None) == (room is None):
            raise FaultPlanError(where, f"a {kind} fault names exactly one of 'request' or 'room'")
        if kind in _RANK_WIDE and (request is not None or room is not None):
            raise FaultPlanError(where, f"{kind} takes a rank and a step, not a request")
        step = _int(e, "step", where, minimum=1)
        if kind in _RANK_WIDE and step is None:
            raise FaultPlanError(f"{where}.step", f"{kind} needs the step it happens at")
        seconds = _seconds(e, kind, where)
        steps = _int(e, "steps", where, minimum=1)
        if steps is not None and kind not in _NEEDS_STEPS:
            raise FaultPlanError(
                f"{where}.steps",
                f"only {', '.join(sorted(_NEEDS_STEPS))} take steps, not {kind}",
            )
        at = e.get("at")
        if at is not None:
            if at not in PHASES:
                raise FaultPlanError(
                    f"{where}.at", f"must be one of {', '.join(PHASES)}; got {at!r}"
                )
            if kind not in _TIMED:
                raise FaultPlanError(f"{where}.at", f"a {kind} fault takes no phase")
            if step is not None:
                raise FaultPlanError(where, "give either 'step' or 'at', not both")
        faults.append(TargetedFault(kind, rank, request, room, step, steps or 1, at, seconds))
    return FaultPlan(seed=seed, prob=prob, prob_ranks=prob_ranks, faults=tuple(faults), mode=mode)


def load_plan(path: str | Path) -> FaultPlan:
    p = Path(path)
    kind = "TOML" if p.suffix == ".toml" else "JSON"
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise FaultPlanError(str(p), f"cannot read it ({e.strerror}); check the path") from None
    try:
        text = raw.decode("utf-8-sig")  # (a byte-order mark is harmless)
    except UnicodeDecodeError as e:
        raise FaultPlanError(
            str(p),
            f"not a text file: byte {e.start} (0x{raw[e.start]:02x}) is not UTF-8; "
            f"a plan is a {kind} text file",
        ) from None
    try:
        doc = tomllib.loads(text) if kind == "TOML" else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise FaultPlanError(str(p), f"not valid {kind}: {e}") from None
    except RecursionError:
        raise FaultPlanError(str(p), f"not valid {kind}: nested too deeply") from None
    return parse_plan(doc)
