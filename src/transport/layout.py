"""Where each write of a request goes, as arrays of (source address,
destination address, length): KV pages coalesced into runs contiguous on both
sides, and a metadata row split into its fields and its room column, which is
written alone and last so that a row whose room matches is complete."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from buffers.kv_args import KVArgs

__all__ = ["runs", "page_writes", "row_writes", "kv_args_for"]

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
    tensors: Sequence[Any], aux: tuple[list[int], list[int], list[int]], engine_rank: int
) -> KVArgs:
    """KVArgs from a list of KV tensors shaped (num_pages, ...) and metadata ``buf_infos()``."""
    return KVArgs(
        engine_rank=engine_rank,
        kv_data_ptrs=[t.data_ptr() for t in tensors],
        kv_data_lens=[t.nbytes for t in tensors],
        kv_item_lens=[t[0].nbytes for t in tensors],
        aux_data_ptrs=aux[0],
        aux_data_lens=aux[1],
        aux_item_lens=aux[2],
    )
