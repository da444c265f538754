"""A read-only snapshot of one request's row of a :class:`~lifecycle.table.RequestTable`."""

from __future__ import annotations

from typing import Any

import attrs
from numpy.typing import NDArray

from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll, Role

__all__ = ["RequestInfo", "INFO_FIELDS"]


@attrs.frozen(repr=False)
class RequestInfo:
    """A read-only snapshot of one request's row (for humans and slow paths);
    the table fills it in (:meth:`~lifecycle.table.RequestTable.info`)."""

    room: int
    state: KVPoll
    role: Role
    reason: FailureReason
    origin: int
    entered_step: int
    entered_time: float
    fake: bool
    metadata_slot: int
    epoch: int = 0

    @classmethod
    def of(cls, slot: int, *columns: NDArray[Any]) -> RequestInfo:
        """Row ``slot`` of the table's columns, given in field order."""
        room, state, role, reason, origin, step, time, fake, meta, epoch = (
            c[slot] for c in columns
        )
        return cls(int(room), KVPoll(int(state)), Role(int(role)), FailureReason(int(reason)),
                   int(origin), int(step), float(time), bool(fake), int(meta), int(epoch))  # fmt: skip

    def __repr__(self) -> str:
        extra = f", reason={self.reason.label}, origin={self.origin}" if self.state == 0 else ""
        extra += f", epoch={self.epoch}" if self.epoch else ""
        return f"RequestInfo(room={self.room}, state={self.state.name}{extra})"


#: the fields, in order: each is also the name of the table's column it reads
INFO_FIELDS: tuple[str, ...] = tuple(f.name for f in attrs.fields(RequestInfo))
