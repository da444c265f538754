"""The words the two sides of the connector say to each other, declared whole.

Every message of the connector protocol is a typed, frozen value (one class
per :class:`Msg` word, below) that travels as a JSON object on the peer's
mailbox queue (:mod:`transport.connector.mailbox`): :meth:`to_wire` builds
that object, :func:`parse` reads one back and checks every field, its type
and range. :data:`MESSAGES` says which side says each word, its class and
what it means. Decode speaks first: it registers a request with every
prefill rank it pairs with, says where to write, or asks them to stop.
Prefill answers that every write landed (with a digest of them when asked;
decode then says they matched), that the request failed (once its writes
drained, or at its drain timeout with some still in flight), or that it
stopped.

A message that does not parse (an unknown word, a field missing or of the
wrong type, a sender that names no rank) is a :class:`MalformedMessage`: the
connector counts it and drops it; it never changes a request or stops the
connector's loop.

Each side names the words it says and hears (``SAYS`` and ``HEARS``);
:func:`check_words` holds them to this table when the connector is
imported: a word one side says that the other does not hear, or one that is
not declared, stops the import.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import attrs

from lifecycle.reasons import FailureReason
from transport.connector.core.graph import ROLES
from transport.connector.core.wire import (
    Geometry,
    HeadSlice,
    Ints,
    MalformedMessage,
    Rows,
    Slot,
    Span,
    Wire,
    fields_of,
    whole,
)
from transport.digest import LegDigest

__all__ = [
    "Msg",
    "Word",
    "MESSAGES",
    "Message",
    "Register",
    "Pages",
    "Abort",
    "Done",
    "Landed",
    "Failed",
    "GaveUp",
    "Stopped",
    "Verified",
    "Incoming",
    "parse",
    "check_words",
]


class Msg(str, enum.Enum):
    """A word of the protocol; on the wire, ``msg["kind"]`` is its value."""

    register = "register"
    pages = "pages"
    abort = "abort"
    done = "done"
    failed = "failed"
    gave_up = "gave_up"
    stopped = "stopped"
    verified = "verified"
    landed = "landed"

    def __str__(self) -> str:
        return str(self.value)


@attrs.frozen(eq=False)
class Register(Wire):
    """Decode registers a request with a prefill rank it pairs with: the head
    slice and state rows that rank sends, and decode's geometry (checked there).
    An older peer that names no page layout or state is token-major and stateless."""

    KIND: ClassVar[Msg] = Msg.register
    room: int
    epoch: int
    decode_tp: int
    dp: int
    kv_heads: int
    mla: bool
    slice: HeadSlice | None = None
    heads_major: bool = False
    head_group: int = 0
    state: Geometry = attrs.Factory(list)
    state_leg: bool = False
    digest: bool = False

    def layout(self) -> dict[str, Any]:
        """The page layout it names, as :func:`transport.layout.page_layout` reads one."""
        return {"heads_major": self.heads_major, "head_group": self.head_group}


@attrs.frozen(eq=False)
class Pages(Wire):
    """Decode says where to write: the pages (after ``skip`` cached ones it
    holds), the metadata slot (-1: not on this leg), the state rows, and for a
    staged request the staging block's buffers (``dst_ptrs``)."""

    KIND: ClassVar[Msg] = Msg.pages
    room: int
    epoch: int
    pages: Ints
    slot: Slot
    skip: int
    dst_heads: int
    dst_ptrs: Ints | None = None
    state: Rows | None = None


@attrs.frozen(eq=False)
class Abort(Wire):
    """Decode failed the request: stop writing it (``why``: a misfit it refused,
    or the digest's mismatch)."""

    KIND: ClassVar[Msg] = Msg.abort
    room: int
    epoch: int
    reason: FailureReason = FailureReason.ABORTED
    why: str | None = None


@attrs.frozen(eq=False)
class Done(Wire):
    """Every write of the request from this sender landed (with the digest of
    its bytes when decode asked for one)."""

    KIND: ClassVar[Msg] = Msg.done
    room: int
    epoch: int
    digest: int | None = None
    sig: int | None = None
    digest_bytes: int = 0

    @classmethod
    def of(cls, room: int, epoch: int, digest: LegDigest | None = None) -> Done:
        if digest is None:
            return cls(room, epoch)
        return cls(room, epoch, digest.value, digest.sig, digest.nbytes)

    def leg_digest(self) -> LegDigest | None:
        """The digest it carries; None if it carries none (no signature)."""
        return LegDigest.from_msg({k: v for k, v in self.to_wire().items() if v is not None})


@attrs.frozen(eq=False)
class Landed(Wire):
    """The engine's own note that the sender's writes of the leg's pages
    [first, end) landed (with the digest on, decode hashes them meanwhile)."""

    KIND: ClassVar[Msg] = Msg.landed
    room: int
    epoch: int
    span: Span


@attrs.frozen(eq=False)
class Failed(Wire):
    """The sender failed the request; none of its writes is left."""

    KIND: ClassVar[Msg] = Msg.failed
    room: int
    epoch: int
    reason: FailureReason = FailureReason.UNKNOWN


@attrs.frozen(eq=False)
class GaveUp(Wire):
    """The sender gave the request up at its drain timeout: a write may still land."""

    KIND: ClassVar[Msg] = Msg.gave_up
    room: int
    epoch: int
    reason: FailureReason = FailureReason.UNKNOWN


@attrs.frozen(eq=False)
class Stopped(Wire):
    """The sender heard the abort: nothing more is written."""

    KIND: ClassVar[Msg] = Msg.stopped
    room: int
    epoch: int
    reason: FailureReason = FailureReason.ABORTED


@attrs.frozen(eq=False)
class Verified(Wire):
    """Every byte of the request from this sender matched the digest it sent (a
    mismatch is an abort, reason checksum mismatch)."""

    KIND: ClassVar[Msg] = Msg.verified
    room: int
    epoch: int


Message = Register | Pages | Abort | Done | Landed | Failed | GaveUp | Stopped | Verified


@attrs.frozen
class Word:
    by: str  # the side that says it; the other hears it
    type: type[Wire]


#: The one declaration of the words: the side that says each, and its message
#: (whose docstring says what it means).
MESSAGES: Mapping[Msg, Word] = MappingProxyType(
    {
        Msg.register: Word("decode", Register),
        Msg.pages: Word("decode", Pages),
        Msg.abort: Word("decode", Abort),
        Msg.verified: Word("decode", Verified),
        Msg.done: Word("prefill", Done),
        Msg.landed: Word("prefill", Landed),
        Msg.failed: Word("prefill", Failed),
        Msg.gave_up: Word("prefill", GaveUp),
        Msg.stopped: Word("prefill", Stopped),
    }
)
_BY_KIND = {m.value: w.type for m, w in MESSAGES.items()}


@attrs.frozen
class Incoming:
    """A message as it reached this rank: from whom (its global rank and the
    incarnation it names; None: an engine's own note, which names none), and
    whether the engine itself reported it rather than the peer's mailbox."""

    peer: int
    inc: int | None
    msg: Message
    notified: bool = False

    @property
    def room(self) -> int:
        return self.msg.room

    @property
    def epoch(self) -> int:
        return self.msg.epoch


def parse(raw: Any) -> Incoming:
    """A mailbox's JSON object as the message it holds, with its sender;
    :class:`MalformedMessage` when it is not one."""
    if not isinstance(raw, Mapping):
        raise MalformedMessage("body", raw, "a JSON object")
    kind = raw.get("kind")
    cls = _BY_KIND.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MalformedMessage("kind", kind, f"one of {sorted(_BY_KIND)}")
    try:
        peer = whole(raw.get("from"))
    except ValueError:
        raise MalformedMessage("from", raw.get("from"), "the sender's rank", kind) from None
    inc = raw.get("inc")
    if inc is not None:
        try:
            inc = whole(inc)
        except ValueError:
            raise MalformedMessage("inc", inc, "the sender's incarnation", kind) from None
    msg: Message = cls.from_wire(raw)
    return Incoming(peer, inc, msg)


def _check_declaration() -> None:
    if set(MESSAGES) != set(Msg):
        raise AssertionError(f"undeclared words: {sorted(set(Msg) - set(MESSAGES))}")
    if {w.by for w in MESSAGES.values()} - set(ROLES):
        raise AssertionError(f"each word is said by one of {ROLES}")
    for m, w in MESSAGES.items():
        if w.type.KIND is not m or not w.type.__doc__:
            raise AssertionError(f"{m}: its message class must say {m} and what it means")
        names = [name for name, _, _ in fields_of(w.type)]  # (each field has a check)
        if names[:2] != ["room", "epoch"]:
            raise AssertionError(f"{m}: every message names its room and attempt first")


def check_words(sides: Mapping[str, tuple[frozenset[Msg], frozenset[Msg]]]) -> None:
    """Hold each side's (says, hears) to :data:`MESSAGES`: a side says exactly
    the words declared as its own and hears exactly the other side's."""
    if set(sides) != set(ROLES):
        raise AssertionError(f"the words of each of {ROLES}, once")
    for role, (says, hears) in sides.items():
        own = frozenset(m for m, w in MESSAGES.items() if w.by == role)
        theirs = frozenset(MESSAGES) - own
        for what, got, want in (("says", says, own), ("hears", hears, theirs)):
            if got != want:
                raise AssertionError(
                    f"{role} {what} {sorted(map(str, got))}; declared: {sorted(map(str, want))}"
                )


_check_declaration()
