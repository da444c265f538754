"""The simulated cluster's configuration and its seeded workload."""

from __future__ import annotations

import os
from typing import Any

import attrs
import numpy as np
import torch
from numpy.typing import NDArray

from buffers import MetadataLayout
from buffers.allocator import MAX_SLOTS
from buffers.checks import Checks
from lifecycle.errors import FaultPlanError
from pdlife.args import SimConfigError, SimConfigTypeError
from pdlife.cluster.plan_doc import MODES, FaultPlan
from pdlife.cluster.topology import HEAD_BYTES, topology_problem

#: --recovery: the presets of lifecycle.rules.recovery.preset
RECOVERY_MODES = ("fail", "retry", "recompute")
MAX_ATTEMPTS = 1 << 15

_BLOCK = 4096
_M62 = (1 << 62) - 1  # rooms stay within int64 wherever a column holds them
SIM_LAYOUT = MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
KV_LAYERS = 2
PAGE_BYTES = 256


#: --state-split: each state row is cut into this many units of its outermost
#: dimension (a mamba state's heads), in blocks that TP splits one by one: the
#: conv tensor's row is [q|k|v] (4, 4 and 8 units), the temporal tensor's one
#: block; a rank of a TP group of size tp holds block / tp units of each
STATE_SPLIT_UNITS = 16
STATE_SPLIT_BLOCKS = ((4, 4, 8), (16,))
#: the smallest block: both TP sizes must divide it
STATE_SPLIT_GRAIN = min(min(b) for b in STATE_SPLIT_BLOCKS)


#: the most ranks one simulated cluster has
MAX_WORLD = 64
#: the most bytes the simulated KV pools (and staging regions) take over all
#: ranks; less where the machine has less than twice this memory
MAX_SIM_BYTES = 8 << 30
#: the longest a collective step may wait for a rank (a day: longer is hung)
MAX_PG_TIMEOUT_S = 86400.0
_MAX_S = 1e6  # a connector's longest setting (transport.connector.config.MAX_SECONDS)

_C = Checks(SimConfigError, SimConfigTypeError)
_SEC = _C.number(0.0, _MAX_S)


def _backend(inst: Any, attr: Any, value: Any) -> None:
    from transport.registry import known_backends

    _C.text(tuple(known_backends()))(inst, attr, value)


def _plan(inst: Any, attr: Any, value: Any) -> None:
    if not isinstance(value, FaultPlan):
        _C.fail(inst, attr.name, value, "a FaultPlan (pdlife.cluster.plan_doc)", wrong_type=True)


@attrs.frozen
class SimConfig:
    """A simulated cluster; every field is checked for type and range, then the
    fields that must fit together (see :meth:`__attrs_post_init__`)."""

    prefill: int = attrs.field(default=2, validator=_C.integer(1))  # prefill TP size
    decode: int = attrs.field(default=2, validator=_C.integer(1))  # decode TP size
    #: prefill DP groups; request i goes to group i % prefill_dp
    prefill_dp: int = attrs.field(default=1, validator=_C.integer(1))
    mla: bool = attrs.field(default=False, validator=_C.flag())  # one latent KV head
    #: the model's KV heads; None: 2 x the larger TP size
    kv_heads: int | None = attrs.field(
        default=None, validator=_C.integer(1, none="2 x the larger TP size")
    )
    page_size: int = attrs.field(default=1, validator=_C.integer(1))  # tokens per KV page
    #: a mamba-like state component, one row per request
    state: bool = attrs.field(default=False, validator=_C.flag())
    #: TP splits that state (each rank holds its share of a row)
    state_split: bool = attrs.field(default=False, validator=_C.flag())
    #: decode lands head-sliced data in a staging buffer first
    staging: bool = attrs.field(default=False, validator=_C.flag())
    #: pages per staging region; 0: max_pages
    staging_pages: int = attrs.field(default=0, validator=_C.integer(0))
    #: decode already holds this many pages of a longer request
    prefix_pages: int = attrs.field(default=0, validator=_C.integer(0))
    requests: int = attrs.field(default=200, validator=_C.integer(1, 2**62))
    seed: int = attrs.field(default=0, validator=_C.integer(0, 2**63 - 1))
    abort_prob: float = attrs.field(
        default=0.02, validator=_C.number(0.0, 1.0, above=False, noun="a probability")
    )
    arrival: int = attrs.field(default=16, validator=_C.integer(1))  # requests per step
    max_pages: int = attrs.field(default=32, validator=_C.integer(1))  # <= kv_pages
    chunk_pages: int = attrs.field(default=8, validator=_C.integer(1))
    metadata_slots: int = attrs.field(default=64, validator=_C.integer(1, MAX_SLOTS))
    kv_pages: int = attrs.field(default=1024, validator=_C.integer(1))
    max_steps: int = attrs.field(default=3000, validator=_C.integer(1, 2**31 - 1))
    # deadlines: the fake backend runs on logical time (scheduler steps), a real
    # transport on the wall clock (seconds), like its heartbeats
    bootstrap_timeout: int = attrs.field(default=400, validator=_C.integer(1))  # steps
    waiting_timeout: int = attrs.field(default=200, validator=_C.integer(1))  # steps
    bootstrap_timeout_s: float = attrs.field(default=20.0, validator=_SEC)
    waiting_timeout_s: float = attrs.field(default=10.0, validator=_SEC)
    stuck_after: int = attrs.field(default=100, validator=_C.integer(1, 1 << 40))  # steps
    backend: str = attrs.field(default="fake", validator=_backend)
    pg_timeout: float = attrs.field(default=30.0, validator=_C.number(0.0, MAX_PG_TIMEOUT_S))
    #: draw timeline.png at the end (matplotlib)
    timeline: bool = attrs.field(default=True, validator=_C.flag())
    #: feed each rank's steps to live spans (pdlife.spans.live) as a host engine
    #: would, and write them to ranks/rankR.spans.json at the end
    live_spans: bool = attrs.field(default=False, validator=_C.flag())
    #: rank r serves Prometheus metrics on port + r (0: each on a port the OS picks)
    metrics_port: int | None = attrs.field(
        default=None, validator=_C.integer(0, 65535, none="no metrics served")
    )
    plan: FaultPlan = attrs.field(factory=FaultPlan, validator=_plan)
    #: phase | step (see pdlife.cluster.plan)
    fault_mode: str = attrs.field(default="phase", validator=_C.text(MODES))
    #: seconds: keep admitting requests this long
    soak: float | None = attrs.field(
        default=None, validator=_C.number(0.0, _MAX_S, none="no soak: run the requests")
    )
    # admission control, like a real scheduler's: past this many live requests
    # arrivals wait, so a long run holds a bounded backlog, not an ever-growing one
    max_live: int = attrs.field(default=256, validator=_C.integer(1))
    #: seconds between RSS samples
    rss_every: float = attrs.field(default=1.0, validator=_SEC)
    #: what a failed request leads to (lifecycle.rules.recovery.preset)
    recovery: str = attrs.field(default="fail", validator=_C.text(RECOVERY_MODES))
    #: attempts in all per request, with recovery "retry"
    max_attempts: int = attrs.field(default=3, validator=_C.integer(1, MAX_ATTEMPTS))
    #: per request: decode flips one byte of its committed KV (byte-moving backends)
    corrupt_prob: float = attrs.field(
        default=0.0, validator=_C.number(0.0, 1.0, above=False, noun="a probability")
    )
    #: the connector checks each leg's KV digest before Success (byte-moving backends)
    digest: bool = attrs.field(default=False, validator=_C.flag())

    def __attrs_post_init__(self) -> None:
        check_combinations(self)

    @property
    def prefill_ranks(self) -> int:
        return self.prefill * self.prefill_dp

    @property
    def world(self) -> int:
        return self.prefill_ranks + self.decode

    @property
    def total_heads(self) -> int:
        if self.mla:
            return 1
        return self.kv_heads if self.kv_heads is not None else 2 * max(self.prefill, self.decode)

    @property
    def mode(self) -> str:
        """The fault mode in force: the plan's, else ``fault_mode``."""
        return self.plan.mode if self.plan.mode is not None else self.fault_mode

    @property
    def capacity(self) -> int:
        """Live requests a queue can hold at once (the step's buffer size)."""
        return max(64, min(self.requests, self.kv_pages, 4096))


class Workload:
    """The run's requests, made on demand from the seed: request ``i`` has a
    room, a page count, an arrival step and (step mode) an abort step.
    Nothing is kept per request, so a soak can admit requests forever."""

    def __init__(self, cfg: SimConfig) -> None:
        self.seed = cfg.seed
        self.arrival_rate = max(cfg.arrival, 1)
        self.max_pages = cfg.max_pages
        self.abort_prob = cfg.abort_prob if cfg.mode == "step" else 0.0
        self.limit: int | None = None if cfg.soak else cfg.requests
        self._blocks: dict[
            int, tuple[NDArray[np.uint64], NDArray[np.int64], NDArray[np.int64]]
        ] = {}

    @staticmethod
    def rooms_of(seed: int, idx: NDArray[np.int64]) -> NDArray[np.uint64]:
        """Distinct rooms in 1..2**62: a bijection of the 62-bit request index."""
        m = np.uint64(_M62)
        with np.errstate(over="ignore"):
            x = (idx.astype(np.uint64) + np.uint64(seed * 0x632BE59BD9B4E019 & _M62)) & m
            for mul in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9):
                x = (x ^ (x >> np.uint64(29))) & m
                x = (x * np.uint64(mul | 1)) & m
            x = x ^ (x >> np.uint64(32))
        out: NDArray[np.uint64] = x + np.uint64(1)
        return out

    @staticmethod
    def index_of(seed: int, room: int) -> int | None:
        """The request index whose room is ``room`` (:meth:`rooms_of` undone, so a
        soak's rooms need no table); None for a room no index maps to."""
        if not 1 <= room <= _M62 + 1:
            return None
        m = _M62
        x = room - 1
        x ^= x >> 32
        for mul in (0xBF58476D1CE4E5B9, 0x9E3779B97F4A7C15):
            x = (x * pow(mul | 1, -1, m + 1)) & m
            x ^= (x >> 29) ^ (x >> 58)
        return (x - (seed * 0x632BE59BD9B4E019 & m)) & m

    def _block(self, b: int) -> tuple[NDArray[np.uint64], NDArray[np.int64], NDArray[np.int64]]:
        got = self._blocks.get(b)
        if got is None:
            idx = np.arange(b * _BLOCK, (b + 1) * _BLOCK, dtype=np.int64)
            rng = np.random.default_rng([self.seed, 0xC0FFEE, b])
            pages = rng.integers(1, self.max_pages + 1, _BLOCK).astype(np.int64)
            arrival = idx // self.arrival_rate + 1
            aborted = rng.random(_BLOCK) < self.abort_prob
            abort_at = np.where(aborted, arrival + rng.integers(0, 4, _BLOCK), 0)
            got = (self.rooms_of(self.seed, idx), pages, abort_at)
            if len(self._blocks) >= 4:  # requests arrive in order: old blocks are done
                self._blocks.pop(min(self._blocks))
            self._blocks[b] = got
        return got

    def __getitem__(self, i: int) -> int:
        return int(self._block(i // _BLOCK)[0][i % _BLOCK])

    def arriving(self, step: int, start: int, room: int, upto: int | None = None) -> range:
        """Indices from ``start`` that have arrived by ``step``: at most ``room``
        of them, and none from ``upto`` on."""
        hi = min(step * self.arrival_rate, start + max(room, 0))
        cap = self.limit if upto is None else upto
        if cap is not None:
            hi = min(hi, cap)
        return range(start, max(start, hi))

    def request(self, i: int) -> tuple[int, int, int]:
        """(room, pages, abort step or 0) of request ``i``."""
        rooms, pages, abort_at = self._block(i // _BLOCK)
        k = i % _BLOCK
        return int(rooms[k]), int(pages[k]), int(abort_at[k])

    def all_rooms(self, n: int) -> list[int]:
        rooms: list[int] = self.rooms_of(self.seed, np.arange(n, dtype=np.int64)).tolist()
        return rooms


def _held(tp: int, heads: int, mla: bool) -> int:
    """KV heads one rank of a TP group of ``tp`` holds."""
    return 1 if mla else max(heads // tp, 1)


def sim_bytes(cfg: SimConfig, **instead: Any) -> int:
    """Bytes of every rank's simulated KV pool, and of decode's staging regions
    when a byte-moving backend stages; ``instead``: fields taken as other values."""
    v = {f.name: getattr(cfg, f.name) for f in attrs.fields(SimConfig)} | instead
    heads = 1 if v["mla"] else v["kv_heads"] or 2 * max(v["prefill"], v["decode"])
    per_page = KV_LAYERS * v["page_size"] * HEAD_BYTES
    pages = v["prefill"] * v["prefill_dp"] * _held(v["prefill"], heads, v["mla"]) * v["kv_pages"]
    decode_pages = v["kv_pages"]
    if v["staging"] and v["backend"] != "fake":
        decode_pages += v["metadata_slots"] * (v["staging_pages"] or v["max_pages"])
    pages += v["decode"] * _held(v["decode"], heads, v["mla"]) * decode_pages
    return int(pages * per_page)


def _too_big(cfg: SimConfig, limit: int) -> str:
    """The field to name when the simulated pools do not fit ``limit``: the
    first whose default (or smallest) value would make them fit."""
    for field, small in (("page_size", 1), ("kv_heads", None), ("staging_pages", 0)):
        if getattr(cfg, field) != small and sim_bytes(cfg, **{field: small}) <= limit:
            return field
    return "prefill_dp" if cfg.prefill_dp > 1 else "page_size"


def memory_limit() -> int:
    """:data:`MAX_SIM_BYTES`, or half this machine's memory when that is less."""
    try:
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return MAX_SIM_BYTES
    return min(MAX_SIM_BYTES, phys // 2) if phys > 0 else MAX_SIM_BYTES


def longest_ask(max_pages: int, prefix_pages: int) -> int:
    """The most pages one request asks prefill for: all of a short one, the
    rest of a long one."""
    return max(max_pages - prefix_pages, prefix_pages)


def check_combinations(cfg: SimConfig) -> None:
    """The fields that must fit together (each field is already in range)."""
    fail = _C.fail
    if cfg.world > MAX_WORLD:
        big = "decode" if cfg.decode > cfg.prefill_ranks else "prefill"
        big = "prefill_dp" if big == "prefill" and cfg.prefill_dp > 1 else big
        fail(
            cfg,
            big,
            getattr(cfg, big),
            f"at most {MAX_WORLD} ranks in all (prefill x prefill_dp + decode is {cfg.world})",
        )
    if cfg.mla and cfg.kv_heads not in (None, 1):
        fail(cfg, "kv_heads", cfg.kv_heads, "None or 1 with mla: one latent KV head")
    problem = topology_problem(cfg.prefill, cfg.decode, cfg.total_heads, cfg.mla)
    if problem is not None:
        fail(cfg, "kv_heads", cfg.total_heads, f"a head count that fits both TP sizes: {problem}")
    if cfg.state_split and not cfg.state:
        fail(cfg, "state_split", True, "False without state (it splits the state rows by TP)")
    if cfg.state_split and (STATE_SPLIT_GRAIN % cfg.prefill or STATE_SPLIT_GRAIN % cfg.decode):
        fail(
            cfg,
            "state_split",
            True,
            f"False unless both TP sizes ({cfg.prefill} and {cfg.decode}) divide the "
            f"{STATE_SPLIT_GRAIN} units of a state row's smallest block",
        )
    if cfg.max_pages > cfg.kv_pages:
        fail(
            cfg,
            "max_pages",
            cfg.max_pages,
            f"at most kv_pages ({cfg.kv_pages}): a request needs its pages in the KV pool at once",
        )
    if cfg.prefix_pages >= cfg.max_pages:
        fail(
            cfg,
            "prefix_pages",
            cfg.prefix_pages,
            f"less than max_pages ({cfg.max_pages}): "
            "a longer request must exist for a prefix to be cached",
        )
    longest = longest_ask(cfg.max_pages, cfg.prefix_pages)
    if cfg.staging_pages and not cfg.staging:
        fail(cfg, "staging_pages", cfg.staging_pages, "0 without staging (it sizes its regions)")
    if cfg.staging_pages and not longest <= cfg.staging_pages <= cfg.kv_pages:
        fail(
            cfg,
            "staging_pages",
            cfg.staging_pages,
            f"0 (max_pages), or {longest}..{cfg.kv_pages}"
            ": a request's pages must fit its region, which need not outgrow the KV pool",
        )
    if cfg.metrics_port and cfg.metrics_port + cfg.world - 1 > 65535:
        fail(
            cfg,
            "metrics_port",
            cfg.metrics_port,
            f"at most {65536 - cfg.world}: rank r serves on port + r",
        )
    need, limit = sim_bytes(cfg), memory_limit()
    if need > limit:
        field = _too_big(cfg, limit)
        fail(
            cfg,
            field,
            getattr(cfg, field),
            f"a value with which the simulated KV pools fit "
            f"in {limit / 2**30:.1f} GiB: they take {need / 2**30:.1f} GiB over {cfg.world} "
            "ranks; lower page_size, kv_heads, the TP sizes or staging_pages",
        )
    if cfg.corrupt_prob and cfg.backend == "fake":
        fail(cfg, "corrupt_prob", cfg.corrupt_prob, "0 with the fake backend (it moves no bytes)")
    try:
        cfg.plan.validate_against(cfg.world, 2**62 if cfg.soak else cfg.requests)
    except FaultPlanError as e:
        fail(cfg, "plan", cfg.plan, f"a plan that fits the run: {e}")
