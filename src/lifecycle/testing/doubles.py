"""Small, deterministic stand-ins for backends, gates and fault hooks."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numpy.typing import NDArray

from lifecycle.protocols import StepContext
from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll

__all__ = ["StatusBoard", "ScriptedPoller", "SetGate", "SetStaging", "ListFaults"]


class StatusBoard:
    """A batch poller whose answers are set by hand (room -> status).

    ``raising`` makes the next ``poll_many`` raise; ``reasons`` gives a
    Failed room its backend reason. It answers from rooms alone
    (``by_room``), so rows without a handle index are polled too.
    """

    by_room = True

    def __init__(self, default: int = KVPoll.Bootstrapping) -> None:
        self.default = default
        self.status: dict[int, int] = {}
        self.reasons: dict[int, FailureReason] = {}
        self.raising: BaseException | None = None
        self.calls = 0

    def set(self, rooms: Iterable[int], status: int) -> None:
        for r in rooms:
            self.status[int(r)] = status

    def poll_many(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.int64]:
        self.calls += 1
        if self.raising is not None:
            exc, self.raising = self.raising, None
            raise exc
        return np.array([self.status.get(r, self.default) for r in rooms.tolist()], dtype=np.int64)

    def failure_reasons(
        self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]
    ) -> NDArray[np.int8]:
        return np.array(
            [self.reasons.get(r, FailureReason.UNKNOWN) for r in rooms.tolist()], dtype=np.int8
        )


class ScriptedPoller:
    """A per-object poller: returns ``value``, or raises ``error`` if set."""

    def __init__(self, value: object = KVPoll.Bootstrapping) -> None:
        self.value = value
        self.error: BaseException | None = None
        self.polls = 0

    def poll(self) -> object:
        self.polls += 1
        if self.error is not None:
            raise self.error
        return self.value


class SetGate:
    """A user gate closed for the rooms in ``closed_rooms``."""

    def __init__(self, name: str = "user") -> None:
        self.name = name
        self.closed_rooms: set[int] = set()

    def closed(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.bool_]:
        return np.array([r in self.closed_rooms for r in rooms.tolist()], dtype=bool)


class SetStaging:
    """Staging scatter stand-in: ``pending_rooms`` are not scattered yet."""

    def __init__(self) -> None:
        self.pending_rooms: set[int] = set()
        self.advanced: list[list[int]] = []

    def advance(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> None:
        self.advanced.append(rooms.tolist())

    def pending(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.bool_]:
        return np.array([r in self.pending_rooms for r in rooms.tolist()], dtype=bool)


class ListFaults:
    """Fails the rooms listed for the next step, once."""

    def __init__(self) -> None:
        self.rooms: set[int] = set()

    def inject(self, ctx: StepContext) -> NDArray[np.bool_]:
        hit = np.array([r in self.rooms for r in ctx.rooms.tolist()], dtype=bool)
        self.rooms.clear()
        return hit
