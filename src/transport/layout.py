"""Where each write of a request goes, as arrays of (source address,
destination address, length): KV pages coalesced into runs contiguous on both
sides, head slices of pages when the two sides' TP sizes differ, state rows,
and a metadata row split into its fields and its room column, which is
written alone and last so that a row whose room matches is complete."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from buffers.kv_args import KVArgs, StateComponent

__all__ = [
    "runs",
    "coalesce",
    "page_writes",
    "sliced_page_writes",
    "state_writes",
    "row_writes",
    "kv_args_for",
]

Writes = tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]


def runs(src: NDArray[np.int64], dst: NDArray[np.int64]) -> Writes:
    """Coalesce page pairs into runs contiguous on both sides: (src start, dst start, length)."""
    if src.size == 0:
        e = np.empty(0, dtype=np.int64)
        return e, e, e
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], brk))
    lens = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], lens


def coalesce(s: NDArray[np.int64], d: NDArray[np.int64], n: NDArray[np.int64]) -> Writes:
    """Merge writes in order where each continues the previous one on both sides."""
    if s.size < 2:
        return s, d, n
    brk = np.flatnonzero((s[1:] != s[:-1] + n[:-1]) | (d[1:] != d[:-1] + n[:-1])) + 1
    starts = np.concatenate(([0], brk))
    return s[starts], d[starts], np.add.reduceat(n, starts)


def sliced_page_writes(
    local: KVArgs,
    dst_ptrs: Sequence[int],
    dst_heads: int,
    src: NDArray[np.int64],
    dst: NDArray[np.int64],
    src_head: int,
    dst_head: int,
    count: int,
) -> Writes:
    """Heads ``[src_head, src_head + count)`` of local pages ``src`` to heads
    ``[dst_head, dst_head + count)`` of the peer's pages ``dst``, whose pages hold
    ``dst_heads`` heads of the same size: one run per token, coalesced where both
    sides are contiguous (whole pages when both hold exactly the slice)."""
    ps, heads = local.page_size, local.kv_head_num
    tok = np.arange(ps, dtype=np.int64)
    parts = []
    for base, far, hb in zip(local.kv_data_ptrs, dst_ptrs, local.head_bytes):
        s = base + (src[:, None] * ps + tok) * heads * hb + src_head * hb
        d = far + (dst[:, None] * ps + tok) * dst_heads * hb + dst_head * hb
        # coalesced per buffer: a run must stay inside one registered region, even
        # where two buffers happen to lie back to back in memory on both sides
        parts.append(coalesce(s.reshape(-1), d.reshape(-1), np.full(s.size, count * hb, np.int64)))
    if not parts:
        return runs(src[:0], dst[:0])
    s, d, n = (np.concatenate(c).astype(np.int64) for c in zip(*parts))
    return s, d, n


def state_writes(
    local: KVArgs,
    peer_state: Sequence[Sequence[int]],
    src_rows: Sequence[NDArray[np.int64]],
    dst_rows: Sequence[NDArray[np.int64]],
) -> Writes:
    """Rows ``src_rows[c]`` of every tensor of state component ``c`` to the peer's
    rows ``dst_rows[c]`` (``peer_state[c]``: the peer's pointers of component c)."""
    parts = []
    for comp, far_ptrs, sr, dr in zip(local.state, peer_state, src_rows, dst_rows):
        for base, far, item in zip(comp.ptrs, far_ptrs, comp.item_lens):
            parts.append(
                coalesce(base + sr * item, far + dr * item, np.full(sr.size, item, np.int64))
            )
    if not parts:
        e = np.empty(0, dtype=np.int64)
        return e, e, e
    s, d, n = (np.concatenate(c).astype(np.int64) for c in zip(*parts))
    return s, d, n


def page_writes(
    local: KVArgs, peer: dict[str, Any], src: NDArray[np.int64], dst: NDArray[np.int64]
) -> Writes:
    """Local pages ``src`` to the peer's pages ``dst``, in every KV buffer."""
    s0, d0, n = runs(src, dst)
    bufs = zip(local.kv_data_ptrs, peer["kv_ptrs"], local.kv_item_lens)
    parts = [(base + s0 * it, far + d0 * it, n * it) for base, far, it in bufs]
    if not parts:
        return runs(src[:0], dst[:0])
    s, d, ln = (np.concatenate(c).astype(np.int64) for c in zip(*parts))
    return s, d, ln


def row_writes(
    local: KVArgs, peer: dict[str, Any], slot: int, peer_slot: int, room_field: bool
) -> Writes:
    """Metadata row ``slot`` to the peer's ``peer_slot``: its fields, or its room column
    alone (the last aux buffer)."""
    fields = list(zip(local.aux_data_ptrs, peer["aux_ptrs"], local.aux_item_lens))
    chosen = fields[-1:] if room_field else fields[:-1]
    s = np.array([b + slot * it for b, _, it in chosen], dtype=np.int64)
    d = np.array([p + peer_slot * it for _, p, it in chosen], dtype=np.int64)
    return s, d, np.array([it for _, _, it in chosen], dtype=np.int64)


def kv_args_for(
    tensors: Sequence[Any],
    aux: tuple[list[int], list[int], list[int]],
    engine_rank: int,
    *,
    page_size: int = 1,
    kv_head_num: int = 1,
    state: Sequence[StateComponent] = (),
) -> KVArgs:
    """KVArgs from a list of KV tensors shaped (num_pages, ...) and metadata
    ``buf_infos()``; a tensor shaped (num_pages, page_size, kv_head_num, head
    bytes) is what head slicing expects."""
    return KVArgs(
        page_size=page_size,
        kv_head_num=kv_head_num,
        state=tuple(state),
        engine_rank=engine_rank,
        kv_data_ptrs=[t.data_ptr() for t in tensors],
        kv_data_lens=[t.nbytes for t in tensors],
        kv_item_lens=[t[0].nbytes for t in tensors],
        aux_data_ptrs=aux[0],
        aux_data_lens=aux[1],
        aux_item_lens=aux[2],
    )
