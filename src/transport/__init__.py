"""Transfer backends behind one registry: fake, Mooncake (TCP), NIXL (UCX)."""

from transport.errors import (
    BackendUnavailable,
    DuplicateRoom,
    TransferFailed,
    TransportError,
    UnknownBackend,
)
from transport.registry import Backend, get_backend, known_backends

__all__ = [
    "Backend",
    "BackendUnavailable",
    "DuplicateRoom",
    "TransferFailed",
    "TransportError",
    "UnknownBackend",
    "get_backend",
    "known_backends",
]
