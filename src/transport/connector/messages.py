"""The words the two sides of the connector say to each other, declared once.

Every message of the connector protocol is a JSON object on the peer's
mailbox queue (:mod:`transport.connector.mailbox`) whose ``kind`` is one of the
:class:`Msg` words; :data:`MESSAGES` says which side says each and what it
means. Decode speaks first: it registers a request with every prefill rank
it pairs with, says where to write, or asks them to stop. Prefill answers
that every write landed (with a digest of them when asked; decode then
says they matched), that the request failed (once its writes drained,
or at its drain timeout with some still in flight), or that it stopped.

Each side names the words it says and hears (``SAYS`` and ``HEARS`` of
:class:`~transport.connector.port.Side`); :func:`check_words` holds them to
this table when the connector is imported: a word one side says that the
other does not hear, or one that is not declared, stops the import.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

import attrs

from transport.connector.graph import ROLES

__all__ = ["Msg", "Word", "MESSAGES", "check_words"]


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


@attrs.frozen
class Word:
    by: str  # the side that says it; the other hears it
    doc: str


#: The one declaration of the words, with the side that says each.
MESSAGES: Mapping[Msg, Word] = MappingProxyType(
    {
        Msg.register: Word(
            "decode",
            "a request, registered with a prefill rank it pairs with: the head slice "
            "and state rows that rank sends, and decode's geometry (checked there)",
        ),
        Msg.pages: Word(
            "decode",
            "where to write: the pages, metadata slot and state rows (or a block of "
            "the staging region), after a prefix of cached pages decode holds",
        ),
        Msg.abort: Word(
            "decode", "decode failed the request: stop writing it (why: a misfit it refused)"
        ),
        Msg.done: Word("prefill", "every write of the request from this sender landed"),
        Msg.landed: Word(
            "prefill",
            "the engine's own note that the sender's writes of the leg's pages "
            "[first, end) landed (with the digest on: decode hashes them meanwhile)",
        ),
        Msg.failed: Word("prefill", "the sender failed the request; none of its writes is left"),
        Msg.gave_up: Word(
            "prefill",
            "the sender gave the request up at its drain timeout: a write may still land",
        ),
        Msg.stopped: Word("prefill", "the sender heard the abort: nothing more is written"),
        Msg.verified: Word(
            "decode",
            "every byte of the request from this sender matched the digest it sent "
            "(a mismatch is an abort, reason checksum mismatch)",
        ),
    }
)


def _check_declaration() -> None:
    if set(MESSAGES) != set(Msg):
        raise AssertionError(f"undeclared words: {sorted(set(Msg) - set(MESSAGES))}")
    if {w.by for w in MESSAGES.values()} - set(ROLES):
        raise AssertionError(f"each word is said by one of {ROLES}")


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
