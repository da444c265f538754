"""Who holds a request back: one all-gather of every rank's local values.

Only taken collectively: every K steps for requests that have not moved
(``StepConfig.stuck_after``, decided from agreed state, so every rank
gathers on the same step), or on demand through ``Stepper.diagnose``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import numpy as np
from numpy.typing import NDArray

from lifecycle.collective import Collective
from lifecycle.packing import unpack
from lifecycle.result import StepResult, StuckReport
from lifecycle.status import TERMINAL, KVPoll

if TYPE_CHECKING:
    from lifecycle.step import Stepper

__all__ = ["diagnose", "stuck_rows", "with_stuck"]


def stuck_rows(s: Stepper, result: StepResult, k: int) -> NDArray[np.int64] | None:
    """Active rows of the last step that have sat at one status for a multiple of k steps."""
    f = s._frame
    assert f is not None
    st = s.table.state[f.rows]
    age = result.step - s.table.entered_step[f.rows]
    stuck = ~TERMINAL[st] & (age >= k) & (age % k == 0)
    return np.flatnonzero(stuck) if stuck.any() else None


def with_stuck(
    s: Stepper, coll: Collective, result: StepResult, rows: NDArray[np.int64]
) -> StepResult:
    return attrs.evolve(result, stuck=diagnose(s, coll, rows))


def diagnose(
    s: Stepper, coll: Collective, rows: NDArray[np.int64] | None
) -> tuple[StuckReport, ...]:
    """Reports for ``rows`` (active-row positions of the last step; None: every
    non-terminal one). Every rank must call it with the same rows."""
    f = s._frame
    if f is None or s.local.values.size != f.n:
        return ()
    statuses = s.table.state[f.rows]
    if rows is None:
        rows = np.flatnonzero(~TERMINAL[statuses])
    words = s.local.words()[rows].astype(np.int32)
    # the rank travels in front of its words: gathers need not be in rank order
    buf = np.concatenate([np.array([s.rank], dtype=np.int32), words])
    gathered = coll.all_gather(np.ascontiguousarray(buf, dtype=np.int32))
    ranks = gathered[:, 0].tolist()
    local, _ = unpack(gathered[:, 1:].astype(np.uint8))
    step = s.table.step_no
    reports = []
    for j, i in enumerate(rows.tolist()):
        agreed = int(statuses[i])
        locs = local[:, j].tolist()
        reports.append(
            StuckReport(
                room=int(f.rooms[i]),
                status=KVPoll(agreed),
                steps=step - int(s.table.entered_step[f.rows[i]]),
                holders=tuple(sorted(r for r, v in zip(ranks, locs) if v == agreed)),
                local=tuple(sorted((r, KVPoll(v)) for r, v in zip(ranks, locs))),
            )
        )
    return tuple(reports)
