"""Connector classes with the field's constructors and methods, over our backends.

Engines build these the way they build today's connectors (``KVArgs()`` then
fields, a manager from ``(args, mode, server_args)``, a sender or receiver per
request); each call is handed to the backend of the same name from
:func:`transport.get_backend`, which does the work and keeps the statuses.
Reach them through :func:`field.conn.backends.get_kv_class`.
"""

from transport.errors import TransportError

__all__ = ["UnsupportedTransferBackend"]


class UnsupportedTransferBackend(TransportError, ValueError):
    """A backend name the field does not know either (a ValueError, as in the field)."""

    def __init__(self, backend: object, known: list[str]) -> None:
        self.backend = backend
        super().__init__(f"Unsupported transfer backend: {backend} (known: {', '.join(known)})")
