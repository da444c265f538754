"""Stage 3 of a step (verdicts and gates): what a source's mask does, read from the rule tables.

The step computes each *source* named in :data:`~lifecycle.rules.graph.VERDICTS`
and :data:`~lifecycle.rules.graph.GATES` as a mask over the active rows; this
module turns them into reason codes and demotions. The smallest reason code
that hits a row wins, which is exactly what MIN does across ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lifecycle.errors import HookError
from lifecycle.reasons import FailureReason
from lifecycle.rules import batch
from lifecycle.rules.graph import GATES, VERDICTS

__all__ = ["MASK_SOURCES", "GATE_DEST", "combine", "hold", "bool_answer"]

_NONE = np.int8(FailureReason.NONE)
#: mask sources and the one reason each carries (``backend`` carries codes itself)
MASK_SOURCES: dict[str, FailureReason] = {
    s: v.reason for v in VERDICTS for s in v.sources if s != "backend"
}
#: each gate source and where its gate's demotion edge leads (from the graph)
GATE_DEST: dict[str, np.int8] = {
    g.source: np.int8(batch.DEST[batch.TRIGGER_ID[g.trigger], batch.DEMOTE_SOURCE]) for g in GATES
}
#: the status a gate demotes from (the graph declares it; hold() lowers only it)
_SOURCE = np.int8(batch.DEMOTE_SOURCE)
_BOOL = np.dtype(np.bool_)
if any(not 0 <= d < _SOURCE for d in GATE_DEST.values()):
    raise AssertionError("a gate demotes Success to a live status below it")


def bool_answer(answer: Any, n: int, hook: str, rank: int) -> NDArray[np.bool_]:
    """A hook's per-row answer: exactly ``n`` booleans, else a :class:`HookError`
    (a gate answering None is not "open")."""
    if type(answer) is np.ndarray and answer.dtype is _BOOL and answer.shape == (n,):
        return answer  # the common answer, checked without a conversion
    arr = np.asarray(answer)
    if arr.dtype != np.bool_ or arr.shape != (n,):
        raise HookError(
            hook,
            rank,
            f"answered {type(answer).__name__} of dtype {arr.dtype} and shape {arr.shape}, "
            f"not {n} booleans",
        )
    return arr


def combine(
    n: int, masks: Mapping[str, NDArray[np.bool_] | None], backend: NDArray[np.int8] | None
) -> NDArray[np.int8] | None:
    """Per active row the winning reason code (NONE: no verdict); None if none hit."""
    codes: NDArray[np.int8] | None = None
    for source, mask in masks.items():
        if mask is None or not mask.any():
            continue
        reason = np.int8(MASK_SOURCES[source])
        if codes is None:
            codes = np.full(n, _NONE, dtype=np.int8)
        np.minimum(codes, np.where(mask, reason, _NONE), out=codes)
    if backend is not None:  # alone, the backend's codes are the codes (never written to)
        codes = backend if codes is None else np.minimum(codes, backend)
    return codes


def hold(local: NDArray[np.int8], closed: NDArray[np.bool_], dest: np.int8) -> None:
    """Demote, in place, the local Successes where ``closed`` to ``dest`` (a
    gate's edge). Only Success is above a gate's destination (the graph's
    check: a gate demotes Success only, and Success is the top status), so
    ``min(value, dest)`` where closed moves exactly the Successes."""
    # the cap per row, Success or dest where closed: two passes (a masked
    # minimum or a table lookup costs several times more)
    drop = closed.view(np.int8)
    if dest != _SOURCE - 1:
        drop = drop * np.int8(_SOURCE - dest)
    np.minimum(local, np.subtract(_SOURCE, drop), out=local)
