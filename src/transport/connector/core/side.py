"""What the connector's core asks of its side: prefill's and decode's parts of
the protocol (:mod:`transport.connector.core.prefill`, :mod:`transport.connector.core.decode`)
answer the same calls, and the core is built with one of them."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np
from numpy.typing import NDArray

from lifecycle.reasons import FailureReason
from transport.connector.core.legs import Request
from transport.connector.core.messages import Incoming, Msg
from transport.staging import Staging

__all__ = ["Side"]

Req_contra = TypeVar("Req_contra", bound="Request[Any]", contravariant=True)


class Side(Protocol[Req_contra]):
    """One side's part of the protocol, as the core drives it.

    The core hands every message, every pass and every failure of a request
    to its side; the side moves the request along
    :mod:`transport.connector.core.graph` through the core."""

    #: peers write into this side's memory (decode): the waiting timeout runs
    #: from its page list to the writers' word, and a request failed for a
    #: writer gone silent is fenced at the drain timeout, not released
    RECEIVES: ClassVar[bool]
    #: the words of :mod:`transport.connector.core.messages` this side says, and hears
    SAYS: ClassVar[frozenset[Msg]]
    HEARS: ClassVar[frozenset[Msg]]
    #: where head slices land before they are scattered (decode, when staged)
    staging: Staging | None
    #: the peers a request not registered yet is expected from: one of them
    #: dead fails it (prefill: the decode ranks the last request paired with)
    expected: frozenset[int]

    def group_record(self) -> dict[str, Any] | None:
        """What this rank publishes for its DP group before pairing (None: nothing)."""

    def on_message(self, req: Req_contra, msg: Incoming) -> None:
        """A peer's message about a live request."""

    def late(self, msg: Incoming, reason: int) -> None:
        """A peer's message about a room released here (``reason``: why it ended)."""

    def steps(self, req: Req_contra) -> bool:
        """Move a live request on; True while data is due from an engine that notifies."""
        ...

    def every_pass(self) -> None:
        """What the core retries on every pass, whatever the requests do."""

    def fail(self, req: Req_contra, reason: FailureReason) -> None:
        """Fail a request here and make its peers stop writing."""

    def give_up(self, req: Req_contra) -> None:
        """The drain timeout passed and the engine's writes were forgotten."""

    def ask_stop(self, req: Req_contra, reason: FailureReason) -> None:
        """Ask every leg that has not stopped yet to stop writing the request."""

    def tell_pages(
        self,
        req: Req_contra,
        pages: NDArray[np.int64],
        slot: int,
        state: list[NDArray[np.int64]] | None,
        skip: int,
    ) -> None:
        """The scheduler said where the request's data goes (a receiver's call)."""

    def advance(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> None:
        """Place the next staged pages of these requests (the staging gate)."""

    def corrupt_at(self, room: int, epoch: int, offset: int) -> None:
        """A test's fault: flip one committed byte of that attempt before its check."""

    def released(self, req: Req_contra) -> None:
        """``req`` was released: forget what the side kept of it."""
