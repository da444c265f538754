"""The request deadlines: what each covers, the reason it fails with, the
clock it runs from, the statuses it runs in, and the one rule for when it
has passed.

Each deadline is declared on its reason's row of
:data:`lifecycle.rules.reasons.REASONS`; :data:`DEADLINES` is read from there.
Three layers keep a request's clocks, each where it can see them: the step
(agreed statuses, :class:`~lifecycle.config.StepConfig`), the connector
(the status each side reports, ``transport.connector.config.ConnectorConfig``)
and the fake backend (``FakeConfig``). Each gives :func:`late` its status
column and one column per :class:`Clock`; the deadline picks the clock and the
statuses, :func:`overdue` says when it has passed, so the same settings mean
the same thing in every layer. An import-time check holds
:data:`~lifecycle.rules.graph.VERDICTS` to the table: the step's deadline
sources carry exactly these reasons.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import numpy as np
from numpy.typing import NDArray

from lifecycle.reasons import FailureReason
from lifecycle.rules.graph import VERDICTS, Verdict
from lifecycle.rules.reasons import REASONS, Clock, agree
from lifecycle.status import KVPoll

__all__ = [
    "Deadline",
    "DEADLINES",
    "overdue",
    "late",
    "limit_of",
    "check_deadlines",
]


@attrs.frozen
class Deadline:
    """A deadline: the setting naming it (``<name>_timeout``), the reason it
    fails a request with, the step's verdict source, what its clock covers,
    the clock, and the statuses it runs in."""

    name: str
    reason: FailureReason
    source: str
    covers: str
    clock: Clock
    statuses: tuple[KVPoll, ...]
    #: indexed by status code: does the clock run there?
    runs_in: NDArray[np.bool_] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        table = np.zeros(len(KVPoll), dtype=bool)
        table[[int(s) for s in self.statuses]] = True
        table.setflags(write=False)
        object.__setattr__(self, "runs_in", table)

    @property
    def setting(self) -> str:
        """The config field (step, connector, fake backend alike) holding its limit."""
        return f"{self.name}_timeout"


#: every deadline, read from the reason table (in reason-code order)
DEADLINES: tuple[Deadline, ...] = tuple(
    Deadline(d.name, row.reason, d.source, d.covers, d.clock, d.statuses)
    for row in REASONS
    if (d := row.deadline) is not None
)


def overdue(now: float, since: NDArray[np.float64], limit: float) -> NDArray[np.bool_]:
    """Where a clock started at ``since`` has run ``limit`` seconds or more by
    ``now`` (a clock not started, NaN, never has: NaN compares False, quietly).
    Every layer's rule."""
    late: NDArray[np.bool_] = now - since >= limit
    return late


def late(
    deadline: Deadline,
    now: float,
    limit: float,
    status: NDArray[np.integer],
    clocks: Mapping[Clock, NDArray[np.float64]],
    rows: NDArray[np.int64],
) -> NDArray[np.bool_]:
    """Per row of ``rows``: it reports a status ``deadline`` runs in (``status``,
    one per row) and the deadline's clock (its column in ``clocks``, indexed by
    ``rows``) is :func:`overdue` by ``limit``. Every layer asks this."""
    out: NDArray[np.bool_] = deadline.runs_in[status] & overdue(
        now, clocks[deadline.clock][rows], limit
    )
    return out


def limit_of(deadline: Deadline, config: object) -> float | None:
    """``deadline``'s limit in a layer's config (None: it does not run)."""
    limit: float | None = getattr(config, deadline.setting)
    return limit


def check_deadlines(deadlines: tuple[Deadline, ...], verdicts: tuple[Verdict, ...]) -> None:
    """Raise unless each deadline is declared once and the step's verdict
    source for it carries its reason."""
    by_source = {s: v.reason for v in verdicts for s in v.sources}
    for d in deadlines:
        if by_source.get(d.source) is not d.reason:
            raise AssertionError(
                f"deadline {d.name}: verdict source {d.source} must carry {d.reason}"
            )
    if len({d.name for d in deadlines}) != len(deadlines):
        raise AssertionError("each deadline is declared once")


check_deadlines(DEADLINES, VERDICTS)
agree(
    "DEADLINES",
    {d.reason: (d.name, d.source, d.covers, d.clock, d.statuses) for d in DEADLINES},
    "deadline",
    read=lambda row: (
        None if (d := row.deadline) is None else (d.name, d.source, d.covers, d.clock, d.statuses)
    ),
)
