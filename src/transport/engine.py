"""What a transfer engine does for the connector: the :class:`Engine` protocol.

The :class:`~transport.connector.hub.Connector` holds everything that is not
engine-specific (rendezvous, mailboxes, heartbeats, ordering, quarantine,
timeouts, the digest). An engine only registers this rank's memory, issues
one-sided writes into a peer's and says whether they landed. Mooncake
(:mod:`transport.backends.mooncake`) and NIXL (:mod:`transport.backends.nixl`)
implement it; a new backend is a class with these methods, handed to the
connector (``Connector(kv_args, config, engine)``): see docs/backends.md.

Threading: :meth:`Engine.start` is called once, by the thread building the
connector, before the connector's background thread exists. Every other call
but :meth:`Engine.stop` comes from that one background thread, so an engine
needs no lock of its own for the connector's sake (its own threads are its
business). :meth:`Engine.stop` is called once, by the thread closing the
connector, after the background thread was stopped and joined (for at most
two seconds: an engine call stuck longer than that may still be running).

Failures: an exception from :meth:`Engine.start` aborts the connector's
construction (raise :class:`~transport.errors.BackendUnavailable` naming what
to fix). An exception from :meth:`Engine.connect` means the peer cannot be
reached yet: it is tried again a heartbeat later, and a peer that keeps
failing while it beats is reported with that error. An exception from
:meth:`Engine.write`, :meth:`Engine.check`, :meth:`Engine.forget` or
:meth:`Engine.notified` fails every live request of the rank (transfer
error, the exception kept as ``Connector.last_error``): return None from
``write`` and -1 from ``check`` for what only concerns one write.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from transport.errors import NotAnEngine

__all__ = ["Engine", "Landed", "check_engine", "IN_FLIGHT", "LANDED", "FAILED"]

#: what :meth:`Engine.check` answers
IN_FLIGHT, LANDED, FAILED = 0, 1, -1

#: (room, epoch, peer, span) of a note that landed on this rank (see :meth:`Engine.notified`)
Landed = tuple[int, int, int, tuple[int, int] | None]


@runtime_checkable
class Engine(Protocol):
    """One rank's transfer engine, driven by one connector.

    A *token* is whatever :meth:`write` returns for one write in flight; the
    connector only hands it back to :meth:`check` and :meth:`forget`. It keeps
    a request's tokens in a list and removes a finished one by equality, so two
    tokens in flight at once compare equal only if they may stand for each
    other (an object compared by identity always does).
    """

    #: whether :meth:`notified` reports the notes that landed here; with False
    #: the decode side learns of completion from the writer's "done" message only
    NOTIFIES: ClassVar[bool]

    def start(self, regions: list[tuple[int, int]], host: str) -> dict[str, Any]:
        """Start the engine on ``host`` (this rank's advertised address) and
        register every ``(address, length)`` of ``regions`` (KV pages, metadata
        rows, state, staging) for peers to write into; return what a peer needs
        to write here (JSON-serialisable: it is published through the store,
        merged with the connector's own keys, which are lower-case words
        without a leading underscore)."""
        ...

    def connect(self, peer: int, info: dict[str, Any]) -> None:
        """Get ready to write to rank ``peer``, whose published record is
        ``info`` (what its :meth:`start` returned, plus the connector's keys).
        Called once per record, before any write to it; it may be a no-op. It
        may add keys to ``info`` (a leading underscore keeps them apart from
        the published ones): the same dict is passed to :meth:`write`."""
        ...

    def write(
        self,
        info: dict[str, Any],
        src: NDArray[np.int64],
        dst: NDArray[np.int64],
        lens: NDArray[np.int64],
        note: bytes,
    ) -> Any | None:
        """Start writing ``lens[i]`` bytes from local address ``src[i]`` to the
        peer's address ``dst[i]``, for every i (one transfer: its entries may
        land in any order), into the peer described by ``info`` (as passed to
        :meth:`connect`). ``note`` (empty: none) is delivered to the peer's
        :meth:`notified` once every entry landed, by an engine that
        ``NOTIFIES``; it is ``b"room:epoch"`` or ``b"room:epoch:first:end"``.
        Return a token for :meth:`check`, or None if the peer is unreachable
        (the request fails, peer dead). Must not block on the transfer."""
        ...

    def check(self, token: Any) -> int:
        """Where the write of ``token`` stands: :data:`IN_FLIGHT` (0),
        :data:`LANDED` (1, every entry is in the peer's memory) or
        :data:`FAILED` (-1: the request fails, transfer error). Asked again
        while 0; once not 0, the token is passed to :meth:`forget` and never
        checked again."""
        ...

    def forget(self, token: Any) -> None:
        """Let go of ``token``: after it landed or failed, or, still in flight,
        when its request is given up at the drain timeout (the write may still
        land: nothing waits for it any more). Must not raise for a token the
        engine already let go of."""
        ...

    def notified(self) -> list[Landed]:
        """Every note that landed on this rank since the last call, each once, as
        (room, epoch, writer's rank, span): span None for ``b"room:epoch"`` (an
        attempt's last write from that writer), ``(first, end)`` for its pages
        ``[first, end)``. An engine that does not ``NOTIFIES`` returns []."""
        ...

    def stop(self) -> None:
        """Release the registered memory and the engine's peers and threads;
        no write of this rank is in flight that anyone still waits for."""
        ...


def check_engine(engine: object) -> None:
    """Raise :class:`~transport.errors.NotAnEngine` naming what ``engine`` lacks
    of :class:`Engine`, so a backend missing a method fails as the connector is
    built, not on its first write."""
    need = [m for m in _MEMBERS if not callable(getattr(engine, m, None))]
    if not isinstance(getattr(engine, "NOTIFIES", None), bool):
        need.append("NOTIFIES (a bool)")
    if need:
        raise NotAnEngine(engine, need)


_MEMBERS = ("start", "connect", "write", "check", "forget", "notified", "stop")
