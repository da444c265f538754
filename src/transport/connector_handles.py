"""A request's handles on a :class:`~transport.connector.Connector`: the
prefill sender and decode receiver the scheduler holds (the field's
``KVSender``/``KVReceiver`` calls), and the KV arguments they are built on."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll
from transport.connector import NOW, Connector
from transport.connector_graph import IS_TERMINAL, Phase, ProtocolError
from transport.status_arrays import StatusHandle

__all__ = ["ConnectorSender", "ConnectorReceiver"]

T = int(KVPoll.Transferring)


class _Handle(StatusHandle):
    def __init__(self, manager: Connector, room: int, peer: int) -> None:
        self.manager = manager
        self._req = manager._take(room, peer)
        super().__init__(manager, room, self._req.index)

    def abort(self) -> None:
        self.fail(FailureReason.ABORTED)

    def fail(self, reason: FailureReason) -> None:
        """The scheduler gave up on this request (agreed Failed, or a client abort):
        stop, and make the peer stop writing; see :attr:`drained`."""
        if not self.detached:
            self.manager._fail(self._req, reason, self.manager.store)
            self.manager._wake.set()

    @property
    def drained(self) -> bool:
        """No write for this request can land any more: its pages and metadata
        row may be reused. Until then, keep them quarantined."""
        req = self._req
        return req.released or bool(IS_TERMINAL[self.manager._phase(req)])

    def clear(self) -> None:
        if self._detach():
            self.manager._clear(self._req)


class ConnectorSender(_Handle):
    def init(self, num_pages: int, metadata_slot: int | None = None) -> None:
        if num_pages < 0:
            raise ValueError(f"room={self.bootstrap_room}: num_pages must be >= 0")
        if self.detached:
            return
        self._req.local_slot = -1 if metadata_slot is None else metadata_slot
        self._req.num_pages = num_pages
        if num_pages > 0:
            self.manager.set(self.index, T)
        self.manager._wake.set()

    def send(self, page_indices: ArrayLike, state_indices: Any = None) -> None:
        pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
        if pages.size and not self.detached:
            self._req.chunks.append(pages)
            self.manager._wake.set()


class ConnectorReceiver(_Handle):
    def init(self, prefill_dp_rank: int | None = None) -> None:
        self._req.want_register = True  # registers once the prefill endpoint is known
        self.manager._wake.set()

    def send_metadata(
        self,
        page_indices: ArrayLike,
        metadata_slot: int,
        state_indices: Any = None,
        decode_prefix_len: int = 0,
    ) -> None:
        m, req = self.manager, self._req
        ph = m._phase(req)
        if self.detached or ph in (Phase.Aborted, *[p for p in Phase if IS_TERMINAL[p]]):
            return  # it already failed: nothing to tell
        if ph != Phase.Handshaken:
            raise ProtocolError(req.room, m.config.tp_rank, ph, "metadata")
        pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
        msg = {"kind": "pages", "room": req.room, "pages": pages.tolist(), "slot": metadata_slot}
        with m._lock:  # growth replaces the column: write it under the lock
            m.waited[req.index] = NOW()
        m._fire(req, "metadata")
        m.mail.send(req.peer, msg, m.store)
