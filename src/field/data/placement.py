"""Which rank holds or writes what, by the field's names: sharded pages and
the writers of state that every rank of an attention-TP group holds whole."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from field._checks import forward_slice, integer, page_indices

__all__ = ["filter_kv_indices_for_shard_rank", "should_send_replicated_state"]


def filter_kv_indices_for_shard_rank(
    *, kv_indices: NDArray[np.int64], index_slice: slice, shard_rank: int, shard_size: int
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Pages dealt round-robin over ``shard_size`` ranks: logical page ``p`` is
    local page ``p // shard_size`` on rank ``p % shard_size``. Returns this
    rank's local page ids and their positions in the request's page list (the
    positions ``index_slice`` covers), which replace the contiguous slice.
    Page ids that are not a one-dimensional sequence of integers, or an
    ``index_slice`` that is not a forward slice (None, a step), raise a
    typed error naming it before anything is computed."""
    size = integer("shard_size", shard_size, 1)
    rank = _below(integer("shard_rank", shard_rank, 0), size, "shard_rank", "shard_size")
    page_indices("kv_indices", kv_indices, " (e.g. a 1-D int64 numpy array)")
    first, last = forward_slice("index_slice", index_slice, " (the pages' request positions)")
    pages = np.asarray(kv_indices)
    start = 0 if first is None else first
    stop = start + pages.size if last is None else last
    if stop - start != pages.size:
        raise ValueError(
            f"index_slice {index_slice} covers {stop - start} positions for {pages.size} pages"
        )
    mine = pages % size == rank
    return pages[mine] // size, np.arange(start, stop, dtype=np.int64)[mine]


def should_send_replicated_state(
    *, src_attn_tp_size: int, dst_attn_tp_size: int, local_tp_rank_in_group: int
) -> bool:
    """Whether this prefill rank writes a state every rank of its attention-TP
    group holds whole. From fewer prefill ranks to more decode ranks, every
    prefill rank writes (each feeds its own decode ranks); from more to fewer,
    the ranks holding one decode rank's copy are equivalent, and only the first
    of each such run of ``src // dst`` ranks writes. One size must divide the
    other; the rank must be in range."""
    src = integer("src_attn_tp_size", src_attn_tp_size, 1)
    dst = integer("dst_attn_tp_size", dst_attn_tp_size, 1)
    rank = integer("local_tp_rank_in_group", local_tp_rank_in_group, 0)
    _below(rank, src, "local_tp_rank_in_group", "src_attn_tp_size")
    if max(src, dst) % min(src, dst):
        raise ValueError(
            f"attention TP sizes {src} (prefill) and {dst} (decode): one must divide the other"
        )
    return src <= dst or rank % (src // dst) == 0


def _below(value: int, bound: int, name: str, bound_name: str) -> int:
    if value >= bound:
        raise ValueError(
            f"{name} = {value} is out of range: it must be below {bound_name} = {bound}"
        )
    return value
