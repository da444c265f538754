"""Several queues in one reduce, and a step that overlaps the forward pass.

A scheduler steps two or three queues per iteration (prefill: bootstrap and
in-flight; decode: handshake, prealloc and transfer). A :class:`StepGroup`
concatenates its steppers' buffers and reduces them in one collective per
group, then hands each stepper its segment; each queue gets its own
:class:`~lifecycle.result.StepResult`, and a divergence names the queue.

Segments line up on every rank because each segment's size comes from
agreed data; the first step of a group of two or more also reduces a small
fixed-size *hello* (a hash of the queues and their configurations), so
ranks that built their groups differently raise instead of handing gloo
buffers of different sizes.

A group applies all its queues or none: every queue's checks (which read
agreed data only, so every rank decides alike) pass before any queue's table
changes.

``start`` prepares and launches the reduce asynchronously; ``finish`` waits
and applies. In between the scheduler may run its forward pass, read the
tables and poll its own engine, but not add, remove or abort requests in a
stepped table: those raise :class:`~lifecycle.errors.TableBusy` until
``finish`` has run. With ``start(..., worker=True)`` the local work itself
(the hooks, verdicts, gates and packing) and the launch run on the group's
own thread, so the caller is blocked only to hand the step over and to
apply it; the hooks then run while the forward pass does, and must be safe
to call from another thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import partial

import numpy as np
from numpy.typing import NDArray

from lifecycle.config import tag_word
from lifecycle.core.packing import PAD, buffer_size
from lifecycle.core.step import RawStepper
from lifecycle.drive.collective import Collective, Pending, start_min
from lifecycle.drive.diagnose import with_stuck
from lifecycle.drive.group_wire import fetch_origins, hello
from lifecycle.drive.worker import Job, Turn, Worker, take_turn, wait_launches
from lifecycle.errors import InvalidArgument, StepInFlight, TableBusy
from lifecycle.result import StepResult

__all__ = ["StepGroup"]

logger = logging.getLogger(__name__)


class StepGroup:
    """Steps several queues' steppers (same rank) with one reduce per group."""

    def __init__(self, steppers: Iterable[RawStepper]) -> None:
        items = tuple(steppers) if isinstance(steppers, Iterable) else None
        if not items:
            raise InvalidArgument("StepGroup steppers", steppers, "at least one Stepper")
        for s in items:
            if not isinstance(s, RawStepper):
                raise InvalidArgument("StepGroup steppers", s, "a Stepper")
        rank = items[0].rank
        for s in items:
            if s.rank != rank:
                raise InvalidArgument(
                    "StepGroup steppers",
                    sorted({x.rank for x in items}),
                    "steppers of one rank (a group is what one rank steps)",
                    rank,
                )
        if len({id(s) for s in items}) != len(items):
            raise InvalidArgument(
                "StepGroup steppers", [s.queue for s in items], "each stepper once", rank
            )
        if len({id(s.table) for s in items}) != len(items):
            raise InvalidArgument(
                "StepGroup steppers",
                [s.queue for s in items],
                "one stepper per table (two would apply one step twice to the same rows)",
                rank,
            )
        names = [s.queue for s in items]
        if len(items) > 1 and len(set(names)) != len(names):
            raise InvalidArgument(
                "StepGroup queue names",
                names,
                "a distinct name for each queue (Stepper(queue=...))",
                rank,
            )
        self.steppers = items
        self._hello_done = len(items) == 1
        self._work: Pending | Job | None = None
        self._worker: Worker | None = None
        self._coll: Collective | None = None
        self._buf: NDArray[np.uint8] | None = None
        #: the results of the step in flight, when _ahead found nothing moved
        self._ready: tuple[object, list[StepResult]] | None = None
        #: names the step in flight (a callback of an earlier one may run late)
        self._step: object = None
        #: the buffer the steppers of a group of several pack into (one
        #: segment each, at these capacities), reduced as it is
        self._joint: NDArray[np.uint8] | None = None
        self._caps: tuple[int, ...] = ()
        self._areas: list[NDArray[np.uint8]] = []

    def step(self, collective: Collective, tag: int | None = None) -> tuple[StepResult, ...]:
        """prepare every queue -> one MIN all-reduce -> apply every queue."""
        # start() and finish() in one; while the reduce is in flight this
        # thread builds the results of a step where nothing moves
        self._begin(collective, tag)
        self._mark()
        try:
            buf = self._prepare(tag)
            try:
                wait_launches()
                work = start_min(collective, buf)
                ready = self._unchanged_results()
                work.wait()
            except BaseException:
                self._release()
                raise
            return self._conclude(buf, collective, ready)
        finally:
            self._landed()

    def _unchanged_results(self) -> list[StepResult] | None:
        """Each queue's result for a step where nothing moves (reads only:
        the frames and the tables, busy until the step is applied)."""
        try:
            out = []
            for s in self.steppers:
                out.append(s.unchanged_result())
        except Exception:  # the step builds them itself if it needs them
            return None
        return out

    def _begin(self, collective: Collective, tag: int | None) -> None:
        """Refuse or take the step (``_mark`` then puts the steppers in flight)."""
        self._refuse(collective, tag)
        self._coll, self._buf, self._ready = collective, None, None
        self._step = object()

    def _mark(self) -> None:
        for s in self.steppers:
            s.in_flight = True

    def _refuse(self, collective: Collective, tag: int | None) -> None:
        """Everything that can refuse a start does so before the first collective."""
        if self._work is not None:
            raise RuntimeError("start() twice: call finish() for the step in flight first")
        if tag is not None:
            tag_word(tag, self.steppers[0].rank)
        for s in self.steppers:
            if s.in_flight:
                raise StepInFlight(s.rank, s.queue, "start")
            if s.table.busy:
                raise TableBusy(s.rank)
        if not self._hello_done:
            wait_launches()
            self._hello(collective)

    def start(
        self,
        collective: Collective,
        tag: int | None = None,
        *,
        ahead: bool = True,
        worker: bool = False,
    ) -> None:
        """Prepare every queue and launch the reduce (``ahead``: build the
        results of a step where nothing moved as soon as the reduce lands;
        ``worker``: prepare and launch on the group's own thread, returning at
        once; what that raises, ``finish`` raises)."""
        self._begin(collective, tag)
        if worker:
            if self._worker is None:
                self._worker = Worker(self)  # before anything is in flight
            self._mark()
            for s in self.steppers:
                s.table.order()  # the worker only reads the tables
                s.table.busy = True
        else:
            self._mark()
            try:
                self._work = self._launch(collective, tag, ahead)
            except BaseException:  # nothing is in flight after all
                self._landed()
                raise
            return
        prev, mine = take_turn()

        def job() -> Pending:
            try:
                return self._launch(collective, tag, ahead, prev)
            finally:
                mine.release()

        self._work = self._worker.submit(job)

    def _launch(
        self, collective: Collective, tag: int | None, ahead: bool, after: Turn | None = None
    ) -> Pending:
        """Prepare and launch (``after``: the launch this one must follow; on
        the caller's thread, every launch of its earlier worker starts)."""
        buf = self._prepare(tag)
        try:
            if after is not None:
                after.wait()
            else:  # on the caller's thread (a worker's own thread never has a tail)
                wait_launches()
            work = start_min(collective, buf)
        except BaseException:
            self._release()
            raise
        then = getattr(work, "then", None) if ahead else None
        if then is not None:
            try:
                then(partial(self._ahead, self._step, buf))
            except Exception:  # launched all the same: finish does it all
                logger.debug("a pending reduce refused then(); finish applies the step")
        return work

    def _prepare(self, tag: int | None) -> NDArray[np.uint8]:
        """Every queue's local work; the buffer to reduce (the tables are busy from here)."""
        steppers = self.steppers
        if len(steppers) > 1:
            self._place()
        try:
            bufs = [s._prepare(tag) for s in steppers]
        except BaseException:
            self._release()
            raise
        buf = bufs[0] if len(bufs) == 1 else self._join(bufs)
        for s in steppers:
            s.table.busy = True
        self._buf = buf
        return buf

    def _place(self) -> None:
        """Give each stepper its segment of one buffer at its capacity (a new
        buffer only when some capacity changed)."""
        caps = tuple([s.capacity for s in self.steppers])
        if caps == self._caps:
            return
        sizes = [buffer_size(c) for c in caps]
        joint = np.full(sum(sizes), PAD, dtype=np.uint8)
        areas, at = [], 0
        for s, size in zip(self.steppers, sizes):
            area = joint[at : at + size]
            s._place(area)
            areas.append(area)
            at += size
        self._joint, self._caps, self._areas = joint, caps, areas

    def _join(self, bufs: list[NDArray[np.uint8]]) -> NDArray[np.uint8]:
        """The steppers' buffers as one: the joint buffer when each packed
        into its own segment (else, e.g. after a resize, a joined copy)."""
        joint = self._joint
        if joint is not None and all([b is a for b, a in zip(bufs, self._areas)]):
            return joint
        return np.concatenate(bufs)

    def _ahead(self, step: object, buf: NDArray[np.uint8]) -> None:
        """Run where the reduce of ``step`` completes, while the caller runs
        its forward pass: for the common step (nothing moved), build the
        results. Reads only (the tables are busy until ``finish``, which
        applies them). A torch future calls back even when its reduce
        failed, maybe once the next step has begun: such a late call does
        nothing, and ``finish`` takes only results tagged with its own step."""
        if step is not self._step:
            return
        try:
            segs = self._split(buf)
            if self._all_unchanged(buf, segs):
                self._ready = (step, [s.unchanged_result() for s in self.steppers])
        except Exception:  # finish does it all again, and raises what it must
            pass

    def finish(self) -> tuple[StepResult, ...]:
        work, coll = self._work, self._coll
        if work is None or coll is None:
            raise RuntimeError("finish() without start()")
        self._work = None
        try:
            return self._finish(work, coll)
        finally:
            self._landed()

    def _landed(self) -> None:
        """The step in flight is over (applied, or refused): the steppers are the caller's."""
        for s in self.steppers:
            s.in_flight = False

    def _finish(self, work: Pending | Job, coll: Collective) -> tuple[StepResult, ...]:
        try:
            if isinstance(work, Job):
                work = work.wait()  # raises what the worker's start raised
            buf = self._buf
            assert buf is not None
            work.wait()
        except BaseException:
            self._release()
            raise
        ready, self._ready = self._ready, None
        if ready is not None and ready[0] is self._step:
            try:
                return tuple(
                    self._stuck(coll, s, s._commit_unchanged(r))
                    for s, r in zip(self.steppers, ready[1])
                )
            finally:
                self._release()
        return self._conclude(buf, coll)

    def _conclude(
        self, buf: NDArray[np.uint8], coll: Collective, ready: list[StepResult] | None = None
    ) -> tuple[StepResult, ...]:
        """Apply the reduced ``buf`` to every queue (the tables are freed;
        ``ready``: the results of the step if nothing moved, built already)."""
        try:
            segs = self._split(buf)
            if self._all_unchanged(buf, segs):
                if ready is None:
                    return tuple(self._stuck(coll, s, s._commit_unchanged()) for s in self.steppers)
                return tuple(
                    self._stuck(coll, s, s._commit_unchanged(r))
                    for s, r in zip(self.steppers, ready)
                )
            if any([s._resize(seg) for s, seg in zip(self.steppers, segs)]):
                bufs = [s._repack() for s in self.steppers]
                buf = bufs[0] if len(bufs) == 1 else np.concatenate(bufs)
                wait_launches()
                coll.all_reduce_min(buf)
                segs = self._split(buf)
            fetches = [s._origins(seg) for s, seg in zip(self.steppers, segs)]
            origins = self._fetch(coll, fetches)
            # every queue's checks pass before any queue changes: a queue that
            # raises (on every rank alike) leaves the whole group unapplied
            settled = [s._settle(seg, o) for s, seg, o in zip(self.steppers, segs, origins)]
        finally:
            self._release()
        results = [s._commit(x) for s, x in zip(self.steppers, settled)]
        return tuple(self._stuck(coll, s, r) for s, r in zip(self.steppers, results))

    def _all_unchanged(self, buf: NDArray[np.uint8], segs: list[NDArray[np.uint8]]) -> bool:
        """Every queue's :meth:`Stepper.unchanged` (the common step)."""
        steppers = self.steppers
        if len(steppers) == 1:
            return steppers[0]._unchanged(segs[0])
        whole, at = buf.tobytes(), 0  # one copy serves every queue's comparison
        for s, seg in zip(steppers, segs):
            if not s._unchanged_in(whole, at):
                return all([s._unchanged(seg) for s, seg in zip(steppers, segs)])
            at += seg.size
        return True

    def _release(self) -> None:
        for s in self.steppers:
            s.table.busy = False

    def _split(self, buf: NDArray[np.uint8]) -> list[NDArray[np.uint8]]:
        if len(self.steppers) == 1 and buf.size == buffer_size(self.steppers[0].capacity):
            return [buf]
        out, at = [], 0
        for s in self.steppers:
            size = buffer_size(s.capacity)
            out.append(buf[at : at + size])
            at += size
        return out

    @staticmethod
    def _fetch(
        coll: Collective, fetches: list[NDArray[np.int32] | None]
    ) -> list[NDArray[np.int32] | None]:
        return fetch_origins(coll, fetches)

    def _hello(self, collective: Collective) -> None:
        hello(self.steppers, collective)
        self._hello_done = True

    @staticmethod
    def _stuck(coll: Collective, s: RawStepper, result: StepResult) -> StepResult:
        k = s.config.stuck_after
        rows = None if k is None else s.stuck_rows(result, k)
        if rows is None:
            return result
        wait_launches()
        return with_stuck(s.last_step(), coll, result, rows)
