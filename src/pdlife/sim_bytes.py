"""Real bytes for byte-moving backends: what each rank's KV pages, state rows
and metadata rows must hold, how prefill fills them and how decode checks them.

Every byte is a function of (room, layer, global token, global KV head, byte)
for KV, of (room, state tensor, byte) for state, and of (room, field, byte) for
a metadata row. A prefill rank fills the heads it holds; a decode rank checks
exactly the heads it holds (:func:`pdlife.sim_topology.heads_of`), so a write
that lands another rank's heads, another token's or another request's is
caught to the byte. Under MLA every rank holds the same head 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from numpy.typing import NDArray

from buffers import MetadataBuffers
from pdlife.sim_config import STATE_SPLIT_BLOCKS, STATE_SPLIT_UNITS
from pdlife.sim_topology import HEAD_BYTES

if TYPE_CHECKING:
    from pdlife.sim import RankRun

__all__ = [
    "STATE_ROW_BYTES",
    "kv_pattern",
    "kv_difference",
    "state_pattern",
    "row_pattern",
    "row_difference",
    "fill_pages",
    "fill_prefix",
    "fill_state",
    "write_first_token",
    "verify_pages",
    "simulate_remote_write",
]

#: the simulated mamba-like state: two tensors (conv and temporal), one row per request
STATE_ROW_BYTES = (64, 192)

_U = np.uint64
_K_ROOM, _K_LAYER, _K_TOKEN, _K_HEAD = (
    _U(0x9E3779B97F4A7C15),
    _U(0xC2B2AE3D27D4EB4F),
    _U(0x165667B19E3779F9),
    _U(0xD6E8FEB86659FD93),
)


def _mix(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    with np.errstate(over="ignore"):
        x = (x ^ (x >> _U(31))) * _U(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U(29))) * _U(0x94D049BB133111EB)
        out: NDArray[np.uint64] = x ^ (x >> _U(32))
    return out


def _bytes(keys: NDArray[np.uint64], n: int) -> NDArray[np.uint8]:
    """``n`` pattern bytes for each key (``n`` a multiple of 8): shape keys.shape + (n,)."""
    words = np.arange(n // 8, dtype=np.uint64)
    with np.errstate(over="ignore"):
        vals = _mix(keys[..., None] + words * _K_ROOM)
    out: NDArray[np.uint8] = vals.view(np.uint8).reshape(*keys.shape, n)
    return out


def kv_pattern(
    room: int, layer: int, first_page: int, n_pages: int, page_size: int, heads: Sequence[int]
) -> NDArray[np.uint8]:
    """Pages ``first_page ..`` of ``room`` in ``layer``, for the global ``heads``:
    shape (n_pages, page_size, len(heads), HEAD_BYTES), the layout of a KV buffer."""
    tokens = np.arange(first_page * page_size, (first_page + n_pages) * page_size, dtype=np.uint64)
    h = np.asarray(list(heads), dtype=np.uint64)
    with np.errstate(over="ignore"):
        base = _mix(_U(room) * _K_ROOM + _U(layer + 1) * _K_LAYER)
        keys = _mix(base ^ (tokens[:, None] * _K_TOKEN) ^ ((h[None, :] + _U(1)) * _K_HEAD))
    return _bytes(keys, HEAD_BYTES).reshape(n_pages, page_size, h.size, HEAD_BYTES)


def kv_difference(
    got: NDArray[np.uint8], room: int, layer: int, first_page: int, heads: Sequence[int]
) -> str | None:
    """Where ``got`` (pages ``first_page ..`` of ``room``, shaped like a KV buffer's
    rows) first differs from the pattern of ``heads``, or None if it is exact."""
    n, page_size = got.shape[0], got.shape[1]
    want = kv_pattern(room, layer, first_page, n, page_size, heads)
    if got.shape == want.shape and np.array_equal(got, want):
        return None
    if got.shape != want.shape:
        return f"layer {layer}: holds {got.shape}, expected {want.shape}"
    p, t, h, b = (int(x) for x in np.argwhere(got != want)[0])
    tok = (first_page + p) * page_size + t
    return (
        f"layer {layer} page {first_page + p} token {tok} head {list(heads)[h]} byte {b}: "
        f"holds {got[p, t, h, b]}, expected {want[p, t, h, b]}"
    )


def state_pattern(room: int, tensor: int, share: tuple[int, int] = (0, 1)) -> NDArray[np.uint8]:
    """The state row of ``room`` in state tensor ``tensor``: whole, or the share
    ``(rank, tp)`` of it a rank of a TP group of size ``tp`` holds."""
    with np.errstate(over="ignore"):
        key = _mix(np.array([room], np.uint64) * _K_ROOM + _U(tensor + 1) * _K_HEAD)
    row: NDArray[np.uint8] = _bytes(key, STATE_ROW_BYTES[tensor])[0]
    rank, tp = share
    if tp == 1:
        return row
    # each block of the row split by TP on its own: this rank's share of each
    unit, parts, at = row.size // STATE_SPLIT_UNITS, [], 0
    for units in STATE_SPLIT_BLOCKS[tensor]:
        n = units // tp
        parts.append(row[(at + rank * n) * unit : (at + (rank + 1) * n) * unit])
        at += units
    out: NDArray[np.uint8] = np.concatenate(parts)
    return out


def row_pattern(meta: MetadataBuffers, room: int) -> list[tuple[str, NDArray[np.uint8]]]:
    """Every field of ``room``'s metadata row but the room, as bytes; the first
    output id is ``room % 50000`` (the first token the scheduler reads)."""
    out = []
    for i, spec in enumerate(meta.layout.fields):
        if spec.name == "bootstrap_room":
            continue
        with np.errstate(over="ignore"):
            key = _mix(np.array([room], np.uint64) * _K_ROOM + _U(i + 1) * _K_LAYER)
        b = _bytes(key, -(-spec.row_bytes // 8) * 8)[0][: spec.row_bytes].copy()
        if spec.name == "output_ids":
            b[:4] = np.array([room % 50000], dtype="<i4").view(np.uint8)
        out.append((spec.name, b))
    return out


def _row_bytes(meta: MetadataBuffers, name: str, slot: int) -> NDArray[np.uint8]:
    out: NDArray[np.uint8] = meta.tensors[name][slot].view(torch.uint8).numpy()
    return out


def row_difference(meta: MetadataBuffers, slot: int, room: int) -> str | None:
    """The first field and byte where row ``slot`` differs from ``room``'s row, or None."""
    for name, want in row_pattern(meta, room):
        got = _row_bytes(meta, name, slot)
        if not np.array_equal(got, want):
            b = int(np.flatnonzero(got != want)[0])
            return f"metadata field {name} byte {b}: holds {got[b]}, expected {want[b]}"
    return None


def _write_row(meta: MetadataBuffers, slot: int, room: int, owner: int) -> None:
    for name, b in row_pattern(meta, room):
        _row_bytes(meta, name, slot)[:] = b
    meta.write(slot, owner, {})  # the room column last, as a real row is written


def fill_pages(run: RankRun, room: int, pages: NDArray[np.int64]) -> None:
    """Prefill: the request's KV, for the heads this rank holds."""
    for layer, t in enumerate(run.kv):
        t.numpy()[pages] = kv_pattern(room, layer, 0, pages.size, run.cfg.page_size, run.heads)


def fill_prefix(run: RankRun, room: int, pages: NDArray[np.int64]) -> None:
    """Decode: the cached prefix (the first ``pages.size`` pages), already held here."""
    fill_pages(run, room, pages)


def fill_state(run: RankRun, room: int, row: int) -> None:
    for i, t in enumerate(run.state_tensors):
        t.numpy()[row] = state_pattern(room, i, run.state_share)


def write_first_token(run: RankRun, room: int, slot: int) -> None:
    """The prefill's metadata row (sent to decode): the plan may drop or corrupt it."""
    # every decode rank's plan is asked, so that each of its faults fires
    kinds = [f.metadata_fault(room) for f in run.faults_for_decode]
    fault = next((k for k in kinds if k is not None), None)
    if fault == "drop_metadata":
        run.meta.clear_room(slot)
        run.meta.tensors["output_ids"][slot, 0] = room % 50000
        return
    owner = room if fault is None else (room ^ 0x5A5A5A5A) or 1
    _write_row(run.meta, slot, room, owner)


def verify_pages(run: RankRun, room: int) -> None:
    """Decode, at Success: every page (the cached prefix too), the state row and
    the metadata row, byte for byte; a difference is an invariant violation."""
    pages = run.pages_of[room]
    checked = 0
    problem = None
    for layer, t in enumerate(run.kv if run.moves_bytes else ()):
        got = t.numpy()[pages]
        problem = kv_difference(got, room, layer, 0, run.heads)
        if problem is not None:
            break
        checked += got.nbytes
    if problem is None and run.state_tensors and run.moves_bytes:
        row = run.state_row_of[room]
        for i, t in enumerate(run.state_tensors):
            got = t.numpy()[row]
            want = state_pattern(room, i, run.state_share)
            if not np.array_equal(got, want):
                b = int(np.flatnonzero(got != want)[0])
                problem = f"state tensor {i} row {row} byte {b}: holds {got[b]}, expected {want[b]}"
                break
            checked += got.nbytes
    if problem is None:
        slot = run._slot[room]
        problem = row_difference(run.meta, slot, room)
        checked += sum(b.nbytes for _, b in row_pattern(run.meta, room))
    if problem is not None:
        run.violations.append(
            f"step {run.step_no}: room {room} on decode rank {run.rank}: {problem} "
            "(decode bytes differ from what prefill wrote)"
        )
        return
    run.bytes_checked += checked


def simulate_remote_write(run: RankRun, room: int, slot: int) -> None:
    """What prefill's metadata write would land (the fake backend moves no bytes)."""
    fault = run.faults.metadata_fault(room)
    if fault == "drop_metadata":
        return
    owner = room if fault is None else (room ^ 0x5A5A5A5A) or 1
    _write_row(run.meta, slot, room, owner)
