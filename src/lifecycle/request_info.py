"""A read-only snapshot of one request's row of a :class:`~lifecycle.table.RequestTable`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll, Role

if TYPE_CHECKING:
    from lifecycle.table import RequestTable

__all__ = ["RequestInfo"]


class RequestInfo:
    """A read-only snapshot of one request's row (for humans and slow paths)."""

    __slots__ = (
        "entered_step",
        "entered_time",
        "fake",
        "metadata_slot",
        "origin",
        "reason",
        "role",
        "room",
        "state",
    )

    def __init__(self, table: RequestTable, slot: int) -> None:
        self.room = int(table.room[slot])
        self.state = KVPoll(int(table.state[slot]))
        self.role = Role(int(table.role[slot]))
        self.reason = FailureReason(int(table.reason[slot]))
        self.origin = int(table.origin[slot])
        self.entered_step = int(table.entered_step[slot])
        self.entered_time = float(table.entered_time[slot])
        self.fake = bool(table.fake[slot])
        self.metadata_slot = int(table.metadata_slot[slot])

    def __repr__(self) -> str:
        extra = f", reason={self.reason.label}, origin={self.origin}" if self.state == 0 else ""
        return f"RequestInfo(room={self.room}, state={self.state.name}{extra})"
