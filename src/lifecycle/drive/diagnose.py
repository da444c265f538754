"""Who holds a request back: one all-gather of every rank's local values.

Only taken collectively: every K steps for requests that have not moved
(``StepConfig.stuck_after``, decided from agreed state, so every rank
gathers on the same step), or on demand through ``Stepper.diagnose``.
"""

from __future__ import annotations

import attrs
import numpy as np
from numpy.typing import NDArray

from lifecycle.core.packing import unpack
from lifecycle.drive.collective import Collective
from lifecycle.result import LastStep, StepResult, StuckReport
from lifecycle.status import TERMINAL, KVPoll

__all__ = ["diagnose", "with_stuck"]


def with_stuck(
    last: LastStep | None, coll: Collective, result: StepResult, rows: NDArray[np.int64]
) -> StepResult:
    return attrs.evolve(result, stuck=diagnose(last, coll, rows))


def diagnose(
    last: LastStep | None, coll: Collective, rows: NDArray[np.int64] | None
) -> tuple[StuckReport, ...]:
    """Reports for ``rows`` (active-row positions of the last step; None: every
    non-terminal one). Every rank must call it with the same rows."""
    if last is None:
        return ()
    statuses = last.statuses
    if rows is None:
        rows = np.flatnonzero(~TERMINAL[statuses])
    words = last.words[rows].astype(np.int32)
    # the rank travels in front of its words: gathers need not be in rank order
    buf = np.concatenate([np.array([last.rank], dtype=np.int32), words])
    gathered = coll.all_gather(np.ascontiguousarray(buf, dtype=np.int32))
    ranks = gathered[:, 0].tolist()
    local, _ = unpack(gathered[:, 1:].astype(np.uint8))
    step = last.step
    reports = []
    for j, i in enumerate(rows.tolist()):
        agreed = int(statuses[i])
        locs = local[:, j].tolist()
        reports.append(
            StuckReport(
                room=int(last.rooms[i]),
                status=KVPoll(agreed),
                steps=step - int(last.entered_step[i]),
                holders=tuple(sorted(r for r, v in zip(ranks, locs) if v == agreed)),
                local=tuple(sorted((r, KVPoll(v)) for r, v in zip(ranks, locs))),
            )
        )
    return tuple(reports)
