"""The field's metadata, page and state helpers, by their own names and call shapes.

Each name here keeps the field's parameters, defaults and return conventions
and delegates to the typed core of :mod:`buffers`; the core keeps its own,
stricter API (room-checked frees, position-based CP filtering, frozen KV args).
Where a name here is deliberately stricter than the field it says so in its
docstring; docs/compat.md has the whole table.

Pools are recognised by what they declare, never by importing an engine: a
pool may list its kinds in ``pd_pool_kinds`` (e.g. ``{"swa"}``); otherwise the
names of its classes are read (an engine's ``BaseSWAKVPool`` subclass counts
as "swa" without this package importing that engine).
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import numpy as np
from numpy.typing import NDArray

from buffers.allocator import SlotAllocator
from buffers.errors import (
    BadArgumentType,
    DoubleFree,
    SlotOutOfRange,
)
from buffers.pages import C128, cp_filter_chunk, cp_split, ring_state_page
from field._checks import forward_slice, integer, optional_integer, page_indices, required

__all__ = [
    "ReqToMetadataIdxAllocator",
    "filter_kv_indices_for_cp_rank",
    "get_dsv4_c128_state_indices",
    "page_indices_to_cp_rank_page_indices",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------

_MANAGER = "the KV manager, with attn_cp_rank and attn_cp_size (this rank's place in CP)"


def _page_ids(name: str, value: Any) -> None:
    page_indices(name, value, " (e.g. a 1-D int64 numpy array)")


def _as_signed(word: int) -> int:
    """The same 64 bits as a signed integer (uint64 tensors are written through an int64 view)."""
    return word - (1 << 64) if word >= 1 << 63 else word


# ---------------------------------------------------------------------------
# metadata slots and rows
# ---------------------------------------------------------------------------


class ReqToMetadataIdxAllocator:
    """``size`` metadata slots handed out first in, first out; ``alloc`` returns
    None when none is free (the request waits). ``size=0`` is an always-empty pool.

    Stricter than the field: ``free`` takes an integer slot of this pool that
    is in use, else it raises and changes nothing. A bool or a float
    (``free(True)``, ``free(1.7)``) raises :class:`~buffers.errors.BadArgumentType`
    (also a TypeError); a slot outside the pool
    :class:`~buffers.errors.SlotOutOfRange`; a slot that is already free
    :class:`~buffers.errors.DoubleFree`. The field would queue any of them,
    and later hand one row to two live requests (or a non-slot to one).
    """

    def __init__(self, size: int) -> None:
        self.size = integer("ReqToMetadataIdxAllocator size", size, 0)
        self._pool = SlotAllocator(self.size) if self.size else None
        self._next_owner = 1  # the core tracks an owner per slot; each alloc is its own

    def available_size(self) -> int:
        return self._pool.available if self._pool is not None else 0

    def alloc(self) -> int | None:
        if self._pool is None:
            return None
        slot = self._pool.alloc(self._next_owner)
        if slot is not None:
            self._next_owner += 1
        return slot

    def free(self, free_index: int) -> None:
        if isinstance(free_index, (bool, np.bool_)):
            raise BadArgumentType(
                "free_index", free_index, f"a slot number in 0..{self.size - 1}, not a bool"
            )
        try:
            slot = operator.index(free_index)
        except TypeError:
            raise BadArgumentType(
                "free_index", free_index, f"an integer slot number in 0..{self.size - 1}"
            ) from None
        if self._pool is None or not 0 <= slot < self.size:
            raise SlotOutOfRange(slot, self.size)
        owner = self._pool.owner_of(slot)
        if owner is None:
            err = DoubleFree(slot, 0)
            err.args = (
                f"metadata slot {slot} freed but it is already free: a double free would "
                "let two live requests share one row. Free a slot exactly once, when its "
                "request leaves the last queue.",
            )
            raise err
        self._pool.free(slot, owner)


# ---------------------------------------------------------------------------
# pages
# ---------------------------------------------------------------------------


def page_indices_to_cp_rank_page_indices(
    page_indices: NDArray[Any], total_pages: int, cp_rank: int, cp_size: int
) -> NDArray[Any]:
    """The request's global page ids whose *value* falls in CP rank ``cp_rank``'s
    share of ``[0, total_pages)`` shifted by the smallest id, in input order.

    This is the field's rule and assumes the request's pages are contiguous;
    :func:`buffers.cp_filter_pages` splits by position and stays right when
    they are not. ``cp_size <= 1`` returns ``page_indices`` itself.

    Every argument is checked first: page ids that are not a one-dimensional
    sequence of integers, or a size or rank that is not an integer, raise
    :class:`~buffers.errors.BadArgumentType` naming it.
    """
    _page_ids("page_indices", page_indices)
    total = integer("total_pages", total_pages, 0)
    size = integer("cp_size", cp_size, 0, " (the attention CP group's size)")
    rank = integer("cp_rank", cp_rank, 0, f" below cp_size ({size})")
    if size <= 1:
        return page_indices
    ids = np.asarray(page_indices)
    if ids.size == 0:
        return ids
    start, end = cp_split(total, size, rank)
    first = int(ids.min())
    kept: NDArray[Any] = ids[(ids >= first + start) & (ids < first + end)]
    return kept


def filter_kv_indices_for_cp_rank(
    kv_mgr: Any, kv_indices: NDArray[Any], index_slice: slice, total_pages: int | None = None
) -> tuple[NDArray[Any], slice]:
    """A chunk's page ids (``kv_indices``, at request positions ``index_slice``)
    cut to CP rank ``kv_mgr.attn_cp_rank`` of ``kv_mgr.attn_cp_size``: the kept
    ids and their positions. Nothing kept: an empty array and an empty slice at
    the chunk start. ``cp_size <= 1`` returns the inputs unchanged.

    Every argument is checked first, whatever the CP size: no manager (or
    one without the two attributes), page ids that are not a one-dimensional
    sequence of integers, an ``index_slice`` that is not a forward slice
    (None, a step, start past stop) or a ``total_pages`` that is not an
    integer raise :class:`~buffers.errors.BadArgumentType` or
    :class:`~buffers.errors.BadArgument` naming it."""
    required("kv_mgr", kv_mgr, _MANAGER)
    if not (hasattr(kv_mgr, "attn_cp_rank") and hasattr(kv_mgr, "attn_cp_size")):
        raise BadArgumentType("kv_mgr", kv_mgr, _MANAGER)
    size = integer("kv_mgr.attn_cp_size", kv_mgr.attn_cp_size, 0)
    rank = integer("kv_mgr.attn_cp_rank", kv_mgr.attn_cp_rank, 0, f" below attn_cp_size ({size})")
    _page_ids("kv_indices", kv_indices)
    start, stop = forward_slice("index_slice", index_slice, " (the chunk's request positions)")
    hint = " (the request's page count; None: len(kv_indices))"
    given = optional_integer("total_pages", total_pages, 0, hint)
    total = len(kv_indices) if given is None else given
    if size <= 1:
        return kv_indices, index_slice
    c0 = 0 if start is None else start
    c1 = total if stop is None else stop
    if c0 >= total:  # a chunk past the request's pages holds none of this rank's
        return kv_indices[:0], slice(c0, c0)
    positions, kept = cp_filter_chunk(slice(c0, min(c1, total)), total, size, rank)
    if positions.size == 0:
        return kv_indices[:0], slice(c0, c0)
    return kv_indices[int(positions[0]) : int(positions[-1]) + 1], kept


def get_dsv4_c128_state_indices(
    req_pool_idx: int, seq_len: int, *, online: bool, ring_size: int
) -> NDArray[np.int32]:
    """The compressed-state row (online) or ring page to ship, as an int32 array
    of 0 or 1 entries. A ring size that is not a multiple of 128 is an error.

    The three numbers are checked first: one that is not an integer (a
    float, a string) raises :class:`~buffers.errors.BadArgumentType`, a
    negative one :class:`~buffers.errors.BadArgument`, naming it."""
    row = integer("req_pool_idx", req_pool_idx, 0, " (the request's row in the state pool)")
    length = integer("seq_len", seq_len, 0, " (the request's token count)")
    ring = integer("ring_size", ring_size, 0, " (a multiple of 128)")
    if not online and length % C128 and ring % C128:
        raise AssertionError(f"C128 ring_size must be 128-aligned, got {ring_size}")
    page = ring_state_page(length, row, ring, online=online)
    if page is None:
        return np.empty(0, dtype=np.int32)
    return np.array([page], dtype=np.int32)
