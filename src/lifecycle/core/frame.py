"""Stage 1 of a step (frame): the rows a step works on, gathered once per change of the table.

Agreed-terminal rows are known to every rank: they are not polled, gated or
reduced. A :class:`Frame` holds, for one table, the whole ordered list (for
the fingerprint and the result) and the compact *active* subset every stage
of the step runs over. It is rebuilt only when the table's membership, its
hand-edited columns or its set of terminal rows change, so a step in
between costs no gathers at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lifecycle.core.fingerprint import list_fingerprint, list_sum, status_sum
from lifecycle.core.packing import status_words
from lifecycle.reasons import FailureReason
from lifecycle.status import TERMINAL
from lifecycle.table import RequestTable

__all__ = ["Frame", "no_origins"]

#: stands in for the metadata columns of a frame no metadata gate reads
_NONE_READ: NDArray[Any] = np.empty(0, dtype=np.int64)
_NONE_READ.setflags(write=False)


class _Filled:
    """Fresh arrays of one value, copied from a read-only one that only grows
    (a copy costs less than a fill right after a collective)."""

    def __init__(self, value: int, dtype: type[np.generic]) -> None:
        self.value, self.dtype = value, dtype
        self.full: NDArray[Any] = np.full(1024, value, dtype=dtype)

    def get(self, n: int) -> NDArray[Any]:
        full = self.full
        if full.size < n:
            full = np.full(max(n, 2 * full.size), self.value, dtype=self.dtype)
            self.full = full  # each caller copies the one it read
        out: NDArray[Any] = full[:n].copy()
        return out


_NO_REASONS = _Filled(int(FailureReason.NONE), np.int8)
_NO_ORIGINS = _Filled(-1, np.int32)


def no_origins(n: int) -> NDArray[np.int32]:
    """A fresh array of ``n`` origins -1 (no failure)."""
    out: NDArray[np.int32] = _NO_ORIGINS.get(n)
    return out


#: read-only arrays that only grow, by name (see :func:`_shared`)
_SHARED: dict[str, NDArray[Any]] = {}


def _shared(name: str, n: int, make: Callable[[int], NDArray[Any]]) -> NDArray[Any]:
    """The first ``n`` entries of the read-only array ``name`` (``make(size)``
    builds it, doubling as needed; each caller slices the one it read: another
    thread may replace it)."""
    a = _SHARED.get(name)
    if a is None or a.size < n:
        a = make(max(n, 1024 if a is None else 2 * a.size))
        a.setflags(write=False)
        _SHARED[name] = a
    return a[:n]


def _positions(n: int) -> NDArray[np.int64]:
    """``0..n-1`` (read-only)."""
    out: NDArray[np.int64] = _shared("positions", n, lambda m: np.arange(m, dtype=np.int64))
    return out


def _zeros16(n: int) -> NDArray[np.uint16]:
    """``n`` zero epochs (read-only)."""
    out: NDArray[np.uint16] = _shared("epochs", n, lambda m: np.zeros(m, dtype=np.uint16))
    return out


class Frame:
    """Cached per-table arrays; ``pos`` maps active rows into the whole list."""

    __slots__ = (
        "_sum",
        "all_active",
        "epoch_all",
        "fake",
        "fp",
        "hidx",
        "key",
        "meta_bad",
        "meta_pos",
        "meta_rooms",
        "meta_slots",
        "n",
        "n_all",
        "no_index",
        "origin_all",
        "pos",
        "reason_all",
        "rooms",
        "rooms_all",
        "rows",
        "rows_all",
        "same",
        "same_arr",
        "snap",
        "state_all",
        "zeros",
    )

    def __init__(
        self, t: RequestTable, pool: int | None, by_index: bool, metadata: bool = True
    ) -> None:
        self.key = Frame.key_of(t)
        rows_all = self.rows_all = t.order().copy()
        self.rooms_all = t.room[rows_all]
        # most tables never retried a request: every epoch 0, nothing to gather
        self.epoch_all = t.epoch[rows_all] if t.epoched else _zeros16(rows_all.size)
        self.epoch_all.setflags(write=False)
        self.n_all = rows_all.size
        # agreed columns of the whole list, kept current by the step's apply
        self.state_all = t.state[rows_all]
        # the table counts its terminal rows; a frame is rebuilt right after a
        # collective, when caches are cold, and most lists hold none
        self.all_active = not t.terminal_count
        if self.all_active and not t.carried:
            # only a terminal row or one a move carried in has a reason or
            # an origin: here every row has none
            self.reason_all = _NO_REASONS.get(self.n_all)
            self.origin_all = _NO_ORIGINS.get(self.n_all)
        else:
            self.reason_all = t.reason[rows_all]
            self.origin_all = t.origin[rows_all]
        # the fingerprint covers every row's agreed status too: ranks that
        # disagree on which rows are terminal would pack different rows at the
        # same position, and on a status one of them would reject the agreed
        # move. The rooms were mixed as they joined (the table's room keys),
        # so it is one weighted sum over the list
        self._sum = list_sum(t.room_key[rows_all], self.state_all)
        self.fp = list_fingerprint(self._sum, self.n_all)
        self.same: bytes | None = None  # see unchanged_words()
        self.same_arr: NDArray[np.uint8] | None = None
        self.snap: tuple[NDArray[np.int8], NDArray[np.int8], NDArray[np.int32]] | None = None
        if self.all_active:
            self.pos = _positions(self.n_all)
            self.rows, self.rooms = self.rows_all, self.rooms_all
        else:
            self.pos = (~TERMINAL[self.state_all]).nonzero()[0]
            self.rows, self.rooms = self.rows_all[self.pos], self.rooms_all[self.pos]
        self.n = self.rows.size
        self.hidx = t.handle_index[self.rows]
        # handed to hooks and results: nobody may write into the cache
        for a in (self.rooms, self.hidx, self.rooms_all, self.pos):
            a.setflags(write=False)
        # rows a batch poller that reads by index cannot answer for: polling
        # them with index -1 would read another request's status
        self.no_index: NDArray[np.bool_] | None = None
        hidx = self.hidx
        # argmin: a cheaper call than min() right after a collective
        if by_index and self.n and hidx[hidx.argmin()] < 0:
            self.no_index = hidx < 0
        self.meta_bad: NDArray[np.bool_] | None = None
        self.meta_pos: NDArray[np.int64] | None = None
        if not metadata:  # no metadata gate reads them
            self.fake = self.zeros = self.meta_slots = self.meta_rooms = _NONE_READ
            return
        self.fake = t.fake[self.rows]
        self.zeros = np.zeros(self.n, dtype=bool)
        mslots = t.metadata_slot[self.rows]
        # rows the metadata gate reads: real requests with a row (None: all of them)
        checkable = ~self.fake & (mslots >= 0)
        # a row outside the pool can never land; it fails instead of being read
        if pool is not None:
            bad = checkable & (mslots >= pool)
            if bad.any():
                self.meta_bad = bad
                checkable &= ~bad
        self.meta_slots, self.meta_rooms = mslots, self.rooms
        if not checkable.all():
            self.meta_pos = checkable.nonzero()[0]
            self.meta_slots, self.meta_rooms = mslots[checkable], self.rooms[checkable]
        # read-only: lets the metadata source skip re-checking, and keeps the cache intact
        self.meta_slots.setflags(write=False)
        self.meta_rooms.setflags(write=False)

    def restate(
        self, pos: NDArray[np.int64], old: NDArray[np.int8], new: NDArray[np.int8], rehash: bool
    ) -> None:
        """Rows at ``pos`` moved from ``old`` to ``new`` agreed statuses
        (``rehash`` False: the frame is rebuilt before its fingerprint is read
        again, since some row became terminal)."""
        if rehash and pos.size:
            delta = new.astype(np.int64) - old  # wraps correctly through uint64
            self._sum = (self._sum + status_sum(delta, pos)) & (2**64 - 1)
            self.fp = list_fingerprint(self._sum, self.n_all)
        self.state_all[pos] = new
        self.same = self.same_arr = self.snap = None

    def retire(self) -> None:
        """The table moved on from this frame (a row became terminal, so the
        next step builds another): its agreed columns are final, and become
        the snapshot as they are (read-only, no copy)."""
        cols = (self.state_all, self.reason_all, self.origin_all)
        for a in cols:
            a.setflags(write=False)
        self.snap = cols

    def unchanged_words(self) -> bytes:
        """The reduced words of the active rows on a step where nothing moves
        (each row's agreed status, no reason), as bytes to compare against."""
        if self.same is None:
            self.same = self.unchanged_array().tobytes()
        return self.same

    def unchanged_array(self) -> NDArray[np.uint8]:
        """:meth:`unchanged_words` as an array (read-only)."""
        if self.same_arr is None:
            out = np.empty(self.n, dtype=np.uint8)
            states = self.state_all if self.all_active else self.state_all[self.pos]
            status_words(states, out)
            out.setflags(write=False)
            self.same_arr = out
        return self.same_arr

    def snapshot(self) -> tuple[NDArray[np.int8], NDArray[np.int8], NDArray[np.int32]]:
        """Read-only copies of the agreed columns of the whole list, shared by
        the results of the steps until a row moves."""
        if self.snap is None:
            cols = (self.state_all.copy(), self.reason_all.copy(), self.origin_all.copy())
            for a in cols:
                a.setflags(write=False)
            self.snap = cols
        return self.snap

    @staticmethod
    def key_of(t: RequestTable) -> tuple[int, int, int]:
        # terminal_count only grows between membership changes (which bump
        # version), so the triple changes whenever the active set does
        return (t.version, t.columns_version, t.terminal_count)

    @classmethod
    def of(
        cls,
        t: RequestTable,
        cached: Frame | None,
        pool: int | None,
        by_index: bool,
        metadata: bool = True,
    ) -> Frame:
        if t._limbo:
            t.order()  # compacts removed rows (membership changes were already counted)
        if cached is not None and cached.key == cls.key_of(t):
            return cached
        return cls(t, pool, by_index, metadata)
