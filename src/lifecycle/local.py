"""Stages 2 and 3 of a step on one rank: observe, verdicts, gates.

Everything runs over the frame's active rows. Each hook the caller plugs in
(poller, staging, metadata source, user gates, fault hook) is asked inside a
containment: if it raises or answers with the wrong shape or dtype, the rows
it was asked about fail with reason LOCAL_EXCEPTION on this rank, which the
reduce spreads to every rank. The group keeps stepping.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from lifecycle.errors import HookError
from lifecycle.frame import Frame
from lifecycle.observe import Observation, contained, observe
from lifecycle.packing import pack, status_words
from lifecycle.protocols import (
    BatchPoller,
    FaultHook,
    Gate,
    MetadataSource,
    StagingGate,
    StepContext,
)
from lifecycle.reasons import FailureReason
from lifecycle.status import I8
from lifecycle.table import RequestTable
from lifecycle.verdicts import bool_answer, combine, hold

if TYPE_CHECKING:
    from lifecycle.step import StepConfig

__all__ = ["LocalStage"]


def _ask_gate(gate: Gate, f: Frame, name: str, rank: int) -> NDArray[np.bool_]:
    return bool_answer(gate.closed(f.rooms, f.hidx), f.n, name, rank)


_S_BYTE = bytes([int(I8.S)])


def _any(mask: NDArray[np.bool_]) -> bool:
    # the first True's position: right after a collective (cold caches) far
    # cheaper than .any(), and no copy
    return bool(mask.size) and bool(mask[mask.argmax()])


class _Lazy:
    """The rows at Success, computed on first use (most steps never need them)."""

    __slots__ = ("_local", "_mask")

    def __init__(self, local: NDArray[np.int8]) -> None:
        self._local = local
        self._mask: NDArray[np.bool_] | None = None

    def __call__(self) -> NDArray[np.bool_]:
        if self._mask is None:
            self._mask = self._local == _S
        return self._mask


def _everyone(n: int) -> NDArray[np.bool_]:
    return np.ones(n, dtype=bool)


def _or(a: NDArray[np.bool_] | None, b: NDArray[np.bool_]) -> NDArray[np.bool_]:
    return b.copy() if a is None else a | b


_F = I8.F
_S = I8.S
_B = I8.B
_NONE = np.int8(FailureReason.NONE)
_NO_ROWS = np.empty(0, dtype=np.int64)
_NO_ROWS.setflags(write=False)


class LocalStage:
    """The hooks of one stepper and what the last prepare computed with them."""

    def __init__(
        self,
        rank: int,
        *,
        poller: BatchPoller | None,
        staging: StagingGate | None,
        metadata: MetadataSource | None,
        gates: Sequence[Gate],
        faults: FaultHook | None,
    ) -> None:
        self.rank = rank
        self.poller = poller
        self.staging = staging
        self.metadata = metadata
        self.gates = tuple(gates)
        self.faults = faults
        self.values: NDArray[np.int8] = np.empty(0, dtype=np.int8)
        self.codes: NDArray[np.int8] | None = None
        self.unfailed: NDArray[np.int8] | None = None
        #: (values, k, the positions of their Failed among the first k)
        self._failed_at: tuple[NDArray[np.int8], int, NDArray[np.int64]] | None = None
        self.obs = Observation(self.values)
        self.now = 0.0

    def reasons(self) -> NDArray[np.int8]:
        """Local reason per active row (NONE where this rank did not fail it)."""
        if self.codes is None:
            return np.full(self.values.size, _NONE, dtype=np.int8)
        return self.codes

    @property
    def exceptions(self) -> dict[int, BaseException]:
        return self.obs.exceptions

    @property
    def raw_invalid(self) -> dict[int, object]:
        return self.obs.raw_invalid

    def _ask(self, hook: str, fn: Callable[[], Any], rows: NDArray[np.bool_], f: Frame) -> Any:
        """Run one hook call; if it raises, fail ``rows`` (HOOK_ERROR) and return None."""
        try:
            return fn()
        except Exception as e:
            self.obs.hook_failed(rows, f.rooms, contained(hook, self.rank, e))
            return None

    def run(
        self,
        t: RequestTable,
        f: Frame,
        cfg: StepConfig,
        now: float,
        step: int,
        clock_error: HookError | None = None,
    ) -> None:
        # every stage adds work only when its source can hit: right after a
        # blocking collective each numpy call costs microseconds (cold caches),
        # so the common step makes as few as it can
        n = f.n
        self.now = now
        staging = self.staging
        early: Exception | None = None
        if staging is not None and n:
            try:
                staging.advance(f.rooms, f.hidx)
            except Exception as e:  # fails the rows it was asked to advance
                early = e
        obs = self.obs = observe(
            self.poller, t.handles, f.rows, f.rooms, f.hidx, f.no_index, self.rank
        )
        if early is not None:
            obs.hook_failed(_everyone(n), f.rooms, contained("staging advance", self.rank, early))
            obs.clean, obs.scan = False, None
        if clock_error is not None:  # no deadline or stamp can be trusted on this rank
            obs.hook_failed(_everyone(n), f.rooms, clock_error)
            obs.clean, obs.scan = False, None
        local, codes = obs.raw, None
        masks: dict[str, NDArray[np.bool_] | None] = {}
        hooked = None
        # the common poll (every value live, nothing failed) on a stage no
        # verdict source can hit: no mask to build
        quiet = obs.clean and (
            self.faults is None
            and not t.abort_count
            and cfg.bootstrap_timeout is None
            and cfg.waiting_timeout is None
            and f.meta_bad is None
        )
        if not quiet:
            if n:
                self._verdicts(t, f, cfg, now, step, masks)
            masks["poll_value"] = obs.invalid
            masks["poll_error"] = obs.errors
            hooked = masks["hook_error"] = obs.hooked
            codes = combine(n, masks, obs.backend)
            # the backend's codes alone mark exactly the rows it reported
            # Failed: the raw values are the local ones
            if codes is not None and codes is not obs.backend:
                local = np.where(codes != _NONE, _F, obs.raw).astype(np.int8)
        gated = staging is not None or self.metadata is not None or self.gates
        at_success = 0
        if gated and n:
            # bytes.count branches on every byte (slow on mixed values);
            # numpy's count costs two calls, which only a long list repays
            if n > 1024:
                at_success = int(np.count_nonzero(local == _S))
            else:
                scan = obs.scan if codes is None else None
                if scan is None:
                    scan = local.tobytes()
                if _S_BYTE in scan:
                    at_success = scan.count(_S_BYTE)
        if at_success:  # gates decide only local Successes
            closed, corrupt = self._gates(f, local, at_success)
            if corrupt is not None or obs.hooked is not hooked:
                if quiet:  # the masks were skipped: build them now
                    self._verdicts(t, f, cfg, now, step, masks)
                    masks["poll_value"] = obs.invalid
                    masks["poll_error"] = obs.errors
                masks["metadata_row"] = corrupt
                masks["hook_error"] = obs.hooked
                codes = combine(n, masks, obs.backend)
                if codes is not None:
                    local = np.where(codes != _NONE, _F, obs.raw).astype(np.int8)
            hold(local, closed)
        self.values, self.codes = local, codes
        #: ``values`` as this prepare left them, when they hold no Failed
        #: (a local Failed comes from a verdict or a poll: both set ``codes``)
        self.unfailed = local if codes is None else None
        self._failed_at = None
        if codes is not None and codes is obs.backend and obs.failed is not None:
            # only the poller's Failed values: they are the Failed rows
            self._failed_at = (local, n, obs.failed.nonzero()[0])

    def failed_in(self, k: int) -> NDArray[np.int64]:
        """The positions of the Failed values among the first ``k`` (ascending)."""
        values = self.values
        if values is self.unfailed:
            return _NO_ROWS
        known = self._failed_at
        if known is None or known[0] is not values or known[1] != k:
            at = (values[:k] == _F).nonzero()[0]
            self._failed_at = known = (values, k, at)
        return known[2]

    def _verdicts(
        self,
        t: RequestTable,
        f: Frame,
        cfg: StepConfig,
        now: float,
        step: int,
        masks: dict[str, NDArray[np.bool_] | None],
    ) -> None:
        """The verdict sources other than observing, as masks over the active rows."""
        n, obs = f.n, self.obs
        # first: a fault hook may request an abort, which this step then carries
        if self.faults is not None:
            faults = self.faults
            # a copy: a hook writing into its view must not reach apply
            ctx = StepContext(self.rank, step, now, f.rooms, t.state[f.rows], t.added_step[f.rows])
            masks["fault_hook"] = self._ask(
                "fault hook",
                lambda: bool_answer(faults.inject(ctx), n, "fault hook", self.rank),
                _everyone(n),
                f,
            )
        if t.abort_count:
            masks["abort_flag"] = t.abort_requested[f.rows]
        if cfg.bootstrap_timeout is not None:
            state = t.state[f.rows]
            masks["bootstrap_deadline"] = (state == _B) & (
                now - t.entered_time[f.rows] >= cfg.bootstrap_timeout
            )
        if cfg.waiting_timeout is not None:
            with np.errstate(invalid="ignore"):
                masks["waiting_deadline"] = now - t.metadata_sent_at[f.rows] >= cfg.waiting_timeout
        if self.metadata is not None and f.meta_bad is not None:
            size = getattr(self.metadata, "size", "?")
            for i in np.flatnonzero(f.meta_bad).tolist():
                obs.exceptions[int(f.rooms[i])] = HookError(
                    "metadata source",
                    self.rank,
                    f"cannot hold room={int(f.rooms[i])}: its metadata slot is outside "
                    f"the pool of {size} rows",
                )
            obs.hooked = _or(obs.hooked, f.meta_bad)

    def _gates(
        self, f: Frame, local: NDArray[np.int8], at_success: int
    ) -> tuple[NDArray[np.bool_] | None, NDArray[np.bool_] | None]:
        """The rows some gate of :data:`GATES` holds closed (None: none), and
        the corrupt metadata rows. Every gate takes the same demotion edge
        (checked where the graph is declared), so their union is all the
        hold needs. A gate decides only rows at Success, so its errors fail
        those."""
        n, rank = f.n, self.rank
        success = _Lazy(local)
        closed: NDArray[np.bool_] | None = None  # never written to: may be a hook's own
        corrupt: NDArray[np.bool_] | None = None
        staging = self.staging
        if staging is not None:  # source staging_pending
            try:
                closed = bool_answer(staging.pending(f.rooms, f.hidx), n, "staging pending", rank)
            except Exception as e:
                self.obs.hook_failed(success(), f.rooms, contained("staging pending", rank, e))
        if self.metadata is not None:  # source metadata_pending: not landed
            try:
                landed, bad = self._metadata(f, success, at_success)
            except Exception as e:
                # every row the gate decides fails, with a row or not: a row
                # without one is held by a source that answers, never released
                self.obs.hook_failed(
                    success() & ~f.fake, f.rooms, contained("metadata source", rank, e)
                )
            else:
                # closed | ~landed in one pass: for booleans, landed <= closed
                closed = ~landed if closed is None else np.less_equal(landed, closed)
                if _any(bad):  # never written to: the arrays may be the source's own
                    bad = bad & success()
                    corrupt = bad if _any(bad) else None
        if self.gates:  # source gate_closed
            user = np.zeros(n, dtype=bool)
            for gate in self.gates:
                name = f"gate {getattr(gate, 'name', '?')!r}"
                ans = self._ask(name, partial(_ask_gate, gate, f, name, rank), success(), f)
                if ans is not None:
                    user |= ans
            closed = user if closed is None else closed | user
        return closed, corrupt

    def _metadata(
        self, f: Frame, success: _Lazy, at_success: int
    ) -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
        """(landed, corrupt) per active row; fake-path requests count as
        landed, a real request without a metadata row never does. The gate
        decides only rows at local Success, and a read costs a cache line per
        row: when at most a quarter of the rows are at Success (a queue
        mostly still transferring), only those are read; otherwise every row
        is, in one pass (the subset's own gathers would cost more). The
        caller only reads them."""
        assert self.metadata is not None
        m = f.meta_slots.size
        ask: NDArray[np.int64] | None = None
        slots, rooms = f.meta_slots, f.meta_rooms  # read-only: the source checks them once
        if at_success * 4 <= m:
            mask = success()
            ask = (mask if f.meta_pos is None else mask[f.meta_pos]).nonzero()[0]
            slots, rooms, m = slots[ask], rooms[ask], ask.size
        ok, bad = self.metadata.landed(slots, rooms)
        ok = bool_answer(ok, m, "metadata source (landed)", self.rank)
        bad = bool_answer(bad, m, "metadata source (corrupt)", self.rank)
        if f.meta_pos is None and ask is None:
            return ok, bad
        at = f.meta_pos if ask is None else ask if f.meta_pos is None else f.meta_pos[ask]
        landed = f.fake.copy()
        landed[at] = ok
        corrupt = f.zeros.copy()
        corrupt[at] = bad
        return landed, corrupt

    def words(self, rows: NDArray[np.int64] | None = None) -> NDArray[np.uint8]:
        """This rank's words for all active rows, or for the positions ``rows``
        (the step's buffer packs its own, sharing the scan for the slots)."""
        values = self.values if rows is None else self.values[rows]
        out = np.empty(values.size, dtype=np.uint8)
        if self.codes is None:
            status_words(values, out)
        else:
            pack(values, self.codes if rows is None else self.codes[rows], out)
        return out
