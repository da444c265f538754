"""The request deadlines, declared once: what each covers, the reason it fails
with, and the one rule for when it has passed.

Three layers keep a request's clocks, each where it can see them: the step
(agreed statuses, :class:`~lifecycle.config.StepConfig`), the connector
(protocol phases, ``transport.connector.config.ConnectorConfig``) and the fake
backend (``FakeConfig``). They all read :data:`DEADLINES` for the reason a
deadline fails a request with and :func:`overdue` for when it has passed, so
the same settings mean the same thing in every layer. An import-time check
holds :data:`~lifecycle.rules.graph.VERDICTS` to the table: the step's
deadline sources carry exactly these reasons.
"""

from __future__ import annotations

import attrs
import numpy as np
from numpy.typing import NDArray

from lifecycle.reasons import FailureReason
from lifecycle.rules.graph import VERDICTS, Verdict

__all__ = ["Deadline", "DEADLINES", "overdue", "check_deadlines"]


@attrs.frozen
class Deadline:
    """A deadline: the setting naming it (``<name>_timeout``), the reason it
    fails a request with, the step's verdict source, and what its clock covers."""

    name: str
    reason: FailureReason
    source: str
    covers: str


DEADLINES: tuple[Deadline, ...] = (
    Deadline(
        "bootstrap",
        FailureReason.BOOTSTRAP_TIMEOUT,
        "bootstrap_deadline",
        "while the request reports Bootstrapping: its peer has not registered it, or "
        "(prefill) not every decode leg has said where to write",
    ),
    Deadline(
        "waiting",
        FailureReason.WAITING_TIMEOUT,
        "waiting_deadline",
        "from decode telling prefill where to write until every byte has landed",
    ),
)


def overdue(now: float, since: NDArray[np.float64], limit: float) -> NDArray[np.bool_]:
    """Where a clock started at ``since`` has run ``limit`` seconds or more by
    ``now`` (a clock not started, NaN, never has: NaN compares False, quietly).
    Every layer's rule."""
    late: NDArray[np.bool_] = now - since >= limit
    return late


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
