"""Typed errors of the transport layer."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["TransportError", "BackendUnavailable", "UnknownBackend", "TransferFailed"]


class TransportError(Exception):
    """Base class of every error raised by :mod:`transport`."""


class UnknownBackend(TransportError):
    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = tuple(sorted(known))
        super().__init__(
            f"unknown transfer backend {name!r}; known backends: {', '.join(self.known)} "
            "(third-party backends register under the entry-point group "
            "'pd_lifecycle.backends')"
        )


class BackendUnavailable(TransportError):
    def __init__(self, name: str, why: str, fix: str) -> None:
        self.name, self.why, self.fix = name, why, fix
        super().__init__(f"transfer backend {name!r} is not available: {why}. {fix}")


class TransferFailed(TransportError):
    """What ``failure_exception()`` raises for a request the backend failed."""

    def __init__(self, room: int, reason: str, detail: str = "") -> None:
        self.room, self.reason = room, reason
        super().__init__(
            f"request room={room}: transfer failed ({reason}){': ' + detail if detail else ''}"
        )
