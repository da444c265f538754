"""What a connector is told: its side and rank, the store, its host, its clocks.

Every field is checked for type and range as the config is built, and the
fields that must fit together are checked after them, so a connector is never
started from a config that cannot work: each refusal is a
:class:`~transport.errors.ConfigError` (a ``ConfigTypeError`` for a wrong
type) naming the field, the value and what the field accepts.

Times are finite seconds (an int or a float, never a bool, NaN or an
infinity) of at most :data:`MAX_SECONDS`; the two request deadlines take None
for no deadline. The deadlines are checked on every pass of the connector's
loop, independently of the heartbeat, so no order between them and the
heartbeat interval is imposed.
"""

from __future__ import annotations

from typing import Any

import attrs

from buffers.checks import Checks
from buffers.kv_args import KVArgs
from transport.errors import ConfigError, ConfigTypeError
from transport.topology import TopologySettingError, head_range

__all__ = ["ConnectorConfig", "MAX_SECONDS", "MIN_HEARTBEAT_S", "check_fit"]

#: the longest time any setting takes (about 11.6 days): the loop's and the
#: heartbeat thread's waits must stay far below what a thread wait accepts
MAX_SECONDS = 1e6
#: the shortest heartbeat interval: a beat is a store write and a look a store
#: read per peer; any shorter and a store round trip is taken for silence
MIN_HEARTBEAT_S = 0.001

_C = Checks(ConfigError, ConfigTypeError)


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
      :mod:`transport.connector.core.graph`).
    - ``waiting_timeout``: decode, from ``send_metadata`` for as long as it
      reports WaitingForInput (or Transferring): until every sender said
      "done" (and, with a digest, its bytes were checked). Prefill, from its
      first write until every decode rank's last word ("verified", when it
      asked for a digest): a write its engine never answers, or a word lost
      on the way, ends there instead of holding the request for ever.
    - ``drain_timeout``: how long a failed request with writes that may still
      land stays quarantined (Aborted) before it is released.
    """

    role: str = attrs.field(validator=_C.text(("prefill", "decode")))
    tp_rank: int = attrs.field(validator=_C.integer(0))  # < tp_size
    tp_size: int = attrs.field(default=1, validator=_C.integer(1))  # this side's TP group
    #: this rank's DP group (prefill DP groups are 0..dp-1)
    dp_rank: int = attrs.field(default=0, validator=_C.integer(0))
    #: every rank holds the same latent KV (kv_head_num 1)
    mla: bool = attrs.field(default=False, validator=_C.flag())
    #: the model's KV heads; None: kv_head_num x tp_size. Without MLA they must
    #: split over tp_size (one of the two divides the other)
    kv_heads: int | None = attrs.field(
        default=None, validator=_C.integer(1, none="kv_head_num x tp_size")
    )
    #: decode: head slices land in a staging region per metadata slot of at most
    #: ``staging_pages`` pages, then ``scatter_pages`` per scheduler step are placed
    staging: bool = attrs.field(default=False, validator=_C.flag())
    staging_pages: int = attrs.field(default=64, validator=_C.integer(1))
    scatter_pages: int = attrs.field(default=16, validator=_C.integer(1))
    store_host: str = attrs.field(default="127.0.0.1", validator=_C.text())
    #: the TCP store's port (required: no port means no store to find the peers in)
    store_port: int = attrs.field(kw_only=True, validator=_C.integer(1, 65535))
    hostname: str | None = attrs.field(
        default=None, validator=_C.text(none="discovered, see transport.addressing")
    )
    #: seconds to retry a refused store connection (a store starting alongside; 0: none)
    store_wait: float = attrs.field(default=0.0, validator=_C.number(0.0, MAX_SECONDS, above=False))
    #: prefixes every store key of this connector: ``{namespace}/{role}/{rank}``
    namespace: str = attrs.field(default="pd", validator=_C.text(forbid="/"))
    heartbeat_interval: float = attrs.field(
        default=0.5, validator=_C.number(MIN_HEARTBEAT_S, MAX_SECONDS, above=False)
    )
    #: a peer is dead after heartbeat_interval x heartbeat_misses of silence; one
    #: late beat must not make a peer dead
    heartbeat_misses: int = attrs.field(default=4, validator=_C.integer(2))
    bootstrap_timeout: float | None = attrs.field(
        default=300.0, validator=_C.number(0.0, MAX_SECONDS, none="no deadline")
    )
    waiting_timeout: float | None = attrs.field(
        default=300.0, validator=_C.number(0.0, MAX_SECONDS, none="no deadline")
    )
    #: the loop's pause while writes are in flight (<= idle_interval)
    poll_interval: float = attrs.field(default=0.0005, validator=_C.number(0.0, MAX_SECONDS))
    #: the loop's pause when idle (a message wakes it sooner)
    idle_interval: float = attrs.field(default=0.05, validator=_C.number(0.0, MAX_SECONDS))
    drain_timeout: float = attrs.field(default=10.0, validator=_C.number(0.0, MAX_SECONDS))
    #: a KV digest of every leg's bytes (:mod:`transport.digest`): prefill sends one
    #: with each leg's "done"; decode asks for it and checks it before Success,
    #: failing the request (checksum mismatch) on a difference, or when none came
    digest: bool = attrs.field(default=False, validator=_C.flag())
    #: NIXL's progress thread: pause between polls (0: it spins)
    progress_delay_us: int = attrs.field(default=100, validator=_C.integer(0, 1_000_000))
    #: NIXL's UCX worker threads that post a transfer's descriptors in parallel
    #: (the agent's ``num_threads``; 0: the caller's thread posts them all)
    nixl_threads: int = attrs.field(default=4, validator=_C.integer(0, 64))

    @property
    def rank(self) -> int:
        """The global id peers know this rank by (DP group major, TP rank minor)."""
        return self.dp_rank * self.tp_size + self.tp_rank

    def __attrs_post_init__(self) -> None:
        if self.tp_rank >= self.tp_size:
            _C.fail(self, "tp_rank", self.tp_rank, f"a rank in 0..{self.tp_size - 1} (tp_size)")
        heads, tp = self.kv_heads, self.tp_size
        if heads is not None and not self.mla and (heads % tp if tp <= heads else tp % heads):
            _C.fail(
                self,
                "kv_heads",
                heads,
                f"a head count that splits over tp_size {tp}: a multiple of it, or a divisor "
                "of it (each head then replicated)",
            )
        if self.poll_interval > self.idle_interval:
            _C.fail(
                self,
                "poll_interval",
                self.poll_interval,
                f"at most idle_interval ({self.idle_interval:g} s): the loop polls closer "
                "while writes are in flight than while idle",
            )


def check_fit(kv_args: Any, config: Any) -> int:
    """Check a connector's KVArgs and config against each other, before it
    starts anything; return the model's KV head count."""
    if not isinstance(config, ConnectorConfig):
        _C.fail("Connector", "config", config, "a ConnectorConfig", wrong_type=True)
    if not isinstance(kv_args, KVArgs):
        _C.fail("Connector", "kv_args", kv_args, "a buffers.KVArgs", wrong_type=True)
    c, n = config, kv_args.kv_head_num
    heads = c.kv_heads or n * c.tp_size
    held = n if c.mla else len(head_range(c.tp_size, c.tp_rank, heads))
    if held != n:
        raise TopologySettingError(
            "kv_heads",
            heads,
            f"a count of which each rank of TP {c.tp_size} holds the KVArgs' kv_head_num: "
            f"{c.role} rank {c.tp_rank} of TP {c.tp_size} holds {held} of {heads} KV heads, but "
            f"its KVArgs say {n}; set kv_heads or kv_head_num",
            "ConnectorConfig",
        )
    if c.role == "decode" and c.staging:
        if kv_args.heads_major:
            _C.fail(
                c,
                "staging",
                True,
                "False with head-major pages (KVArgs.heads_major): a rank's head slice of a "
                "head-major page is one run already; staging gathers token-major slices",
            )
        if kv_args.head_group:
            _C.fail(
                c,
                "staging",
                True,
                "False with pages cut in head groups (KVArgs.head_group): a head group of "
                "consecutive pages is one run already; staging gathers token-major slices",
            )
        if not kv_args.aux_data_lens:
            _C.fail(
                c,
                "staging",
                True,
                "False when the KVArgs have no metadata (aux) buffers: staging keeps one "
                "region per metadata slot",
            )
        pool = kv_args.kv_data_lens[0] // kv_args.kv_item_lens[0] if kv_args.kv_data_lens else 0
        if c.staging_pages > pool:
            _C.fail(
                c,
                "staging_pages",
                c.staging_pages,
                f"at most the KV pool's {pool} pages (no request can ask for more; each "
                "metadata slot holds a region of this many pages)",
            )
    return heads
