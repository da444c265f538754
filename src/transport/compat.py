"""The field's backend selection names, kept so engines switch with no change."""

from __future__ import annotations

import enum
from typing import Any

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


def get_kv_class(backend: TransferBackend | str, class_type: KVClassType) -> Any:
    """The class of ``class_type`` for ``backend`` (imports the backend lazily)."""
    if class_type is KVClassType.KVARGS:
        from buffers.kv_args import KVArgs

        return KVArgs
    name = backend.value if isinstance(backend, TransferBackend) else backend
    loaded = get_backend(name)
    return {
        KVClassType.MANAGER: loaded.manager,
        KVClassType.SENDER: loaded.sender,
        KVClassType.RECEIVER: loaded.receiver,
        KVClassType.BOOTSTRAP_SERVER: loaded.bootstrap,
    }[class_type]
