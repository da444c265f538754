"""Metadata slot allocator: FIFO reuse, owner tracking, optional quarantine.

Every misuse seen in the field is a typed error that changes nothing: a
double free, a free by a room that does not own the slot, an out-of-range
slot, a room that is not a uint64. Owners are kept as full uint64 rooms, and
whether a slot is free, owned or quarantined is a separate column, so no room
value can be mistaken for a marker. A slot can be *quarantined* on free (its remote writer may still be
writing, e.g. after an abort); it is handed out again only after
:meth:`SlotAllocator.release`.
"""

from __future__ import annotations

import operator
from collections import deque
from typing import Protocol, SupportsIndex, cast

import numpy as np

from buffers.errors import (
    BadArgument,
    BadArgumentType,
    DoubleFree,
    NotQuarantined,
    SlotNotOwned,
    SlotOutOfRange,
    SlotQuarantined,
)

__all__ = ["SlotAllocator", "RoomClearer", "MAX_SLOTS", "check_room"]

_FREE, _OWNED, _QUARANTINE = 0, 1, 2
MAX_SLOTS = 1 << 24
_MAX_ROOM = (1 << 64) - 1


def _int(value: object) -> int:
    """``value`` as an int (only called on values that passed an integer check)."""
    return operator.index(cast("SupportsIndex", value))


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_room(room: object) -> int:
    """A room as an int in 1..2**64-1 (int or numpy integer, not bool), else BadArgument."""
    expected = "an integer in 1..2**64-1 (int or numpy integer)"
    if not _is_int(room):
        raise BadArgumentType("room", room, expected)
    if not 0 < _int(room) <= _MAX_ROOM:
        raise BadArgument("room", room, expected)
    return _int(room)


class RoomClearer(Protocol):
    def clear_room(self, slot: int) -> None: ...


class SlotAllocator:
    """``size`` slots; ``alloc`` returns None when all are taken (wait, not error)."""

    def __init__(self, size: int, rows: RoomClearer | None = None) -> None:
        if not _is_int(size) or not 1 <= _int(size) <= MAX_SLOTS:
            raise BadArgument("SlotAllocator size", size, f"an integer in 1..{MAX_SLOTS}")
        if rows is not None and not callable(getattr(rows, "clear_room", None)):
            raise BadArgument("SlotAllocator rows", rows, "an object with clear_room(slot)")
        self.size = _int(size)
        self._free: deque[int] = deque(range(self.size))
        self._owner = np.zeros(self.size, dtype=np.uint64)
        self._state = np.full(self.size, _FREE, dtype=np.int8)
        self._rows = rows

    def alloc(self, room: int) -> int | None:
        """A free slot for ``room`` (checked first), or None when none is free."""
        room = check_room(room)
        if not self._free:
            return None
        slot = self._free.popleft()
        self._owner[slot] = room
        self._state[slot] = _OWNED
        return slot

    def _check(self, slot: object) -> int:
        if not _is_int(slot):
            raise BadArgument("metadata slot", slot, f"an integer in 0..{self.size - 1}")
        s = _int(slot)
        if not 0 <= s < self.size:
            raise SlotOutOfRange(s, self.size)
        return s

    def free(self, slot: int, room: int, *, quarantine: bool = False) -> None:
        """Give ``slot`` back; zeroes its room row first (next owner sees 'not written')."""
        slot = self._check(slot)
        room = check_room(room)
        if not isinstance(quarantine, (bool, np.bool_)):
            raise BadArgument("quarantine", quarantine, "a bool")
        state = int(self._state[slot])
        if state == _FREE:
            raise DoubleFree(slot, room)
        if state == _QUARANTINE:
            raise SlotQuarantined(slot)
        owner = int(self._owner[slot])
        if owner != room:
            raise SlotNotOwned(slot, room, owner)
        if self._rows is not None:
            self._rows.clear_room(slot)
        self._owner[slot] = 0
        if quarantine:
            self._state[slot] = _QUARANTINE
        else:
            self._state[slot] = _FREE
            self._free.append(slot)

    def release(self, slot: int) -> None:
        """End a slot's quarantine: its remote writer has drained."""
        slot = self._check(slot)
        if self._state[slot] != _QUARANTINE:
            raise NotQuarantined(slot)
        if self._rows is not None:
            self._rows.clear_room(slot)  # a late write may have landed meanwhile
        self._state[slot] = _FREE
        self._free.append(slot)

    def owner_of(self, slot: int) -> int | None:
        """The room holding ``slot``, or None when free or quarantined."""
        slot = self._check(slot)
        return int(self._owner[slot]) if self._state[slot] == _OWNED else None

    @property
    def in_use(self) -> int:
        return int((self._state == _OWNED).sum())

    @property
    def quarantined(self) -> int:
        return int((self._state == _QUARANTINE).sum())

    @property
    def available(self) -> int:
        return len(self._free)

    def live(self) -> dict[int, int]:
        """slot -> room for every slot in use."""
        idx = np.flatnonzero(self._state == _OWNED)
        return dict(zip(idx.tolist(), self._owner[idx].tolist()))
