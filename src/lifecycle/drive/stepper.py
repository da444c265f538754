"""The stepper a scheduler uses: the sans-I/O :class:`~lifecycle.core.step.RawStepper`
driven over a :class:`~lifecycle.drive.collective.Collective`.

``step`` runs the five stages of a step (see :mod:`lifecycle.core.step`) with one
MIN all-reduce; ``start``/``finish`` split it around the forward pass;
``diagnose`` asks every rank who holds each request back. Each goes through
a :class:`~lifecycle.drive.group.StepGroup` of this one queue, so a lone stepper and
a group share one driver.
"""

from __future__ import annotations

from lifecycle.core.step import RawStepper
from lifecycle.drive.collective import Collective
from lifecycle.drive.diagnose import diagnose
from lifecycle.drive.group import StepGroup
from lifecycle.drive.worker import wait_launches
from lifecycle.result import StepResult, StuckReport

__all__ = ["Stepper"]


class Stepper(RawStepper):
    """Steps the requests of one :class:`~lifecycle.table.RequestTable` (one
    queue) on one rank, over a collective."""

    _group: StepGroup | None = None

    def _as_group(self) -> StepGroup:
        if self._group is None:
            self._group = StepGroup([self])
        return self._group

    def step(self, collective: Collective, tag: int | None = None) -> StepResult:
        """prepare -> MIN all-reduce over ``collective`` -> apply."""
        return self._as_group().step(collective, tag)[0]

    def start(
        self, collective: Collective, tag: int | None = None, *, worker: bool = False
    ) -> None:
        """Prepare and launch the reduce; the scheduler may run its forward pass
        until :meth:`finish` (see docs/scheduler-integration.md). ``worker``:
        prepare and launch on the stepper's own thread (the hooks then run
        during the forward pass)."""
        self._as_group().start(collective, tag, worker=worker)

    def finish(self) -> StepResult:
        return self._as_group().finish()[0]

    def diagnose(self, collective: Collective) -> tuple[StuckReport, ...]:
        """On demand (collectively: every rank must call it): who holds each
        non-terminal request of the last step back."""
        self._idle("diagnose")
        wait_launches()  # after the reduces of this thread's earlier worker starts
        return diagnose(self.last_step(), collective, None)
