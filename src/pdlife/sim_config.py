"""The simulated cluster's configuration and its seeded workload."""

from __future__ import annotations

import attrs
import numpy as np
import torch
from numpy.typing import NDArray

from buffers import MetadataLayout
from pdlife.plan import FaultPlan

_BLOCK = 4096
_M62 = (1 << 62) - 1  # rooms stay within int64 wherever a column holds them
SIM_LAYOUT = MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
KV_LAYERS = 2
PAGE_BYTES = 256


#: --state-split: each state row is cut into this many units of its outermost
#: dimension (a mamba state's heads), of which a rank of a TP group of size tp
#: holds 16 / tp
STATE_SPLIT_UNITS = 16


@attrs.frozen
class SimConfig:
    prefill: int = 2  # prefill TP size (ranks per prefill DP group)
    decode: int = 2  # decode TP size
    prefill_dp: int = 1  # prefill DP groups; request i goes to group i % prefill_dp
    mla: bool = False  # one latent KV head, the same on every rank
    kv_heads: int | None = None  # the model's KV heads; None: 2 x the larger TP size
    page_size: int = 1  # tokens per KV page
    state: bool = False  # a mamba-like state component, one row per request
    state_split: bool = False  # TP splits that state (each rank holds its share of a row)
    staging: bool = False  # decode lands head-sliced data in a staging buffer first
    staging_pages: int = 0  # pages per staging region; 0: max_pages
    prefix_pages: int = 0  # decode already holds this many pages of a longer request
    requests: int = 200
    seed: int = 0
    abort_prob: float = 0.02
    arrival: int = 16
    max_pages: int = 32
    chunk_pages: int = 8
    metadata_slots: int = 64
    kv_pages: int = 1024
    max_steps: int = 3000
    # deadlines: the fake backend runs on logical time (scheduler steps), a real
    # transport on the wall clock (seconds), like its heartbeats
    bootstrap_timeout: int = 400  # steps
    waiting_timeout: int = 200  # steps
    bootstrap_timeout_s: float = 20.0
    waiting_timeout_s: float = 10.0
    stuck_after: int = 100
    backend: str = "fake"
    pg_timeout: float = 30.0
    timeline: bool = True  # draw timeline.png at the end (matplotlib)
    metrics_port: int | None = None  # rank r serves Prometheus metrics on port + r
    plan: FaultPlan = attrs.field(factory=FaultPlan)
    fault_mode: str = "phase"  # phase | step (see pdlife.plan)
    soak: float | None = None  # seconds: keep admitting requests this long
    # admission control, like a real scheduler's: past this many live requests
    # arrivals wait, so a long run holds a bounded backlog, not an ever-growing one
    max_live: int = 256
    rss_every: float = 1.0  # seconds between RSS samples

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
