"""One consensus step over the live requests of one queue, on one rank.

Theory of operation
-------------------
Per rank, for the ordered list of live requests of one queue, a step is five
stages; every docstring numbers them so:

1. **frame** (:mod:`~lifecycle.core.frame`) -- the rows not yet agreed
   terminal, gathered once per change of the table (terminal rows latch).
2. **observe** (:mod:`~lifecycle.core.observe`) -- one raw status per active
   row, every poller error contained as a verdict.
3. **verdicts and gates** (:mod:`~lifecycle.core.sources`, rules in
   :mod:`lifecycle.rules.graph`) -- every source of :data:`VERDICTS` as a mask,
   the smallest reason code wins and turns the value into Failed; then the
   :data:`GATES` may demote a local Success to Transferring.
4. **reduce** (:mod:`~lifecycle.core.packing`) -- the caller's collective
   MIN-reduces a byte per active row, a header that catches diverging lists,
   configurations, queues and iterations, and the failure slots that say
   which rank each new failure came from (a second small reduce asks only
   when several ranks failed rows and the slots cannot say).
5. **apply** (:mod:`~lifecycle.core.settle`) -- every row moves to its agreed
   status along a declared edge; a move the graph lacks raises before
   anything changes.

Steps 1-3 are :meth:`RawStepper.prepare`; :meth:`RawStepper.origins` and
:meth:`RawStepper.apply` follow the reduces. This is the sans-I/O stepper:
nothing here does I/O, and nothing here imports what does. The drivers
compose it with a :class:`~lifecycle.drive.collective.Collective`:
:class:`~lifecycle.drive.stepper.Stepper` (``step``, ``start``/``finish`` to
overlap the reduce with the forward pass, ``diagnose``) and
:class:`~lifecycle.drive.group.StepGroup` (several queues in one reduce).

The buffer has an agreed *capacity* (:mod:`lifecycle.core.capacity`): the first
step of a stepper reduces at a fixed size (:data:`FIRST_CAPACITY`) whatever
its configuration, and every later size is computed from reduced headers
only, so the sizes of the collectives always match across ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import NDArray

from lifecycle import validate
from lifecycle.config import (
    FIRST_CAPACITY,
    MAX_CAPACITY,
    MAX_RANK,
    Reading,
    StepConfig,
    read_clock,
    require_method,
    tag_word,
)
from lifecycle.core.buffer import StepBuffer
from lifecycle.core.capacity import Capacity
from lifecycle.core.fingerprint import stable_hash
from lifecycle.core.frame import Frame
from lifecycle.core.local import LocalStage
from lifecycle.core.observe import Observation
from lifecycle.core.packing import Header, buffer_size
from lifecycle.core.settle import Settled, Who, settle, unchanged_result
from lifecycle.errors import InvalidArgument, ReducedBufferMismatch, StepInFlight
from lifecycle.protocols import BatchPoller, FaultHook, Gate, MetadataSource, StagingGate
from lifecycle.result import LastStep, StepResult
from lifecycle.status import TERMINAL
from lifecycle.table import RequestTable

__all__ = ["RawStepper"]


class RawStepper:
    """Steps the requests of one :class:`RequestTable` (one queue) on one rank,
    sans I/O: it makes the buffer to reduce and applies the reduced one."""

    def __init__(
        self,
        table: RequestTable,
        rank: int,
        *,
        poller: BatchPoller | None = None,
        staging: StagingGate | None = None,
        metadata: MetadataSource | None = None,
        gates: Sequence[Gate] = (),
        faults: FaultHook | None = None,
        config: StepConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        queue: str = "",
        agreed_capacity: int | None = None,
    ) -> None:
        if not isinstance(table, RequestTable):
            raise InvalidArgument("Stepper table", table, "a RequestTable")
        rank = validate.integer(rank, "Stepper rank", 0, MAX_RANK)
        if config is not None and not isinstance(config, StepConfig):
            raise InvalidArgument("Stepper config", config, "a StepConfig", rank)
        if not isinstance(queue, str):
            raise InvalidArgument("Stepper queue", queue, "a str naming the queue", rank)
        if not callable(clock):
            raise InvalidArgument("Stepper clock", clock, "a callable returning seconds", rank)
        require_method(poller, "poll_many", "Stepper poller")
        require_method(staging, "advance", "Stepper staging")
        require_method(staging, "pending", "Stepper staging")
        require_method(metadata, "landed", "Stepper metadata")
        require_method(faults, "inject", "Stepper faults")
        gates = tuple(gates)
        for g in gates:
            require_method(g, "closed", "Stepper gate")
        if agreed_capacity is not None:
            agreed_capacity = validate.integer(
                agreed_capacity, "Stepper agreed_capacity", 1, MAX_CAPACITY, rank
            )
        self.table = table
        self.rank = rank
        self.queue = queue
        self.config = config or StepConfig()
        self.clock = clock
        self.local = LocalStage(
            rank, poller=poller, staging=staging, metadata=metadata, gates=gates, faults=faults
        )
        table.rank = rank
        if table.step_no == 0 or np.isnan(table.now):
            # rows added before any stepper had a clock entered now
            now = float(clock())
            live = table.order()
            unset = live[np.isnan(table.entered_time[live])]
            table.entered_time[unset] = now
            table.now = now
        pool = getattr(metadata, "size", None)
        self._pool = pool if validate.is_integer(pool) else None
        self._by_index = poller is not None and not getattr(poller, "by_room", False)
        #: set only from reduced headers (or by a caller that got it that way)
        self._cap = Capacity.first(FIRST_CAPACITY if agreed_capacity is None else agreed_capacity)
        #: the capacity floor this rank asks for (its reduce agrees the largest)
        self._want = Capacity.first(self.config.initial_capacity).rows
        self._frame: Frame | None = None
        self._buffer = StepBuffer(rank, self.config.fingerprint, stable_hash(queue))
        self._tag = 0
        self._prepared = False
        self._settled: Settled | None = None
        #: (a reduced buffer, its header) of the step in hand
        self._seen: tuple[NDArray[np.uint8], Header] | None = None
        #: set by a group between its start() and finish(): the step in flight
        #: owns the stepper, and the hand-driven protocol below refuses
        self.in_flight = False

    @property
    def capacity(self) -> int:
        """The rows the step's buffer holds (agreed: the same on every rank)."""
        return self._cap.rows

    def _idle(self, method: str, reduced: object = None) -> None:
        """Refuse a hand-driven call during a step in flight, or (``reduced``
        given) with a buffer that is not this step's; before anything changes."""
        if self.in_flight:
            raise StepInFlight(self.rank, self.queue, method)
        if reduced is None:
            return
        size = buffer_size(self.capacity)
        if not (
            isinstance(reduced, np.ndarray)
            and reduced.dtype == np.uint8
            and reduced.shape == (size,)
        ):
            want = f"a uint8 array of {size} bytes (capacity {self.capacity})"
            raise ReducedBufferMismatch(
                self.rank, self.queue, method, "the reduced buffer", want, reduced
            )

    # -- the sans-IO protocol ------------------------------------------------
    def prepare(self, tag: int | None = None) -> NDArray[np.uint8]:
        """Local work of a step; returns the uint8 buffer to MIN-reduce."""
        self._idle("prepare")
        return self._prepare(tag)

    def frame(self) -> Frame:
        """The rows the next step works on (rebuilt when the table changed)."""
        t = self.table
        f = self._frame
        if t._limbo or f is None or f.key != (t.version, t.columns_version, t.terminal_count):
            meta = self.local.metadata is not None
            f = self._frame = Frame.of(t, f, self._pool, self._by_index, meta)
        return f

    def _prepare(
        self,
        tag: int | None,
        observed: Observation | None = None,
        read: Reading | None = None,
        frame: Frame | None = None,
    ) -> NDArray[np.uint8]:
        # ``read``, ``frame``: the clock's reading and the rows ``observed`` polled
        word = 0 if tag is None else tag_word(tag, self.rank)
        t = self.table
        f = self.frame() if frame is None else frame
        now, late = read or read_clock(self.clock, self.rank, t.now)
        self.local.run(t, f, self.config, now, t.step_no + 1, late, observed)
        self._tag = word
        self._prepared = True
        self._settled = None
        self._seen = None
        return self._pack()

    def _pack(self) -> NDArray[np.uint8]:
        f, cap = self._frame, self.capacity
        assert f is not None
        return self._buffer.pack(f, self.local, cap, self._tag, self._want, self._failer(cap))

    def _failer(self, k: int) -> bool:
        """Does this rank fail one of its first ``k`` active rows (those it packs)?"""
        return self.local.failed_in(k).size > 0

    def resize(self, reduced: NDArray[np.uint8]) -> bool:
        """After a reduce: True if some rank's list outgrew the capacity.

        Capacity then grows and :meth:`repack` gives the buffer to reduce again.
        """
        self._idle("resize", reduced)
        return self._resize(reduced)

    def _header(self, reduced: NDArray[np.uint8]) -> Header:
        """The reduced buffer's header, read once per buffer of this step
        (resize, then origins, look at the same one)."""
        seen = self._seen
        if seen is not None and seen[0] is reduced:
            return seen[1]
        hdr = Header(reduced)
        self._seen = (reduced, hdr)
        return hdr

    def _resize(self, reduced: NDArray[np.uint8]) -> bool:
        hdr = self._header(reduced)
        if not hdr.agreed:
            return False  # every rank raises in origins()/apply() instead
        cap = self._cap = self._cap.with_floor(hdr.floor)
        grown = cap.grown(hdr.need)
        if grown is None:
            return False
        self._cap = grown
        return True

    def unchanged(self, reduced: NDArray[np.uint8]) -> bool:
        """True when the reduce returned this rank's own header and every
        active row at its agreed status: every rank sent the same list,
        configuration, queue, tag and sizes, and nothing moves. Then nothing
        can raise, no origin is fetched, and :meth:`commit_unchanged` applies
        the step (the common step, in a few byte comparisons)."""
        self._idle("unchanged", reduced)
        return self._unchanged(reduced)

    def _unchanged(self, reduced: NDArray[np.uint8]) -> bool:
        f = self._frame
        if not self._prepared or f is None or f.n > self.capacity:
            return False
        return self._buffer.unchanged(reduced, f)

    def _unchanged_in(self, whole: bytes, at: int) -> bool:
        """:meth:`unchanged` for this stepper's segment at ``at`` of a group's
        reduced buffer, given as bytes."""
        f = self._frame
        if not self._prepared or f is None or f.n > self.capacity:
            return False
        return self._buffer.unchanged_in(whole, at, f)

    def commit_unchanged(self, result: StepResult | None = None) -> StepResult:
        """Apply a step :meth:`unchanged` accepted (what :meth:`apply` would do);
        ``result``: its :meth:`unchanged_result`, if built."""
        self._idle("commit_unchanged")
        return self._commit_unchanged(result)

    def unchanged_result(self) -> StepResult:
        """The result of the prepared step, should nothing move (reads only;
        also readies the words the check after the reduce compares)."""
        f = self._frame
        assert f is not None
        f.unchanged_words()
        return unchanged_result(self.queue, self.local, f, self.table.step_no + 1)

    def _commit_unchanged(self, result: StepResult | None = None) -> StepResult:
        result = result or self.unchanged_result()
        self._commit_quiet()
        return result

    def _commit_quiet(self) -> None:
        """:meth:`commit_unchanged` for a driver that builds no result."""
        f = self._frame
        assert f is not None and self._prepared
        # the header came back as this rank sent it: its own floor was agreed
        cap = self._cap
        if cap.floor < self._want or cap.rows < cap.floor or f.n * 4 < cap.rows:
            self._cap = cap.with_floor(self._want).settled(f.n)  # else: nothing changes
        self._prepared = False
        self._settled = None
        self.table.step_no, self.table.now = self.table.step_no + 1, self.local.now

    def repack(self) -> NDArray[np.uint8]:
        """The prepared local values at the current capacity (no second poll)."""
        self._idle("repack")
        return self._repack()

    def _repack(self) -> NDArray[np.uint8]:
        if not self._prepared or self._frame is None:
            raise RuntimeError("repack() before prepare()")
        self._seen = None
        return self._pack()

    def origins(self, reduced: NDArray[np.uint8]) -> NDArray[np.int32] | None:
        """After the last reduce: the int32 buffer to MIN-reduce for the origin
        ranks of new failures, or None when this step needs none: no new
        failure, a single rank failed rows (the header says so), or the
        failure slots name every origin (the same answer on every rank). Raises
        :class:`CollectiveMismatch` on every rank when the ranks' lists,
        configurations, queues or tags differ."""
        self._idle("origins", reduced)
        return self._origins(reduced)

    def _origins(self, reduced: NDArray[np.uint8]) -> NDArray[np.int32] | None:
        if not self._prepared or self._frame is None:
            raise RuntimeError("origins() before prepare(): a step is prepare, reduce, apply")
        if self._settled is None:
            who = Who(self.rank, self.queue, self.config)
            hdr = self._header(reduced)
            self._settled = settle(
                who, self._frame, hdr, reduced, self.capacity, self._tag, self.local
            )
        return self._settled.fetch

    def apply(
        self, reduced: NDArray[np.uint8], origins: NDArray[np.int32] | None = None
    ) -> StepResult:
        """Advance every request to its agreed status; returns what happened."""
        self._idle("apply", reduced)
        if origins is None and self._unchanged(reduced):
            return self._commit_unchanged()
        return self._commit(self._settle(reduced, origins))

    def settle(self, reduced: NDArray[np.uint8], origins: NDArray[np.int32] | None) -> Settled:
        """The checks of :meth:`apply`, changing nothing: raises what apply
        would raise, else returns what :meth:`commit` applies."""
        self._idle("settle", reduced)
        return self._settle(reduced, origins, "settle")

    def _settle(
        self,
        reduced: NDArray[np.uint8],
        origins: NDArray[np.int32] | None,
        method: str = "apply",
    ) -> Settled:
        fetch = self._origins(reduced)
        if fetch is not None and origins is None:
            raise RuntimeError(
                "apply(): this step has new failures; MIN-reduce origins(reduced) over the "
                "group and pass it as apply(reduced, origins)"
            )
        if fetch is not None and not (
            isinstance(origins, np.ndarray)
            and origins.dtype == np.int32
            and origins.shape == fetch.shape
        ):
            want = f"an int32 array of {fetch.size} entries (what origins() returned, reduced)"
            raise ReducedBufferMismatch(self.rank, self.queue, method, "origins", want, origins)
        settled = self._settled
        assert settled is not None
        settled.plan(Who(self.rank, self.queue, self.config), self.local, origins)
        return settled

    def commit(self, settled: Settled) -> StepResult:
        """Apply a settled step (from :meth:`settle`) to the table."""
        self._idle("commit")
        return self._commit(settled)

    def _commit(self, settled: Settled) -> StepResult:
        if settled is not self._settled:
            raise RuntimeError("commit(): pass the outcome settle() returned for this step")
        self._prepared = False
        self._settled = None
        self._cap = self._cap.settled(settled.hdr.need)
        return settled.commit(self.table, self.local, self.queue, self.config.recovery)

    @property
    def last_local(self) -> tuple[NDArray[np.uint64], NDArray[np.int8], NDArray[np.int8]]:
        """(rooms, gated local status, local reason) of the last prepare over the
        active rows: what this rank contributed to the reduce."""
        rooms = self._frame.rooms if self._frame is not None else np.empty(0, np.uint64)
        return rooms, self.local.values, self.local.reasons()

    @property
    def record_holds(self) -> bool:
        """Whether each step records which gate held which request (:meth:`last_holds`)."""
        return self.local.explain

    @record_holds.setter
    def record_holds(self, on: bool) -> None:
        self.local.explain = bool(on)

    def last_holds(self) -> dict[str, NDArray[np.uint64]]:
        """With :attr:`record_holds`: the rooms each gate held at Transferring on
        this rank in the last prepare (its poll said Success), by gate name
        (``GATES``: staging, metadata, user); empty otherwise."""
        f = self._frame
        if f is None or not self.local.held:
            return {}
        return {gate: f.rooms[pos] for gate, pos in self.local.held.items()}

    # -- for the drivers ---------------------------------------------------
    def _place(self, area: NDArray[np.uint8]) -> None:
        """Pack into ``area`` (this stepper's segment of a group's buffer)."""
        self._buffer.place(area, self.capacity)

    def stuck_rows(self, result: StepResult, k: int) -> NDArray[np.int64] | None:
        """Active rows of the last step that have sat at one status for a
        multiple of ``k`` steps (agreed data: every rank finds the same)."""
        f = self._frame
        if f is None or not f.n:
            return None
        t = self.table
        age = result.step - t.entered_step[f.rows]
        stuck = ~TERMINAL[t.state[f.rows]] & (age >= k) & (age % k == 0)
        return np.flatnonzero(stuck) if stuck.any() else None

    def last_step(self) -> LastStep | None:
        """A frozen copy of the last step's active rows: agreed statuses and this
        rank's own words (None before a step, or if it was left half done)."""
        f = self._frame
        if f is None or self.local.values.size != f.n:
            return None
        t = self.table
        return LastStep(
            rank=self.rank,
            step=t.step_no,
            rooms=f.rooms.copy(),
            statuses=t.state[f.rows],
            entered_step=t.entered_step[f.rows],
            words=self.local.words(),
        )
