"""A real Mooncake backend: KV pages and metadata rows written over TCP.

A Mooncake ``TransferEngine`` per rank (``P2PHANDSHAKE``, TCP) on memory
registered from the :class:`~buffers.KVArgs` of each side; everything else
(rendezvous, mailboxes, heartbeats, ordering, quarantine, timeouts) is the
shared :class:`~transport.connector.hub.Connector`.

Engine quirks absorbed here: a submit to an unreachable peer returns batch id
0 (the connector fails the request with peer dead); a batch's status can be
read only once as finished (later reads say "in progress"), so every finished
read is cached until the batch is forgotten; a negative status is a failed
write (transfer error).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from transport.connector.config import ConnectorConfig
from transport.connector.handles import ConnectorReceiver, ConnectorSender
from transport.connector.hub import Connector
from transport.engine_logs import engine_logs
from transport.errors import BackendUnavailable, require_module
from transport.layout import kv_args_for

__all__ = [
    "MooncakeConfig",
    "MooncakeManager",
    "MooncakeSender",
    "MooncakeReceiver",
    "kv_args_for",
    "probe",
]

MooncakeConfig = ConnectorConfig
MooncakeSender = ConnectorSender
MooncakeReceiver = ConnectorReceiver


def probe() -> None:
    """Raise BackendUnavailable unless the Mooncake engine imports here."""
    # the engine logs every connection at INFO: errors only, unless the user chose
    engine_logs()
    require_module(
        "mooncake",
        "mooncake.engine",
        "TransferEngine",
        "Install it with `pip install 'pd-lifecycle[mooncake]'` and Debian's libibverbs1",
    )


class MooncakeManager(Connector):
    """One per rank. Create senders (prefill) or receivers (decode) from it."""

    def _start_engine(self) -> dict[str, Any]:
        probe()
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        rc = self.engine.initialize(self.host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise BackendUnavailable(
                "mooncake",
                f"engine initialize on {self.host} returned {rc}",
                "check MooncakeConfig.hostname (or PDLIFE_HOST)",
            )
        ptrs, lens = (list(x) for x in zip(*self.regions()))
        if self.engine.batch_register_memory(ptrs, lens) != 0:
            raise BackendUnavailable(
                "mooncake", "registering the KV/metadata buffers failed", "check KVArgs"
            )
        self.endpoint = f"{self.host}:{self.engine.get_rpc_port()}"
        return {"endpoint": self.endpoint}

    #: engine batches this rank keeps in flight at most: the engine's TCP lanes
    #: refuse submissions past their queue ("queue-full rejection"), which reads as
    #: a failed or unreachable write; the rest of a write waits for room
    WINDOW: ClassVar[int] = 64
    _inflight = 0

    def _write(self, info: dict[str, Any], *w_notif: Any) -> _Batches | None:
        src, dst, lens, _ = w_notif  # the room travels in the mailbox's "done" instead
        # One entry per batch: the engine's status call reads a batch's first
        # task only and frees the batch when that one is done; a batch whose
        # other tasks are still in flight then leaks (linear RSS growth on
        # prefill, measured by `pdlife engine-memory`) and would count as
        # landed before they have. The token is the write's batches.
        token = _Batches(info["endpoint"], list(zip(_ints(src), _ints(dst), _ints(lens))))
        return token if self._top_up(token) else None

    def _top_up(self, token: _Batches) -> bool:
        """Submit what of ``token`` the window has room for (at least one batch per
        write, so that every write moves); False if the peer is unreachable."""
        while token.todo and (self._inflight < self.WINDOW or not token.pending):
            s_, d_, n_ = token.todo[-1]
            bid = int(self.engine.batch_transfer_async_write(token.endpoint, [s_], [d_], [n_]))
            if bid == 0:  # the engine's way of saying "unreachable"
                return False
            token.todo.pop()
            token.pending.append(bid)
            self._inflight += 1
        return True

    def _check(self, token: _Batches) -> int:
        # A batch's status is read once: the engine frees a finished batch and
        # may hand its id to the next one, so a finished id is dropped at once
        # and never asked about (or remembered) again.
        still: list[int] = []
        for bid in token.pending:
            s = int(self.engine.transfer_check_status(bid))
            if s < 0:
                self._inflight -= len(still) + 1
                token.pending = token.pending[token.pending.index(bid) + 1 :]
                return -1
            if s == 0:
                still.append(bid)
            else:
                self._inflight -= 1
        token.pending = still
        if not self._top_up(token):
            return -1
        return 0 if token.pending or token.todo else 1

    def _forget(self, token: _Batches) -> None:
        self._inflight -= len(token.pending)
        token.pending = []
        token.todo = []


class _Batches:
    """The engine batches of one write in flight, and its entries not submitted
    yet (last first); compared by identity."""

    __slots__ = ("endpoint", "pending", "todo")

    def __init__(self, endpoint: str, entries: list[tuple[int, int, int]]) -> None:
        self.endpoint = endpoint
        self.pending: list[int] = []
        self.todo = entries[::-1]


def _ints(a: NDArray[np.int64]) -> list[int]:
    out: list[int] = a.tolist()
    return out


MANAGER = MooncakeManager
SENDER = MooncakeSender
RECEIVER = MooncakeReceiver
BOOTSTRAP = None
