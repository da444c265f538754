"""The live requests of one queue on one rank, held column-wise in arrays.

A :class:`RequestTable` is what a step runs over: the ordered list of live
requests of one scheduler queue. Every per-request field (state, reason,
origin, clocks, metadata slot...) is a numpy column indexed by a *slot*
that never moves while the request lives; ``order`` lists the slots in queue
order (insertion order, which every rank reproduces by making the same
calls). Removal is O(1): the slot is marked dead, the order compacted on its
next read; adding or removing nothing changes nothing. The only Python
objects kept per request are the optional per-request pollers (``handles``),
for backends without a batch poll.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from lifecycle import validate
from lifecycle.core.fingerprint import room_keys
from lifecycle.errors import (
    DuplicateRequest,
    InvalidArgument,
    ReservedRoom,
    TableBusy,
    UnknownRequest,
)
from lifecycle.reasons import FailureReason
from lifecycle.request_info import INFO_FIELDS, RequestInfo
from lifecycle.status import TERMINAL, KVPoll, Role

__all__ = ["RequestTable"]

_INITIAL = 64
#: the most rows one table may hold (a table this size is ~2 GiB of columns)
MAX_ROWS = 1 << 24
#: metadata slots and handle indices: -1 (none) or a non-negative int64
_MAX_INDEX = (1 << 62) - 1


class RequestTable:
    """Live requests of one queue, keyed by bootstrap room (``rank`` only names
    this rank in error messages)."""

    _COLUMNS: tuple[tuple[str, Any, Any], ...] = (
        ("room", np.uint64, 0),
        ("room_key", np.uint64, 0),  # the room mixed (fingerprint.room_keys): the list hash's input
        ("state", np.int8, KVPoll.Bootstrapping),
        ("role", np.int8, Role.SENDER),
        ("reason", np.int8, FailureReason.NONE),
        ("origin", np.int32, -1),
        ("entered_step", np.int64, 0),
        ("entered_time", np.float64, 0.0),
        ("added_step", np.int64, 0),
        ("fake", np.bool_, False),
        ("abort_requested", np.bool_, False),
        ("metadata_slot", np.int64, -1),
        ("handle_index", np.int64, -1),
        ("metadata_sent_at", np.float64, np.nan),
        ("alive", np.bool_, False),
        ("carries", np.bool_, False),  # holds a reason or origin a move carried in
        ("epoch", np.uint16, 0),  # the attempt: a retry is the same room, one epoch on
    )

    room: NDArray[np.uint64]
    room_key: NDArray[np.uint64]
    state: NDArray[np.int8]
    role: NDArray[np.int8]
    reason: NDArray[np.int8]
    origin: NDArray[np.int32]
    entered_step: NDArray[np.int64]
    entered_time: NDArray[np.float64]
    added_step: NDArray[np.int64]
    fake: NDArray[np.bool_]
    abort_requested: NDArray[np.bool_]
    metadata_slot: NDArray[np.int64]
    handle_index: NDArray[np.int64]
    metadata_sent_at: NDArray[np.float64]
    alive: NDArray[np.bool_]
    carries: NDArray[np.bool_]
    epoch: NDArray[np.uint16]

    def __init__(self, rank: int = 0, capacity: int = _INITIAL) -> None:
        self.rank = validate.integer(rank, "RequestTable rank", 0, (1 << 24) - 1)
        self._cap = validate.integer(capacity, "RequestTable capacity", 1, MAX_ROWS, rank)
        for name, dtype, fill in self._COLUMNS:
            setattr(self, name, np.full(self._cap, fill, dtype=dtype))
        self.handles: list[Any] = [None] * self._cap
        self._index: dict[int, int] = {}
        self._order = np.empty(self._cap, dtype=np.int64)
        self._len = 0  # used prefix of _order, dead slots included
        self._free: list[int] = list(range(self._cap - 1, -1, -1))
        self._limbo: list[int] = []  # dead slots still listed in _order
        self.version = 0  # bumped on every add/remove: invalidates cached fingerprints
        self.columns_version = 0  # bumped when a per-request column is edited by hand
        self.abort_count = 0  # live requests with an abort requested (skips a gather)
        self.terminal_count = 0  # live requests at Success or Failed (the step keeps it)
        #: live requests whose reason or origin a move carried in: only they
        #: (and terminal ones) can differ from NONE and -1 (skips two gathers)
        self.carried = 0
        self.epoched = 0  # live requests at an epoch past 0, retries (skips a gather)
        self.step_no = 0  # advanced by the stepper
        # time of the last step, for rows added between steps; NaN until a
        # stepper owns the table (it then stamps the rows added before it)
        self.now = float("nan")
        self.busy = False  # a started step is in flight (see StepGroup.start)

    # -- size and lookup -------------------------------------------------
    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, room: object) -> bool:
        return room in self._index

    def __iter__(self) -> Iterator[int]:
        return iter(self.rooms().tolist())

    def slot_of(self, room: int) -> int:
        if type(room) is not int:
            room = validate.room(room, self.rank, allow_zero=True)
        try:
            return self._index[room]
        except KeyError:
            raise UnknownRequest(room, self.rank) from None

    def _info(self, slot: int) -> RequestInfo:
        return RequestInfo.of(slot, *[getattr(self, name) for name in INFO_FIELDS])

    def info(self, room: int) -> RequestInfo:
        return self._info(self.slot_of(room))

    def order(self) -> NDArray[np.int64]:
        """Slots of the live requests in queue order (a view; do not keep it)."""
        if self._limbo:
            live = self._order[: self._len]
            live = live[self.alive[live]]
            self._len = live.size
            self._order[: self._len] = live
            self._free.extend(self._limbo)
            self._limbo.clear()
        return self._order[: self._len]

    def rooms(self) -> NDArray[np.uint64]:
        return self.room[self.order()]

    def states(self) -> NDArray[np.int8]:
        return self.state[self.order()]

    # -- mutation ----------------------------------------------------------
    def _check_idle(self) -> None:
        if self.busy:
            raise TableBusy(self.rank)

    def _grow(self, need: int) -> None:
        new_cap = self._cap
        while new_cap < need:
            new_cap *= 2
        if new_cap == self._cap:
            return
        for name, dtype, fill in self._COLUMNS:
            col = np.full(new_cap, fill, dtype=dtype)
            col[: self._cap] = getattr(self, name)
            setattr(self, name, col)
        self.handles.extend([None] * (new_cap - self._cap))
        order = np.empty(new_cap, dtype=np.int64)
        order[: self._len] = self._order[: self._len]
        self._order = order
        self._free[:0] = range(new_cap - 1, self._cap - 1, -1)
        self._cap = new_cap

    def _check_rooms(self, rooms: Sequence[int], fake: NDArray[np.bool_] | bool) -> None:
        fakes = [fake] * len(rooms) if isinstance(fake, bool) else fake.tolist()
        for r, f in zip(rooms, fakes):
            if r in self._index:
                raise DuplicateRequest(r, self.rank)
            if r == 0 and not f:
                raise ReservedRoom(self.rank)
        if len(set(rooms)) != len(rooms):
            seen: set[int] = set()
            dup = next(r for r in rooms if r in seen or seen.add(r))  # type: ignore[func-returns-value]
            raise DuplicateRequest(dup, self.rank)

    def add(
        self,
        room: int,
        *,
        role: Role = Role.SENDER,
        state: KVPoll = KVPoll.Bootstrapping,
        handle: Any = None,
        fake: bool = False,
        metadata_slot: int = -1,
        handle_index: int = -1,
        epoch: int = 0,
    ) -> int:
        """Add one request at the end of the queue; returns its slot."""
        return int(
            self.extend(
                [room],
                role=role,
                state=state,
                handles=None if handle is None else [handle],
                fake=fake,
                metadata_slots=metadata_slot,
                handle_indices=handle_index,
                epochs=epoch,
            )[0]
        )

    def extend(
        self,
        rooms: Iterable[int] | NDArray[np.uint64],
        *,
        role: Role = Role.SENDER,
        state: KVPoll = KVPoll.Bootstrapping,
        handles: Sequence[Any] | None = None,
        fake: ArrayLike = False,
        metadata_slots: ArrayLike = -1,
        handle_indices: ArrayLike = -1,
        epochs: ArrayLike = 0,
    ) -> NDArray[np.int64]:
        """Add many requests at the end of the queue, in order; returns their slots.

        Validation happens first: a room that is not an integer in
        1..2**64-1 (0 only with ``fake``), a duplicate, a state or role that is
        not a member of its enum, a column of the wrong type or length raises
        a typed error and the table is left as it was.
        """
        self._check_idle()
        rank = self.rank
        room_list = validate.rooms(rooms, rank)
        k = len(room_list)
        role = validate.role(role, rank)
        state = validate.status(state, "initial state", rank)
        fake_arr = validate.bool_column(fake, k, "fake", rank)
        mslots = validate.int_column(metadata_slots, k, "metadata_slots", -1, _MAX_INDEX, rank)
        hidx = validate.int_column(handle_indices, k, "handle_indices", -1, _MAX_INDEX, rank)
        epoch = validate.int_column(epochs, k, "epochs", 0, (1 << 16) - 1, rank)
        self._check_rooms(room_list, fake_arr)
        if handles is not None and len(handles) != k:
            raise InvalidArgument("handles", f"{len(handles)} handles", f"{k} (one per room)", rank)
        if len(self._index) + k > MAX_ROWS:
            raise InvalidArgument("rooms", f"{k} more rows", f"at most {MAX_ROWS} live rows", rank)
        if not k:  # nothing joins: the list and the frames cached from it stand
            return np.empty(0, dtype=np.int64)
        self.order()  # recycle dead slots before taking new ones
        if len(self._free) < k:
            self._grow(len(self._index) + k)
        slots = np.array(self._free[len(self._free) - k :][::-1], dtype=np.int64)
        del self._free[len(self._free) - k :]
        room_arr = np.asarray(room_list, dtype=np.uint64)
        self.room[slots] = room_arr
        self.epoch[slots] = epoch
        self.epoched += int(np.count_nonzero(self.epoch[slots]))
        self.room_key[slots] = room_keys(room_arr, self.epoch[slots])
        self.state[slots] = state
        self.terminal_count += k if KVPoll(state).terminal else 0
        self.role[slots] = role
        self.reason[slots] = FailureReason.NONE
        self.origin[slots] = -1
        self.entered_step[slots] = self.step_no
        self.added_step[slots] = self.step_no
        self.entered_time[slots] = self.now
        self.fake[slots] = fake_arr
        self.abort_requested[slots] = False
        self.metadata_slot[slots] = mslots
        self.handle_index[slots] = hidx
        self.metadata_sent_at[slots] = np.nan
        self.alive[slots] = True
        self.carries[slots] = False
        if handles is not None:
            for s, h in zip(slots.tolist(), handles):
                self.handles[s] = h
        self._index.update(zip(room_list, slots.tolist()))
        self._order[self._len : self._len + k] = slots
        self._len += k
        self.version += 1
        return slots

    def remove(self, room: int) -> RequestInfo:
        """Remove one request (O(1)); returns its last row."""
        self._check_idle()
        slot = self.slot_of(room)
        info = self._info(slot)
        del self._index[info.room]
        self._drop([slot])
        return info

    def remove_many(self, rooms: Iterable[int] | NDArray[np.uint64]) -> int:
        """Remove several requests; all must be live (checked before any is removed)."""
        self._check_idle()
        room_list = validate.rooms(rooms, self.rank)
        index = self._index
        for r in room_list:
            if r not in index:
                self.slot_of(r)  # raises UnknownRequest
        if len(set(room_list)) != len(room_list):
            raise UnknownRequest(next(r for r in room_list if room_list.count(r) > 1), self.rank)
        slots = [self._index.pop(r) for r in room_list]
        if slots:  # nothing leaves: the list and the frames cached from it stand
            self._drop(slots)
        return len(slots)

    def _drop(self, slots: list[int]) -> None:
        """Mark the slots of requests just taken out of the index dead."""
        at = np.array(slots, dtype=np.int64)  # (once, not once per column)
        if self.abort_count:
            self.abort_count -= int(np.count_nonzero(self.abort_requested[at]))
            self.abort_requested[at] = False
        self.terminal_count -= int(np.count_nonzero(TERMINAL[self.state[at]]))
        if self.carried:
            self.carried -= int(np.count_nonzero(self.carries[at]))
        if self.epoched:
            self.epoched -= int(np.count_nonzero(self.epoch[at]))
        self.alive[at] = False
        handles = self.handles
        for s in slots:
            handles[s] = None
        self._limbo.extend(slots)
        self.version += 1

    # -- requests from the scheduler, acted on at the next step ----------
    def request_abort(self, room: int) -> None:
        """Ask for ``room`` to fail with reason ABORTED at the next step (on every rank)."""
        self._check_idle()
        slot = self.slot_of(room)
        if not self.abort_requested[slot]:
            self.abort_requested[slot] = True
            self.abort_count += 1

    def mark_metadata_sent(self, room: int, now: float) -> None:
        """Start the waiting-timeout clock (decode: metadata sent to prefill)."""
        self._check_idle()
        slot = self.slot_of(room)
        at = validate.finite(now)
        if at is None:
            raise InvalidArgument("mark_metadata_sent now", now, "a finite time", self.rank)
        self.metadata_sent_at[slot] = at

    def set_metadata_slot(self, room: int, slot: int) -> None:
        self._set_index(room, self.metadata_slot, slot, "metadata slot")

    def set_handle_index(self, room: int, index: int) -> None:
        """The backend's own index for this request (passed to ``poll_many``)."""
        self._set_index(room, self.handle_index, index, "handle index")

    def _set_index(self, room: int, column: NDArray[np.int64], value: int, what: str) -> None:
        self._check_idle()
        column[self.slot_of(room)] = validate.integer(value, what, -1, _MAX_INDEX, self.rank)
        self.columns_version += 1

    # -- moving a request to the next queue ---------------------------------
    def move(
        self,
        room: int,
        other: RequestTable,
        *,
        state: KVPoll | None = None,
        handle_index: int | None = None,
        metadata_slot: int | None = None,
    ) -> int:
        """Move ``room`` to the end of ``other``'s queue; returns its slot there.

        Everything the request carries goes with it: role, fake flag, epoch, a
        pending abort, its failure reason and origin, its metadata slot, handle
        and handle index, the waiting-timeout clock and how long it has been at
        its status (a bootstrap or waiting deadline keeps counting from where it
        was). ``state`` (which restarts the status clock when it differs),
        ``handle_index`` and ``metadata_slot`` may be given for the new queue.
        Checked first; a refused move changes neither table.
        """
        self._check_idle()
        if not isinstance(other, RequestTable) or other is self:
            raise InvalidArgument("move target", other, "another RequestTable", self.rank)
        src = self.slot_of(room)
        r = int(self.room[src])
        if r in other._index:
            raise DuplicateRequest(r, other.rank)
        cur = KVPoll(int(self.state[src]))
        new_state = cur if state is None else validate.status(state, "move state", self.rank)
        hidx = int(self.handle_index[src]) if handle_index is None else handle_index
        mslot = int(self.metadata_slot[src]) if metadata_slot is None else metadata_slot
        hidx = validate.integer(hidx, "handle index", -1, _MAX_INDEX, self.rank)
        mslot = validate.integer(mslot, "metadata slot", -1, _MAX_INDEX, self.rank)
        if len(other._index) + 1 > MAX_ROWS:
            raise InvalidArgument("move", r, f"room in a table below {MAX_ROWS} rows", other.rank)
        dst = other.add(
            r,
            role=Role(int(self.role[src])),
            state=new_state,
            handle=self.handles[src],
            fake=bool(self.fake[src]),
            metadata_slot=mslot,
            handle_index=hidx,
            epoch=int(self.epoch[src]),
        )
        other.reason[dst] = self.reason[src]
        other.origin[dst] = self.origin[src]
        if self.reason[src] != FailureReason.NONE or self.origin[src] != -1:
            other.carries[dst] = True
            other.carried += 1
        other.metadata_sent_at[dst] = self.metadata_sent_at[src]
        # ages carry over; step counters are per table, so keep the distance
        other.added_step[dst] = other.step_no - (self.step_no - int(self.added_step[src]))
        if new_state == cur:
            other.entered_step[dst] = other.step_no - (self.step_no - int(self.entered_step[src]))
            other.entered_time[dst] = self.entered_time[src]
        if self.abort_requested[src]:
            other.request_abort(r)
        self.remove(r)
        return dst
