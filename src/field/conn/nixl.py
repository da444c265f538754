"""The field's NIXL connector classes: the Mooncake ones over the NIXL backend.

Both engines sit behind one connector with one config, so only the registry
entry differs; the field's NIXL names are kept for engines that use them.
"""

from __future__ import annotations

from typing import Any

from field.conn.kv_args import KVArgs
from field.conn.mooncake import (
    MooncakeKVBootstrapServer,
    MooncakeKVManager,
    MooncakeKVReceiver,
    MooncakeKVSender,
)

__all__ = ["NixlKVManager", "NixlKVSender", "NixlKVReceiver", "NixlKVBootstrapServer", "CLASSES"]


class NixlKVManager(MooncakeKVManager):
    """One per rank: registers this rank's memory with NIXL (DRAM) and moves pages."""

    BACKEND = "nixl"


class NixlKVSender(MooncakeKVSender):
    pass


class NixlKVReceiver(MooncakeKVReceiver):
    pass


class NixlKVBootstrapServer(MooncakeKVBootstrapServer):
    """The bootstrap store prefill and decode managers meet at."""


CLASSES: dict[str, Any] = {
    "kvargs": KVArgs,
    "manager": NixlKVManager,
    "sender": NixlKVSender,
    "receiver": NixlKVReceiver,
    "bootstrap_server": NixlKVBootstrapServer,
}
