"""What every backend keeps per request: a status and a failure reason in
numpy arrays, one slot per live request, so the step's batch poll is one
gather. Terminal states latch here, whatever the engine says later."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll
from transport.errors import TransferFailed

__all__ = ["StatusArrays", "StatusHandle"]

_F = int(KVPoll.Failed)
_S = int(KVPoll.Success)


class StatusArrays:
    """Statuses and reasons of one rank's requests (a backend manager's base)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.status = np.full(capacity, _F, dtype=np.int8)
        self.reason = np.full(capacity, FailureReason.NONE, dtype=np.int8)
        self._free: list[int] = list(range(capacity - 1, -1, -1))

    def take(self, initial: int) -> int:
        """A slot for a new request, starting at ``initial``."""
        if not self._free:
            old = self.status.size
            self.status = np.concatenate((self.status, np.full(old, _F, np.int8)))
            self.reason = np.concatenate((self.reason, np.full(old, FailureReason.NONE, np.int8)))
            self._free.extend(range(old * 2 - 1, old - 1, -1))
        idx = self._free.pop()
        self.status[idx] = initial
        self.reason[idx] = FailureReason.NONE
        return idx

    def release(self, index: int) -> None:
        self._free.append(index)

    def terminal(self, index: int) -> bool:
        return int(self.status[index]) in (_S, _F)

    def set(self, index: int, status: int, reason: FailureReason = FailureReason.NONE) -> bool:
        """Move a request; False (and no change) once it is Success or Failed."""
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
    """The part of a sender or receiver that reads its manager's arrays."""

    def __init__(self, arrays: StatusArrays, room: int, index: int) -> None:
        self._arrays = arrays
        self.bootstrap_room = room
        self.index = index

    def poll(self) -> int:
        return int(self._arrays.status[self.index])

    def failure_reason(self) -> FailureReason:
        return FailureReason(int(self._arrays.reason[self.index]))

    def failure_exception(self) -> None:
        """Raise why this request failed (the field's call); nothing if it did not."""
        if self.poll() == _F:
            raise TransferFailed(self.bootstrap_room, self.failure_reason().label)
