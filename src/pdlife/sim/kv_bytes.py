"""Real bytes for byte-moving backends: what each rank's KV pages, state rows
and metadata rows must hold, how prefill fills them and how decode checks them.

Every byte is a function of (room, layer, global token, global KV head, byte)
for KV, of (room, state tensor, byte) for state, and of (room, field, byte) for
a metadata row. A prefill rank fills the heads it holds; a decode rank checks
exactly the heads it holds (:func:`pdlife.cluster.topology.heads_of`), so a write
that lands another rank's heads, another token's or another request's is
caught to the byte. Under MLA every rank holds the same head 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.typing import NDArray

from buffers import FieldSpec, MetadataBuffers
from lifecycle.core.fingerprint import mix64
from pdlife.cluster.config import (
    KV_LAYERS,
    SIM_LAYOUT,
    STATE_SPLIT_BLOCKS,
    STATE_SPLIT_UNITS,
    SimConfig,
)
from pdlife.cluster.topology import HEAD_BYTES, Place, heads_of

__all__ = [
    "STATE_ROW_BYTES",
    "kv_pattern",
    "kv_difference",
    "state_pattern",
    "row_pattern",
    "row_size",
    "row_difference",
    "RankBytes",
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


_mix = mix64


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
    specs = _row_fields(meta)
    if not specs:
        return []
    # one pass for every field (a field's bytes are a prefix of its key's stream)
    fields = np.array([i + 1 for i, _ in specs], dtype=np.uint64)
    width = max(-(-s.row_bytes // 8) * 8 for _, s in specs)
    with np.errstate(over="ignore"):
        keys = _mix(np.array([room], np.uint64) * _K_ROOM + fields * _K_LAYER)
    block = _bytes(keys, width)
    out = []
    for j, (_, spec) in enumerate(specs):
        b = block[j, : spec.row_bytes]
        if spec.name == "output_ids":
            b[:4] = np.array([room % 50000], dtype="<i4").view(np.uint8)
        out.append((spec.name, b))
    return out


def row_size(meta: MetadataBuffers) -> int:
    """The bytes :func:`row_pattern` gives for a row."""
    return sum(s.row_bytes for _, s in _row_fields(meta))


def _row_fields(meta: MetadataBuffers) -> list[tuple[int, FieldSpec]]:
    """The fields a row's pattern covers, with their place in the layout:
    every field but the room."""
    return [(i, s) for i, s in enumerate(meta.layout.fields) if s.name != "bootstrap_room"]


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


class RankBytes:
    """One rank's KV pool (a few layers of pages, for the heads it holds), its
    state tensors and its metadata rows; ``moves_bytes``: a backend moves them
    (else the fake backend moves nothing, and only metadata rows are checked)."""

    def __init__(self, cfg: SimConfig, where: Place, moves_bytes: bool) -> None:
        self.where = where
        self.moves_bytes = moves_bytes
        self.page_size = cfg.page_size
        self.state_split = cfg.state_split
        self.slots = cfg.metadata_slots
        self.meta = MetadataBuffers(cfg.metadata_slots, SIM_LAYOUT)
        #: the global KV heads this rank holds (MLA: the one latent head, everywhere)
        self.heads = (
            range(1) if cfg.mla else heads_of(where.tp_size, where.tp_rank, cfg.total_heads)
        )
        self.kv = [
            torch.zeros(
                (cfg.kv_pages, cfg.page_size, len(self.heads), HEAD_BYTES), dtype=torch.uint8
            )
            for _ in range(KV_LAYERS)
        ]
        # a mamba-like state component: one row per request, held whole on every
        # rank, or (--state-split) this rank's share of each row
        self.state_share = (where.tp_rank, where.tp_size) if cfg.state_split else (0, 1)
        self.state_tensors = (
            [
                torch.zeros((cfg.metadata_slots, n // self.state_share[1]), dtype=torch.uint8)
                for n in STATE_ROW_BYTES
            ]
            if cfg.state
            else []
        )
        #: bytes of one request's metadata and state rows
        self.row_bytes = sum(self.meta.buf_infos()[2]) + sum(
            t[0].nbytes for t in self.state_tensors
        )
        #: bytes of one KV page over every layer
        self.page_bytes = sum(t[0].nbytes for t in self.kv)

    def state_row(self, slot: int) -> int:
        """The state row a request holding metadata ``slot`` uses: the slot on
        prefill, mirrored on decode, so that a transfer that confused state rows
        with metadata slots lands in the wrong row."""
        return slot if self.where.side == "prefill" else self.slots - 1 - slot

    def fill_pages(self, room: int, pages: NDArray[np.int64]) -> None:
        """Prefill: the request's KV, for the heads this rank holds."""
        for layer, t in enumerate(self.kv):
            t.numpy()[pages] = kv_pattern(room, layer, 0, pages.size, self.page_size, self.heads)

    def fill_prefix(self, room: int, pages: NDArray[np.int64]) -> None:
        """Decode: the cached prefix (the first ``pages.size`` pages), already held here."""
        self.fill_pages(room, pages)

    def fill_state(self, room: int, row: int) -> None:
        for i, t in enumerate(self.state_tensors):
            t.numpy()[row] = state_pattern(room, i, self.state_share)

    def write_first_token(self, room: int, slot: int, fault: str | None) -> None:
        """The prefill's metadata row (sent to decode), as the plan's ``fault``
        (if any) drops or corrupts it."""
        if fault == "drop_metadata":
            self.meta.clear_room(slot)
            self.meta.tensors["output_ids"][slot, 0] = room % 50000
            return
        owner = room if fault is None else (room ^ 0x5A5A5A5A) or 1
        _write_row(self.meta, slot, room, owner)

    def simulate_remote_write(self, room: int, slot: int, fault: str | None) -> None:
        """What prefill's metadata write would land (the fake backend moves no
        bytes), as the plan's ``fault`` (if any) drops or corrupts it."""
        if fault == "drop_metadata":
            return
        owner = room if fault is None else (room ^ 0x5A5A5A5A) or 1
        _write_row(self.meta, slot, room, owner)

    def verify(
        self, room: int, pages: NDArray[np.int64], slot: int, row: int | None
    ) -> tuple[str | None, int]:
        """Decode, at Success: every page (the cached prefix too), the state row
        and the metadata row, byte for byte. The first difference (None if there
        is none), and the bytes found right (none if there is a difference)."""
        checked = 0
        problem = None
        for layer, t in enumerate(self.kv if self.moves_bytes else ()):
            got = t.numpy()[pages]
            problem = kv_difference(got, room, layer, 0, self.heads)
            if problem is not None:
                return problem, 0
            checked += got.nbytes
        if self.state_tensors and self.moves_bytes:
            assert row is not None
            for i, t in enumerate(self.state_tensors):
                got = t.numpy()[row]
                want = state_pattern(room, i, self.state_share)
                if not np.array_equal(got, want):
                    b = int(np.flatnonzero(got != want)[0])
                    return (
                        f"state tensor {i} row {row} byte {b}: holds {got[b]}, expected {want[b]}",
                        0,
                    )
                checked += got.nbytes
        problem = row_difference(self.meta, slot, room)
        if problem is not None:
            return problem, 0
        return None, checked + row_size(self.meta)
