"""Page arithmetic for context parallelism and compressed ring state.

CP ownership rule
-----------------
A request's pages are split over ``n`` CP ranks by *position in the
request's page list*: with ``m`` pages, rank ``r`` owns positions
``[r*base + min(r, rem), that + base + (r < rem))`` where
``base, rem = divmod(m, n)``. :func:`cp_filter_pages` returns the page ids at
those positions. For contiguous page ids this is exactly "shift the split by
the smallest id and keep ids inside it"; unlike that rule it stays correct
when the pool hands out non-contiguous pages (the shifted range would then
keep the wrong ids, or none).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "cp_split",
    "cp_filter_pages",
    "cp_filter_chunk",
    "ring_state_page",
    "C128",
]

C128 = 128


def cp_split(total: int, n: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of the ``total`` items rank ``rank`` of ``n`` owns."""
    if n < 1 or not 0 <= rank < n:
        raise ValueError(f"cp_split: rank {rank} is not in a CP group of size {n}")
    if total < 0:
        raise ValueError(f"cp_split: total must be >= 0, got {total}")
    base, rem = divmod(total, n)
    start = rank * base + min(rank, rem)
    return start, start + base + (1 if rank < rem else 0)


def cp_filter_pages(page_ids: ArrayLike, n: int, rank: int) -> NDArray[np.int64]:
    """The request's page ids owned by CP rank ``rank`` (by position; see module doc)."""
    ids = np.asarray(page_ids, dtype=np.int64).reshape(-1)
    start, end = cp_split(ids.size, n, rank)
    return ids[start:end]


def cp_filter_chunk(chunk: slice, total: int, n: int, rank: int) -> tuple[NDArray[np.int64], slice]:
    """Intersect a chunk (positions ``chunk.start:chunk.stop`` of a request of
    ``total`` positions) with CP rank ``rank``'s range.

    Returns the kept indices *relative to the chunk* and the adjusted slice
    in request positions; when nothing is kept the slice is empty and sits at
    the chunk start.
    """
    c0 = 0 if chunk.start is None else chunk.start
    c1 = total if chunk.stop is None else chunk.stop
    if chunk.step not in (None, 1) or not 0 <= c0 <= c1 <= total:
        raise ValueError(f"cp_filter_chunk: {chunk} is not a forward slice within 0..{total}")
    a, b = cp_split(total, n, rank)
    lo, hi = max(c0, a), min(c1, b)
    if lo >= hi:
        return np.empty(0, dtype=np.int64), slice(c0, c0)
    return np.arange(lo - c0, hi - c0, dtype=np.int64), slice(lo, hi)


def ring_state_page(seq_len: int, req_row: int, ring: int, *, online: bool = False) -> int | None:
    """Page of the 128-token compressed state to ship for a request, or None.

    None when ``seq_len`` is 0 or a multiple of 128 (no partial state). Online
    mode keeps one row per request. Otherwise the ring holds ``ring // 128``
    pages per request.
    """
    if seq_len < 0 or req_row < 0:
        raise ValueError("ring_state_page: seq_len and req_row must be >= 0")
    if seq_len == 0 or seq_len % C128 == 0:
        return None
    if online:
        return req_row
    if ring <= 0 or ring % C128:
        raise ValueError(f"ring_state_page: ring size {ring} must be a positive multiple of 128")
    return req_row * (ring // C128) + ((seq_len - 1) % ring) // C128
