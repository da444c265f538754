"""The field's backend selection, by its own names: engines switch with no other change.

``get_kv_class(TransferBackend.X, KVClassType.Y)`` returns the class an engine
builds for that backend and role (see :mod:`field.conn`): built and
driven the way engines build today's connectors, doing the work through our
backend of the same name. It returns None where the backend has no such class
(the fake backend has no bootstrap server), raises ``ValueError("Unsupported
transfer backend: ...")`` for a name it does not know, a typed
:class:`~buffers.errors.BadArgument` (a ValueError; for a value that is not
a name, also a TypeError) for a class type that is not a ``KVClassType``, and
:class:`~transport.errors.BackendUnavailable`, naming what to install or the
hardware needed, for a backend whose package or hardware is missing here.
"""

from __future__ import annotations

import enum
import importlib
from typing import Any

from field._checks import member
from field.conn import UnsupportedTransferBackend
from transport.errors import BackendUnavailable
from transport.registry import get_backend

__all__ = ["TransferBackend", "KVClassType", "get_kv_class"]


class TransferBackend(enum.Enum):
    MOONCAKE = "mooncake"
    MORI = "mori"
    NIXL = "nixl"
    ASCEND = "ascend"
    FAKE = "fake"


class KVClassType(enum.Enum):
    KVARGS = "kvargs"
    MANAGER = "manager"
    SENDER = "sender"
    RECEIVER = "receiver"
    BOOTSTRAP_SERVER = "bootstrap_server"


#: backends with field-shaped classes, and the module that holds them
_FIELD_CLASSES = {
    TransferBackend.FAKE: "field.conn.fake",
    TransferBackend.MOONCAKE: "field.conn.mooncake",
    TransferBackend.NIXL: "field.conn.nixl",
}


def _backend(transfer_backend: Any) -> TransferBackend:
    value = getattr(transfer_backend, "value", transfer_backend)
    try:
        return TransferBackend(value)
    except ValueError:
        raise UnsupportedTransferBackend(
            transfer_backend, [b.value for b in TransferBackend]
        ) from None


def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
    """The class of ``class_type`` for ``transfer_backend``, or None where it has none."""
    backend = _backend(transfer_backend)
    kind = member("class_type", class_type, KVClassType, " (or its value, e.g. 'manager')")
    get_backend(backend.value)  # imports it; a missing package or hardware raises here
    module = _FIELD_CLASSES.get(backend)
    if module is None:
        raise BackendUnavailable(
            backend.value,
            "it has no field-shaped connector classes yet",
            f"drive it through transport.get_backend({backend.value!r})",
        )
    classes: dict[str, Any] = importlib.import_module(module).CLASSES
    return classes.get(kind.value)
