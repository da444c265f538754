"""One consensus step over a table of live requests.

Theory of operation
-------------------
Per rank, for the ordered list of live requests of one queue:

1. **observe** -- one raw status per non-terminal request: a backend's batch
   poll (one array) if it has one, else each request's ``poll()``. Terminal
   requests are not polled: their agreed status latches.
2. **local verdicts**, first one wins, each turning the local value into
   Failed with a reason: injected fault, bootstrap timeout, waiting timeout,
   local abort, poller exception, invalid status, hook error, metadata row
   corrupt, and finally a Failed reported by the backend itself (its reason,
   else UNKNOWN).
3. **gates**, in order staging, metadata, user gates: each may only apply
   its declared demotion Success -> Transferring (never hide a Failed).
4. **reduce** -- one MIN all-reduce per group of a buffer of packed words
   (:mod:`lifecycle.packing`) plus a header with the list length, a
   fingerprint of the ordered rooms, hashes of the config and the queue name,
   the caller's iteration tag and the capacity each rank asked for.

Every user hook (staging, fault hook, failure reasons, gates, metadata
source, the poll) runs contained: an exception or an answer of the wrong
shape, dtype or kind fails the rows it was asked about (reason HOOK_ERROR,
or LOCAL_EXCEPTION / INVALID_STATUS for the poll) in the local value, so the
failure reaches every rank through the reduce and no rank leaves the step
early.
5. **apply** -- every request moves to its agreed status along a declared
   edge (batch executor); a move the graph lacks raises before anything
   changes.

Steps 1-3 are :meth:`Stepper.prepare`, step 5 is :meth:`Stepper.apply`;
:meth:`Stepper.step` runs them around a :class:`~lifecycle.collective.Collective`.
Nothing here does I/O, so the same code runs under real gloo ranks, in a
single-threaded simulated world and under trace replay.

The buffer has an agreed *capacity* (the same on every rank because it only
changes from reduced data). A stepper's first reduce is at a fixed
:data:`BOOT_CAPACITY`; its header tells every rank the largest
``initial_capacity`` asked for, which becomes the floor. When some rank's list outgrows it, the header
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

from lifecycle import batch, validate
from lifecycle.collective import Collective
from lifecycle.errors import (
    CollectiveMismatch,
    HookError,
    IllegalTransition,
    InvalidArgument,
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
    hash31,
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
    [
        r
        for r in FailureReason
        if r not in (FailureReason.INVALID_STATUS, FailureReason.HOOK_ERROR, FailureReason.NONE)
    ]
)
_HOOK = FailureReason.HOOK_ERROR
_UNKNOWN_R = FailureReason.UNKNOWN


#: the largest buffer capacity a config may ask for (64 MiB of int32 words)
MAX_CAPACITY = 1 << 24
#: the capacity of a stepper's first reduce, whatever its config: the group
#: agrees there on the largest ``initial_capacity`` any rank asked for, so
#: ranks built with different settings never hand gloo different sizes
BOOT_CAPACITY = 64


def _seconds_or_none(inst: Any, attribute: Any, value: object) -> None:
    if value is not None:
        validate.seconds(value, f"StepConfig.{attribute.name}")


@attrs.frozen
class StepConfig:
    """How a stepper behaves; all deadlines off by default.

    Every rank of a group must use the same config (except
    ``initial_capacity``, of which the group takes the largest): a hash of
    it travels in the header and a difference raises
    :class:`~lifecycle.errors.CollectiveMismatch` on every rank.
    """

    #: seconds a request may stay Bootstrapping before it fails (None: never)
    bootstrap_timeout: float | None = attrs.field(default=None, validator=_seconds_or_none)
    #: seconds from ``mark_metadata_sent`` until an unfinished request fails
    waiting_timeout: float | None = attrs.field(default=None, validator=_seconds_or_none)
    #: a poll value outside KVPoll: "raise" InvalidStatus on every rank after the
    #: reduce (nothing applied), or "fail" the request with reason INVALID_STATUS
    invalid_status: Literal["raise", "fail"] = "raise"
    #: report requests that have not changed status for this many steps
    stuck_after: int | None = None
    #: agreed buffer capacity to start with (rounded up to a power of two)
    initial_capacity: int = 64

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.invalid_status, str) or self.invalid_status not in ("raise", "fail"):
            raise InvalidArgument(
                "StepConfig.invalid_status", self.invalid_status, "'raise' or 'fail'"
            )
        if self.stuck_after is not None:
            validate.integer(self.stuck_after, "StepConfig.stuck_after", 1, 1 << 40)
        validate.integer(self.initial_capacity, "StepConfig.initial_capacity", 1, MAX_CAPACITY)

    @property
    def fingerprint(self) -> int:
        """31-bit hash of what every rank must agree on (not the capacity hint)."""
        return hash31(
            repr(
                (
                    None if self.bootstrap_timeout is None else float(self.bootstrap_timeout),
                    None if self.waiting_timeout is None else float(self.waiting_timeout),
                    self.invalid_status,
                    None if self.stuck_after is None else int(self.stuck_after),
                )
            )
        )


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


_TAG = 10  # header position of the iteration tag pair (see lifecycle.packing)
_EMPTY_I64 = np.empty(0, dtype=np.int64)
_EMPTY_F64 = np.empty(0, dtype=np.float64)


class _View:
    """Per-table arrays that change only when the table's membership or
    columns change; rebuilt then, reused by every step in between."""

    __slots__ = (
        "checkable",
        "fake",
        "fp",
        "header",
        "hidx",
        "key",
        "meta_bad",
        "meta_rooms",
        "meta_rows",
        "meta_slots",
        "mslots",
        "n",
        "no_index",
        "no_reason",
        "ones",
        "rooms",
        "rows",
    )

    def __init__(
        self, t: RequestTable, head: tuple[int, int, int], pool: int | None, by_index: bool
    ) -> None:
        self.key = (t.version, t.columns_version)
        self.rows = t.order().copy()
        self.rooms = t.room[self.rows]
        self.hidx = t.handle_index[self.rows]
        # handed to hooks and kept in results: nobody may write into the cache
        self.rooms.setflags(write=False)
        self.hidx.setflags(write=False)
        self.mslots = t.metadata_slot[self.rows]
        self.fake = t.fake[self.rows]
        self.n = self.rows.size
        self.fp = fingerprint(self.rooms)
        self.ones = np.ones(self.n, dtype=bool)
        self.header = np.empty(HEADER, dtype=np.int32)
        config, queue, capacity = head
        write_header(self.header, self.n, self.fp, config, queue, 0, capacity)
        self.no_reason = np.full(self.n, _NONE, dtype=np.int8)
        # rows a batch poller that reads by index cannot answer for: polling
        # them with index -1 would read another request's status
        self.no_index: NDArray[np.bool_] | None = None
        if by_index:
            missing = self.hidx < 0
            if missing.any():
                self.no_index = missing
        # rows the metadata gate reads: real requests with a row (None: all of them)
        checkable = ~self.fake & (self.mslots >= 0)
        # a row outside the pool can never land; it fails instead of being read
        self.meta_bad: NDArray[np.bool_] | None = None
        if pool is not None:
            bad = checkable & (self.mslots >= pool)
            if bad.any():
                self.meta_bad = bad
                checkable &= ~bad
        self.meta_rows: NDArray[np.int64] | None = None
        self.checkable: NDArray[np.bool_] | None = None
        self.meta_slots, self.meta_rooms = self.mslots, self.rooms
        if not checkable.all():
            self.checkable = checkable
            self.meta_rows = np.flatnonzero(checkable)
            self.meta_slots, self.meta_rooms = self.mslots[checkable], self.rooms[checkable]
        self.meta_slots.setflags(write=False)  # lets the metadata source skip re-checking it


def _hook(obj: object, method: str, what: str) -> None:
    if obj is not None and not callable(getattr(obj, method, None)):
        raise InvalidArgument(what, obj, f"an object with a {method}() method")


def _bools(answer: object, k: int, hook: str, rank: int) -> NDArray[np.bool_]:
    """A hook's per-row answer: exactly ``k`` numpy bools, else a :class:`HookError`."""
    arr = np.asarray(answer)
    if arr.dtype != np.bool_ or arr.shape != (k,):
        raise HookError(
            hook,
            rank,
            f"answered {type(answer).__name__} of dtype {arr.dtype} and shape {arr.shape}, "
            f"not {k} booleans",
        )
    return arr


class Stepper:
    """Steps the requests of one :class:`RequestTable` on one rank.

    ``queue`` names the queue this stepper steps ("bootstrap", "inflight",
    ...): its hash travels in the header, so ranks that step different queues
    in the same collective raise instead of mixing them up.
    ``agreed_capacity`` is for a stepper that replaces one on the same group
    whose capacity was agreed (the value of its :attr:`capacity`, which is
    the same on every rank); every rank must pass the same value or None.
    """

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
        _hook(poller, "poll_many", "Stepper poller")
        _hook(staging, "advance", "Stepper staging")
        _hook(staging, "pending", "Stepper staging")
        _hook(metadata, "landed", "Stepper metadata")
        _hook(faults, "inject", "Stepper faults")
        gates = tuple(gates)
        for g in gates:
            _hook(g, "closed", "Stepper gate")
        if agreed_capacity is not None:
            agreed_capacity = validate.integer(
                agreed_capacity, "Stepper agreed_capacity", 1, MAX_CAPACITY, rank
            )
        self.table = table
        self.rank = rank
        self.poller = poller
        self.staging = staging
        self.metadata = metadata
        self.gates = gates
        self.faults = faults
        self.config = config or StepConfig()
        self.clock = clock
        self.queue = queue
        table.rank = rank
        if table.step_no == 0 or np.isnan(table.now):
            # rows added before any stepper had a clock entered now
            now = float(clock())
            live = table.order()
            unset = live[np.isnan(table.entered_time[live])]
            table.entered_time[unset] = now
            table.now = now
        self._head = (self.config.fingerprint, hash31(queue), self.config.initial_capacity)
        if agreed_capacity is None:
            self.capacity = BOOT_CAPACITY
            self._floor: int | None = None  # agreed at the first reduce
        else:
            self.capacity = self._floor = _bucket(0, agreed_capacity)
        self._tag = 0
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
            pool = getattr(self.metadata, "size", None)
            by_index = self.poller is not None and not getattr(self.poller, "by_room", False)
            v = self._view = _View(
                t, self._head, pool if validate.is_integer(pool) else None, by_index
            )
        return v

    def _blame(self, rooms: NDArray[np.uint64], err: BaseException) -> None:
        """Report ``err`` for each of ``rooms`` in ``StepResult.exceptions``."""
        self._exceptions.update(dict.fromkeys(rooms.tolist(), err))

    def _contained(self, hook: str, exc: Exception) -> HookError:
        if isinstance(exc, HookError):
            return exc
        err = HookError(hook, self.rank, f"raised {exc!r}")
        err.__cause__ = exc
        return err

    # ------------------------------------------------------------------
    # prepare: observe, verdicts, gates -> buffer
    # ------------------------------------------------------------------
    def prepare(self, tag: int | None = None) -> NDArray[np.int32]:
        """Local work of a step; returns the int32 buffer to MIN-reduce.

        ``tag`` (e.g. the scheduler's iteration number) must be the same on
        every rank for this step; None on every rank when not used.
        """
        if tag is None:
            tag_word = 0
        else:
            if not validate.is_integer(tag):
                raise InvalidArgument("step tag", tag, "an integer (the iteration)", self.rank)
            tag_word = int(tag) % ((1 << 31) - 1) + 1
        t = self.table
        v = self._current_view()
        rows, rooms, hidx, n = v.rows, v.rooms, v.hidx, v.n
        state = t.state[rows]
        now = self.clock()
        step = t.step_no + 1
        self._exceptions = {}
        self._raw_invalid = {}
        self._tag = tag_word
        # rows not yet agreed terminal; the table's count settles the common case
        all_active = t.terminal_count == 0
        active = v.ones if all_active else (state > _F) & (state < _S)
        if all_active:
            act_rooms, act_hidx = rooms, hidx
        else:
            act_rooms, act_hidx = rooms[active], hidx[active]
        hooked: NDArray[np.bool_] | None = None  # rows a misbehaving hook fails

        def hook_failed(mask: NDArray[np.bool_], hook: str, exc: Exception) -> None:
            nonlocal hooked
            self._blame(rooms[mask & active], self._contained(hook, exc))
            hooked = mask.copy() if hooked is None else hooked | mask

        if self.staging is not None and act_rooms.size:
            try:
                self.staging.advance(act_rooms, act_hidx)
            except Exception as e:  # fails the rows it was asked to advance
                hook_failed(active, "staging advance", e)

        # 1. observe (terminal rows keep their latched status)
        reason: NDArray[np.int8] | None = None
        if act_rooms.size:
            noidx = None
            if v.no_index is not None:
                noidx = v.no_index if all_active else v.no_index[active]
            vals, exc, invalid, breason, unpolled = self._observe(
                rows, active, all_active, act_rooms, act_hidx, noidx
            )
            if all_active:
                local = vals
            else:
                local = state.copy()
                local[active] = vals
        else:
            local = state.copy()
            exc = invalid = breason = unpolled = None

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
            seen = state.copy()  # a hook writing into its view must not reach apply
            ctx = StepContext(self.rank, step, now, rooms, seen, t.added_step[rows])
            try:
                injected = _bools(self.faults.inject(ctx), n, "fault hook", self.rank)
            except Exception as e:
                hook_failed(v.ones, "fault hook", e)
            else:
                verdict(injected, FailureReason.INJECTED_FAULT)
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
        verdict(unpolled, _HOOK, sub=True)
        verdict(hooked, _HOOK)
        landed: NDArray[np.bool_] | None = None
        if self.metadata is not None and n:
            if v.meta_bad is not None:
                bad = v.meta_bad if all_active else v.meta_bad & active
                if bad.any():
                    for i in np.flatnonzero(bad).tolist():
                        self._exceptions[int(rooms[i])] = HookError(
                            "metadata source",
                            self.rank,
                            f"cannot hold room={int(rooms[i])}: its metadata slot "
                            f"{int(v.mslots[i])} is outside the pool of "
                            f"{getattr(self.metadata, 'size', '?')} rows",
                        )
                    verdict(bad, _HOOK)
            success = local == _S
            if not all_active:
                success &= active  # latched rows are neither checked nor gated
            if success.any():
                try:
                    landed, corrupt = self._metadata_check(v, success)
                except Exception as e:
                    asked = success if v.checkable is None else success & v.checkable
                    self._blame(rooms[asked], self._contained("metadata source", e))
                    verdict(asked, _HOOK)
                    landed = v.fake.copy()
                else:
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
        # latched Success is never held back). A gate that raises or answers
        # nonsense fails the rows it was deciding (those at Success).
        if n and (self.staging is not None or landed is not None or self.gates):
            at = local == batch.DEMOTE_SOURCE
            if not all_active:
                at &= active
            if at.any():
                if self.staging is not None:
                    pend = self._ask(
                        self.staging.pending, "staging pending", v, active, all_active, act_rooms,
                        act_hidx, at,
                    )  # fmt: skip
                    if pend is not None:
                        batch.demote(local, "hold_staging", pend, at)
                if landed is not None:
                    batch.demote(local, "hold_metadata", ~landed, at)
                for gate in self.gates:
                    closed = self._ask(
                        gate.closed, f"gate {getattr(gate, 'name', '?')!r}", v, active,
                        all_active, act_rooms, act_hidx, at,
                    )  # fmt: skip
                    if closed is not None:
                        batch.demote(local, "hold_gate", closed, at)
                if self._gate_failed is not None:
                    failed_at = self._gate_failed
                    self._gate_failed = None
                    if reason is None:
                        reason = np.full(n, _NONE, dtype=np.int8)
                    reason[failed_at] = _HOOK
                    local[failed_at] = _F

        self._state, self._local = state, local
        self._has_reason = reason is not None
        self._reason = reason if reason is not None else v.no_reason
        self._now = now
        self._prepared = True
        return self._pack_buffer(v)

    _gate_failed: NDArray[np.bool_] | None = None

    def _ask(
        self,
        fn: Callable[..., Any],
        hook: str,
        v: _View,
        active: NDArray[np.bool_],
        all_active: bool,
        act_rooms: NDArray[np.uint64],
        act_hidx: NDArray[np.int64],
        at: NDArray[np.bool_],
    ) -> NDArray[np.bool_] | None:
        """A gate's answer for every active row (False on latched rows); None
        when the gate raised or answered nonsense (the rows at ``at`` are then
        marked to fail, and ``at`` is cleared so later gates skip them).

        Asking about all active rows, not only those at Success, costs one
        gather in an array-backed gate and saves two mask selections here.
        """
        try:
            if all_active:
                return _bools(fn(v.rooms, v.hidx), v.n, hook, self.rank)
            full = np.zeros(v.n, dtype=bool)
            full[active] = _bools(fn(act_rooms, act_hidx), act_rooms.size, hook, self.rank)
            return full
        except Exception as e:
            self._blame(v.rooms[at], self._contained(hook, e))
            failed = at.copy()
            self._gate_failed = failed if self._gate_failed is None else self._gate_failed | failed
            at[:] = False
            return None

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
        if self._tag:
            buf[_TAG] = self._tag
            buf[_TAG + 1] = -self._tag
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
        noidx: NDArray[np.bool_] | None,
    ) -> tuple[
        NDArray[np.int8],
        NDArray[np.bool_] | None,
        NDArray[np.bool_] | None,
        NDArray[np.int8] | None,
        NDArray[np.bool_] | None,
    ]:
        """Raw statuses of the active rows: (values, raised, invalid, backend
        reason, not polled for want of a handle index).

        Masks are None when nothing raised / nothing was invalid / the backend
        gave no reasons (the common case costs no arrays).
        """
        k = rooms.size
        exc: NDArray[np.bool_] | None = None
        breason: NDArray[np.int8] | None = None
        unpolled: NDArray[np.bool_] | None = None
        if self.poller is not None:
            ask_rooms, ask_hidx, pos = rooms, hidx, None
            if noidx is not None and noidx.any():
                unpolled = noidx
                self._blame(
                    rooms[noidx],
                    HookError(
                        "batch poll",
                        self.rank,
                        "cannot answer for a request without a handle index (set it with "
                        "add(handle_index=...) or set_handle_index, or mark a poller that "
                        "answers from rooms alone with by_room = True)",
                    ),
                )
                pos = np.flatnonzero(~noidx)
                ask_rooms, ask_hidx = rooms[pos], hidx[pos]
            m = ask_rooms.size
            try:
                sub_exc: NDArray[np.bool_] | None = None
                try:
                    arr = np.asarray(self.poller.poll_many(ask_rooms, ask_hidx))
                except PartialPollError as pe:
                    arr = np.asarray(pe.statuses)
                    bad_keys = [
                        i for i in pe.errors if not validate.is_integer(i) or not 0 <= i < m
                    ]
                    if bad_keys:
                        raise ValueError(
                            f"PartialPollError names positions {bad_keys} outside the batch of {m}"
                        ) from pe
                    sub_exc = np.zeros(m, dtype=bool)
                    for i, err in pe.errors.items():
                        sub_exc[i] = True
                        self._exceptions[int(ask_rooms[i])] = err
                if arr.shape != (m,):
                    raise ValueError(f"poll_many returned shape {arr.shape}, expected ({m},)")
                if arr.dtype.kind not in "iu":
                    raise TypeError(f"poll_many must return integers, got dtype {arr.dtype}")
            except Exception as e:  # never let one rank's error desync the group
                self._blame(ask_rooms, e)
                return np.zeros(k, np.int8), np.ones(k, bool), None, None, unpolled
            if pos is not None:
                full_arr = np.full(k, KVPoll.Failed, dtype=np.int64)
                full_arr[pos] = arr
                arr = full_arr
                if sub_exc is not None:
                    exc = np.zeros(k, dtype=bool)
                    exc[pos] = sub_exc
            else:
                exc = sub_exc
            values: Any = arr
        else:
            handles = self.table.handles
            slots = (rows if all_active else rows[active]).tolist()
            out: list[Any] = []
            p = 0
            while p < k:
                try:
                    for s in slots[p:]:
                        out.append(handles[s].poll())
                        p += 1
                except Exception as e:
                    self._exceptions[int(rooms[p])] = e
                    out.append(KVPoll.Failed)
                    if exc is None:
                        exc = np.zeros(k, dtype=bool)
                    exc[p] = True
                    p += 1
            values = out
            # only integers are statuses: 2.7, True or "4" are invalid, never rounded
            arr = np.fromiter(
                (x if validate.is_integer(x) and 0 <= x <= 4 else -1 for x in out),
                dtype=np.int64,
                count=k,
            )
        invalid: NDArray[np.bool_] | None = None
        lo = int(arr.min()) if k else 1
        if k and (lo < 0 or int(arr.max()) > 4):
            invalid = (arr < 0) | (arr > 4)
            if exc is not None:
                invalid &= ~exc
            if unpolled is not None:
                invalid &= ~unpolled
            for i in np.flatnonzero(invalid).tolist():
                self._raw_invalid[int(rooms[i])] = values[i]
            arr = np.where(invalid, KVPoll.Failed, arr)
        if exc is not None:
            arr = np.where(exc, KVPoll.Failed, arr)
        vals = arr.astype(np.int8)  # a fresh array: the backend's is never written to
        if invalid is not None or exc is not None or unpolled is not None:
            lo = int(vals.min()) if k else 1
        if lo == 0:
            failed = vals == _F
            if exc is not None:
                failed &= ~exc
            if invalid is not None:
                failed &= ~invalid
            if unpolled is not None:
                failed &= ~unpolled
            if failed.any():
                breason = np.full(k, FailureReason.UNKNOWN, dtype=np.int8)
                if self.poller is not None:
                    reasons_fn = getattr(self.poller, "failure_reasons", None)
                    if reasons_fn is not None:
                        nf = int(failed.sum())
                        try:
                            given = np.asarray(reasons_fn(rooms[failed], hidx[failed]))
                            if given.shape != (nf,) or given.dtype.kind not in "iu":
                                raise HookError(
                                    "failure_reasons",
                                    self.rank,
                                    f"answered dtype {given.dtype} shape {given.shape}, "
                                    f"not {nf} integer reason codes",
                                )
                        except Exception as e:
                            self._blame(rooms[failed], self._contained("failure_reasons", e))
                            breason[failed] = _HOOK
                        else:
                            breason[failed] = np.where(
                                np.isin(given, _BACKEND_REASONS), given, _UNKNOWN
                            )
                else:
                    handles = self.table.handles
                    slots_l = (rows if all_active else rows[active]).tolist()
                    for i in np.flatnonzero(failed).tolist():
                        code, why = _reason_of(handles[slots_l[i]])
                        breason[i] = code
                        if why is not None:
                            self._exceptions[int(rooms[i])] = self._contained("failure_reason", why)
        return vals, exc, invalid, breason, unpolled

    def _metadata_check(
        self, v: _View, success: NDArray[np.bool_]
    ) -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
        """(landed, corrupt) per row, for rows at Success; fake-path requests
        count as landed, a real request without a metadata row never does."""
        assert self.metadata is not None
        ok, bad = self.metadata.landed(v.meta_slots, v.meta_rooms)
        m = v.meta_slots.size
        ok = _bools(ok, m, "metadata source (landed)", self.rank)
        bad = _bools(bad, m, "metadata source (corrupt)", self.rank)
        if v.meta_rows is None:
            landed = ok
            corrupt = bad & success
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
    def _agree(self, hdr: Header) -> None:
        """On the first reduce: adopt the largest capacity any rank asked for."""
        if self._floor is None:
            self._floor = _bucket(0, min(max(hdr.cap_max, 1), MAX_CAPACITY))
            if hdr.len_max <= self.capacity:  # this reduce was whole: grow for the next
                self.capacity = max(self.capacity, self._floor)

    def resize(self, reduced: NDArray[np.int32]) -> bool:
        """After a reduce: True if some rank's list outgrew the capacity.

        Capacity then grows and :meth:`repack` gives the buffer to reduce again.
        """
        hdr = Header(reduced)
        self._agree(hdr)
        assert self._floor is not None
        if hdr.len_max <= reduced.size - HEADER:  # every rank's list fitted
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
        if reduced.size - HEADER < hdr.len_max:
            raise RuntimeError("apply(): capacity too small; call resize() and reduce again")
        self._agree(hdr)
        assert self._floor is not None
        if hdr.len_max * 4 < self.capacity and self.capacity > self._floor:
            self.capacity = max(self._floor, _bucket(hdr.len_max * 2, self._floor))
        self._prepared = False
        differs = hdr.differs()
        if differs:
            raise CollectiveMismatch(
                self.rank,
                n,
                (hdr.len_min, hdr.len_max),
                v.fp,
                (hdr.fp_min, hdr.fp_max),
                differs,
                self._mismatch_detail(hdr, differs),
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
    def _mismatch_detail(self, hdr: Header, differs: tuple[str, ...]) -> str:
        out = []
        if "step configuration" in differs:
            out.append(
                f"Step configuration: this rank's {self.config!r} hashes to "
                f"{self._head[0]:#010x}; across ranks {hdr.config[0]:#010x}..{hdr.config[1]:#010x}."
            )
        if "queue" in differs:
            out.append(
                f"Queue: this rank steps {self.queue!r} ({self._head[1]:#010x}); across ranks "
                f"{hdr.queue[0]:#010x}..{hdr.queue[1]:#010x}."
            )
        if "tag" in differs:
            out.append(
                f"Tag: this rank's iteration tag word is {self._tag} (0: none); across ranks "
                f"{hdr.tag[0]}..{hdr.tag[1]}: some rank is on another iteration."
            )
        return " ".join(out)

    def step(self, collective: Collective, tag: int | None = None) -> StepResult:
        """prepare -> MIN all-reduce over ``collective`` -> apply.

        ``tag``: the caller's iteration number, the same on every rank; a rank
        on another iteration makes every rank raise CollectiveMismatch.
        """
        buf = self.prepare(tag)
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


def _reason_of(handle: Any) -> tuple[FailureReason, Exception | None]:
    """A per-object poller's reason for a Failed it reported, and what its
    reason hook raised (its reason is then ``hook error``)."""
    fn = getattr(handle, "failure_reason", None)
    if fn is not None:
        try:
            raw = fn()
            if not validate.is_integer(raw):
                raise TypeError(f"failure_reason() returned {raw!r}, not a reason code")
            code = int(raw)
        except Exception as e:
            return _HOOK, e
        ok = code in _BACKEND_REASONS
        return (FailureReason(code) if ok else FailureReason.UNKNOWN), None
    fn = getattr(handle, "failure_exception", None)
    if fn is not None:
        try:
            return (FailureReason.TRANSFER_ERROR if fn() is not None else _UNKNOWN_R), None
        except Exception:
            return FailureReason.TRANSFER_ERROR, None
    return FailureReason.UNKNOWN, None
