"""Stage 3 of a step (verdicts and gates): every source the rule tables name, as one function each.

:data:`~lifecycle.rules.graph.VERDICTS` and :data:`~lifecycle.rules.graph.GATES` name,
for each verdict and each gate, the *source* of its mask: ``abort_flag``,
``metadata_pending``... :data:`SOURCES` maps every verdict source to the
function computing its mask, :data:`GATE_SOURCES` every gate source to the
function computing where that gate is closed. :func:`check_sources`, run at
import, makes the three tables name the same sources, so a misspelt name
fails at import instead of silently dropping a verdict or opening a gate.

Each function reads one :class:`Inputs` (plain data and the hooks of one
step); none keeps state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray

from lifecycle.config import StepConfig
from lifecycle.core.frame import Frame
from lifecycle.core.observe import Observation, contained
from lifecycle.core.verdicts import bool_answer
from lifecycle.errors import HookError
from lifecycle.protocols import FaultHook, Gate, MetadataSource, StagingGate, StepContext
from lifecycle.rules.deadlines import DEADLINES, Deadline, late, limit_of
from lifecycle.rules.graph import GATES, VERDICTS, GateRule, Verdict
from lifecycle.rules.reasons import Clock
from lifecycle.status import I8
from lifecycle.table import RequestTable

__all__ = ["Inputs", "Source", "SOURCES", "GATE_SOURCES", "armed", "check_sources", "everyone"]

Mask = NDArray[np.bool_]
_S = I8.S


def everyone(n: int) -> Mask:
    return np.ones(n, dtype=bool)


def _any(mask: Mask) -> bool:
    # the first True's position: right after a collective (cold caches) far
    # cheaper than .any(), and no copy
    return bool(mask.size) and bool(mask[mask.argmax()])


class Inputs:
    """What the sources of one step read: the table, the frame, the rules'
    configuration, the hooks, and what observing found."""

    __slots__ = (
        "at_success",
        "config",
        "corrupt",
        "frame",
        "hooks",
        "now",
        "obs",
        "rank",
        "step",
        "success",
        "table",
    )

    def __init__(
        self,
        table: RequestTable,
        frame: Frame,
        config: StepConfig,
        now: float,
        step: int,
        obs: Observation,
        hooks: Hooks,
        rank: int,
    ) -> None:
        self.table, self.frame, self.config = table, frame, config
        self.now, self.step, self.obs, self.hooks, self.rank = now, step, obs, hooks, rank
        #: the rows a metadata source reported corrupt (set by the gates)
        self.corrupt: Mask | None = None
        #: the rows at local Success, on first use, and how many there are (set
        #: before the gates, the only sources that read them)
        self.success: Callable[[], Mask] = _unset
        self.at_success = 0

    def ask(self, hook: str, fn: Callable[[], Any], rows: Mask) -> Any:
        """Run one hook call; if it raises, fail ``rows`` (HOOK_ERROR), return None."""
        try:
            return fn()
        except Exception as e:
            self.obs.hook_failed(rows, self.frame.rooms, contained(hook, self.rank, e))
            return None


def _unset() -> Mask:
    raise AssertionError("Inputs.success is set before the gates read it")


@attrs.frozen
class Hooks:
    """The hooks a user plugged into one stepper."""

    staging: StagingGate | None
    metadata: MetadataSource | None
    gates: tuple[Gate, ...]
    faults: FaultHook | None


@attrs.frozen
class Source:
    """A verdict source. ``after_gates``: it reads what the gates found, so it
    is read again when they found something. ``needs``: the setting (a
    :class:`StepConfig` field) or hook (a :class:`Hooks` field) without which
    it can never hit, so a stepper without it never asks."""

    fn: Callable[[Inputs], Mask | None]
    after_gates: bool = False
    needs: str | None = None

    def armed(self, config: StepConfig, hooks: Hooks) -> bool:
        need = self.needs
        return need is None or getattr(config, need, getattr(hooks, need, None)) is not None


# -- verdict sources -----------------------------------------------------------
def _fault_hook(x: Inputs) -> Mask | None:
    faults = x.hooks.faults
    if faults is None:
        return None
    t, f, n = x.table, x.frame, x.frame.n
    # a copy: a hook writing into its view must not reach apply
    ctx = StepContext(x.rank, x.step, x.now, f.rooms, t.state[f.rows], t.added_step[f.rows])
    ask = partial(_inject, faults, ctx, n, x.rank)
    answer: Mask | None = x.ask("fault hook", ask, everyone(n))
    return answer


def _inject(faults: FaultHook, ctx: StepContext, n: int, rank: int) -> Mask:
    return bool_answer(faults.inject(ctx), n, "fault hook", rank)


def _abort_flag(x: Inputs) -> Mask | None:
    t = x.table
    return t.abort_requested[x.frame.rows] if t.abort_count else None


def _deadline(d: Deadline, x: Inputs) -> Mask | None:
    """Rows past deadline ``d``: its clock and statuses are the reason table's.
    A row entered Bootstrapping when its attempt was born, so the step's born
    clock is the time it entered its status (the table runs that clock in
    Bootstrapping only); the waiting clock is NaN until the metadata was sent."""
    limit, t, rows = limit_of(d, x.config), x.table, x.frame.rows
    if limit is None:
        return None
    clocks = {Clock.BORN: t.entered_time, Clock.WAITED: t.metadata_sent_at}
    return late(d, x.now, limit, t.state[rows], clocks, rows)


def _hook_error(x: Inputs) -> Mask | None:
    """Every hook that raised or answered nonsense, and rows whose metadata
    slot lies outside the source's pool."""
    f, obs = x.frame, x.obs
    if x.hooks.metadata is not None and f.meta_bad is not None:
        size = getattr(x.hooks.metadata, "size", "?")
        for i in np.flatnonzero(f.meta_bad).tolist():
            room = int(f.rooms[i])
            obs.exceptions[room] = HookError(
                "metadata source",
                x.rank,
                f"cannot hold room={room}: its metadata slot is outside the pool of {size} rows",
            )
        obs.hooked = f.meta_bad.copy() if obs.hooked is None else obs.hooked | f.meta_bad
    return obs.hooked


#: Every verdict source, in the order a step reads them: the fault hook first
#: (it may request an abort this step carries), hook errors last (every hook
#: before has had its chance to fail). ``backend`` is not here: it is the
#: poller's own reason codes (:attr:`Observation.backend`), not a mask.
SOURCES: dict[str, Source] = {
    "fault_hook": Source(_fault_hook, needs="faults"),
    "abort_flag": Source(_abort_flag),
    **{d.source: Source(partial(_deadline, d), needs=d.setting) for d in DEADLINES},
    "poll_value": Source(lambda x: x.obs.invalid),
    "poll_error": Source(lambda x: x.obs.errors),
    "metadata_row": Source(lambda x: x.corrupt, after_gates=True),
    "hook_error": Source(_hook_error, after_gates=True),
}
LATE: tuple[str, ...] = tuple(k for k, s in SOURCES.items() if s.after_gates)
SourceFn = Callable[[Inputs], Mask | None]


def armed(config: StepConfig, hooks: Hooks) -> tuple[tuple[str, SourceFn], ...]:
    """(name, function) of every source that can hit under ``config`` with
    ``hooks``, in order: what a step iterates (the others' masks are None)."""
    return tuple((k, s.fn) for k, s in SOURCES.items() if s.armed(config, hooks))


# -- gate sources --------------------------------------------------------------
# A gate source answers where its gate is closed, given the union ``closed`` of
# the gates asked before it (None: none closed), and returns the new union.
GateSource = Callable[[Inputs, Mask | None], Mask | None]


def _staging_pending(x: Inputs, closed: Mask | None) -> Mask | None:
    staging, f = x.hooks.staging, x.frame
    if staging is None:
        return closed
    try:
        pending = bool_answer(staging.pending(f.rooms, f.hidx), f.n, "staging pending", x.rank)
    except Exception as e:  # a gate decides only rows at Success: its errors fail those
        x.obs.hook_failed(x.success(), f.rooms, contained("staging pending", x.rank, e))
        return closed
    return pending if closed is None else closed | pending


def _metadata_pending(x: Inputs, closed: Mask | None) -> Mask | None:
    """Not landed; fake-path requests count as landed, a real request
    without a metadata row never does."""
    if x.hooks.metadata is None:
        return closed
    f = x.frame
    try:
        landed, bad = _landed(x)
    except Exception as e:
        # every row the gate decides fails, with a row or not: a row without
        # one is held by a source that answers, never released
        x.obs.hook_failed(x.success() & ~f.fake, f.rooms, contained("metadata source", x.rank, e))
        return closed
    if _any(bad):  # never written to: the arrays may be the source's own
        bad = bad & x.success()
        x.corrupt = bad if _any(bad) else None
    # closed | ~landed in one pass: for booleans, landed <= closed
    return ~landed if closed is None else np.less_equal(landed, closed)


def _landed(x: Inputs) -> tuple[Mask, Mask]:
    """(landed, corrupt) per active row. A read costs a cache line per row:
    when at most a quarter of the rows are at Success (a queue mostly still
    transferring), only those are read; otherwise every row is, in one pass
    (the subset's own gathers would cost more)."""
    f, source = x.frame, x.hooks.metadata
    assert source is not None
    m = f.meta_slots.size
    ask: NDArray[np.int64] | None = None
    slots, rooms = f.meta_slots, f.meta_rooms  # read-only: the source checks them once
    if x.at_success * 4 <= m:
        mask = x.success()
        ask = (mask if f.meta_pos is None else mask[f.meta_pos]).nonzero()[0]
        slots, rooms, m = slots[ask], rooms[ask], ask.size
    ok, bad = source.landed(slots, rooms)
    ok = bool_answer(ok, m, "metadata source (landed)", x.rank)
    bad = bool_answer(bad, m, "metadata source (corrupt)", x.rank)
    if f.meta_pos is None and ask is None:
        return ok, bad
    at = f.meta_pos if ask is None else ask if f.meta_pos is None else f.meta_pos[ask]
    landed = f.fake.copy()
    landed[at] = ok
    corrupt = f.zeros.copy()
    corrupt[at] = bad
    return landed, corrupt


def _gate_closed(x: Inputs, closed: Mask | None) -> Mask | None:
    gates, f = x.hooks.gates, x.frame
    if not gates:
        return closed
    user = np.zeros(f.n, dtype=bool)
    for gate in gates:
        name = f"gate {getattr(gate, 'name', '?')!r}"
        ans = x.ask(name, partial(_ask_gate, gate, f, name, x.rank), x.success())
        if ans is not None:
            user |= ans
    return user if closed is None else closed | user


def _ask_gate(gate: Gate, f: Frame, name: str, rank: int) -> Mask:
    return bool_answer(gate.closed(f.rooms, f.hidx), f.n, name, rank)


#: Every gate source; the step asks them in :data:`GATES` order.
GATE_SOURCES: dict[str, GateSource] = {
    "staging_pending": _staging_pending,
    "metadata_pending": _metadata_pending,
    "gate_closed": _gate_closed,
}


def check_sources(
    verdicts: Sequence[Verdict],
    gates: Sequence[GateRule],
    sources: Mapping[str, object],
    gate_sources: Mapping[str, object],
) -> None:
    """Raise :class:`AssertionError` naming every source one table names and
    another lacks (the step would skip it: a verdict lost, a gate open)."""
    named = {s for v in verdicts for s in v.sources if s != "backend"}
    gated = {g.source for g in gates}
    problems = [
        f"{what} {sorted(a - b)} {why}"
        for what, a, b, why in (
            ("VERDICTS name source(s)", named, set(sources), "that SOURCES lacks"),
            ("SOURCES has source(s)", set(sources), named, "that no verdict names"),
            ("GATES name source(s)", gated, set(gate_sources), "that GATE_SOURCES lacks"),
            ("GATE_SOURCES has source(s)", set(gate_sources), gated, "that no gate names"),
        )
        if a - b
    ]
    if problems:
        raise AssertionError(
            "lifecycle rule tables disagree: " + "; ".join(problems) + " (a misspelt name?)"
        )


check_sources(VERDICTS, GATES, SOURCES, GATE_SOURCES)
