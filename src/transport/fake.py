"""The fake backend: moves no bytes; used for warm-up and lifecycle tests.

Semantics: a sender says WaitingForInput until it is given the page count,
then Transferring, and Success once every page was "sent" (zero pages: at
once). A receiver goes Bootstrapping -> WaitingForInput after ``init`` ->
Success after its metadata was sent. ``abort`` makes either Failed. Terminal
states latch.

Statuses live in one numpy array in the :class:`FakeManager`, indexed by the
request's ``index``; ``poll_many`` is one gather.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll
from transport.errors import TransferFailed

__all__ = ["FakeManager", "FakeSender", "FakeReceiver", "FakeBootstrap"]

_TERMINAL = (KVPoll.Success, KVPoll.Failed)


class FakeManager:
    """Holds every fake request's status; one per rank."""

    def __init__(self, capacity: int = 1024) -> None:
        self.status = np.full(capacity, KVPoll.Failed, dtype=np.int8)
        self.reason = np.full(capacity, FailureReason.NONE, dtype=np.int8)
        self.pages_left = np.zeros(capacity, dtype=np.int64)
        self._free: list[int] = list(range(capacity - 1, -1, -1))

    def _take(self, initial: KVPoll) -> int:
        if not self._free:
            old = self.status.size
            for name in ("status", "reason", "pages_left"):
                arr = getattr(self, name)
                grown = np.zeros(old * 2, dtype=arr.dtype)
                grown[:old] = arr
                setattr(self, name, grown)
            self._free.extend(range(old * 2 - 1, old - 1, -1))
        idx = self._free.pop()
        self.status[idx] = initial
        self.reason[idx] = FailureReason.NONE
        self.pages_left[idx] = 0
        return idx

    def release(self, index: int) -> None:
        self._free.append(index)

    def set(self, index: int, status: KVPoll, reason: FailureReason = FailureReason.NONE) -> None:
        if self.status[index] in _TERMINAL:
            return  # latch
        self.status[index] = status
        if status == KVPoll.Failed:
            self.reason[index] = reason

    def sender(self, room: int) -> FakeSender:
        return FakeSender(self, room)

    def receiver(self, room: int) -> FakeReceiver:
        return FakeReceiver(self, room)

    def poll_many(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.int8]:
        out: NDArray[np.int8] = self.status[indices]
        return out

    def failure_reasons(
        self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]
    ) -> NDArray[np.int8]:
        out: NDArray[np.int8] = self.reason[indices]
        return out


class _FakeRequest:
    def __init__(self, manager: FakeManager, room: int, initial: KVPoll) -> None:
        self.manager = manager
        self.bootstrap_room = room
        self.index = manager._take(initial)
        self._cleared = False

    def poll(self) -> int:
        return int(self.manager.status[self.index])

    def failure_reason(self) -> FailureReason:
        return FailureReason(int(self.manager.reason[self.index]))

    def failure_exception(self) -> None:
        if self.poll() == KVPoll.Failed:
            raise TransferFailed(self.bootstrap_room, self.failure_reason().label)

    def abort(self) -> None:
        self.manager.set(self.index, KVPoll.Failed, FailureReason.ABORTED)

    def clear(self) -> None:
        if not self._cleared:
            self._cleared = True
            self.manager.release(self.index)


class FakeSender(_FakeRequest):
    def __init__(self, manager: FakeManager, room: int) -> None:
        super().__init__(manager, room, KVPoll.WaitingForInput)

    def init(self, num_pages: int, metadata_slot: int | None = None) -> None:
        if num_pages < 0:
            raise ValueError(f"room={self.bootstrap_room}: num_pages must be >= 0")
        self.manager.pages_left[self.index] = num_pages
        self.manager.set(self.index, KVPoll.Success if num_pages == 0 else KVPoll.Transferring)

    def send(self, page_indices: ArrayLike, state_indices: Any = None) -> None:
        m = self.manager
        if m.status[self.index] in _TERMINAL:
            return
        m.pages_left[self.index] -= np.asarray(page_indices).size
        if m.pages_left[self.index] <= 0:
            m.set(self.index, KVPoll.Success)


class FakeReceiver(_FakeRequest):
    def __init__(self, manager: FakeManager, room: int) -> None:
        super().__init__(manager, room, KVPoll.Bootstrapping)

    def init(self, prefill_dp_rank: int | None = None) -> None:
        self.manager.set(self.index, KVPoll.WaitingForInput)

    def send_metadata(
        self,
        page_indices: ArrayLike,
        metadata_slot: int,
        state_indices: Any = None,
        decode_prefix_len: int = 0,
    ) -> None:
        self.manager.set(self.index, KVPoll.Success)


class FakeBootstrap:
    """An in-process bootstrap table (the fake path needs no rendezvous)."""

    def __init__(self) -> None:
        self._table: dict[str, bytes] = {}

    def publish(self, key: str, value: bytes) -> None:
        self._table[key] = value

    def lookup(self, key: str, timeout: float = 0.0) -> bytes | None:
        return self._table.get(key)
