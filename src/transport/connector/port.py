"""The two interfaces between the connector and its parts, declared once.

:class:`Port` is what a part sees of the connector: a side of the protocol
(:mod:`transport.connector.prefill`, :mod:`transport.connector.decode`), the
request handles (:mod:`transport.connector.handles`) and the clocks
(:mod:`transport.connector.liveness`) reach the connector only through it, and none of
them imports :mod:`transport.connector.hub`. :class:`Side` is what the connector
asks of its side: prefill's and decode's part of the protocol answer the same
calls, and the connector picks one when it is built.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np
from numpy.typing import NDArray

from buffers.kv_args import KVArgs
from lifecycle.reasons import FailureReason
from transport.connector.config import ConnectorConfig
from transport.connector.legs import Request
from transport.connector.mailbox import Mailbox
from transport.connector.messages import Incoming, Message, Msg
from transport.digest import Views
from transport.layout import Writes
from transport.staging import Staging
from transport.status_arrays import Statuses

__all__ = ["Port", "Side"]

R = TypeVar("R", bound="Request[Any]")
Req_contra = TypeVar("Req_contra", bound="Request[Any]", contravariant=True)


class Side(Protocol[Req_contra]):
    """One side's part of the protocol, as the connector drives it.

    The connector hands every message, every loop pass and every failure of
    a request to its side; the side moves the request along
    :mod:`transport.connector.graph` through the :class:`Port`."""

    #: peers write into this side's memory (decode): the waiting timeout runs
    #: from its page list to the writers' word, and a request failed for a
    #: writer gone silent is fenced at the drain timeout, not released
    RECEIVES: ClassVar[bool]
    #: the words of :mod:`transport.connector.messages` this side says, and hears
    SAYS: ClassVar[frozenset[Msg]]
    HEARS: ClassVar[frozenset[Msg]]
    #: where head slices land before they are scattered (decode, when staged)
    staging: Staging | None
    #: the peers a request not registered yet is expected from: one of them
    #: dead fails it (prefill: the decode ranks the last request paired with)
    expected: frozenset[int]

    def start(self) -> None:
        """Once the mailbox is up: publish what peers read before pairing."""

    def on_message(self, req: Req_contra, msg: Incoming, store: Any) -> None:
        """A peer's message about a live request."""

    def late(self, msg: Incoming, reason: int, store: Any) -> None:
        """A peer's message about a room released here (``reason``: why it ended)."""

    def steps(self, req: Req_contra, store: Any) -> bool:
        """Move a live request on; True while data is due from an engine that notifies."""
        ...

    def every_pass(self, store: Any) -> None:
        """What the loop retries on every pass, whatever the requests do."""

    def fail(self, req: Req_contra, reason: FailureReason, store: Any) -> None:
        """Fail a request here and make its peers stop writing."""

    def give_up(self, req: Req_contra, store: Any) -> None:
        """The drain timeout passed and the engine's writes were forgotten."""

    def ask_stop(self, req: Req_contra, reason: FailureReason, store: Any) -> None:
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


class Port(Statuses, Protocol):
    """The connector as its parts see it: its rank and geometry, its lock and
    per-request columns (written under the lock: growth replaces them), its
    requests, the mailbox and the engine's writes."""

    NOTIFIES: bool  # the engine itself reports a peer's last write landing
    config: ConnectorConfig
    rank: int
    kv_args: KVArgs
    kv_heads: int
    state_geom: list[list[Any]]
    split_state: bool
    mail: Mailbox
    store: Any
    stats: dict[str, int]
    views: Views
    last_error: Exception | None
    side: Side[Any]
    _wake: threading.Event
    _reqs: dict[tuple[int, int], Request[Any]]  # (room, epoch) -> request
    _peer_dead: set[int]
    phase: NDArray[np.int8]
    born: NDArray[np.float64]
    waited: NDArray[np.float64]
    failed_at: NDArray[np.float64]
    scatter_left: NDArray[np.int32]

    @property
    def _lock(self) -> AbstractContextManager[Any]: ...

    def set(self, index: int, status: int, reason: FailureReason = FailureReason.NONE) -> bool: ...

    def _take(self, room: int, make: Callable[[int, int], R], epoch: int = 0) -> R: ...

    def _live(self, room: int) -> Request[Any] | None: ...

    def _fire_many(
        self, reqs: Sequence[Request[Any]], trigger: str, reason: FailureReason = FailureReason.NONE
    ) -> NDArray[np.bool_]: ...

    def _fire(
        self, req: Request[Any], trigger: str, reason: FailureReason = FailureReason.NONE
    ) -> bool: ...

    def _phase(self, req: Request[Any]) -> int: ...

    def _fail(self, req: Request[Any], reason: FailureReason, store: Any) -> None: ...

    def _clear(self, req: Request[Any]) -> None: ...

    def _send(self, peer: int, msg: Message, store: Any) -> None: ...

    def _peer_info(self, peer: int, store: Any) -> dict[str, Any] | None: ...

    def _submit(
        self, req: Request[Any], info: dict[str, Any], w: Writes, notif: bytes, st: Any
    ) -> None: ...

    def _reap(self, req: Request[Any], store: Any) -> None: ...

    def _forget(self, token: Any) -> None: ...
