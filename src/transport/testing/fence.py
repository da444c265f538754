"""The fence a simulated network holds decode's KV pages to.

Decode's scheduler gives each page to one attempt of one request
(:meth:`PageFence.assign`) and takes it back (:meth:`PageFence.free`). A write
that lands in a page that belongs to another request or attempt, or to none,
is a :class:`Violation`: the protocol must never let one happen, whatever the
network does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import attrs
import numpy as np

from buffers.kv_args import KVArgs

__all__ = ["PageFence", "Pages", "Violation"]


class Pages(Protocol):
    """A rank whose KV pages are fenced: its number and its buffers."""

    @property
    def rank(self) -> int: ...

    @property
    def kv_args(self) -> KVArgs: ...


@attrs.frozen
class Violation:
    """A write that landed where the fence says it must not."""

    at: float
    rank: int
    what: str


class PageFence:
    """Decode's pages by (rank, buffer, page) -> the (room, epoch) they belong to now."""

    def __init__(self) -> None:
        self.owner: dict[tuple[int, int, int], tuple[int, int]] = {}
        self.violations: list[Violation] = []

    def assign(self, rank: Pages, pages: Iterable[int | np.integer], room: int, epoch: int) -> None:
        """Decode's scheduler gave ``pages`` of ``rank`` to attempt ``epoch`` of ``room``."""
        given = [int(p) for p in pages]
        for buf in range(len(rank.kv_args.kv_data_ptrs)):
            for p in given:
                self.owner[rank.rank, buf, p] = (room, epoch)

    def free(self, rank: Pages, pages: Iterable[int | np.integer]) -> None:
        """Decode's scheduler took ``pages`` of ``rank`` back: they belong to no request."""
        given = [int(p) for p in pages]
        for buf in range(len(rank.kv_args.kv_data_ptrs)):
            for p in given:
                self.owner.pop((rank.rank, buf, p), None)

    def check(self, target: Pages, addr: int, n: int, room: int, epoch: int, now: float) -> None:
        """Record a violation for each page of ``target`` that ``n`` bytes written at
        ``addr`` by attempt ``epoch`` of ``room`` touch without owning it."""
        a = target.kv_args
        for buf, (ptr, size, item) in enumerate(
            zip(a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens)
        ):
            if not ptr <= addr < ptr + size:
                continue
            for page in range((addr - ptr) // item, (addr - ptr + n - 1) // item + 1):
                owner = self.owner.get((target.rank, buf, page))
                if owner != (room, epoch):
                    self.violations.append(
                        Violation(
                            now,
                            target.rank,
                            f"room={room} attempt {epoch} wrote page {page} of buffer "
                            f"{buf}, which belongs to {owner or 'no request'}",
                        )
                    )
