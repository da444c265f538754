"""Metadata slot allocator: FIFO reuse, owner tracking, optional quarantine.

Every misuse seen in the field is a typed error that changes nothing: a
double free, a free by a room that does not own the slot, an out-of-range
slot. A slot can be *quarantined* on free (its remote writer may still be
writing, e.g. after an abort); it is handed out again only after
:meth:`SlotAllocator.release`.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import numpy as np

from buffers.errors import (
    DoubleFree,
    NotQuarantined,
    SlotNotOwned,
    SlotOutOfRange,
    SlotQuarantined,
)

__all__ = ["SlotAllocator", "RoomClearer"]

_FREE = -1
_QUARANTINE = -2


class RoomClearer(Protocol):
    def clear_room(self, slot: int) -> None: ...


class SlotAllocator:
    """``size`` slots; ``alloc`` returns None when all are taken (wait, not error)."""

    def __init__(self, size: int, rows: RoomClearer | None = None) -> None:
        if size < 1:
            raise ValueError(f"SlotAllocator size must be >= 1, got {size}")
        self.size = size
        self._free: deque[int] = deque(range(size))
        self._owner = np.full(size, _FREE, dtype=np.int64)
        self._rows = rows

    def alloc(self, room: int) -> int | None:
        if not self._free:
            return None
        slot = self._free.popleft()
        self._owner[slot] = room
        return slot

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.size:
            raise SlotOutOfRange(slot, self.size)

    def free(self, slot: int, room: int, *, quarantine: bool = False) -> None:
        """Give ``slot`` back; zeroes its room row first (next owner sees 'not written')."""
        self._check(slot)
        owner = int(self._owner[slot])
        if owner == _FREE:
            raise DoubleFree(slot, room)
        if owner == _QUARANTINE:
            raise SlotQuarantined(slot)
        if owner != room:
            raise SlotNotOwned(slot, room, owner)
        if self._rows is not None:
            self._rows.clear_room(slot)
        if quarantine:
            self._owner[slot] = _QUARANTINE
        else:
            self._owner[slot] = _FREE
            self._free.append(slot)

    def release(self, slot: int) -> None:
        """End a slot's quarantine: its remote writer has drained."""
        self._check(slot)
        if self._owner[slot] != _QUARANTINE:
            raise NotQuarantined(slot)
        if self._rows is not None:
            self._rows.clear_room(slot)  # a late write may have landed meanwhile
        self._owner[slot] = _FREE
        self._free.append(slot)

    def owner_of(self, slot: int) -> int | None:
        """The room holding ``slot``, or None when free or quarantined."""
        self._check(slot)
        o = int(self._owner[slot])
        return o if o >= 0 else None

    @property
    def in_use(self) -> int:
        return int((self._owner >= 0).sum())

    @property
    def quarantined(self) -> int:
        return int((self._owner == _QUARANTINE).sum())

    @property
    def available(self) -> int:
        return len(self._free)

    def live(self) -> dict[int, int]:
        """slot -> room for every slot in use."""
        idx = np.flatnonzero(self._owner >= 0)
        return dict(zip(idx.tolist(), self._owner[idx].tolist()))
