"""What a connector is told: its side and rank, the store, its host, its clocks."""

from __future__ import annotations

import attrs

__all__ = ["ConnectorConfig"]


@attrs.frozen
class ConnectorConfig:
    role: str  # "prefill" | "decode"
    tp_rank: int
    store_host: str = "127.0.0.1"
    store_port: int = 0
    hostname: str | None = None  # None: discovered (see transport.addressing)
    #: seconds to retry a refused store connection (a store starting alongside)
    store_wait: float = 0.0
    namespace: str = "pd"
    heartbeat_interval: float = 0.5
    heartbeat_misses: int = 4
    bootstrap_timeout: float | None = 300.0
    waiting_timeout: float | None = 300.0
    poll_interval: float = 0.0005
    idle_interval: float = 0.05
    drain_timeout: float = 10.0
    progress_delay_us: int = 100  # NIXL's progress thread: pause between polls

    def __attrs_post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"config role must be 'prefill' or 'decode', got {self.role!r}")
