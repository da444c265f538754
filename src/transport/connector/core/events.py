"""What goes into the connector's core and what comes out of it, as values.

The core (:class:`~transport.connector.core.machine.ConnectorCore`) does no I/O: its
driver (:class:`~transport.connector.hub.Connector`) reads the mailbox, the
store and the engine, and hands the core what it found as the events below,
each with the time it was taken; the core answers with effects, which the
driver performs: a message to send, a write to issue, a write to let go of.

Events
    :class:`Arrived` a peer's message (or the engine's own note) reached this
    rank, from the incarnation of that peer this rank knows; :class:`Stale`
    one from an old incarnation of a peer that restarted (refused, counted);
    :class:`Written` a write issued for :class:`Write` landed, failed, or
    found its peer unreachable; :class:`PeerReady` a peer's endpoint record,
    connected to (the core asked for it through :meth:`ConnectorCore.wanted`);
    :class:`PeerUnreachable` a peer that beats but cannot be reached;
    :class:`GroupKnown` a prefill DP group's record; :class:`Silence` the
    peers whose heartbeat stopped, as of a look at them; :class:`Restarted`
    peers seen with a new incarnation. Time passes with every call
    (``now``); a :class:`Tick` is a pass with nothing else to tell.

Effects
    :class:`Send` a message to a peer rank; :class:`Write` bytes to write
    into a peer (the driver hands the engine's answer back as
    :class:`Written` with the same ``write`` id); :class:`Forget` a write
    given up at the drain timeout (it may still land; nothing waits for it).
"""

from __future__ import annotations

from typing import Any

import attrs

from transport.connector.core.messages import Incoming, Message
from transport.layout import Writes

__all__ = [
    "Arrived",
    "Stale",
    "Written",
    "PeerReady",
    "PeerUnreachable",
    "GroupKnown",
    "Silence",
    "Restarted",
    "Tick",
    "Event",
    "Send",
    "Write",
    "Forget",
    "Effect",
    "LANDED",
    "FAILED",
    "UNREACHABLE",
]

#: what became of a write (:class:`Written`)
LANDED, FAILED, UNREACHABLE = "landed", "failed", "unreachable"


@attrs.frozen
class Arrived:
    msg: Incoming


@attrs.frozen
class Stale:
    """A message from an old incarnation of a peer that restarted: refused."""

    msg: Incoming


@attrs.frozen
class Written:
    write: int  # the id of the :class:`Write`
    outcome: str  # LANDED, FAILED or UNREACHABLE


@attrs.frozen
class PeerReady:
    peer: int
    info: dict[str, Any] = attrs.field(eq=False)


@attrs.frozen
class PeerUnreachable:
    peer: int
    why: str


@attrs.frozen
class GroupKnown:
    dp: int
    record: dict[str, Any] = attrs.field(eq=False)


@attrs.frozen
class Silence:
    peers: frozenset[int]


@attrs.frozen
class Restarted:
    """Peers seen with a new incarnation (peer -> the incarnation now published)."""

    incarnations: dict[int, Any] = attrs.field(eq=False)


@attrs.frozen
class Tick:
    """Nothing but time passed."""


Event = (
    Arrived
    | Stale
    | Written
    | PeerReady
    | PeerUnreachable
    | GroupKnown
    | Silence
    | Restarted
    | Tick
)


@attrs.frozen
class Send:
    peer: int
    msg: Message


@attrs.frozen(eq=False)
class Write:
    write: int  # this write's id, named again by :class:`Written` and :class:`Forget`
    room: int  # the request and attempt it writes for
    epoch: int
    peer: int
    info: dict[str, Any]  # the peer's endpoint record (as :class:`PeerReady` gave it)
    writes: Writes  # (src, dst, lens)
    note: bytes  # the engine's completion note (b"": none)


@attrs.frozen
class Forget:
    write: int


Effect = Send | Write | Forget
