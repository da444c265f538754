"""What a step reports: values identical on every rank (except ``exceptions``)."""

from __future__ import annotations

import attrs
import numpy as np
from numpy.typing import NDArray

from lifecycle.reasons import FailureReason
from lifecycle.status import NUM_STATUSES, KVPoll

__all__ = ["Failure", "StuckReport", "StepResult", "LastStep"]


@attrs.frozen
class Failure:
    room: int
    reason: FailureReason
    origin: int


@attrs.frozen
class StuckReport:
    """A request that has not advanced; ``holders`` are the ranks at its agreed status."""

    room: int
    status: KVPoll
    steps: int
    holders: tuple[int, ...]
    local: tuple[tuple[int, KVPoll], ...]  # (rank, gated local status) for every rank


@attrs.frozen(eq=False)
class StepResult:
    """What one step did for one queue.

    Arrays cover every live request in queue order; ``changed`` indexes the
    rows whose agreed status moved in this step.
    """

    step: int
    queue: str
    rooms: NDArray[np.uint64]
    statuses: NDArray[np.int8]  # agreed status per request
    reasons: NDArray[np.int8]  # agreed failure reason (NONE unless Failed)
    origins: NDArray[np.int32]  # rank a failure came from (-1 unless Failed)
    active: NDArray[np.int64]  # rows that took part in the reduce (not agreed terminal before)
    changed: NDArray[np.int64]
    previous: NDArray[np.int8]  # status of the changed rows before the step
    triggers: NDArray[np.int16]  # the trigger each changed row took
    dwell: NDArray[np.float64]  # how long each changed row stayed in its previous status
    exceptions: dict[int, BaseException] = attrs.field(factory=dict)
    stuck: tuple[StuckReport, ...] = ()

    def _new(self, status: int) -> NDArray[np.int64]:
        rows: NDArray[np.int64] = self.changed[self.statuses[self.changed] == status]
        return rows

    @property
    def succeeded(self) -> NDArray[np.uint64]:
        """Rooms that reached Success in this step."""
        return self.rooms[self._new(KVPoll.Success)]

    @property
    def failed(self) -> NDArray[np.uint64]:
        """Rooms that reached Failed in this step."""
        return self.rooms[self._new(KVPoll.Failed)]

    def failures(self) -> list[Failure]:
        """The newly failed requests with the agreed reason and origin rank."""
        rows = self._new(KVPoll.Failed)
        return [
            Failure(int(r), FailureReason(int(c)), int(o))
            for r, c, o in zip(
                self.rooms[rows].tolist(),
                self.reasons[rows].tolist(),
                self.origins[rows].tolist(),
            )
        ]

    @property
    def counts(self) -> dict[KVPoll, int]:
        """Number of live requests at each agreed status."""
        c = np.bincount(self.statuses, minlength=NUM_STATUSES)
        return {s: int(c[s]) for s in KVPoll}


@attrs.frozen(eq=False)
class LastStep:
    """One rank's last step over its active rows, frozen (arrays are copies):
    what a diagnosis gathers and compares across ranks."""

    rank: int
    #: the table's step number after it
    step: int
    rooms: NDArray[np.uint64]
    #: the agreed status of each row, and the step it entered it
    statuses: NDArray[np.int8]
    entered_step: NDArray[np.int64]
    #: this rank's own word per row (its local status and reason)
    words: NDArray[np.uint8]
