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
from numpy.typing import ArrayLike

from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll
from transport.status_arrays import StatusArrays, StatusHandle

__all__ = ["FakeManager", "FakeSender", "FakeReceiver", "FakeBootstrap"]


class FakeManager(StatusArrays):
    """Holds every fake request's status; one per rank."""

    def __init__(self, capacity: int = 1024) -> None:
        super().__init__(capacity)
        self.pages_left: dict[int, int] = {}

    def sender(self, room: int) -> FakeSender:
        return FakeSender(self, room)

    def receiver(self, room: int) -> FakeReceiver:
        return FakeReceiver(self, room)


class _FakeRequest(StatusHandle):
    def __init__(self, manager: FakeManager, room: int, initial: KVPoll) -> None:
        super().__init__(manager, room, manager.take(initial))
        self.manager = manager

    def _move(self, status: KVPoll, reason: FailureReason = FailureReason.NONE) -> None:
        if not self.detached:  # a cleared handle's slot may be another request's now
            self.manager.set(self.index, status, reason)

    def abort(self) -> None:
        self._move(KVPoll.Failed, FailureReason.ABORTED)

    def fail(self, reason: FailureReason) -> None:
        """The scheduler gave up on it (or the other side said it failed)."""
        self._move(KVPoll.Failed, reason)

    def clear(self) -> None:
        if self._detach():
            self.manager.pages_left.pop(self.index, None)
            self.manager.release(self.index)


class FakeSender(_FakeRequest):
    def __init__(self, manager: FakeManager, room: int) -> None:
        super().__init__(manager, room, KVPoll.WaitingForInput)

    def init(self, num_pages: int, metadata_slot: int | None = None) -> None:
        if num_pages < 0:
            raise ValueError(f"room={self.bootstrap_room}: num_pages must be >= 0")
        if self.detached:
            return
        self.manager.pages_left[self.index] = num_pages
        self._move(KVPoll.Success if num_pages == 0 else KVPoll.Transferring)

    def send(self, page_indices: ArrayLike, state_indices: Any = None) -> None:
        m = self.manager
        if self.detached or m.terminal(self.index):
            return
        left = m.pages_left.get(self.index, 0) - np.asarray(page_indices).size
        m.pages_left[self.index] = left
        if left <= 0:
            self._move(KVPoll.Success)


class FakeReceiver(_FakeRequest):
    def __init__(self, manager: FakeManager, room: int) -> None:
        super().__init__(manager, room, KVPoll.Bootstrapping)

    def init(self, prefill_dp_rank: int | None = None) -> None:
        self._move(KVPoll.WaitingForInput)

    def send_metadata(
        self,
        page_indices: ArrayLike,
        metadata_slot: int,
        state_indices: Any = None,
        decode_prefix_len: int = 0,
    ) -> None:
        self._move(KVPoll.Success)


class FakeBootstrap:
    """An in-process bootstrap table (the fake path needs no rendezvous)."""

    def __init__(self) -> None:
        self._table: dict[str, bytes] = {}

    def publish(self, key: str, value: bytes) -> None:
        self._table[key] = value

    def lookup(self, key: str, timeout: float = 0.0) -> bytes | None:
        return self._table.get(key)
