"""One queue's table and stepper, kept from one consensus call to the next.

An engine calls the field's consensus function once per queue per scheduler
iteration, with the queue's current list. Building a table and a stepper for
every call costs more than the call it replaces; a :class:`Session` keeps
them and applies only what changed in the list since the last call:

- the list is recognised by the identity of its objects (the decode requests
  when given, else the pollers): when the live rows are the list's first
  entries, in order, a comparison of the two lists (identical objects compare
  in C without a call) is all it costs. Otherwise the objects' ids are
  matched. The session holds the objects it remembers, so none can be freed
  and its ``id`` reused by a new one;
- requests that left are removed from the table; requests that arrived at the
  end are added; anything else (a reordered list, an insertion in the
  middle, a room that repeats or is missing) rebuilds the table, which is
  what every call did before;
- a request at Success or Failed leaves the table once the result is out: if
  the engine keeps it in its list, the next call polls it afresh, as the
  field's function would.

A request's position in the list is its handle index (and, for the metadata
gate, its metadata slot), so the gates read the caller's objects by position,
and the session polls the list itself, in one loop, when no staging gate
advances first.
"""

from __future__ import annotations

import itertools
import logging
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from field.step.gates import RoomGate, StagingAdapter, is_fake, room_of
from lifecycle.config import StepConfig
from lifecycle.core.frame import Frame
from lifecycle.core.observe import Polled, poll_each
from lifecycle.drive.collective import Collective
from lifecycle.drive.stepper import Stepper
from lifecycle.errors import IllegalTransition
from lifecycle.protocols import FaultHook
from lifecycle.reasons import FailureReason
from lifecycle.result import Failure
from lifecycle.table import RequestTable

__all__ = ["Session"]

logger = logging.getLogger(__name__)

_NO_IDS = np.zeros(0, dtype=np.int64)
_REQ_ROOM = operator.attrgetter("req.bootstrap_room")


def _rooms(
    pollers: Sequence[Any], decode_reqs: Sequence[Any] | None, start: int
) -> list[int | None]:
    if decode_reqs is None:
        return [room_of(getattr(p, "bootstrap_room", None)) for p in pollers[start:]]
    out: list[int | None] = []
    for i in range(start, len(decode_reqs)):
        req = getattr(decode_reqs[i], "req", decode_reqs[i])
        room = room_of(getattr(req, "bootstrap_room", None))
        out.append(
            room if room is not None else room_of(getattr(pollers[i], "bootstrap_room", None))
        )
    return out


class Session:
    """The table, stepper and gates of one queue of one kind on one group."""

    def __init__(self, collective: Collective, gated: bool, staged: bool) -> None:
        self.collective = collective
        self.rank = collective.rank
        self.gated = gated
        self.staged = staged
        self.table: RequestTable | None = None
        self.stepper: Stepper | None = None
        self.known = True
        self.capacity: int | None = None
        self.faults: FaultHook | None = None
        self.meta: RoomGate | None = None
        self.staging: StagingAdapter | None = None
        #: the live rows' objects (decode requests, or pollers), in table order
        self._refs: list[Any] = []
        #: their pollers (the same list when no decode requests are given)
        self._prefs: list[Any] = []
        #: the table slot of each live row, in order
        self._slots = _NO_IDS
        #: ((id(table), its version, k), the rooms of the first k rows)
        self._want: tuple[tuple[int, ...], list[int]] = ((), [])
        #: the last frame whose rows were seen to be the list's, in order
        self._direct: Frame | None = None

    def holds(self, first: Any) -> bool:
        """True when ``first`` is one of this session's live rows."""
        refs = self._refs
        if not refs:
            return False
        if refs[0] is first:
            return True
        try:
            return first in refs  # identity first, in C
        except Exception:  # an ``==`` that raises: not one of ours
            return False

    # -- one call ---------------------------------------------------------------
    def run(
        self,
        pollers: list[Any],
        decode_reqs: list[Any] | None,
        *,
        metadata_buffers: Any,
        server_args: Any,
        staging_handler: Any,
        faults: FaultHook | None,
    ) -> tuple[list[int], list[Failure]]:
        """Step the list once; its agreed statuses and failures."""
        try:
            return self._run(
                pollers, decode_reqs, metadata_buffers, server_args, staging_handler, faults
            )
        except IllegalTransition as e:
            # a poller reported less than the status agreed before (the field's
            # function would just reduce it). That is decided from agreed data,
            # so every rank is here: each reduces once more what it contributed
            # (polled, gated and staged once), over a table that starts afresh
            logger.debug("a poller went back (%s): the queue's table starts afresh", e)
            assert self.stepper is not None
            rooms, values, reasons = self.stepper.last_local
            self._forget()
            return self._replay(rooms, values, reasons)

    def _replay(
        self, rooms: NDArray[np.uint64], values: NDArray[np.int8], reasons: NDArray[np.int8]
    ) -> tuple[list[int], list[Failure]]:
        n = rooms.size
        table = RequestTable(rank=self.rank, capacity=max(64, n))
        table.extend(rooms, handle_indices=np.arange(n, dtype=np.int64))
        stepper = Stepper(
            table,
            self.rank,
            poller=_Replay(values, reasons),
            config=StepConfig(invalid_status="fail"),
            agreed_capacity=self.capacity,
        )
        result = stepper.step(self.collective)
        self.capacity = stepper.capacity
        out: list[int] = result.statuses.tolist()
        return out, result.failures()

    def _run(
        self,
        pollers: list[Any],
        decode_reqs: list[Any] | None,
        metadata_buffers: Any,
        server_args: Any,
        staging_handler: Any,
        faults: FaultHook | None,
    ) -> tuple[list[int], list[Failure]]:
        fresh = False
        if self.gated and (self.meta is None or self.meta.buffers is not metadata_buffers):
            self.meta = RoomGate(metadata_buffers, self.known)
            fresh = True
        if self.staged and self.staging is None:
            self.staging = StagingAdapter(staging_handler, self._swap)
        fresh |= self._sync(pollers, decode_reqs, server_args)
        if self.meta is not None:
            assert decode_reqs is not None
            self.meta.rebind(decode_reqs, self.known)
        if self.staging is not None:
            assert decode_reqs is not None
            self.staging.rebind(decode_reqs, staging_handler)
        stepper = self.stepper
        if stepper is None or fresh or faults is not self.faults:
            stepper = self._stepper(faults)
        try:
            # the list's pollers are the table's handles in the step's order (not
            # with staging: it advances first and swaps handles): polled here
            polled = None if self.staging is not None else self._poll(stepper, pollers)
            statuses, result = stepper.step_polled(self.collective, polled)
        except IllegalTransition:
            raise  # run() replays what this rank contributed
        except BaseException:
            self._forget()  # whatever state it was left in is not reused
            raise
        self.capacity = stepper.capacity
        if result is None:  # nothing moved, no row is at Success or Failed
            return statuses.tolist(), []
        assert self.table is not None
        if self.table.terminal_count:
            self._retire(statuses)
        # failures only where some row is at Failed (most calls have none)
        failures = result.failures() if statuses.size and statuses.min() == 0 else []
        return statuses.tolist(), failures

    def _poll(self, stepper: Stepper, pollers: list[Any]) -> Polled | None:
        """Each poller's answer, when the step's rows are the list's in order
        (checked once per frame); else None (the step polls its rows)."""
        f = stepper.frame()
        n = len(pollers)
        if f is not self._direct:
            if not (f.n == n and f.all_active and np.array_equal(f.hidx, np.arange(n))):
                return None
            self._direct = f
        return poll_each(pollers)

    def _forget(self) -> None:
        self.table = self.stepper = None
        self._refs, self._prefs, self._slots = [], [], _NO_IDS

    def _swap(self, position: int, poller: Any) -> None:
        assert self.table is not None
        self.table.handles[int(self._slots[position])] = poller

    def _retire(self, statuses: NDArray[np.int8]) -> None:
        """Take finished requests out of the table: a later call polls them afresh."""
        table = self.table
        assert table is not None
        live = (statuses != 0) & (statuses != 4)  # not Failed, not Success
        done = ~live
        table.remove_many(table.room[self._slots[done]])
        keep = live.tolist()
        self._refs = list(itertools.compress(self._refs, keep))
        self._prefs = list(itertools.compress(self._prefs, keep))
        self._slots = self._slots[live]
        self._renumber()  # the rows after a finished one move up in the list

    # -- bringing the table to the list ----------------------------------------
    def _sync(self, pollers: list[Any], decode_reqs: list[Any] | None, server_args: Any) -> bool:
        """Bring the table to the list; True when it had to be rebuilt."""
        ident = pollers if decode_reqs is None else decode_reqs
        n, m = len(ident), len(self._refs)
        table = self.table
        if table is not None and self.known:
            k = self._kept(ident)
            if k is not None and self.gated and not self._rooms_hold(pollers, decode_reqs, k):
                k = None  # a kept request carries another room now: the gate reads rooms
            if k is not None and (k == n or self._append(pollers, decode_reqs, server_args, k)):
                if k != m or n != m:
                    self._positions(ident, pollers)
                elif decode_reqs is not None and not _same(pollers, self._prefs):
                    # new poller objects for the same requests (a wrapper per call)
                    handles = table.handles
                    for slot, p in zip(self._slots.tolist(), pollers):
                        handles[slot] = p
                    self._prefs = list(pollers)
                return False
        self._rebuild(pollers, decode_reqs, server_args)
        self._positions(ident, pollers)
        return True

    def _kept(self, ident: list[Any]) -> int | None:
        """How many leading entries of the list are live rows (the others left the
        table here); None when the list is not live rows, in order, then new ones."""
        refs, m = self._refs, len(self._refs)
        n = len(ident)
        if n >= m and _same(ident if n == m else ident[:m], refs):
            return m
        # some rows left the list: match by identity
        old = np.fromiter(map(id, refs), np.int64, m)
        new = np.fromiter(map(id, ident), np.int64, len(ident))
        order = np.argsort(old, kind="stable")
        srt = old[order]
        at = np.minimum(np.searchsorted(srt, new), max(m - 1, 0))
        found = (srt[at] == new) if m else np.zeros(new.size, dtype=bool)
        k = int(found.sum())
        if not found[:k].all():  # an old row after a new one
            return None
        was = order[at[:k]]
        if k > 1 and not (np.diff(was) > 0).all():  # reordered
            return None
        assert self.table is not None
        gone = np.ones(m, dtype=bool)
        gone[was] = False
        if gone.any():
            self.table.remove_many(self.table.room[self._slots[gone]])
            self._slots = self._slots[~gone]
        return k

    def _rooms_hold(self, pollers: list[Any], decode_reqs: list[Any] | None, k: int) -> bool:
        """Whether the first ``k`` requests still carry the rooms their rows hold
        (the metadata gate holds each row to its request's room)."""
        table = self.table
        assert table is not None and decode_reqs is not None
        key, want = self._want
        if key != (id(table), table.version, k):  # the rows' rooms, read once per change
            want = table.room[self._slots[:k]].tolist()
            self._want = ((id(table), table.version, k), want)
        reqs = decode_reqs if k == len(decode_reqs) else decode_reqs[:k]
        try:
            got = list(map(_REQ_ROOM, reqs))  # the common shape, in one C loop
        except AttributeError:
            got = [getattr(getattr(d, "req", d), "bootstrap_room", None) for d in reqs]
        return bool(got == want or _rooms(pollers, decode_reqs, 0)[:k] == want)

    def _append(
        self, pollers: list[Any], decode_reqs: list[Any] | None, server_args: Any, k: int
    ) -> bool:
        table = self.table
        assert table is not None
        rooms = _rooms(pollers, decode_reqs, k)
        if any(r is None or r in table for r in rooms) or len(set(rooms)) != len(rooms):
            return False
        slots = table.extend(
            [int(r) for r in rooms if r is not None],
            handles=pollers[k:],
            fake=self._fake(decode_reqs, server_args, k),
        )
        self._slots = np.concatenate([self._slots, slots])
        return True

    def _positions(self, ident: list[Any], pollers: list[Any]) -> None:
        """Remember the list; each row's position in it is its handle index."""
        self._refs = list(ident)
        self._prefs = self._refs if ident is pollers else list(pollers)
        self._renumber()

    def _renumber(self) -> None:
        """Each row's position is its handle index (and, gated, its metadata slot:
        the gate reads that request's own ``metadata_buffer_index``)."""
        table = self.table
        assert table is not None
        positions = np.arange(self._slots.size, dtype=np.int64)
        table.handle_index[self._slots] = positions
        if self.gated:
            table.metadata_slot[self._slots] = np.where(table.fake[self._slots], -1, positions)
        table.columns_version += 1

    def _fake(self, decode_reqs: list[Any] | None, server_args: Any, start: int) -> Any:
        if decode_reqs is None or not self.gated:
            return False
        return np.fromiter(
            (is_fake(getattr(dr, "req", dr), server_args) for dr in decode_reqs[start:]),
            dtype=bool,
            count=len(decode_reqs) - start,
        )

    def _rebuild(self, pollers: list[Any], decode_reqs: list[Any] | None, server_args: Any) -> None:
        n = len(pollers)
        rooms = _rooms(pollers, decode_reqs, 0)
        self.known = all(r is not None for r in rooms) and len(set(rooms)) == n
        ids = [int(r) for r in rooms if r is not None] if self.known else list(range(1, n + 1))
        table = RequestTable(rank=self.rank, capacity=max(64, n))
        self._slots = table.extend(
            ids, handles=pollers, fake=self._fake(decode_reqs, server_args, 0)
        )
        self.table = table
        self._want = ((), [])

    def _stepper(self, faults: FaultHook | None) -> Stepper:
        assert self.table is not None
        self.faults = faults
        self.stepper = Stepper(
            self.table,
            self.rank,
            staging=self.staging,
            metadata=self.meta,
            faults=faults,
            config=StepConfig(invalid_status="fail"),
            # a capacity learnt from an earlier call's reduced header: agreed on every rank
            agreed_capacity=self.capacity,
        )
        return self.stepper


_NOT_A_STATUS = 99


class _Replay:
    """What this rank contributed to a step, contributed once more."""

    def __init__(self, values: NDArray[np.int8], reasons: NDArray[np.int8]) -> None:
        self.values, self.reasons = values.copy(), reasons.copy()
        # a value outside KVPoll is read as one again (no backend reports that reason)
        self.values[self.reasons == FailureReason.INVALID_STATUS] = _NOT_A_STATUS

    def poll_many(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.int8]:
        out: NDArray[np.int8] = self.values[indices]
        return out

    def failure_reasons(
        self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]
    ) -> NDArray[np.int8]:
        out: NDArray[np.int8] = self.reasons[indices]
        return out


def _same(a: list[Any], b: list[Any]) -> bool:
    """The same objects in the same order. Identical entries compare in C with no
    call; an entry that differs is asked ``==`` (equal objects count as the same
    request), and one whose ``==`` raises or is not a bool means different."""
    if len(a) != len(b):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False
