"""What the step asks of backends, gates and fault hooks.

Every per-request call passes the requests' rooms and, in parallel, the
backend's own indices from the table's ``handle_index`` column, so an
implementation that keeps its state in arrays answers with one gather.

All are structural (``typing.Protocol``): a backend or a scheduler satisfies
them by having the methods, with no import of this package.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "Poller",
    "BatchPoller",
    "StagingGate",
    "MetadataSource",
    "Gate",
    "FaultHook",
    "StepContext",
]


@runtime_checkable
class Poller(Protocol):
    """One request's sender or receiver (the field's per-object API)."""

    def poll(self) -> int: ...


@runtime_checkable
class BatchPoller(Protocol):
    """A backend that can report the statuses of many requests in one call.

    ``indices`` are the backend's own per-request indices as stored in the
    table's ``handle_index`` column; a backend that keeps its statuses in an
    array answers with one gather. A row whose index was never set is not
    passed (it fails with reason ``hook error``: index -1 would read another
    request's status), unless the poller has ``by_room = True``, meaning it
    answers from rooms alone. The answer must be one integer per request;
    anything else fails the batch (reason ``local exception``). May also define
    ``failure_reasons(rooms, indices) -> ArrayLike`` giving a
    :class:`~lifecycle.reasons.FailureReason` code for each (Failed) request.
    """

    def poll_many(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> ArrayLike: ...


@runtime_checkable
class StagingGate(Protocol):
    """Scatter from a staging buffer when prefill and decode TP sizes differ."""

    def advance(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> None:
        """Make progress on the scatter of these unfinished requests (before polling)."""
        ...

    def pending(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.bool_]:
        """True where the request's scatter is not done yet."""
        ...


@runtime_checkable
class MetadataSource(Protocol):
    """Where the first-token metadata rows land (see ``buffers.MetadataBuffers``)."""

    def landed(
        self, slots: NDArray[np.int64], rooms: NDArray[np.uint64]
    ) -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
        """``(landed, corrupt)``: row carries this room / row carries another non-zero room."""
        ...


@runtime_checkable
class Gate(Protocol):
    """A user's local condition that must hold before a Success counts."""

    name: str

    def closed(
        self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]
    ) -> NDArray[np.bool_]: ...


@attrs.frozen
class StepContext:
    """What a fault hook sees: this rank's view of the step about to happen."""

    rank: int
    step: int
    now: float
    rooms: NDArray[np.uint64]
    states: NDArray[np.int8]
    added_step: NDArray[np.int64]


@runtime_checkable
class FaultHook(Protocol):
    """Injects failures (testing). Returns the rows to report Failed."""

    def inject(self, ctx: StepContext) -> NDArray[np.bool_]: ...
