"""What a step reports: values identical on every rank (except ``exceptions``)."""

from __future__ import annotations

import attrs
import numpy as np
from numpy.typing import NDArray

from lifecycle.reasons import FailureReason
from lifecycle.rules.recovery import FAIL_ALL, Action, RecoveryTable, Where
from lifecycle.status import NUM_STATUSES, KVPoll

__all__ = ["Failure", "Retry", "StuckReport", "StepResult", "LastStep"]

_NO_EPOCHS = np.zeros(0, dtype=np.uint16)
#: statuses as plain integers (an enum member's lookup on its class is slow)
_SUCCESS, _FAILED = int(KVPoll.Success), int(KVPoll.Failed)


@attrs.frozen
class Failure:
    """A request that failed in a step: the agreed reason and origin rank, the
    attempt (``epoch``) that failed and what the recovery table decided."""

    room: int
    reason: FailureReason
    origin: int
    epoch: int = 0
    action: Action = Action.FAIL


@attrs.frozen
class Retry:
    """A failed request the recovery table sends round again: its next attempt
    is ``epoch`` (the failed one's + 1), served ``where`` the policy says."""

    room: int
    epoch: int
    reason: FailureReason
    origin: int
    where: Where


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
    #: the attempt of each row (0 for a first attempt; empty: all 0)
    epochs: NDArray[np.uint16] = _NO_EPOCHS
    #: what decides each failure (the step config's; no recovery by default)
    recovery: RecoveryTable = FAIL_ALL

    def _new(self, status: int) -> NDArray[np.int64]:
        if not self.changed.size:
            return self.changed[:0]  # (a view: the shared empty array stays unreachable)
        rows: NDArray[np.int64] = self.changed[self.statuses[self.changed] == status]
        return rows

    @property
    def succeeded(self) -> NDArray[np.uint64]:
        """Rooms that reached Success in this step."""
        return self.rooms[self._new(_SUCCESS)]

    @property
    def failed(self) -> NDArray[np.uint64]:
        """Rooms that reached Failed in this step."""
        return self.rooms[self._new(_FAILED)]

    def _epochs(self, rows: NDArray[np.int64]) -> NDArray[np.uint16]:
        if self.epochs.size != self.rooms.size:
            return np.zeros(rows.size, dtype=np.uint16)
        out: NDArray[np.uint16] = self.epochs[rows]
        return out

    def decisions(self) -> tuple[NDArray[np.int64], NDArray[np.int8], NDArray[np.uint16]]:
        """For the rows that failed in this step: (rows, the recovery table's
        action, the epoch of the next attempt). A pure function of agreed
        columns (reason, epoch) and the config's table: the same on every rank."""
        rows = self._new(_FAILED)
        action, nxt = self.recovery.decide(self.reasons[rows], self._epochs(rows))
        return rows, action, nxt

    def failures(self) -> list[Failure]:
        """The newly failed requests with the agreed reason and origin rank,
        the attempt that failed and the action the recovery table took."""
        rows, action, _ = self.decisions()
        if not rows.size:
            return []
        return [
            Failure(int(r), FailureReason(int(c)), int(o), int(e), Action(int(a)))
            for r, c, o, e, a in zip(
                self.rooms[rows].tolist(),
                self.reasons[rows].tolist(),
                self.origins[rows].tolist(),
                self._epochs(rows).tolist(),
                action.tolist(),
            )
        ]

    def retries(self) -> list[Retry]:
        """The newly failed requests the recovery table retries, with the epoch
        of their next attempt: the engine starts that attempt (a new transfer
        for the same room), on every rank alike."""
        rows, action, nxt = self.decisions()
        keep = action == Action.RETRY
        rows, nxt = rows[keep], nxt[keep]
        return [
            Retry(
                int(r), int(e), FailureReason(int(c)), int(o), self.recovery[FailureReason(c)].where
            )
            for r, e, c, o in zip(
                self.rooms[rows].tolist(),
                nxt.tolist(),
                self.reasons[rows].tolist(),
                self.origins[rows].tolist(),
            )
        ]

    @property
    def recomputed(self) -> NDArray[np.uint64]:
        """Rooms the recovery table hands back to be prefilled locally."""
        rows, action, _ = self.decisions()
        out: NDArray[np.uint64] = self.rooms[rows[action == Action.RECOMPUTE]]
        return out

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
