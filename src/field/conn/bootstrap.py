"""The field's bootstrap server, as our rendezvous store: a TCP key-value store
on ``(host, port)`` where prefill ranks publish endpoints and both sides
exchange control messages. Start it once, on the prefill side; port 0 binds
one the OS picks (``.port`` says which)."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

from field.conn.base import BaseKVBootstrapServer

__all__ = ["BootstrapServer"]


class BootstrapServer(BaseKVBootstrapServer):
    def __init__(self, host: str, port: int) -> None:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        self.store: Any = TCPStore(
            host, int(port), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
        # port 0: one the OS picked as it bound the socket (no window in which
        # another process can take it)
        self.host, self.port = host, int(self.store.port)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            del self.store
