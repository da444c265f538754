"""The stepper a scheduler uses: the sans-I/O :class:`~lifecycle.core.step.RawStepper`
driven over a :class:`~lifecycle.drive.collective.Collective`.

``step`` runs the five stages of a step (see :mod:`lifecycle.core.step`) with one
MIN all-reduce; ``start``/``finish`` split it around the forward pass;
``diagnose`` asks every rank who holds each request back. Each goes through
a :class:`~lifecycle.drive.group.StepGroup` of this one queue, so a lone stepper and
a group share one driver; a lone stepper's ``step`` (with a batch poller) and
``step_polled`` take a quick step of their own where only the poll acts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from lifecycle.config import read_clock, tag_word
from lifecycle.core.frame import Frame
from lifecycle.core.observe import LONG, Polled, observe, status_bytes, statuses
from lifecycle.core.settle import unchanged_result
from lifecycle.core.step import RawStepper
from lifecycle.drive.collective import Collective, start_min
from lifecycle.drive.diagnose import diagnose
from lifecycle.drive.group import StepGroup
from lifecycle.drive.worker import wait_launches
from lifecycle.result import StepResult, StuckReport

__all__ = ["Stepper"]


class Stepper(RawStepper):
    """Steps the requests of one :class:`~lifecycle.table.RequestTable` (one
    queue) on one rank, over a collective."""

    _group: StepGroup | None = None

    @property
    def _by_batch(self) -> bool:
        """A batch poller and no staging gate (which advances before the poll):
        a step may poll first, then take the quick step or prepare with that poll."""
        local = self.local
        return local.poller is not None and local.staging is None

    def _as_group(self) -> StepGroup:
        if self._group is None:
            self._group = StepGroup([self])
        return self._group

    def step(self, collective: Collective, tag: int | None = None) -> StepResult:
        """prepare -> MIN all-reduce over ``collective`` -> apply.

        With a batch poller and no staging gate the batch poll runs first, and
        a step where only the poll acts after a common step (every answer a
        live status, no gate with a Success to decide, no fault hook, abort,
        timeout, stuck report, terminal row or clock error) packs only its
        words and builds its result while the reduce is in flight
        (:meth:`step_polled`'s quick step)."""
        if self._by_batch:
            # a lone stepper with a batch poller: the common step in a few calls
            res = self._step_polled(collective, None, True, tag)[1]
            if res is None:  # nothing moved: the result the group would build
                f = self._frame
                assert f is not None
                f.unchanged_words()
                res = unchanged_result(self.queue, self.local, f, self.table.step_no)
            return res
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
        The reduce runs on this thread, overlapping nothing.

        After a common step, a step where only the poll acts (every answer a
        live status, no gate with a Success to decide, no fault hook, abort,
        timeout or stuck report) packs only the words, in a few calls."""
        return self._step_polled(collective, polled, False)

    def _step_polled(
        self, collective: Collective, polled: Polled | None, result: bool, tag: int | None = None
    ) -> tuple[NDArray[np.int8], StepResult | None]:
        """:meth:`step_polled`; ``result``: a quick step builds the result of a
        step where nothing moved while its reduce is in flight; ``tag``: as
        :meth:`step`'s."""
        group, t = self._as_group(), self.table
        if group._work is not None or self.in_flight or t.busy:
            group._begin(collective, tag)  # raises what a step here raises
        word = 0 if tag is None else tag_word(tag, self.rank)  # raises for a bad tag
        if polled is not None and self.local.poller is not None:
            raise ValueError("step_polled(polled=...) of a stepper with a batch poller")
        read = read_clock(self.clock, self.rank, t.now)
        f, values, obs = self.frame(), None, None
        if self._by_batch and not (read[1] or t.terminal_count or self.config.stuck_after):
            # the batch poll, once: the quick step takes it, or prepare below (over
            # this frame, whatever the poll did); in flight, as in a group's step
            self.in_flight = True
            try:
                obs = observe(
                    self.local.poller, t.handles, f.rows, f.rooms, f.hidx, f.no_index, self.rank
                )
            finally:
                self.in_flight = False
            if obs.clean:  # a long list has no scan: its array serves
                words = obs.raw if obs.scan is None else obs.scan
                buf = self._quick(f, words, obs.given, read[0], obs.raw, word)
                if buf is not None:
                    return self._reduce_quick(collective, f, buf, result)
        elif polled is not None:
            answers = polled[0]
            if len(answers) != f.n:
                raise ValueError(f"{len(answers)} polled answers for {f.n} active rows")
            scan = None
            if not (polled[1] or read[1] or t.terminal_count or self.config.stuck_after):
                scan = status_bytes(answers)
                buf = None if scan is None else self._quick(f, scan, answers, read[0])
                if buf is not None:
                    return self._reduce_quick(collective, f, buf)
            values = statuses(answers, f.n, scan)
        group._begin(collective, tag)
        group._mark()
        try:
            if polled is not None:
                obs = observe(
                    None, t.handles, f.rows, f.rooms, f.hidx, None, self.rank, polled, values
                )
            buf = self._prepare(tag, obs, read, f)  # raises before the table is busy
            t.busy = True
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
            if t.terminal_count or self.config.stuck_after is not None:
                res = group._stuck(collective, self, self._commit_unchanged())
                return res.statuses, res
            self._commit_quiet()
            return f.state_all, None
        finally:
            group._landed()

    def _quick(
        self,
        f: Frame,
        scan: bytes | bytearray | NDArray[np.int8],
        answers: list[object] | NDArray[Any] | None,
        now: float,
        values: NDArray[np.int8] | None = None,
        tag: int = 0,
    ) -> NDArray[np.uint8] | None:
        """prepare() for a step where only the poll acts, after a common step
        (:meth:`LocalStage.quiet`, :meth:`StepBuffer.repack`): what prepare
        would pack, in a few calls; None, changing nothing, where it must run.
        ``values``: the answers as statuses, if taken already; ``tag``: the
        step's tag word."""
        if not self.local.quiet(self.table, f, self.config, scan):
            return None
        buf = self._buffer.repack(f, scan, self._cap.rows, self._want, tag)
        if buf is not None:
            if isinstance(scan, np.ndarray):
                self.local.took(scan if values is None else values, None, answers, now)
            else:
                if values is None:
                    values = np.frombuffer(scan, dtype=np.int8)
                self.local.took(values, bytes(scan), answers, now)
            self._tag, self._prepared, self._settled, self._seen = tag, True, None, None
        return buf

    def _pack(self) -> NDArray[np.uint8]:
        # after a common step, a step with no Failed value packs only its
        # words (StepBuffer.repack: what pack would write, in one call)
        f, local = self._frame, self.local
        if f is not None and local.values is local.unfailed:
            values = local.values  # a long list in one numpy call, a short one as bytes
            words = values if values.size > LONG else values.tobytes()
            buf = self._buffer.repack(f, words, self._cap.rows, self._want, self._tag)
            if buf is not None:
                return buf
        return super()._pack()

    def _reduce_quick(
        self, collective: Collective, f: Frame, buf: NDArray[np.uint8], result: bool = False
    ) -> tuple[NDArray[np.int8], StepResult | None]:
        """Reduce what :meth:`_quick` packed and apply it, as :meth:`step_polled`
        does (``result``: build the result of a step where nothing moved while
        the reduce is in flight, and return it if so)."""
        t, ready = self.table, None
        self.in_flight = t.busy = True
        self._as_group()._step = object()  # a late callback of an earlier start is not ours
        try:
            try:
                wait_launches()
                if result:
                    work = start_min(collective, buf)
                    ready = self._unchanged_ahead()
                    work.wait()
                else:
                    collective.all_reduce_min(buf)
            except BaseException:
                t.busy = False
                raise
            if self._buffer.unchanged(buf, f):
                t.busy = False
                self._commit_quiet()
                return f.state_all, ready
            res = self._as_group()._conclude(buf, collective)[0]
            return res.statuses, res
        finally:
            self.in_flight = False

    def _unchanged_ahead(self) -> StepResult | None:
        """:meth:`unchanged_result`, or None if it cannot be built (the step
        then builds what it needs after the reduce)."""
        try:
            return self.unchanged_result()
        except Exception:
            return None

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
