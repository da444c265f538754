"""Decode's staging buffer: head-sliced KV lands here contiguous, then a
bounded scatter per scheduler step places it.

One region per metadata slot and KV buffer, ``pages`` pages long. Each
sender's heads land as one block, ordered by their first head: the block of
heads ``[h, h + c)`` starts at ``h * pages * page_size * head_bytes`` in the
region and holds ``(pages, page_size, c, head_bytes)``. The scatter copies a
block's pages into heads ``[h, h + c)`` of the request's KV pages. A region is
the slot's: it is quarantined and released with the metadata slot, so it is
reused only after the scatter is done (Success) or the peers drained (Failed).
"""

from __future__ import annotations

import ctypes

import attrs
import numpy as np
from numpy.typing import NDArray

from buffers.kv_args import KVArgs

__all__ = ["Scatter", "Staging"]


@attrs.define(eq=False)
class Scatter:
    """One request's scatter: its slot, its KV pages, its blocks (head, count)."""

    slot: int
    pages: NDArray[np.int64]
    blocks: list[tuple[int, int]]
    next: int = 0

    @property
    def left(self) -> int:
        return int(self.pages.size) - self.next


def _view(ptr: int, nbytes: int) -> NDArray[np.uint8]:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class Staging:
    def __init__(self, kv: KVArgs, slots: int, pages: int) -> None:
        if slots < 1 or pages < 1:
            raise ValueError(f"staging needs >= 1 slot and >= 1 page, got {slots} and {pages}")
        self.slots, self.pages, self.page_size = slots, pages, kv.page_size
        self.items, self.head_bytes = kv.kv_item_lens, kv.head_bytes
        self.bufs = [np.zeros(slots * pages * it, dtype=np.uint8) for it in self.items]
        self.kv = [
            _view(p, n).reshape(-1, kv.page_size, kv.kv_head_num, hb)
            for p, n, hb in zip(kv.kv_data_ptrs, kv.kv_data_lens, kv.head_bytes)
        ]

    def regions(self) -> list[tuple[int, int]]:
        return [(int(b.ctypes.data), int(b.nbytes)) for b in self.bufs]

    def block(self, slot: int, head: int) -> list[int]:
        """Per KV buffer, where the block starting at ``head`` of ``slot`` begins."""
        return [
            int(b.ctypes.data) + (slot * self.pages * it) + head * self.pages * self.page_size * hb
            for b, it, hb in zip(self.bufs, self.items, self.head_bytes)
        ]

    def scatter(self, job: Scatter, budget: int) -> None:
        """Place the next ``budget`` pages of ``job``."""
        j0, j1 = job.next, min(job.pages.size, job.next + max(budget, 1))
        dst = job.pages[j0:j1]
        for buf, kv, it, hb in zip(self.bufs, self.kv, self.items, self.head_bytes):
            region = job.slot * self.pages * it
            for head, count in job.blocks:
                at = region + head * self.pages * self.page_size * hb
                blk = buf[at : at + self.pages * self.page_size * count * hb]
                kv[dst, :, head : head + count, :] = blk.reshape(
                    self.pages, self.page_size, count, hb
                )[j0:j1]
        job.next = j1
