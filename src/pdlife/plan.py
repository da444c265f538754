"""Fault plans: seeded probabilistic faults plus targeted, replayable ones.

A plan is a JSON or TOML document. Two modes decide *when* a fault fires.

**Phase-keyed** (``mode = "phase"``, the default): a fault is tied to a
request's lifecycle, not to the clock. For every (seed, rank, request) one
draw decides whether that rank fails the request and at which phase
(Bootstrapping, WaitingForInput or Transferring); client aborts are drawn the
same way per request (which ones, at which phase). A fault fires on the first
step at which the request has reached its phase on that rank (its agreed
status, or what the backend reports this step, whichever is further), so it
fires before the request can finish, however fast a real transport moves::

    seed = 7
    mode = "phase"
    [probabilistic]
    prob = 0.05             # per rank and request: fails it at a drawn phase
    ranks = [0, 1]          # optional: only these ranks draw
    [[faults]]
    kind = "fail"
    request = 12            # index into the run's requests (or: room = ...)
    rank = 3                # the global rank that misbehaves
    at = "Transferring"     # when the request reaches this phase there

Of all the draws for one request (every rank's fault, and the abort) only
the one at the earliest phase fires (ties: the abort, then the lowest rank),
so which requests fail, and why, is a function of the seed alone: the same
on every run and on every backend. See the README's guarantee for what can
still differ (timings, step counts, the origin rank of a tie).

**Step-keyed** (``mode = "step"``): each rank draws per request *per step*,
and targeted faults name a scheduler iteration. How many steps a request
lives depends on real transfer timing, so on a real transport two runs fail
different requests; use it for soak-style noise::

    seed = 7
    mode = "step"
    [probabilistic]
    prob = 0.01             # per rank, per request, per step
    [[faults]]
    kind = "delay"          # fail | delay | hold_gate | drop_metadata |
                            # corrupt_metadata | raise_in_poll | kill_rank
    request = 12
    rank = 3
    step = 5                # scheduler iteration on that rank (default: first
                            # step the request is live there, or ``at``)
    steps = 4               # for delay and hold_gate: how long

Every field is validated; an error names the entry and the field, e.g.
``faults[2].kind``. The same plan and seed give the same faults.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray

from lifecycle.errors import FaultPlanError
from lifecycle.faults import ProbabilisticFaults
from lifecycle.protocols import StepContext
from lifecycle.status import KVPoll

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
    "RankFaults",
    "KINDS",
    "MODES",
    "PHASES",
    "Decision",
    "phase_decisions",
]

KINDS = (
    "fail",
    "delay",
    "hold_gate",
    "drop_metadata",
    "corrupt_metadata",
    "raise_in_poll",
    "kill_rank",
)
FaultKind = str
_NEEDS_REQUEST = set(KINDS) - {"kill_rank"}
_NEEDS_STEPS = {"delay", "hold_gate"}
_TIMED = {"fail", "delay", "hold_gate", "raise_in_poll"}
_FIELDS = {"kind", "request", "room", "rank", "step", "steps", "at"}
MODES = ("phase", "step")
#: the phases a fault or an abort can be keyed to, in lifecycle order
PHASES = ("Bootstrapping", "WaitingForInput", "Transferring")
_PHASE_VALUE = {
    "Bootstrapping": int(KVPoll.Bootstrapping),
    "WaitingForInput": int(KVPoll.WaitingForInput),
    "Transferring": int(KVPoll.Transferring),
}


@attrs.frozen
class TargetedFault:
    kind: FaultKind
    rank: int
    request: int | None = None
    room: int | None = None
    step: int | None = None
    steps: int = 1
    at: str | None = None  # a phase: fire when the request reaches it on this rank


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
        if kind == "kill_rank" and (request is not None or room is not None):
            raise FaultPlanError(where, "kill_rank takes a rank and a step, not a request")
        step = _int(e, "step", where, minimum=1)
        if kind == "kill_rank" and step is None:
            raise FaultPlanError(f"{where}.step", "kill_rank needs the step to kill at")
        steps = _int(e, "steps", where, minimum=1)
        if steps is not None and kind not in _NEEDS_STEPS:
            raise FaultPlanError(
                f"{where}.steps", f"only delay and hold_gate take steps, not {kind}"
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
        faults.append(TargetedFault(kind, rank, request, room, step, steps or 1, at))
    return FaultPlan(seed=seed, prob=prob, prob_ranks=prob_ranks, faults=tuple(faults), mode=mode)


def load_plan(path: str | Path) -> FaultPlan:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise FaultPlanError(str(p), f"cannot read it ({e.strerror}); check the path") from None
    try:
        doc = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise FaultPlanError(
            str(p), f"not valid {'TOML' if p.suffix == '.toml' else 'JSON'}: {e}"
        ) from None
    return parse_plan(doc)


_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """splitmix64's finalizer: a bijection of uint64 that scrambles every bit."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        out: NDArray[np.uint64] = x ^ (x >> np.uint64(31))
    return out


def draw(seed: int, salt: int, rank: int, rooms: NDArray[np.uint64]) -> NDArray[np.float64]:
    """A uniform draw in [0, 1) per room, keyed by (seed, salt, rank, room) alone:
    the same request gets the same number whatever order or step it is asked in."""
    with np.errstate(over="ignore"):
        salted = np.array([seed & (2**64 - 1)], np.uint64) + _GOLDEN * np.uint64(salt + 1)
        key = _mix(_mix(salted) ^ _mix(np.array([rank + 1], np.uint64) * _GOLDEN))
    bits = _mix(np.asarray(rooms, np.uint64) ^ key)
    out: NDArray[np.float64] = (bits >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return out


@attrs.frozen
class Decision:
    """One phase-keyed draw: ``rank`` fails (or, rank -1, the client aborts)
    ``room`` when it reaches ``phase``. Only the request's winner fires."""

    room: int
    rank: int
    phase: str
    kind: str  # "fail" | "abort"
    wins: bool


def phase_decisions(
    plan: FaultPlan, abort_prob: float, abort_seed: int, world: int, rooms: NDArray[np.uint64]
) -> list[Decision]:
    """Every phase-keyed draw for ``rooms`` (each rank's fault, the client's abort),
    with each request's winner marked: the earliest phase; ties go to the abort,
    then to the lowest rank."""
    rooms = np.asarray(rooms, np.uint64)
    n = rooms.size
    big = len(PHASES) * (world + 2)
    best = np.full(n, big, np.int64)
    found: list[tuple[NDArray[np.int64], int, str, NDArray[np.int64]]] = []
    if abort_prob > 0:
        hit = np.flatnonzero(draw(abort_seed, 3, 0, rooms) < abort_prob)
        phase = (draw(abort_seed, 4, 0, rooms[hit]) * len(PHASES)).astype(np.int64)
        found.append((hit, -1, "abort", phase))
    if plan.prob > 0:
        for r in range(world) if plan.prob_ranks is None else plan.prob_ranks:
            hit = np.flatnonzero(draw(plan.seed, 1, r, rooms) < plan.prob)
            phase = (draw(plan.seed, 2, r, rooms[hit]) * len(PHASES)).astype(np.int64)
            found.append((hit, r, "fail", phase))
    for hit, r, _, phase in found:
        np.minimum.at(best, hit, phase * (world + 2) + r + 1)
    out = []
    for hit, r, kind, phase in found:
        wins = best[hit] == phase * (world + 2) + r + 1
        for i, p, w in zip(hit.tolist(), phase.tolist(), wins.tolist()):
            out.append(Decision(int(rooms[i]), r, PHASES[p], kind, bool(w)))
    out.sort(key=lambda d: (d.room, d.rank))
    return out


class RankFaults:
    """A plan bound to one rank of a run: the step's fault hook, plus the
    queries the simulated scheduler asks (delay, hold, metadata, raise, kill).

    ``room_of`` maps a request index to its room (a sequence or any object
    with ``__getitem__``). In phase mode the simulator calls :meth:`admit`
    for new requests and passes each queue's observed statuses to
    :meth:`inject_phase`.
    """

    def __init__(
        self,
        plan: FaultPlan,
        rank: int,
        room_of: Any,
        mode: str = "step",
        world: int = 1,
        abort_prob: float = 0.0,
        abort_seed: int = 0,
    ) -> None:
        self.rank = rank
        self.plan = plan
        self.mode = mode
        self.world = world
        self.abort_prob = abort_prob
        self.abort_seed = abort_seed
        self._room_of_request = room_of
        self.prob = (
            ProbabilisticFaults(plan.prob, seed=plan.seed, rank=rank)
            if mode == "step" and plan.prob and (plan.prob_ranks is None or rank in plan.prob_ranks)
            else None
        )
        self.mine: list[TargetedFault] = list(plan.for_rank(rank))
        self._rooms = [self.room(f) for f in self.mine]
        self._fired_idx: set[int] = set()
        self.first_seen: dict[int, int] = {}
        self.reached_at: dict[tuple[int, int], int] = {}  # (fault index, room) -> step
        self.fired: list[tuple[int, str, int | None]] = []  # (step, kind, room)
        # phase mode: the winners this rank carries out, room -> phase value
        self.pending_fail: dict[int, int] = {}
        self.pending_abort: dict[int, int] = {}
        self.decisions: list[Decision] = []

    def room(self, f: TargetedFault) -> int | None:
        if f.kind == "kill_rank":
            return None
        return f.room if f.room is not None else int(self._room_of_request[f.request or 0])

    # -- phase mode --------------------------------------------------------------
    def admit(self, rooms: Sequence[int], aborts_here: bool) -> None:
        """Draw the phase-keyed decisions of new requests; keep those this rank
        carries out (its own faults; the client's aborts if ``aborts_here``)."""
        if self.mode != "phase" or not rooms or (self.plan.prob == 0 and self.abort_prob == 0):
            return
        for d in phase_decisions(
            self.plan,
            self.abort_prob,
            self.abort_seed,
            self.world,
            np.asarray(rooms, np.uint64),
        ):
            if d.rank == self.rank or (d.rank == -1 and aborts_here):
                self.decisions.append(d)
                if d.wins and d.kind == "fail":
                    self.pending_fail[d.room] = _PHASE_VALUE[d.phase]
                elif d.wins:
                    self.pending_abort[d.room] = _PHASE_VALUE[d.phase]

    def forget(self, room: int) -> None:
        """The request finished here: drop what was kept for it."""
        self.first_seen.pop(room, None)
        self.pending_fail.pop(room, None)
        self.pending_abort.pop(room, None)

    def _reached(self, ctx: StepContext, observed: NDArray[np.int8] | None) -> NDArray[np.int8]:
        if observed is None:
            return ctx.states
        return np.where(ctx.states == KVPoll.Failed, ctx.states, np.maximum(ctx.states, observed))

    def inject_phase(
        self, ctx: StepContext, observed: NDArray[np.int8] | None, abort: Any = None
    ) -> NDArray[np.bool_]:
        """The step's fault hook with the statuses the backend reported this step:
        targeted ``at`` faults and phase-keyed winners that have reached their
        phase fire now; an abort winner is handed to ``abort(room)``."""
        rooms = ctx.rooms.tolist()
        hit = self.inject(ctx)
        if not rooms:
            return hit
        reached = self._reached(ctx, observed).tolist()
        for i, f in enumerate(self.mine):
            if f.at is None:
                continue
            want = _PHASE_VALUE[f.at]
            for j, r in enumerate(rooms):
                if r == self._rooms[i] and reached[j] >= want and reached[j] != KVPoll.Failed:
                    first = self.reached_at.setdefault((i, r), ctx.step)
                    if f.kind == "fail" and first == ctx.step:
                        hit[j] = True
                        self._fired(i, ctx.step, r)
        if self.pending_fail or self.pending_abort:
            for j, r in enumerate(rooms):
                if reached[j] == KVPoll.Failed:
                    continue
                p = self.pending_fail.get(r)
                if p is not None and reached[j] >= p:
                    hit[j] = True
                    del self.pending_fail[r]
                    self.fired.append((ctx.step, "fail", r))
                p = self.pending_abort.get(r)
                if p is not None and reached[j] >= p and abort is not None:
                    del self.pending_abort[r]
                    self.fired.append((ctx.step, "abort", r))
                    abort(r)
        return hit

    # -- step mode and targeted faults -----------------------------------------
    def _fired(self, i: int, step: int, room: int | None) -> None:
        if i not in self._fired_idx:
            self._fired_idx.add(i)
        self.fired.append((step, self.mine[i].kind, room))

    def _active(self, kind: str, room: int, step: int) -> bool:
        for i, f in enumerate(self.mine):
            if f.kind != kind or self._rooms[i] != room:
                continue
            if f.at is not None:
                start = self.reached_at.get((i, room))
                if start is None:
                    continue
            else:
                start = f.step if f.step is not None else self.first_seen.get(room, step)
            if start <= step < start + f.steps:
                if i not in self._fired_idx:
                    self._fired(i, step, room)
                return True
        return False

    def note_live(self, rooms: Sequence[int], step: int) -> None:
        for r in rooms:
            self.first_seen.setdefault(r, step)

    def inject(self, ctx: StepContext) -> NDArray[np.bool_]:
        rooms = ctx.rooms.tolist()
        self.note_live(rooms, ctx.step)
        hit = np.array([self._active("fail", r, ctx.step) for r in rooms], dtype=bool)
        if self.prob is not None:
            hit |= self.prob.inject(ctx)
        return hit

    def delayed(self, room: int, step: int) -> bool:
        return self._active("delay", room, step)

    def gate_held(self, room: int, step: int) -> bool:
        return self._active("hold_gate", room, step)

    def raises(self, room: int, step: int) -> bool:
        return self._active("raise_in_poll", room, step)

    def metadata_fault(self, room: int) -> str | None:
        for i, f in enumerate(self.mine):
            if f.kind in ("drop_metadata", "corrupt_metadata") and self._rooms[i] == room:
                self._fired(i, 0, room)
                return f.kind
        return None

    def kill_at(self, step: int) -> bool:
        return any(f.kind == "kill_rank" and f.step == step for f in self.mine)

    def unfired(self, kinds: Sequence[str] | None = None) -> list[str]:
        """The targeted faults of this rank that never fired (kill_rank aside:
        a rank that fired it is dead), as plan-file descriptions."""
        out = []
        for i, f in enumerate(self.mine):
            if f.kind == "kill_rank" or i in self._fired_idx:
                continue
            if kinds is not None and f.kind not in kinds:
                continue
            who = f"request {f.request}" if f.request is not None else f"room {f.room}"
            when = f"at {f.at}" if f.at else (f"step {f.step}" if f.step else "its first step")
            out.append(f"{f.kind} on rank {f.rank}, {who}, {when}")
        return out
