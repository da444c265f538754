"""What a connector is told: its side and rank, the store, its host, its clocks."""

from __future__ import annotations

import attrs

__all__ = ["ConnectorConfig"]


@attrs.frozen
class ConnectorConfig:
    """One rank's connector: its side and place, the store, its clocks.

    The timeouts (seconds on this rank's clock; None: none):

    - ``bootstrap_timeout``: from the request's ``sender()``/``receiver()`` for
      as long as it reports Bootstrapping, then it fails (reason bootstrap
      timeout) and its peers hear why. On decode that is until it registered
      the request with every prefill rank of it. On prefill it is until every
      decode leg registered it *and* sent its page list: the deadline covers
      the wait for decode's scheduler to give the request its pages and
      metadata row, since prefill reports WaitingForInput only then (see
      :mod:`transport.connector_graph`).
    - ``waiting_timeout``: decode, from ``send_metadata`` until every sender
      said "done".
    - ``drain_timeout``: how long a failed request with writes that may still
      land stays quarantined (Aborted) before it is released.
    """

    role: str  # "prefill" | "decode"
    tp_rank: int
    tp_size: int = 1  # this side's TP group
    dp_rank: int = 0  # this rank's DP group (prefill DP groups are 0..dp-1)
    mla: bool = False  # every rank holds the same latent KV (kv_head_num 1)
    kv_heads: int | None = None  # the model's KV heads; None: kv_head_num x tp_size
    #: decode: head slices land in a staging region per metadata slot of at most
    #: ``staging_pages`` pages, then ``scatter_pages`` per scheduler step are placed
    staging: bool = False
    staging_pages: int = 64
    scatter_pages: int = 16
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
        if not 0 <= self.tp_rank < self.tp_size or self.dp_rank < 0:
            raise ValueError(
                f"config: tp_rank {self.tp_rank} must be in 0..tp_size-1 ({self.tp_size}) "
                f"and dp_rank {self.dp_rank} >= 0"
            )
        if self.staging_pages < 1 or self.scatter_pages < 1:
            raise ValueError("config: staging_pages and scatter_pages must be >= 1")
        if not (self.heartbeat_interval > 0 and self.heartbeat_misses >= 2):
            raise ValueError(
                f"config: heartbeat_interval must be > 0 (got {self.heartbeat_interval}) and "
                f"heartbeat_misses >= 2 (got {self.heartbeat_misses}): one late beat must "
                "not make a peer dead"
            )
        if not self.drain_timeout > 0:
            raise ValueError(f"config: drain_timeout must be > 0 seconds, got {self.drain_timeout}")
