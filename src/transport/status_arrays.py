"""What every backend keeps per request: a status and a failure reason in
numpy arrays, one slot per live request, so the step's batch poll is one
gather. Terminal states latch here, whatever the engine says later.

Growth replaces the arrays, so every write goes through :meth:`set` (or a
subclass's own locked writes) under ``_lock``: a background engine thread
writing into an array that :meth:`take` has just copied would be lost."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import numpy as np
from numpy.typing import NDArray

from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll
from transport.errors import TransferFailed

__all__ = ["FEW", "Statuses", "StatusArrays", "StatusHandle", "detach_many"]

_F = int(KVPoll.Failed)
#: below this many requests a batch call goes one by one (numpy's calls cost more)
FEW = 16
_S = int(KVPoll.Success)


class Statuses(Protocol):
    """What a handle reads of its manager: a status and a reason per slot."""

    status: NDArray[np.int8]
    reason: NDArray[np.int8]


class StatusArrays:
    """Statuses and reasons of one rank's requests (a backend manager's base)."""

    #: more per-request columns a subclass keeps: name -> (dtype, fill)
    COLUMNS: ClassVar[dict[str, tuple[Any, Any]]] = {}

    def __init__(self, capacity: int = 1024) -> None:
        self._lock = threading.RLock()
        self._cols: dict[str, tuple[Any, Any]] = {
            "status": (np.int8, _F),
            "reason": (np.int8, int(FailureReason.NONE)),
            **self.COLUMNS,
        }
        for name, (dtype, fill) in self._cols.items():
            setattr(self, name, np.full(capacity, fill, dtype=dtype))
        self.status: NDArray[np.int8]
        self.reason: NDArray[np.int8]
        self._free: list[int] = list(range(capacity - 1, -1, -1))

    def take(self, initial: int) -> int:
        """A slot for a new request, starting at ``initial``."""
        with self._lock:
            if not self._free:
                old = self.status.size
                for name, (dtype, fill) in self._cols.items():
                    grown = np.concatenate((getattr(self, name), np.full(old, fill, dtype)))
                    setattr(self, name, grown)
                self._free.extend(range(old * 2 - 1, old - 1, -1))
            idx = self._free.pop()
            for name, (_, fill) in self._cols.items():
                getattr(self, name)[idx] = fill
            self.status[idx] = initial
            return idx

    def release(self, index: int) -> None:
        with self._lock:
            self._free.append(index)

    def terminal(self, index: int) -> bool:
        return int(self.status[index]) in (_S, _F)

    def set(self, index: int, status: int, reason: FailureReason = FailureReason.NONE) -> bool:
        """Move a request; False (and no change) once it is Success or Failed."""
        with self._lock:
            if self.terminal(index):
                return False
            self.status[index] = status
            if status == _F:
                self.reason[index] = reason
            return True

    def poll_many(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.int8]:
        out: NDArray[np.int8] = self.status[indices]
        return out

    def failure_reasons(
        self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]
    ) -> NDArray[np.int8]:
        out: NDArray[np.int8] = self.reason[indices]
        return out


class StatusHandle:
    """The part of a sender or receiver that reads its manager's arrays.

    Once cleared, a handle answers from what it last saw: its slot may
    already belong to another request, which a stale reference must neither
    read nor move."""

    def __init__(self, arrays: Statuses, room: int, index: int) -> None:
        self._arrays = arrays
        self.bootstrap_room = room
        self.index = index
        self._final: tuple[int, int] | None = None

    def _detach(self) -> bool:
        """Freeze what this handle answers; False if it was already detached."""
        if self._final is not None:
            return False
        self._final = (int(self._arrays.status[self.index]), int(self._arrays.reason[self.index]))
        return True

    @property
    def detached(self) -> bool:
        return self._final is not None

    def poll(self) -> int:
        if self._final is not None:
            return self._final[0]
        return int(self._arrays.status[self.index])

    def failure_reason(self) -> FailureReason:
        if self._final is not None:
            return FailureReason(self._final[1])
        return FailureReason(int(self._arrays.reason[self.index]))

    def failure_exception(self) -> None:
        """Raise why this request failed (the field's call); nothing if it did not."""
        if self.poll() == _F:
            raise TransferFailed(self.bootstrap_room, self.failure_reason().label)


def detach_many(handles: Sequence[StatusHandle], arrays: Statuses) -> None:
    """:meth:`StatusHandle._detach` of each of ``handles`` (none detached yet,
    each on ``arrays``), with one read of the arrays for the lot (a few, one
    by one: numpy's calls cost more)."""
    if len(handles) < FEW:
        for h in handles:
            h._detach()
        return
    at = [h.index for h in handles]
    for h, status, reason in zip(handles, arrays.status[at].tolist(), arrays.reason[at].tolist()):
        h._final = (status, reason)
