"""What one simulated rank holds for its requests: their handles, metadata
slots (the allocator), KV pages and state rows while live, the buffers of
failed requests waiting for their peer to stop writing, and the accounting
that says whether any leaked."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
from numpy.typing import NDArray

from buffers import SlotAllocator

__all__ = ["Held", "Ledger"]

#: what a request gives back when it ends: its handle, metadata slot and KV pages
Held = tuple[Any, int | None, NDArray[np.int64] | None]


class Ledger:
    """A rank's holdings, room by room, over a pool of ``kv_pages`` pages."""

    def __init__(self, kv_pages: int, alloc: SlotAllocator) -> None:
        self.kv_pages = kv_pages
        self.alloc = alloc
        self.handles: dict[int, Any] = {}
        self.need: dict[int, int] = {}  # room -> pages, while live
        self.pages_free: deque[int] = deque(range(kv_pages))
        self.pages_of: dict[int, NDArray[np.int64]] = {}
        self.slot_of: dict[int, int] = {}
        self.state_row_of: dict[int, int] = {}
        self.due_of: dict[int, int] = {}  # decode: bytes asked of prefill, by room
        #: failed decode requests whose buffers wait for the peer to stop writing
        self.draining: dict[int, Held] = {}

    def admit(self, room: int, handle: Any, pages: int) -> None:
        """A new live request, with its handle and the KV pages it will need."""
        self.handles[room] = handle
        self.need[room] = pages

    def fits(self, room: int) -> bool:
        """Whether the free pool holds the pages ``room`` needs."""
        return self.need[room] <= len(self.pages_free)

    def hold(self, room: int, slot: int) -> NDArray[np.int64]:
        """``room`` takes metadata ``slot`` (allocated) and the pages it needs."""
        self.slot_of[room] = slot
        pages = np.array([self.pages_free.popleft() for _ in range(self.need[room])], np.int64)
        self.pages_of[room] = pages
        return pages

    def end(self, room: int) -> Held:
        """``room`` is no longer live: what it held, to release or quarantine."""
        self.need.pop(room, None)
        h = self.handles.pop(room)
        slot = self.slot_of.pop(room, None)
        pages = self.pages_of.pop(room, None)
        self.state_row_of.pop(room, None)  # the row goes with the metadata slot
        self.due_of.pop(room, None)
        return h, slot, pages

    def release(self, room: int, held: Held, quarantined: bool) -> None:
        """Give back what ``room`` held (its slot from quarantine, if it was there)."""
        h, slot, pages = held
        if slot is not None:
            if quarantined:
                self.alloc.release(slot)
            else:
                self.alloc.free(slot, room)  # zeroes the room row
        if pages is not None:
            self.pages_free.extend(pages.tolist())
        h.clear()

    def quarantine(self, room: int, held: Held) -> None:
        """Keep what a failed request held out of reuse until its peer has drained."""
        slot = held[1]
        if slot is not None:
            self.alloc.free(slot, room, quarantine=True)
        self.draining[room] = held

    def drained(self, room: int) -> None:
        """The ranks agreed ``room``'s buffers may be reused: release them."""
        self.release(room, self.draining.pop(room), quarantined=True)

    def fenced_pages(self, settled: set[int]) -> int:
        """KV pages of draining requests held only by a fence (here or on another
        rank of the group): their writer stopped beating."""
        return sum(e[2].size for r, e in self.draining.items() if r in settled and e[2] is not None)

    def page_states(self, settled: set[int]) -> dict[str, int]:
        """KV pages by what keeps them from reuse: a live request (``held``), a
        failed one waiting for its peer to stop writing (``quarantined``), or a
        fence on a writer that stopped beating (``fenced``)."""
        draining = sum(e[2].size for e in self.draining.values() if e[2] is not None)
        fenced = self.fenced_pages(settled)
        held = sum(p.size for p in self.pages_of.values())
        return {"held": held, "quarantined": draining - fenced, "fenced": fenced}

    def draining_states(self, settled: set[int]) -> dict[str, int]:
        """Failed requests whose pages are kept: waiting for their peer to stop
        writing (``quarantined``), or held only by a fence (``fenced``)."""
        fenced = sum(1 for r in self.draining if r in settled)
        return {"quarantined": len(self.draining) - fenced, "fenced": fenced}

    def pinned(self, settled: set[int]) -> list[int]:
        """Draining requests whose peer never confirmed it stopped writing."""
        return [r for r in self.draining if r not in settled]

    def slot_problems(self) -> list[str]:
        """What is wrong with the slot accounting, if anything."""
        a = self.alloc
        out = []
        if a.in_use + a.available + a.quarantined != a.size:
            out.append("slot accounting broken")
        if len(self.slot_of) != a.in_use:
            out.append(f"{a.in_use} slots in use but {len(self.slot_of)} requests hold one")
        return out

    def report(self, settled: set[int]) -> dict[str, int]:
        """Leaked, fenced and held slots and pages; ``settled``: the draining
        rooms held only by a fence."""
        fence = {r: e for r, e in self.draining.items() if r in settled}
        fenced_slots = sum(s is not None for _, s, _ in fence.values())
        fenced = self.fenced_pages(settled)
        return {
            # fenced buffers are not leaks: they wait for a writer that stopped
            # beating (a killed rank's never come back), and are counted apart
            "leaked_slots": self.alloc.in_use + self.alloc.quarantined - fenced_slots,
            "leaked_kv_pages": self.kv_pages - len(self.pages_free) - fenced,
            "fenced_slots": fenced_slots,
            "fenced_kv_pages": fenced,
            # what of that requests not finished (or still draining) hold: a rank
            # that stopped on an error keeps those, and should hold nothing else
            "held_slots": len(self.slot_of)
            + sum(s is not None for _, s, _ in self.draining.values()),
            "held_kv_pages": sum(p.size for p in self.pages_of.values())
            + sum(p.size for _, _, p in self.draining.values() if p is not None),
        }
