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
from lifecycle.packing import HEADER, PAD, Header, fingerprint, pack, unpack, write_header
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
#: reasons a backend may report; the rest are the step's own verdicts
_BACKEND_REASONS = np.array(
    [
        FailureReason.ABORTED,
        FailureReason.PEER_DEAD,
        FailureReason.BOOTSTRAP_TIMEOUT,
        FailureReason.WAITING_TIMEOUT,
        FailureReason.METADATA_CORRUPT,
        FailureReason.TRANSFER_ERROR,
        FailureReason.UNKNOWN,
    ]
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
    reasons: NDArray[np.int8]  # agreed reason (NONE unless Failed)
    holders: NDArray[np.int32]  # Failed: origin rank; pending: lowest rank at that status
    changed: NDArray[np.int64]  # row indices whose status changed this step
    previous: NDArray[np.int8]  # their status before the step
    triggers: NDArray[np.int16]  # the trigger each changed row took
    exceptions: dict[int, BaseException] = attrs.field(factory=dict)
    stuck: tuple[StuckReport, ...] = ()

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
        return [
            Failure(int(r), FailureReason(int(c)), int(o))
            for r, c, o in zip(
                self.rooms[rows].tolist(),
                self.reasons[rows].tolist(),
                self.holders[rows].tolist(),
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
    need = max(floor, n + n // 4, 1)
    return 1 << (need - 1).bit_length()


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
        self.capacity = _bucket(0, self.config.initial_capacity)
        self._floor = self.capacity
        self._fp_version = -1
        self._fp = 0
        self._prepared = False
        self._rows: NDArray[np.int64] = np.empty(0, dtype=np.int64)
        self._state: NDArray[np.int8] = np.empty(0, dtype=np.int8)
        self._local: NDArray[np.int8] = np.empty(0, dtype=np.int8)
        self._reason: NDArray[np.int8] = np.empty(0, dtype=np.int8)
        self._words: NDArray[np.int32] = np.empty(0, dtype=np.int32)
        self._raw_invalid: dict[int, object] = {}
        self._exceptions: dict[int, BaseException] = {}
        self._now = 0.0

    # ------------------------------------------------------------------
    # prepare: observe, verdicts, gates -> buffer
    # ------------------------------------------------------------------
    def prepare(self) -> NDArray[np.int32]:
        """Local work of a step; returns the int32 buffer to MIN-reduce."""
        t = self.table
        rows = t.order().copy()
        n = rows.size
        rooms = t.room[rows]
        state = t.state[rows]
        now = self.clock()
        step = t.step_no + 1
        active = ~TERMINAL[state]
        all_active = bool(active.all())
        act_rooms = rooms if all_active else rooms[active]
        self._exceptions = {}
        self._raw_invalid = {}

        hidx_all = t.handle_index[rows]
        if self.staging is not None and act_rooms.size:
            self.staging.advance(act_rooms, hidx_all if all_active else hidx_all[active])

        # 1. observe
        raw = state.copy()
        reason = np.full(n, _NONE, dtype=np.int8)
        if act_rooms.size:
            vals, exc, invalid, backend_reason = self._observe(rows, active, all_active, act_rooms)
            if all_active:
                raw[:] = np.where(invalid | exc, _F, vals)
                exc_full, inv_full, breason = exc, invalid, backend_reason
            else:
                raw[active] = np.where(invalid | exc, _F, vals)
                exc_full = np.zeros(n, dtype=bool)
                inv_full = np.zeros(n, dtype=bool)
                breason = np.full(n, FailureReason.UNKNOWN, dtype=np.int8)
                exc_full[active] = exc
                inv_full[active] = invalid
                breason[active] = backend_reason
        else:
            exc_full = inv_full = np.zeros(n, dtype=bool)
            breason = np.full(n, FailureReason.UNKNOWN, dtype=np.int8)

        # 2. local verdicts, first one wins
        def verdict(mask: NDArray[np.bool_], code: FailureReason) -> None:
            hit = mask & active & (reason == _NONE)
            if hit.any():
                reason[hit] = code

        if self.faults is not None and n:
            ctx = StepContext(self.rank, step, now, rooms, state, t.added_step[rows])
            verdict(np.asarray(self.faults.inject(ctx), dtype=bool), FailureReason.INJECTED_FAULT)
        cfg = self.config
        if cfg.bootstrap_timeout is not None:
            late = (state == KVPoll.Bootstrapping) & (
                now - t.entered_time[rows] >= cfg.bootstrap_timeout
            )
            verdict(late, FailureReason.BOOTSTRAP_TIMEOUT)
        if cfg.waiting_timeout is not None:
            sent = t.metadata_sent_at[rows]
            with np.errstate(invalid="ignore"):
                verdict(now - sent >= cfg.waiting_timeout, FailureReason.WAITING_TIMEOUT)
        verdict(t.abort_requested[rows], FailureReason.ABORTED)
        verdict(exc_full, FailureReason.LOCAL_EXCEPTION)
        verdict(inv_full, FailureReason.INVALID_STATUS)
        success = (raw == _S) & active  # latched rows are neither checked nor gated
        landed: NDArray[np.bool_] | None = None
        if self.metadata is not None and success.any():
            landed, corrupt = self._metadata_check(rows, rooms, success)
            verdict(corrupt, FailureReason.METADATA_CORRUPT)
        verdict(raw == _F, FailureReason.UNKNOWN)
        if (breason != FailureReason.UNKNOWN).any():
            upgrade = (reason == FailureReason.UNKNOWN) & (raw == _F) & active
            reason[upgrade] = breason[upgrade]
        local = np.where(reason != _NONE, _F, raw).astype(np.int8)

        # 3. gates: only the declared Success -> Transferring demotion, and only on
        # requests not yet agreed terminal (a latched Success is never held back)
        if self.staging is not None and ((local == _S) & active).any():
            sel = (local == _S) & active
            pend = np.zeros(n, dtype=bool)
            pend[sel] = np.asarray(self.staging.pending(rooms[sel], hidx_all[sel]), dtype=bool)
            local = batch.demote(local, "hold_staging", pend)
        if landed is not None:
            local = batch.demote(local, "hold_metadata", ~landed)
        for gate in self.gates:
            sel = (local == _S) & active
            if not sel.any():
                break
            closed = np.zeros(n, dtype=bool)
            closed[sel] = np.asarray(gate.closed(rooms[sel], hidx_all[sel]), dtype=bool)
            local = batch.demote(local, "hold_gate", closed)

        self._rows, self._state, self._local, self._reason = rows, state, local, reason
        self._now = now
        self._words = np.empty(n, dtype=np.int32)
        pack(local, reason, self.rank, self._words)
        if self._fp_version != t.version:
            self._fp, self._fp_version = fingerprint(rooms), t.version
        self._prepared = True
        return self._pack_buffer()

    def _pack_buffer(self) -> NDArray[np.int32]:
        n = self._words.size
        buf = np.empty(HEADER + self.capacity, dtype=np.int32)
        write_header(buf, n, self._fp)
        k = min(n, self.capacity)
        buf[HEADER : HEADER + k] = self._words[:k]
        buf[HEADER + k :] = PAD
        return buf

    def _observe(
        self,
        rows: NDArray[np.int64],
        active: NDArray[np.bool_],
        all_active: bool,
        rooms: NDArray[np.uint64],
    ) -> tuple[NDArray[np.int8], NDArray[np.bool_], NDArray[np.bool_], NDArray[np.int8]]:
        """Raw statuses of the active rows: (values, raised, invalid, backend reason)."""
        k = rooms.size
        exc = np.zeros(k, dtype=bool)
        breason = np.full(k, FailureReason.UNKNOWN, dtype=np.int8)
        if self.poller is not None:
            hidx = self.table.handle_index[rows if all_active else rows[active]]
            try:
                try:
                    arr = np.asarray(self.poller.poll_many(rooms, hidx))
                except PartialPollError as pe:
                    arr = np.asarray(pe.statuses)
                    for i, err in pe.errors.items():
                        exc[i] = True
                        self._exceptions[int(rooms[i])] = err
                if arr.shape != (k,):
                    raise ValueError(f"poll_many returned shape {arr.shape}, expected ({k},)")
            except Exception as e:  # never let one rank's error desync the group
                for r in rooms.tolist():
                    self._exceptions[r] = e
                return np.zeros(k, np.int8), np.ones(k, bool), np.zeros(k, bool), breason
            if arr.dtype.kind not in "iub":
                raise TypeError(f"poll_many must return integers, got dtype {arr.dtype}")
            arr = np.where(exc, KVPoll.Failed, arr)
            invalid = ((arr < 0) | (arr > KVPoll.Success)) & ~exc
            vals = np.where(invalid, _F, arr).astype(np.int8)
            failed = (vals == _F) & ~invalid & ~exc
            reasons_fn = getattr(self.poller, "failure_reasons", None)
            if failed.any() and reasons_fn is not None:
                given = np.asarray(reasons_fn(rooms[failed], hidx[failed]), np.int64)
                breason[failed] = np.where(np.isin(given, _BACKEND_REASONS), given, _UNKNOWN)
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
                    exc[pos] = True
                    pos += 1
            try:
                arr = np.fromiter(out, dtype=np.int64, count=k)
                invalid = (arr < 0) | (arr > KVPoll.Success)
            except (TypeError, ValueError):
                invalid = np.array([not isinstance(v, int) or not 0 <= v <= 4 for v in out])
                arr = np.array([v if not bad else 0 for v, bad in zip(out, invalid)])
            vals = np.where(invalid, _F, arr).astype(np.int8)
            failed = (vals == _F) & ~invalid & ~exc
            for i in np.flatnonzero(failed).tolist():
                breason[i] = _reason_of(handles[slots[i]])
        if invalid.any():
            for i in np.flatnonzero(invalid).tolist():
                self._raw_invalid[int(rooms[i])] = arr[i] if self.poller is not None else out[i]
        return vals, exc, invalid, breason

    def _metadata_check(
        self, rows: NDArray[np.int64], rooms: NDArray[np.uint64], success: NDArray[np.bool_]
    ) -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
        """(landed, corrupt) per row; fake-path requests count as landed."""
        assert self.metadata is not None
        t = self.table
        n = rows.size
        landed = np.ones(n, dtype=bool)
        corrupt = np.zeros(n, dtype=bool)
        check = success & ~t.fake[rows]
        slots = t.metadata_slot[rows]
        no_slot = check & (slots < 0)
        landed[no_slot] = False
        check &= slots >= 0
        if check.any():
            ok, bad = self.metadata.landed(slots[check], rooms[check])
            landed[check] = ok
            corrupt[check] = bad
        return landed, corrupt

    @property
    def last_local(self) -> tuple[NDArray[np.uint64], NDArray[np.int8], NDArray[np.int8]]:
        """(rooms, gated local status, local reason) of the last prepare: what
        this rank contributed to the reduce (for traces, replay and tests)."""
        return self.table.room[self._rows], self._local, self._reason

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
        if not self._prepared:
            raise RuntimeError("repack() before prepare()")
        return self._pack_buffer()

    def apply(self, reduced: NDArray[np.int32]) -> StepResult:
        """Advance every request to its agreed status; returns what happened."""
        if not self._prepared:
            raise RuntimeError("apply() before prepare(): every step is prepare, reduce, apply")
        hdr = Header(reduced)
        n = self._rows.size
        if hdr.len_max > self.capacity:
            raise RuntimeError("apply(): capacity too small; call resize() and reduce again")
        if hdr.len_max * 4 < self.capacity and self.capacity > self._floor:
            self.capacity = max(self._floor, _bucket(hdr.len_max * 2, self._floor))
        if not hdr.agreed:
            self._prepared = False
            raise CollectiveMismatch(
                self.rank, n, (hdr.len_min, hdr.len_max), self._fp, (hdr.fp_min, hdr.fp_max)
            )
        agreed, reason, holder = unpack(reduced[HEADER : HEADER + n])
        state = self._state
        if self.config.invalid_status == "raise":
            bad = (agreed == _F) & (reason == FailureReason.INVALID_STATUS) & (state != _F)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                room = int(self.table.room[self._rows[i]])
                self._prepared = False
                raise InvalidStatus(room, int(holder[i]), self._raw_invalid.get(room))
        new, trig, illegal = batch.advance(state, agreed, reason)
        if illegal.any():
            i = int(np.flatnonzero(illegal)[0])
            self._prepared = False
            raise IllegalTransition(
                int(self.table.room[self._rows[i]]),
                self.rank,
                int(state[i]),
                int(agreed[i]),
                "advance",
            )
        t = self.table
        step = t.step_no + 1
        changed = np.flatnonzero(new != state)
        if changed.size:
            slots = self._rows[changed]
            t.state[slots] = new[changed]
            t.entered_step[slots] = step
            t.entered_time[slots] = self._now
            failed = changed[new[changed] == _F]
            if failed.size:
                t.reason[self._rows[failed]] = reason[failed]
                t.origin[self._rows[failed]] = holder[failed]
        t.step_no = step
        t.now = self._now
        self._prepared = False
        return StepResult(
            step=step,
            rooms=t.room[self._rows],
            statuses=new,
            reasons=np.where(new == _F, reason, _NONE).astype(np.int8),
            holders=holder,
            changed=changed,
            previous=state[changed],
            triggers=trig[changed],
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
        if k is not None:
            age = result.step - self.table.entered_step[self._rows]
            stuck = ~TERMINAL[result.statuses] & (age >= k) & (age % k == 0)
            if stuck.any():
                rows = np.flatnonzero(stuck)
                result = attrs.evolve(result, stuck=self._diagnose(collective, rows, result))
        return result

    def diagnose(self, collective: Collective) -> tuple[StuckReport, ...]:
        """On demand (collectively: every rank must call it): who holds each
        non-terminal request of the last step back."""
        if self._local.size != self._rows.size:
            return ()
        statuses = self.table.state[self._rows]
        rows = np.flatnonzero(~TERMINAL[statuses])
        result_stub = statuses
        return self._diagnose_rows(collective, rows, result_stub)

    def _diagnose(
        self, collective: Collective, rows: NDArray[np.int64], result: StepResult
    ) -> tuple[StuckReport, ...]:
        return self._diagnose_rows(collective, rows, result.statuses)

    def _diagnose_rows(
        self, collective: Collective, rows: NDArray[np.int64], statuses: NDArray[np.int8]
    ) -> tuple[StuckReport, ...]:
        # one all-gather, of a length every rank agrees on (derived from agreed state)
        words = self._words[rows] if rows.size else np.empty(0, dtype=np.int32)
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
                    room=int(self.table.room[self._rows[i]]),
                    status=KVPoll(agreed),
                    steps=step - int(self.table.entered_step[self._rows[i]]),
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
