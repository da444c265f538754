"""Typed errors of the transport layer."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "InvalidEpoch",
    "epoch_of_arg",
    "TransportError",
    "BackendUnavailable",
    "ConfigError",
    "ConfigTypeError",
    "UnknownBackend",
    "TransferFailed",
    "DuplicateRoom",
    "ChecksumMismatch",
    "NotAnEngine",
    "require_module",
]


class TransportError(Exception):
    """Base class of every error raised by :mod:`transport`."""


class ConfigError(TransportError, ValueError):
    """A setting (a :class:`~transport.connector.config.ConnectorConfig` or
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
    """A backend name no builtin or entry point answers to (or no name at all:
    ``name`` is what the caller passed, whatever its type)."""

    def __init__(self, name: object, known: Iterable[str]) -> None:
        self.name = name
        self.known = tuple(sorted(known))
        what = (
            f"unknown transfer backend {name!r}"
            if isinstance(name, str)
            else f"a transfer backend is named by a string, got {name!r} ({type(name).__name__})"
        )
        super().__init__(
            f"{what}; known backends: {', '.join(self.known)} "
            "(third-party backends register under the entry-point group "
            "'pd_lifecycle.backends')"
        )


class BackendUnavailable(TransportError):
    def __init__(self, name: str, why: str, fix: str) -> None:
        self.name, self.why, self.fix = name, why, fix
        super().__init__(f"transfer backend {name!r} is not available: {why}. {fix}")


class NotAnEngine(TransportError, TypeError):
    """A connector was handed an engine lacking members of the
    :class:`~transport.engine.Engine` protocol; nothing was started."""

    def __init__(self, engine: object, missing: Iterable[str]) -> None:
        self.engine, self.missing = engine, tuple(missing)
        super().__init__(
            f"{type(engine).__name__} is not a transfer engine: it lacks "
            f"{', '.join(self.missing)}; implement the Engine protocol of transport.engine "
            "(see docs/backends.md)"
        )


def require_module(backend: str, module: str, name: str, fix: str) -> None:
    """Import ``name`` from ``module`` (an engine's binding) or raise
    :class:`BackendUnavailable` naming ``backend``, why, and ``fix``: every
    backend's probe."""
    try:
        # the import statement's own hook, as ``from module import name`` would
        found = __import__(module, fromlist=[name])
        getattr(found, name)
    except (ImportError, AttributeError) as e:
        why = f"cannot import {name} from {module} ({e})"
        raise BackendUnavailable(backend, why, fix) from None


class TransferFailed(TransportError):
    """What ``failure_exception()`` raises for a request the backend failed."""

    def __init__(self, room: int, reason: str, detail: str = "") -> None:
        self.room, self.reason = room, reason
        super().__init__(
            f"request room={room}: transfer failed ({reason}){': ' + detail if detail else ''}"
        )


class DuplicateRoom(TransportError, ValueError):
    """A sender or receiver was asked for a bootstrap room that already has a
    live request on this manager (a client-supplied room used twice). Nothing
    was changed: the live request keeps its room and goes on; refuse the new
    one. Also a ``ValueError``, what this error was before it had a type."""

    def __init__(self, room: int, role: str, rank: int) -> None:
        self.room, self.role, self.rank = room, role, rank
        super().__init__(
            f"request room={room}: {role} rank {rank} already has a live request with this "
            "bootstrap room; rooms must be unique among live requests. Nothing was changed "
            "and the live request goes on: refuse the new request (or give it another "
            "room), or clear the old one first."
        )


class ChecksumMismatch(TransportError):
    """A decode rank's committed bytes of a request do not match the digest a
    prefill rank sent with its "done", or no comparable digest came (the check
    fails closed). Not raised: the request fails (reason checksum mismatch) and
    this is the rank's ``last_error``."""

    def __init__(self, room: int, rank: int, why: str) -> None:
        self.room, self.rank = room, rank
        super().__init__(
            f"request room={room} on decode rank {rank}: Verifying -> Failed, checksum "
            f"mismatch: {why}. Both sides failed it; retry the request, and if it recurs "
            "check the link and memory between these ranks, or that both sides run with "
            "ConnectorConfig.digest and the same hash (transport.digest.ALGORITHM)"
        )


class InvalidEpoch(TransportError, ValueError):
    """A sender or receiver was asked for an attempt (epoch) that is not an int
    in 0..65535. Nothing was changed."""

    def __init__(self, room: object, epoch: object, role: str, rank: int) -> None:
        self.room, self.epoch, self.role, self.rank = room, epoch, role, rank
        super().__init__(
            f"request room={room}: {role} rank {rank} was asked for attempt {epoch!r} "
            f"({type(epoch).__name__}); an attempt (epoch) is an int in 0..65535, 0 for a "
            "request's first and one more for each retry. Nothing was changed."
        )


def epoch_of_arg(room: object, epoch: object, role: str, rank: int) -> int:
    """``epoch`` as an int, or :class:`InvalidEpoch` (numpy integers are taken)."""
    if type(epoch) is int and 0 <= epoch < 1 << 16:  # the common case, without the ABC
        return epoch
    import numbers

    if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral):
        raise InvalidEpoch(room, epoch, role, rank)
    value = int(epoch)
    if not 0 <= value < 1 << 16:
        raise InvalidEpoch(room, epoch, role, rank)
    return value
