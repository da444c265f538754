"""The stepper a scheduler uses: the sans-I/O :class:`~lifecycle.core.step.RawStepper`
driven over a :class:`~lifecycle.drive.collective.Collective`.

``step`` runs the five stages of a step (see :mod:`lifecycle.core.step`) with one
MIN all-reduce; ``start``/``finish`` split it around the forward pass;
``diagnose`` asks every rank who holds each request back. Each goes through
a :class:`~lifecycle.drive.group.StepGroup` of this one queue, so a lone stepper and
a group share one driver.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from lifecycle.config import Reading, read_clock
from lifecycle.core.observe import Observation, Polled, observe
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

    def step_polled(
        self, collective: Collective, polled: Polled | None = None
    ) -> tuple[NDArray[np.int8], StepResult | None]:
        """:meth:`step` for a driver that needs the agreed statuses first:
        (the whole list's agreed statuses, the step's result). On a step where
        nothing moved and no row is terminal (the common one) no result is
        built: it is None, and the statuses are the table's own column (read
        them before the next step). ``polled``: each active row's answer, in
        the frame's order, from a driver without a batch poller that polled
        its handles itself (see :func:`~lifecycle.core.observe.poll_each`).
        The reduce runs on this thread, overlapping nothing."""
        group = self._as_group()
        group._begin(collective, None)
        group._mark()
        try:
            t, obs = self.table, None
            read = read_clock(self.clock, self.rank, t.now)
            if polled is not None:
                if self.local.poller is not None:
                    raise ValueError("step_polled(polled=...) of a stepper with a batch poller")
                fr = self.frame()
                obs = observe(None, t.handles, fr.rows, fr.rooms, fr.hidx, None, self.rank, polled)
            buf = None if obs is None else self._quick(obs, read)
            if buf is None:
                buf = self._prepare(None, obs, read)  # raises before the table is busy
            self.table.busy = True
            try:
                wait_launches()
                collective.all_reduce_min(buf)
            except BaseException:
                group._release()
                raise
            if not self._unchanged(buf):
                res = group._conclude(buf, collective)[0]
                return res.statuses, res
            group._release()
            f = self._frame
            assert f is not None
            if self.table.terminal_count or self.config.stuck_after is not None:
                res = group._stuck(collective, self, self._commit_unchanged())
                return res.statuses, res
            self._commit_quiet()
            return f.state_all, None
        finally:
            group._landed()

    def _quick(self, obs: Observation, read: Reading) -> NDArray[np.uint8] | None:
        """prepare() for a step after a common one where only the poll acts
        (:meth:`LocalStage.quiet`, :meth:`StepBuffer.repack`): what prepare
        would pack, in fewer calls; None where prepare must run."""
        f = self._frame
        if f is None or read[1] is not None:
            return None
        if not self.local.quiet(self.table, f, self.config, obs, read[0]):
            return None
        buf = self._buffer.repack(f, obs.raw, self._cap.rows, self._want)
        if buf is None:
            return None
        self._tag, self._prepared, self._settled, self._seen = 0, True, None, None
        return buf

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
