"""One consensus step over a table of live requests.

Theory of operation
-------------------
Per rank, for the ordered list of live requests of one queue:

1. **observe** -- one raw status per non-terminal request: a backend's batch
   poll (one array) if it has one, else each request's ``poll()``. Terminal
   requests are not polled: their agreed status latches.
2. **local verdicts**, first one wins, each turning the local value into
   Failed with a reason: injected fault, bootstrap timeout, waiting timeout,
   local abort, poller exception, invalid status, metadata row corrupt, and
   finally a Failed reported by the backend itself (its reason, else UNKNOWN).
3. **gates**, in order staging, metadata, user gates: each may only apply
   its declared demotion Success -> Transferring (never hide a Failed).
4. **reduce** -- one MIN all-reduce per group of a buffer of packed words
   (:mod:`lifecycle.packing`) plus a header with the list length and a
   fingerprint of the ordered rooms.
5. **apply** -- every request moves to its agreed status along a declared
   edge (batch executor); a move the graph lacks raises before anything
   changes.

Steps 1-3 are :meth:`Stepper.prepare`, step 5 is :meth:`Stepper.apply`;
:meth:`Stepper.step` runs them around a :class:`~lifecycle.collective.Collective`.
Nothing here does I/O, so the same code runs under real gloo ranks, in a
single-threaded simulated world and under trace replay.

The buffer has an agreed *capacity* (the same on every rank because it only
changes from reduced data). When some rank's list outgrows it, the header
shows it to every rank, capacity grows, and the same local values are reduced
once more at the new size: every rank takes that decision from the same
reduced header, so the sizes of the collectives always match. Sized with
``initial_capacity`` at or above the largest queue, a step is always exactly
one all-reduce per group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs
import numpy as np
from numpy.typing import NDArray

from lifecycle import batch
from lifecycle.collective import Collective
from lifecycle.errors import (
    CollectiveMismatch,
    IllegalTransition,
    InvalidStatus,
    PartialPollError,
)
from lifecycle.packing import (
    HEADER,
    MAX_RANK,
    PAD,
    REASON_SHIFT,
    STATUS_SHIFT,
    Header,
    fingerprint,
    unpack,
    write_header,
)
from lifecycle.protocols import (
    BatchPoller,
    FaultHook,
    Gate,
    MetadataSource,
    StagingGate,
    StepContext,
)
from lifecycle.reasons import FailureReason
from lifecycle.status import NUM_STATUSES, TERMINAL, KVPoll
from lifecycle.table import RequestTable

__all__ = ["StepConfig", "StepResult", "Failure", "StuckReport", "Stepper"]

_F = np.int8(KVPoll.Failed)
_S = np.int8(KVPoll.Success)
_NONE = np.int8(FailureReason.NONE)
_UNKNOWN = np.int8(FailureReason.UNKNOWN)
#: reasons a backend may report (its own, or a peer's it relays); INVALID_STATUS
#: is the step's own verdict (it can make every rank raise), NONE is not a reason
_BACKEND_REASONS = np.array(
    [r for r in FailureReason if r not in (FailureReason.INVALID_STATUS, FailureReason.NONE)]
)


@attrs.frozen
class StepConfig:
    """How a stepper behaves; all deadlines off by default."""

    #: seconds a request may stay Bootstrapping before it fails (None: never)
    bootstrap_timeout: float | None = attrs.field(default=None)
    #: seconds from ``mark_metadata_sent`` until an unfinished request fails
    waiting_timeout: float | None = attrs.field(default=None)
    #: a poll value outside KVPoll: "raise" InvalidStatus on every rank after the
    #: reduce (nothing applied), or "fail" the request with reason INVALID_STATUS
    invalid_status: Literal["raise", "fail"] = "raise"
    #: report requests that have not changed status for this many steps
    stuck_after: int | None = None
    #: agreed buffer capacity to start with (rounded up to a power of two)
    initial_capacity: int = 64

    @bootstrap_timeout.validator
    @waiting_timeout.validator
    def _positive(self, attribute: Any, value: float | None) -> None:
        if value is not None and not value > 0:
            raise ValueError(f"StepConfig.{attribute.name} must be > 0 or None, got {value!r}")

    def __attrs_post_init__(self) -> None:
        if self.invalid_status not in ("raise", "fail"):
            raise ValueError(
                f"StepConfig.invalid_status must be 'raise' or 'fail', got {self.invalid_status!r}"
            )
        if self.stuck_after is not None and self.stuck_after < 1:
            raise ValueError(f"StepConfig.stuck_after must be >= 1, got {self.stuck_after}")
        if self.initial_capacity < 1:
            raise ValueError("StepConfig.initial_capacity must be >= 1")


@attrs.frozen
class Failure:
    room: int
    reason: FailureReason
    origin: int


@attrs.frozen
class StuckReport:
    """A request that has not advanced; ``holders`` are the ranks at its agreed status."""

    room: int
    status: KVPoll
    steps: int
    holders: tuple[int, ...]
    local: tuple[tuple[int, KVPoll], ...]  # (rank, gated local status) for every rank


@attrs.frozen(eq=False)
class StepResult:
    """What one step did, identical on every rank (except ``exceptions``)."""

    step: int
    rooms: NDArray[np.uint64]  # live requests in queue order
    statuses: NDArray[np.int8]  # agreed status per request
    words: NDArray[np.int32]  # the reduced words (reason and origin are decoded lazily)
    changed: NDArray[np.int64]  # row indices whose status changed this step
    previous: NDArray[np.int8]  # their status before the step
    triggers: NDArray[np.int16]  # the trigger each changed row took
    dwell: NDArray[np.float64]  # how long each changed row stayed in its previous status
    exceptions: dict[int, BaseException] = attrs.field(factory=dict)
    stuck: tuple[StuckReport, ...] = ()

    @property
    def reasons(self) -> NDArray[np.int8]:
        """Agreed failure reason per request (NONE unless Failed)."""
        r = ((self.words >> REASON_SHIFT) & 0xF).astype(np.int8)
        out: NDArray[np.int8] = np.where(self.statuses == _F, r, _NONE).astype(np.int8)
        return out

    @property
    def holders(self) -> NDArray[np.int32]:
        """Failed: the origin rank; pending: the lowest rank at the agreed status."""
        out: NDArray[np.int32] = self.words & np.int32(MAX_RANK)
        return out

    def _new(self, status: int) -> NDArray[np.int64]:
        rows: NDArray[np.int64] = self.changed[self.statuses[self.changed] == status]
        return rows

    @property
    def succeeded(self) -> NDArray[np.uint64]:
        """Rooms that reached Success in this step."""
        return self.rooms[self._new(KVPoll.Success)]

    @property
    def failed(self) -> NDArray[np.uint64]:
        """Rooms that reached Failed in this step."""
        return self.rooms[self._new(KVPoll.Failed)]

    def failures(self) -> list[Failure]:
        """The newly failed requests with the agreed reason and origin rank."""
        rows = self._new(KVPoll.Failed)
        w = self.words[rows]
        return [
            Failure(int(r), FailureReason(int(c)), int(o))
            for r, c, o in zip(
                self.rooms[rows].tolist(),
                ((w >> REASON_SHIFT) & 0xF).tolist(),
                (w & MAX_RANK).tolist(),
            )
        ]

    @property
    def counts(self) -> dict[KVPoll, int]:
        """Number of live requests at each agreed status."""
        c = np.bincount(self.statuses, minlength=NUM_STATUSES)
        return {s: int(c[s]) for s in KVPoll}

    def with_status(self, status: KVPoll) -> NDArray[np.uint64]:
        rooms: NDArray[np.uint64] = self.rooms[self.statuses == status]
        return rooms


def _bucket(n: int, floor: int) -> int:
    """Capacity for ``n`` requests: 1/8 headroom, rounded up to an eighth of a
    power of two (at most ~25% padding, and few distinct sizes)."""
    need = max(floor, n + n // 8, 1)
    grain = max(1, 1 << max(0, need.bit_length() - 3))
    return -(-need // grain) * grain


_EMPTY_I64 = np.empty(0, dtype=np.int64)
_EMPTY_F64 = np.empty(0, dtype=np.float64)


class _View:
    """Per-table arrays that change only when the table's membership or
    columns change; rebuilt then, reused by every step in between."""

    __slots__ = (
        "fake",
        "fp",
        "header",
        "hidx",
        "key",
        "meta_rooms",
        "meta_rows",
        "meta_slots",
        "mslots",
        "n",
        "no_reason",
        "ones",
        "rooms",
        "rows",
    )

    def __init__(self, t: RequestTable) -> None:
        self.key = (t.version, t.columns_version)
        self.rows = t.order().copy()
        self.rooms = t.room[self.rows]
        self.hidx = t.handle_index[self.rows]
        self.mslots = t.metadata_slot[self.rows]
        self.fake = t.fake[self.rows]
        self.n = self.rows.size
        self.fp = fingerprint(self.rooms)
        self.ones = np.ones(self.n, dtype=bool)
        self.header = np.empty(HEADER, dtype=np.int32)
        write_header(self.header, self.n, self.fp)
        self.no_reason = np.full(self.n, _NONE, dtype=np.int8)
        # rows the metadata gate reads: real requests with a row (None: all of them)
        checkable = ~self.fake & (self.mslots >= 0)
        self.meta_rows: NDArray[np.int64] | None = None
        self.meta_slots, self.meta_rooms = self.mslots, self.rooms
        if not checkable.all():
            self.meta_rows = np.flatnonzero(checkable)
            self.meta_slots, self.meta_rooms = self.mslots[checkable], self.rooms[checkable]


class Stepper:
    """Steps the requests of one :class:`RequestTable` on one rank."""

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
    ) -> None:
        if not 0 <= rank <= MAX_RANK:
            raise ValueError(f"rank {rank} does not fit the reduced word (0..{MAX_RANK})")
        self.table = table
        self.rank = rank
        self.poller = poller
        self.staging = staging
        self.metadata = metadata
        self.gates = tuple(gates)
        self.faults = faults
        self.config = config or StepConfig()
        self.clock = clock
        table.rank = rank
        if table.step_no == 0:
            table.now = clock()  # rows added before the first step entered now
        self.capacity = _bucket(0, self.config.initial_capacity)
        self._floor = self.capacity
        self._view: _View | None = None
        self._buf = np.empty(0, dtype=np.int32)
        self._prepared = False
        self._state: NDArray[np.int8] = np.empty(0, dtype=np.int8)
        self._local: NDArray[np.int8] = np.empty(0, dtype=np.int8)
        self._reason: NDArray[np.int8] = np.empty(0, dtype=np.int8)
        self._has_reason = False
        self._packed = 0
        self._raw_invalid: dict[int, object] = {}
        self._exceptions: dict[int, BaseException] = {}
        self._now = 0.0
        self._const_word = np.int32((int(FailureReason.NONE) << REASON_SHIFT) | rank)

    def _current_view(self) -> _View:
        t = self.table
        if t._limbo:
            t.order()  # compacts removed rows (membership changes were already counted)
        v = self._view
        if v is None or v.key != (t.version, t.columns_version):
            v = self._view = _View(t)
        return v

    # ------------------------------------------------------------------
    # prepare: observe, verdicts, gates -> buffer
    # ------------------------------------------------------------------
    def prepare(self) -> NDArray[np.int32]:
        """Local work of a step; returns the int32 buffer to MIN-reduce."""
        t = self.table
        v = self._current_view()
        rows, rooms, hidx, n = v.rows, v.rooms, v.hidx, v.n
        state = t.state[rows]
        now = self.clock()
        step = t.step_no + 1
        self._exceptions = {}
        self._raw_invalid = {}
        # rows not yet agreed terminal; the table's count settles the common case
        all_active = t.terminal_count == 0
        active = v.ones if all_active else (state > _F) & (state < _S)
        if all_active:
            act_rooms, act_hidx = rooms, hidx
        else:
            act_rooms, act_hidx = rooms[active], hidx[active]

        if self.staging is not None and act_rooms.size:
            self.staging.advance(act_rooms, act_hidx)

        # 1. observe (terminal rows keep their latched status)
        reason: NDArray[np.int8] | None = None
        if act_rooms.size:
            vals, exc, invalid, breason = self._observe(
                rows, active, all_active, act_rooms, act_hidx
            )
            if all_active:
                local = vals
            else:
                local = state.copy()
                local[active] = vals
        else:
            local = state.copy()
            exc = invalid = breason = None

        # 2. local verdicts, first one wins; `reason` exists only once one hits
        def verdict(mask: NDArray[np.bool_] | None, code: FailureReason, sub: bool = False) -> None:
            nonlocal reason
            if mask is None or not mask.any():
                return
            if sub and not all_active:  # mask is over the active rows only
                full = np.zeros(n, dtype=bool)
                full[active] = mask
                mask = full
            hit = mask if all_active else mask & active
            if reason is None:
                reason = np.full(n, _NONE, dtype=np.int8)
            else:
                hit = hit & (reason == _NONE)
            reason[hit] = code

        if self.faults is not None and n:
            ctx = StepContext(self.rank, step, now, rooms, state, t.added_step[rows])
            verdict(np.asarray(self.faults.inject(ctx), dtype=bool), FailureReason.INJECTED_FAULT)
        cfg = self.config
        if cfg.bootstrap_timeout is not None and n:
            late = (state == KVPoll.Bootstrapping) & (
                now - t.entered_time[rows] >= cfg.bootstrap_timeout
            )
            verdict(late, FailureReason.BOOTSTRAP_TIMEOUT)
        if cfg.waiting_timeout is not None and n:
            with np.errstate(invalid="ignore"):
                verdict(
                    now - t.metadata_sent_at[rows] >= cfg.waiting_timeout,
                    FailureReason.WAITING_TIMEOUT,
                )
        if t.abort_count:
            verdict(t.abort_requested[rows], FailureReason.ABORTED)
        verdict(exc, FailureReason.LOCAL_EXCEPTION, sub=True)
        verdict(invalid, FailureReason.INVALID_STATUS, sub=True)
        landed: NDArray[np.bool_] | None = None
        if self.metadata is not None and n:
            success = local == _S
            if not all_active:
                success &= active  # latched rows are neither checked nor gated
            if success.any():
                landed, corrupt = self._metadata_check(v, success)
                verdict(corrupt, FailureReason.METADATA_CORRUPT)
        if n and int(local.min()) == 0:
            backend_failed = local == _F
            if not all_active:
                backend_failed &= active
            if breason is not None and reason is None and backend_failed.any():
                reason = np.full(n, _NONE, dtype=np.int8)
            if reason is not None:
                hit = backend_failed & (reason == _NONE)
                if breason is None:
                    reason[hit] = FailureReason.UNKNOWN
                elif all_active:
                    reason[hit] = breason[hit]
                else:
                    full_b = np.full(n, FailureReason.UNKNOWN, dtype=np.int8)
                    full_b[active] = breason
                    reason[hit] = full_b[hit]
            else:
                verdict(backend_failed, FailureReason.UNKNOWN)
        if reason is not None:
            local = np.where(reason != _NONE, _F, local).astype(np.int8)

        # 3. gates: each may only apply its declared demotion (Success ->
        # Transferring), and only on requests not yet agreed terminal (a
        # latched Success is never held back)
        if n and (self.staging is not None or landed is not None or self.gates):
            at = local == batch.DEMOTE_SOURCE
            if not all_active:
                at &= active
            if at.any():
                if self.staging is not None:
                    pend = self._ask(
                        self.staging.pending, v, active, all_active, act_rooms, act_hidx
                    )
                    batch.demote(local, "hold_staging", pend, at)
                if landed is not None:
                    batch.demote(local, "hold_metadata", ~landed, at)
                for gate in self.gates:
                    closed = self._ask(gate.closed, v, active, all_active, act_rooms, act_hidx)
                    batch.demote(local, "hold_gate", closed, at)

        self._state, self._local = state, local
        self._has_reason = reason is not None
        self._reason = reason if reason is not None else v.no_reason
        self._now = now
        self._prepared = True
        return self._pack_buffer(v)

    @staticmethod
    def _ask(
        fn: Callable[..., Any],
        v: _View,
        active: NDArray[np.bool_],
        all_active: bool,
        act_rooms: NDArray[np.uint64],
        act_hidx: NDArray[np.int64],
    ) -> NDArray[np.bool_]:
        """A gate's answer for every active row (False on latched rows).

        Asking about all active rows, not only those at Success, costs one
        gather in an array-backed gate and saves two mask selections here.
        """
        if all_active:
            out: NDArray[np.bool_] = np.asarray(fn(v.rooms, v.hidx), dtype=bool)
            return out
        full = np.zeros(v.n, dtype=bool)
        full[active] = np.asarray(fn(act_rooms, act_hidx), dtype=bool)
        return full

    def _local_words(self) -> NDArray[np.int32]:
        """This rank's packed words of the last prepare."""
        words = np.left_shift(self._local, STATUS_SHIFT, dtype=np.int32, casting="unsafe")
        if self._has_reason:
            words |= np.left_shift(self._reason, REASON_SHIFT, dtype=np.int32, casting="unsafe")
            words |= np.int32(self.rank)
        else:
            words |= self._const_word
        return words

    def _pack_buffer(self, v: _View) -> NDArray[np.int32]:
        n = v.n
        size = HEADER + self.capacity
        if self._buf.size != size:
            self._buf = np.full(size, PAD, dtype=np.int32)
            self._packed = 0
        buf = self._buf
        buf[:HEADER] = v.header
        k = min(n, self.capacity)
        if k == n:  # the common case: pack straight into the buffer
            words = buf[HEADER : HEADER + n]
            np.left_shift(self._local, STATUS_SHIFT, out=words, dtype=np.int32, casting="unsafe")
            if self._has_reason:
                words |= np.left_shift(self._reason, REASON_SHIFT, dtype=np.int32, casting="unsafe")
                words |= np.int32(self.rank)
            else:
                words |= self._const_word
        else:
            buf[HEADER : HEADER + k] = self._local_words()[:k]
        if self._packed > k:  # a reduce leaves PAD as PAD, so only a shrink needs refilling
            buf[HEADER + k : HEADER + self._packed] = PAD
        self._packed = k
        return buf

    def _observe(
        self,
        rows: NDArray[np.int64],
        active: NDArray[np.bool_],
        all_active: bool,
        rooms: NDArray[np.uint64],
        hidx: NDArray[np.int64],
    ) -> tuple[
        NDArray[np.int8],
        NDArray[np.bool_] | None,
        NDArray[np.bool_] | None,
        NDArray[np.int8] | None,
    ]:
        """Raw statuses of the active rows: (values, raised, invalid, backend reason).

        Masks are None when nothing raised / nothing was invalid / the backend
        gave no reasons (the common case costs no arrays).
        """
        k = rooms.size
        exc: NDArray[np.bool_] | None = None
        breason: NDArray[np.int8] | None = None
        if self.poller is not None:
            try:
                try:
                    arr = np.asarray(self.poller.poll_many(rooms, hidx))
                except PartialPollError as pe:
                    arr = np.asarray(pe.statuses)
                    exc = np.zeros(k, dtype=bool)
                    for i, err in pe.errors.items():
                        exc[i] = True
                        self._exceptions[int(rooms[i])] = err
                if arr.shape != (k,):
                    raise ValueError(f"poll_many returned shape {arr.shape}, expected ({k},)")
                if arr.dtype.kind not in "iub":
                    raise TypeError(f"poll_many must return integers, got dtype {arr.dtype}")
            except Exception as e:  # never let one rank's error desync the group
                for r in rooms.tolist():
                    self._exceptions[r] = e
                return np.zeros(k, np.int8), np.ones(k, bool), None, None
            values: Any = arr
        else:
            handles = self.table.handles
            slots = (rows if all_active else rows[active]).tolist()
            out: list[Any] = []
            pos = 0
            while pos < k:
                try:
                    for s in slots[pos:]:
                        out.append(handles[s].poll())
                        pos += 1
                except Exception as e:
                    self._exceptions[int(rooms[pos])] = e
                    out.append(KVPoll.Failed)
                    if exc is None:
                        exc = np.zeros(k, dtype=bool)
                    exc[pos] = True
                    pos += 1
            values = out
            try:
                arr = np.fromiter(out, dtype=np.int64, count=k)
            except (TypeError, ValueError):
                arr = np.array([v if isinstance(v, int) else -1 for v in out], dtype=np.int64)
        invalid: NDArray[np.bool_] | None = None
        lo = int(arr.min()) if k else 1
        if k and (lo < 0 or int(arr.max()) > 4):
            invalid = (arr < 0) | (arr > 4)
            if exc is not None:
                invalid &= ~exc
            for i in np.flatnonzero(invalid).tolist():
                self._raw_invalid[int(rooms[i])] = values[i]
            arr = np.where(invalid, KVPoll.Failed, arr)
        if exc is not None:
            arr = np.where(exc, KVPoll.Failed, arr)
        vals = arr.astype(np.int8)  # a fresh array: the backend's is never written to
        if invalid is not None or exc is not None:
            lo = int(vals.min()) if k else 1
        if lo == 0:
            failed = vals == _F
            if exc is not None:
                failed &= ~exc
            if invalid is not None:
                failed &= ~invalid
            if failed.any():
                breason = np.full(k, FailureReason.UNKNOWN, dtype=np.int8)
                if self.poller is not None:
                    reasons_fn = getattr(self.poller, "failure_reasons", None)
                    if reasons_fn is not None:
                        given = np.asarray(reasons_fn(rooms[failed], hidx[failed]), np.int64)
                        breason[failed] = np.where(
                            np.isin(given, _BACKEND_REASONS), given, _UNKNOWN
                        )
                else:
                    handles = self.table.handles
                    slots_l = (rows if all_active else rows[active]).tolist()
                    for i in np.flatnonzero(failed).tolist():
                        breason[i] = _reason_of(handles[slots_l[i]])
        return vals, exc, invalid, breason

    def _metadata_check(
        self, v: _View, success: NDArray[np.bool_]
    ) -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
        """(landed, corrupt) per row, for rows at Success; fake-path requests
        count as landed, a real request without a metadata row never does."""
        assert self.metadata is not None
        ok, bad = self.metadata.landed(v.meta_slots, v.meta_rooms)
        if v.meta_rows is None:
            landed = np.asarray(ok, dtype=bool)
            corrupt = np.asarray(bad, dtype=bool) & success
        else:
            landed = v.fake.copy()  # fake rows are exempt; real rows without a slot stay False
            landed[v.meta_rows] = ok
            corrupt = np.zeros(v.n, dtype=bool)
            corrupt[v.meta_rows] = bad
            corrupt &= success
        return landed, corrupt

    @property
    def last_local(self) -> tuple[NDArray[np.uint64], NDArray[np.int8], NDArray[np.int8]]:
        """(rooms, gated local status, local reason) of the last prepare: what
        this rank contributed to the reduce (for traces, replay and tests)."""
        rooms = self._view.rooms if self._view is not None else np.empty(0, np.uint64)
        return rooms, self._local, self._reason

    # ------------------------------------------------------------------
    # reduce-side decisions (identical on every rank: they read reduced data)
    # ------------------------------------------------------------------
    def resize(self, reduced: NDArray[np.int32]) -> bool:
        """After a reduce: True if some rank's list outgrew the capacity.

        Capacity then grows and :meth:`repack` gives the buffer to reduce again.
        """
        hdr = Header(reduced)
        if hdr.len_max <= self.capacity:
            return False
        self.capacity = _bucket(hdr.len_max, self._floor)
        return True

    def repack(self) -> NDArray[np.int32]:
        """The prepared local values at the current capacity (no second poll)."""
        if not self._prepared or self._view is None:
            raise RuntimeError("repack() before prepare()")
        return self._pack_buffer(self._view)

    def apply(self, reduced: NDArray[np.int32]) -> StepResult:
        """Advance every request to its agreed status; returns what happened."""
        if not self._prepared or self._view is None:
            raise RuntimeError("apply() before prepare(): every step is prepare, reduce, apply")
        v = self._view
        hdr = Header(reduced)
        n = v.n
        if hdr.len_max > self.capacity:
            raise RuntimeError("apply(): capacity too small; call resize() and reduce again")
        if hdr.len_max * 4 < self.capacity and self.capacity > self._floor:
            self.capacity = max(self._floor, _bucket(hdr.len_max * 2, self._floor))
        self._prepared = False
        if not hdr.agreed:
            raise CollectiveMismatch(
                self.rank, n, (hdr.len_min, hdr.len_max), v.fp, (hdr.fp_min, hdr.fp_max)
            )
        words = reduced[HEADER : HEADER + n].copy()
        agreed = (words >> STATUS_SHIFT).astype(np.int8)
        state = self._state
        t = self.table
        step = t.step_no + 1
        dwell = _EMPTY_F64
        if agreed.tobytes() == state.tobytes():  # the common case: nothing moved
            changed, trig = _EMPTY_I64, np.empty(0, dtype=np.int16)
        else:
            reason = ((words >> REASON_SHIFT) & 0xF).astype(np.int8)
            if self.config.invalid_status == "raise":
                bad = (agreed == _F) & (reason == FailureReason.INVALID_STATUS) & (state != _F)
                if bad.any():
                    i = int(np.flatnonzero(bad)[0])
                    room = int(v.rooms[i])
                    raise InvalidStatus(room, int(words[i] & MAX_RANK), self._raw_invalid.get(room))
            new, trig_all, illegal = batch.advance(state, agreed, reason)
            if illegal.any():
                i = int(np.flatnonzero(illegal)[0])
                raise IllegalTransition(
                    int(v.rooms[i]), self.rank, int(state[i]), int(agreed[i]), "advance"
                )
            changed = np.flatnonzero(new != state)
            trig = trig_all[changed]
            t.terminal_count += int(TERMINAL[new[changed]].sum())
            slots = v.rows[changed]
            dwell = self._now - t.entered_time[slots]
            t.state[slots] = new[changed]
            t.entered_step[slots] = step
            t.entered_time[slots] = self._now
            failed = changed[new[changed] == _F]
            if failed.size:
                t.reason[v.rows[failed]] = reason[failed]
                t.origin[v.rows[failed]] = words[failed] & MAX_RANK
        t.step_no = step
        t.now = self._now
        return StepResult(
            step=step,
            rooms=v.rooms,
            statuses=agreed,
            words=words,
            changed=changed,
            previous=state[changed],
            dwell=dwell,
            triggers=trig,
            exceptions=self._exceptions,
        )

    # ------------------------------------------------------------------
    # composed step and stuck diagnosis
    # ------------------------------------------------------------------
    def step(self, collective: Collective) -> StepResult:
        """prepare -> MIN all-reduce over ``collective`` -> apply."""
        buf = self.prepare()
        collective.all_reduce_min(buf)
        if self.resize(buf):
            buf = self.repack()
            collective.all_reduce_min(buf)
        result = self.apply(buf)
        k = self.config.stuck_after
        if k is not None and self._view is not None and self._view.n:
            age = result.step - self.table.entered_step[self._view.rows]
            stuck = ~TERMINAL[result.statuses] & (age >= k) & (age % k == 0)
            if stuck.any():
                rows = np.flatnonzero(stuck)
                result = attrs.evolve(
                    result, stuck=self._diagnose_rows(collective, rows, result.statuses)
                )
        return result

    def diagnose(self, collective: Collective) -> tuple[StuckReport, ...]:
        """On demand (collectively: every rank must call it): who holds each
        non-terminal request of the last step back."""
        if self._view is None or self._local.size != self._view.n:
            return ()
        statuses = self.table.state[self._view.rows]
        rows = np.flatnonzero(~TERMINAL[statuses])
        return self._diagnose_rows(collective, rows, statuses)

    def _diagnose_rows(
        self, collective: Collective, rows: NDArray[np.int64], statuses: NDArray[np.int8]
    ) -> tuple[StuckReport, ...]:
        assert self._view is not None
        # one all-gather, of a length every rank agrees on (derived from agreed state)
        words = self._local_words()[rows] if rows.size else np.empty(0, dtype=np.int32)
        gathered = collective.all_gather(np.ascontiguousarray(words, dtype=np.int32))
        local, _, origin = unpack(gathered)
        step = self.table.step_no
        reports = []
        for j, i in enumerate(rows.tolist()):
            agreed = int(statuses[i])
            ranks = origin[:, j].tolist()
            locs = local[:, j].tolist()
            holders = tuple(sorted(r for r, s in zip(ranks, locs) if s == agreed))
            reports.append(
                StuckReport(
                    room=int(self._view.rooms[i]),
                    status=KVPoll(agreed),
                    steps=step - int(self.table.entered_step[self._view.rows[i]]),
                    holders=holders,
                    local=tuple(sorted((r, KVPoll(s)) for r, s in zip(ranks, locs))),
                )
            )
        return tuple(reports)


def _reason_of(handle: Any) -> FailureReason:
    """A per-object poller's reason for a Failed it reported."""
    fn = getattr(handle, "failure_reason", None)
    if fn is not None:
        try:
            code = int(fn())
        except Exception:
            return FailureReason.UNKNOWN
        return FailureReason(code) if code in _BACKEND_REASONS else FailureReason.UNKNOWN
    fn = getattr(handle, "failure_exception", None)
    if fn is not None:
        try:
            return FailureReason.TRANSFER_ERROR if fn() is not None else FailureReason.UNKNOWN
        except Exception:
            return FailureReason.TRANSFER_ERROR
    return FailureReason.UNKNOWN
