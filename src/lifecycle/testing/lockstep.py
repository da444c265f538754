"""Drive W steppers as W ranks in one thread, with no threads or network.

This is the simulated world used by the property tests and by trace replay:
each rank prepares, the buffers are MIN-reduced with numpy, each rank
applies. Behaviour is identical to a real group because the steppers are the
same objects and take the same sans-IO path (prepare, reduce, resize and
reduce again if needed, origin fetch if needed, apply); only the collective
is replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lifecycle.config import tag_word
from lifecycle.drive.stepper import Stepper
from lifecycle.errors import InvalidArgument, LifecycleError
from lifecycle.result import StepResult

__all__ = ["lockstep", "reduce_min"]


def reduce_min(bufs: Sequence[NDArray[Any]]) -> NDArray[Any]:
    shapes = [(b.size, b.dtype.str) for b in bufs]
    if len(set(shapes)) != 1:
        raise LifecycleError(
            f"lockstep: buffer sizes differ across ranks {[b.size for b in bufs]}; capacity "
            "must be agreed (a real gloo group would abort the process here)"
        )
    out: NDArray[Any] = np.minimum.reduce(list(bufs))
    return out


Reduce = Callable[[list[NDArray[Any]]], NDArray[Any]]
Adjust = Callable[[int, NDArray[np.int8]], NDArray[np.int8]]


def lockstep(
    steppers: Sequence[Stepper],
    tag: int | Sequence[int | None] | None = None,
    *,
    reduce: Reduce = reduce_min,
    adjust: Adjust | None = None,
) -> list[StepResult | BaseException]:
    """One step on every rank (``tag``: the iteration, as in :meth:`Stepper.step`;
    a sequence gives each rank its own). A rank whose origins/apply raises gets
    its exception in its place in the returned list (ranks are independent
    there, exactly as in a real group).

    ``reduce`` replaces the status reduce and ``adjust(rank, values)`` may
    replace a rank's gated local values before it: both exist for negative
    controls (a suite must catch a MAX reduce or a gate that promotes)."""
    if isinstance(tag, Sequence) and not isinstance(tag, (str, bytes)):
        tags = list(tag)
        if len(tags) != len(steppers):
            raise InvalidArgument(
                "lockstep tag", tag, f"one tag per rank ({len(steppers)} of them)"
            )
    else:
        tags = [tag] * len(steppers)  # type: ignore[list-item]
    for s, t in zip(steppers, tags):
        tag_word(t, s.rank)  # refused before any rank prepares
    bufs = []
    for r, (s, t) in enumerate(zip(steppers, tags)):
        buf = s.prepare(t)
        if adjust is not None:
            values = adjust(r, s.local.values)
            if values is not s.local.values:
                s.local.values = values
                buf = s.repack()
        bufs.append(buf)
    red = reduce(bufs)
    if any([s.resize(red) for s in steppers]):
        red = reduce([s.repack() for s in steppers])
    fetches: list[NDArray[np.int32] | BaseException | None] = []
    for s in steppers:
        try:
            fetches.append(s.origins(red.copy()))
        except Exception as e:
            fetches.append(e)
    present = [f for f in fetches if isinstance(f, np.ndarray)]
    if present and len(present) != sum(f is None or isinstance(f, np.ndarray) for f in fetches):
        raise LifecycleError("lockstep: the ranks disagree on whether this step fetches origins")
    origins = reduce_min(present) if present else None
    out: list[StepResult | BaseException] = []
    for s, f in zip(steppers, fetches):
        if isinstance(f, BaseException):
            out.append(f)
            continue
        try:
            out.append(s.apply(red.copy(), origins))
        except Exception as e:
            out.append(e)
    return out
