"""Typed errors of the transport layer."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "TransportError",
    "BackendUnavailable",
    "ConfigError",
    "ConfigTypeError",
    "UnknownBackend",
    "TransferFailed",
]


class TransportError(Exception):
    """Base class of every error raised by :mod:`transport`."""


class ConfigError(TransportError, ValueError):
    """A setting (a :class:`~transport.connector_config.ConnectorConfig` or
    :class:`~transport.topology.Topology` field) of the wrong range, or settings
    that do not fit together; raised before anything is started. ``field`` is
    the field's name, ``allowed`` what it accepts."""

    def __init__(self, field: str, value: object, allowed: str, owner: str = "") -> None:
        # here, not at the top: ``import transport`` stays light (buffers imports torch)
        from buffers.checks import setting_message

        self.field, self.value, self.allowed, self.owner = field, value, allowed, owner
        super().__init__(setting_message(field, value, allowed, owner) + "; nothing was started")


class ConfigTypeError(ConfigError, TypeError):
    """A setting of the wrong type (also a TypeError); nothing was started."""


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
