"""A step group's two extra collectives, over plain data: the *hello* that
checks every rank built the same group, and the origin fetch that finds
which rank a new failure came from when the buffer's failure slots could not
say."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from lifecycle.config import FIRST_CAPACITY
from lifecycle.core.fingerprint import stable_hash
from lifecycle.core.packing import Field, Header, buffer_size, write_field
from lifecycle.core.step import RawStepper
from lifecycle.drive.collective import Collective
from lifecycle.drive.worker import wait_launches
from lifecycle.errors import CollectiveMismatch

__all__ = ["fetch_origins", "hello"]


def fetch_origins(
    coll: Collective, fetches: list[NDArray[np.int32] | None]
) -> list[NDArray[np.int32] | None]:
    """One small reduce for every queue's new failures (only when there are some)."""
    need = [f for f in fetches if f is not None]
    if not need:
        return fetches
    joined = need[0].copy() if len(need) == 1 else np.concatenate(need)
    wait_launches()
    coll.all_reduce_min(joined)
    out: list[NDArray[np.int32] | None] = []
    at = 0
    for f in fetches:
        if f is None:
            out.append(None)
        else:
            out.append(joined[at : at + f.size])
            at += f.size
    return out


def hello(steppers: Sequence[RawStepper], collective: Collective) -> None:
    """Raise on every rank unless every rank steps the same queues, in the same
    order, with the same configurations."""
    shape = "|".join(f"{s.queue}:{s.config.fingerprint:x}" for s in steppers)
    value = stable_hash(f"{len(steppers)}|{shape}")
    # as long as a lone stepper's first buffer, so a rank that steps these
    # queues one by one meets the hello at the same size and both raise
    buf = np.zeros(buffer_size(FIRST_CAPACITY), dtype=np.uint8)
    write_field(buf, Field.CONFIG, value)
    collective.all_reduce_min(buf)
    hdr = Header(buf)
    if Field.CONFIG in hdr.differing():
        s = steppers[0]
        names = [x.queue for x in steppers]
        raise CollectiveMismatch(
            s.rank,
            sum(len(x.table) for x in steppers),
            (0, 0),
            value,
            hdr.bounds(Field.CONFIG),
            differs=("queue",),
            detail=(
                f"The ranks built their step groups differently: this rank steps the queues "
                f"{names} in this order, with their configurations; every rank must step "
                "the same queues in the same order."
            ),
        )
