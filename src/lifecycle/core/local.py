"""Stages 2 and 3 of a step on one rank (observe; verdicts and gates), run in order.

Everything runs over the frame's active rows. Each hook the caller plugs in
(poller, staging, metadata source, user gates, fault hook) is asked inside a
containment: if it raises or answers with the wrong shape or dtype, the rows
it was asked about fail with reason LOCAL_EXCEPTION on this rank, which the
reduce spreads to every rank. The group keeps stepping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lifecycle.config import StepConfig
from lifecycle.core.frame import Frame
from lifecycle.core.observe import Observation, contained, observe
from lifecycle.core.packing import pack, status_words
from lifecycle.core.sources import GATE_SOURCES, LATE, SOURCES, Hooks, Inputs, armed, everyone
from lifecycle.core.verdicts import GATE_DEST, combine, hold
from lifecycle.errors import HookError
from lifecycle.protocols import BatchPoller, FaultHook, Gate, MetadataSource, StagingGate
from lifecycle.reasons import FailureReason
from lifecycle.rules.graph import GATES
from lifecycle.status import I8, KVPoll
from lifecycle.table import RequestTable

__all__ = ["LocalStage"]


_S_BYTE = bytes([int(I8.S)])
#: the live statuses' bytes (a poll of only these fails nothing)
_LIVE = bytes(int(s) for s in KVPoll if s != KVPoll.Failed)


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


_F = I8.F
_S = I8.S
_B = I8.B
_NONE = np.int8(FailureReason.NONE)
_NO_ROWS = np.empty(0, dtype=np.int64)
_NO_ROWS.setflags(write=False)
#: the sources an empty list can still hit: what observing itself found
_OBSERVED = ("poll_value", "poll_error", "hook_error")


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
        #: the hooks, fixed for the stepper's life (read them as the properties below)
        self.hooks = Hooks(staging, metadata, tuple(gates), faults)
        self._armed_for: tuple[StepConfig, tuple[tuple[str, Any], ...]] | None = None
        self.values: NDArray[np.int8] = np.empty(0, dtype=np.int8)
        self.codes: NDArray[np.int8] | None = None
        self.unfailed: NDArray[np.int8] | None = None
        #: (values, k, the positions of their Failed among the first k)
        self._failed_at: tuple[NDArray[np.int8], int, NDArray[np.int64]] | None = None
        self.obs = Observation(self.values)
        self.now = 0.0
        #: record which gate held which row (:attr:`held`); off, the step asks nothing more
        self.explain = False
        #: the last prepare's holds, with :attr:`explain`: gate name -> the active
        #: rows' positions it held at Transferring (a row two gates would hold is
        #: the first one's, in the order of ``GATES``)
        self.held: dict[str, NDArray[np.int64]] = {}

    @property
    def staging(self) -> StagingGate | None:
        return self.hooks.staging

    @property
    def metadata(self) -> MetadataSource | None:
        return self.hooks.metadata

    @property
    def gates(self) -> tuple[Gate, ...]:
        return self.hooks.gates

    @property
    def faults(self) -> FaultHook | None:
        return self.hooks.faults

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

    def run(
        self,
        t: RequestTable,
        f: Frame,
        cfg: StepConfig,
        now: float,
        step: int,
        clock_error: HookError | None = None,
        observed: Observation | None = None,
    ) -> None:
        # every stage adds work only when its source can hit: right after a
        # blocking collective each numpy call costs microseconds (cold caches),
        # so the common step makes as few as it can
        n = f.n
        self.now = now
        if self.held:
            self.held = {}
        staging = self.staging
        if observed is not None and staging is not None:  # the scatter advances before the poll
            raise ValueError("a step with a staging gate observes its rows itself")
        early: Exception | None = None
        if staging is not None and n:
            try:
                staging.advance(f.rooms, f.hidx)
            except Exception as e:  # fails the rows it was asked to advance
                early = e
        obs = self.obs = observed or observe(
            self.poller, t.handles, f.rows, f.rooms, f.hidx, f.no_index, self.rank
        )
        if early is not None:
            obs.hook_failed(everyone(n), f.rooms, contained("staging advance", self.rank, early))
            obs.clean, obs.scan = False, None
        if clock_error is not None:  # no deadline or stamp can be trusted on this rank
            obs.hook_failed(everyone(n), f.rooms, clock_error)
            obs.clean, obs.scan = False, None
        local, codes = obs.raw, None
        x: Inputs | None = None  # built only for a step some source or gate reads
        masks: dict[str, NDArray[np.bool_] | None] = {}
        hooked = None
        # the common poll (every value live, nothing failed) on a stage no
        # verdict source can hit: no mask to build
        quiet = obs.clean and self._only_poll(t, f, cfg)
        if not quiet:
            x = Inputs(t, f, cfg, now, step, obs, self.hooks, self.rank)
            if n:
                masks = {name: fn(x) for name, fn in self._armed(cfg)}
            else:  # no row for a source to hit: only what observing found
                masks = {name: SOURCES[name].fn(x) for name in _OBSERVED}
            hooked = obs.hooked
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
            if x is None:
                x = Inputs(t, f, cfg, now, step, obs, self.hooks, self.rank)
            x.success, x.at_success = _Lazy(local), at_success
            # in the table's order, each from its own source, each taking its
            # own edge (gates that share an edge share one pass)
            closed: dict[np.int8, NDArray[np.bool_] | None] = {}
            for rule in GATES:  # masks here are never written to: may be a hook's own
                dest = GATE_DEST[rule.source]
                before = closed.get(dest)
                closed[dest] = GATE_SOURCES[rule.source](x, before)
                if self.explain:
                    self._attribute(rule.name, x.success, before, closed[dest])
            if x.corrupt is not None or obs.hooked is not hooked:
                # what the gates found: the late sources again (every source,
                # when the quiet step skipped them)
                for name in SOURCES if quiet else LATE:
                    masks[name] = SOURCES[name].fn(x)
                codes = combine(n, masks, obs.backend)
                if codes is not None:
                    local = np.where(codes != _NONE, _F, obs.raw).astype(np.int8)
            for dest, mask in closed.items():
                if mask is not None:
                    hold(local, mask, dest)
        self.values, self.codes = local, codes
        #: ``values`` as this prepare left them, when they hold no Failed
        #: (a local Failed comes from a verdict or a poll: both set ``codes``)
        self.unfailed = local if codes is None else None
        self._failed_at = None
        if codes is not None and codes is obs.backend and obs.failed is not None:
            # only the poller's Failed values: they are the Failed rows
            self._failed_at = (local, n, obs.failed.nonzero()[0])

    def _attribute(
        self,
        gate: str,
        success: _Lazy,
        before: NDArray[np.bool_] | None,
        after: NDArray[np.bool_] | None,
    ) -> None:
        """Record the local Successes ``gate`` closed that no earlier gate had
        (``success``: the rows at Success, found once for every gate)."""
        if after is None or after is before:  # this gate closed nothing of its own
            return
        own = np.logical_and(after, success())
        if before is not None:
            np.greater(own, before, out=own)  # (booleans: own and not before)
        rows = own.nonzero()[0]
        if rows.size:
            self.held[gate] = rows

    def _only_poll(self, t: RequestTable, f: Frame, cfg: StepConfig) -> bool:
        """No verdict source but the poll can hit (no fault hook, abort,
        timeout or row outside the metadata pool)."""
        return (
            self.hooks.faults is None
            and not t.abort_count
            and cfg.bootstrap_timeout is None
            and cfg.waiting_timeout is None
            and f.meta_bad is None
        )

    def quiet(
        self, t: RequestTable, f: Frame, cfg: StepConfig, scan: bytes | bytearray | NDArray[np.int8]
    ) -> bool:
        """Whether :meth:`run` would do nothing but take a caller's poll of the
        active rows (``scan``: the statuses, a byte each, or as an int8 array)
        as it is: every value a live status, no staging gate, no verdict
        source but the poll can hit, and no gate has a Success to decide.
        Then :meth:`took` records them as run would."""
        h = self.hooks
        if h.staging is not None or not self._only_poll(t, f, cfg):
            return False
        gated = h.metadata is not None or bool(h.gates)
        if isinstance(scan, np.ndarray):  # a long list: two numpy calls
            lo, hi = scan[scan.argmin()], scan[scan.argmax()]
            return bool(lo >= _B and hi <= _S and not (gated and hi == _S))
        return not (scan.translate(None, _LIVE) or (gated and _S_BYTE in scan))

    def took(
        self,
        values: NDArray[np.int8],
        scan: bytes | None,
        answers: list[object] | NDArray[Any] | None,
        now: float,
    ) -> None:
        """This stage as :meth:`run` leaves it on a step :meth:`quiet` accepted."""
        obs = self.obs = Observation(values)
        obs.clean, obs.scan, obs.given = True, scan, answers
        self.values, self.codes, self.unfailed, self._failed_at = values, None, values, None
        self.now = now
        if self.held:  # (no gate had a Success to decide)
            self.held = {}

    def _armed(self, cfg: StepConfig) -> tuple[tuple[str, Any], ...]:
        """The sources that can hit under ``cfg`` (kept while ``cfg`` is the same)."""
        got = self._armed_for
        if got is None or got[0] is not cfg:
            got = self._armed_for = (cfg, armed(cfg, self.hooks))
        return got[1]

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
