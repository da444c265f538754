"""What a simulated rank counts and samples as it runs: its checks' tallies
(violations, disagreements, bytes checked) and bounded samples of step
latency, queue counts, failure steps and memory."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

__all__ = ["RankStats", "Reservoir", "rss_mb"]


def rss_mb() -> float:
    """This process's resident set size (Linux), in MiB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


class Reservoir:
    """At most ``cap`` samples, evenly thinned as more arrive (bounded memory)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.stride = 1
        self.seen = 0
        self.items: list[Any] = []

    def add(self, x: Any) -> None:
        if self.seen % self.stride == 0:
            self.items.append(x)
            if len(self.items) >= self.cap:
                self.items = self.items[::2]
                self.stride *= 2
        self.seen += 1


class RankStats:
    """One rank's tallies and samples; ``rss_every``: seconds between memory samples."""

    def __init__(self, rss_every: float) -> None:
        self.rss_every = rss_every
        self.violations: list[str] = []
        self.disagreements = 0
        self.stuck_reports = 0
        self.drain_failed = 0
        self.bytes_checked = 0
        self.corrupt_unseen = 0  # decode: flipped bytes a Success carried (no digest)
        # decode: bytes asked of prefill (uncached pages of this rank's heads, the
        # state and metadata rows), in all and for the requests that succeeded, to
        # hold prefill's bytes_written against
        self.bytes_asked = self.bytes_due = 0
        self.staged = 0  # decode: requests whose KV landed via the staging buffer
        self.latency_us = Reservoir(20_000)
        self.counts = Reservoir(4_000)
        self.failure_steps = Reservoir(2_000)
        self.rss = Reservoir(2_000)
        self.start = self.last_rss = time.monotonic()

    def begin(self) -> None:
        """The run starts now: memory samples are timed from here."""
        self.start = self.last_rss = time.monotonic()

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self.start

    def sample_rss(self, finished: int, force: bool = False) -> None:
        """A memory sample, at most one per ``rss_every`` unless ``force``."""
        now = time.monotonic()
        if force or now - self.last_rss >= self.rss_every:
            self.last_rss = now
            # the Python heap beside the RSS: growth in one but not the other is native
            blocks = sys.getallocatedblocks()
            self.rss.add((round(now - self.start, 2), finished, round(rss_mb(), 2), blocks))
