"""Drive W steppers as W ranks in one thread, with no threads or network.

This is the simulated world used by the property tests and by trace replay:
each rank prepares, the buffers are MIN-reduced with numpy, each rank
applies. Behaviour is identical to a real group because the steppers are the
same objects; only the collective is replaced.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from lifecycle.errors import LifecycleError
from lifecycle.step import Stepper, StepResult

__all__ = ["lockstep", "reduce_min"]


def reduce_min(bufs: Sequence[NDArray[np.int32]]) -> NDArray[np.int32]:
    sizes = [b.size for b in bufs]
    if len(set(sizes)) != 1:
        raise LifecycleError(
            f"lockstep: buffer sizes differ across ranks {sizes}; capacity must be agreed "
            "(a real gloo group would abort the process here)"
        )
    out: NDArray[np.int32] = np.minimum.reduce(list(bufs))
    return out


def lockstep(
    steppers: Sequence[Stepper], tag: int | None = None
) -> list[StepResult | BaseException]:
    """One step on every rank (``tag``: the iteration, as in :meth:`Stepper.step`).
    A rank whose apply raises gets its exception in its place in the returned
    list (ranks are independent there, exactly as in a real group)."""
    bufs = [s.prepare(tag) for s in steppers]
    red = reduce_min(bufs)
    if any([s.resize(red) for s in steppers]):
        red = reduce_min([s.repack() for s in steppers])
    out: list[StepResult | BaseException] = []
    for s in steppers:
        try:
            out.append(s.apply(red.copy()))
        except Exception as e:
            out.append(e)
    return out
