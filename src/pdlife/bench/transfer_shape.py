"""What ``pdlife bench-transfer`` moves: the KV geometry on every rank, the byte
pattern each rank's pages hold, and the raw engine's 1:1 writes of the same
bytes.

A :class:`Shape` is the model's KV (``buffers`` buffers of ``pages`` pages,
each page ``page_tokens`` tokens x ``kv_heads`` heads of ``head_bytes``) and
the two TP sizes; every rank holds its heads of every page (see
:class:`transport.topology.Topology`), token-major or head-major
(``heads_major``), or cut in one region per head group (``head_group``). The pattern is a function of a byte's place in the model's
KV (page, token, global head, byte, buffer), so a decode rank checks every
byte it holds against the bytes the model's page holds there, whichever
prefill rank wrote them.

``raw-1:1`` moves the same bytes between the same pairs of ranks as the
head-sliced request, but laid out as if the TP sizes were equal: each pair's
share is a block of whole pages on both sides (the heads ``[h, h + c)`` of a
buffer are its ``h``-th block of ``c``-head pages), so the engine writes one
run per buffer, or one per page when decode's pages are shuffled.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray

from transport.layout import coalesce
from transport.topology import Slice, Topology

__all__ = ["Shape", "pattern", "raw_runs", "shape_of", "DTYPE_BYTES"]

#: bytes of one value of a head (bf16 / fp16)
DTYPE_BYTES = 2

Writes = tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]


@attrs.frozen
class Shape:
    pages: int  # per KV buffer, on every rank
    page_tokens: int
    kv_heads: int
    head_bytes: int
    buffers: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    heads_major: bool = False
    shuffle: bool = False
    #: heads per head-group region on every rank (KVArgs.head_group; 0: none)
    head_group: int = 0
    #: decode lands head slices in a staging region, then scatters them
    staging: bool = False

    @property
    def topology(self) -> Topology:
        return Topology(self.prefill_tp, self.decode_tp, self.kv_heads)

    def heads(self, role: str, rank: int) -> range:
        return self.topology.heads(role, rank)

    def page_bytes(self, heads: int) -> int:
        return self.page_tokens * heads * self.head_bytes

    @property
    def model_bytes(self) -> int:
        """The model's KV: every head of every page of every buffer once."""
        return self.buffers * self.pages * self.page_bytes(self.kv_heads)

    def moved_bytes(self) -> int:
        """What reaches decode: every decode rank's heads (a replicated head once per
        decode rank holding it)."""
        held = sum(len(self.heads("decode", d)) for d in range(self.decode_tp))
        return self.buffers * self.pages * self.page_bytes(held)

    def held_bytes(self) -> int:
        """Every rank's KV, both sides (decode twice: its pages and their check
        pattern; staged, a staging region per metadata slot besides: three)."""
        pre = sum(len(self.heads("prefill", p)) for p in range(self.prefill_tp))
        dec = sum(len(self.heads("decode", d)) for d in range(self.decode_tp))
        return self.buffers * self.pages * self.page_bytes(pre + (5 if self.staging else 2) * dec)

    @property
    def layout(self) -> str:
        """The ``--layout`` this shape was built from."""
        return "group" if self.head_group else "head" if self.heads_major else "token"

    def tensor_shape(self, heads: int) -> tuple[int, ...]:
        if self.head_group:
            k = self.head_group
            return (heads // k, self.pages, self.page_tokens, k, self.head_bytes)
        if self.heads_major:
            return (self.pages, heads, self.page_tokens, self.head_bytes)
        return (self.pages, self.page_tokens, heads, self.head_bytes)

    def held(self, t: Any, pages: Any) -> Any:
        """Pages ``pages`` of a rank's KV tensor ``t`` (of every head-group region)."""
        return t[:, pages] if self.head_group else t[pages]

    def dst_pages(self) -> NDArray[np.int64]:
        """Decode's page for each of prefill's: the same, or a fixed permutation."""
        if self.shuffle:
            return np.random.default_rng(0).permutation(self.pages).astype(np.int64)
        return np.arange(self.pages, dtype=np.int64)


def shape_of(
    total_mib: int,
    page_kib: int | None,
    buffers: int = 1,
    shuffle: bool = False,
    *,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    page_tokens: int | None = None,
    head_dim: int | None = None,
    kv_heads: int | None = None,
    layout: str = "token",
    staging: bool = False,
) -> Shape:
    """The bench's KV geometry: whole pages of ``page_kib`` (one token of one head,
    today's 1:1 case), or, once the TP sizes differ or any of the head flags is
    given, pages of ``page_tokens`` tokens x ``kv_heads`` heads of ``head_dim``
    2-byte values (16 x 8 x 128 unless given)."""
    heads_mode = (prefill_tp, decode_tp) != (1, 1) or any(
        x is not None for x in (page_tokens, head_dim, kv_heads)
    )
    if heads_mode:
        t, h, hb = page_tokens or 16, kv_heads or 8, (head_dim or 128) * DTYPE_BYTES
    else:
        t, h, hb = 1, 1, (page_kib or 256) * 1024
    per_buffer = total_mib * 1024 * 1024 // buffers
    group = 0
    if layout == "group":  # the largest group every rank of both sides holds whole
        group = math.gcd(*(max(1, h // tp) for tp in (prefill_tp, decode_tp)))
    return Shape(
        head_group=group,
        pages=per_buffer // (t * h * hb),
        page_tokens=t,
        kv_heads=h,
        head_bytes=hb,
        buffers=buffers,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        heads_major=layout == "head",
        shuffle=shuffle,
        staging=staging,
    )


def pattern(shape: Shape, heads: range, buf: int, chunk: int = 256) -> NDArray[np.uint8]:
    """The model's bytes of heads ``heads`` of every page of buffer ``buf``, in the
    rank's layout: ``(page * 37 + token * 11 + head * 5 + byte * 3 + buf * 7 + 1)
    mod 251``, built a chunk of pages at a time (the terms reduced first, in int16)."""
    s = shape
    out = np.empty(s.tensor_shape(len(heads)), dtype=np.uint8)
    t = (np.arange(s.page_tokens, dtype=np.int16) * 11 % 251)[None, :, None, None]
    h = (np.arange(heads.start, heads.stop, dtype=np.int16) * 5 % 251)[None, None, :, None]
    b = (np.arange(s.head_bytes, dtype=np.int64) * 3 % 251).astype(np.int16)[None, None, None, :]
    inner = t + h + b + (buf * 7 + 1) % 251  # < 4 * 251
    for p0 in range(0, s.pages, chunk):
        pg = np.arange(p0, min(p0 + chunk, s.pages), dtype=np.int64) * 37 % 251
        v = ((pg.astype(np.int16)[:, None, None, None] + inner) % 251).astype(np.uint8)
        if s.head_group:  # (regions, pages, tokens, heads of the region, bytes)
            k = s.head_group
            grouped = v.reshape(*v.shape[:2], -1, k, s.head_bytes).transpose(2, 0, 1, 3, 4)
            out[:, p0 : p0 + pg.size] = grouped
        else:
            out[p0 : p0 + pg.size] = v.transpose(0, 2, 1, 3) if s.heads_major else v
    return out


def _pair_runs(
    shape: Shape, s: Slice, src_base: int, dst_base: int, dst: NDArray[np.int64]
) -> Writes:
    block = shape.page_bytes(s.count)  # one pair's share of a page
    src = src_base + s.src_head * shape.pages * shape.page_bytes(1)
    to = dst_base + s.dst_head * shape.pages * shape.page_bytes(1)
    idx = np.arange(shape.pages, dtype=np.int64)
    w = (src + idx * block, to + dst * block, np.full(idx.size, block, dtype=np.int64))
    return w if shape.shuffle else coalesce(*w)


def raw_runs(
    shape: Shape, rank: int, kv: list[Any], peers: dict[int, dict[str, Any]]
) -> dict[int, Writes]:
    """Prefill rank ``rank``'s raw 1:1 writes, by decode rank (``peers``: their
    endpoint records): the bytes its head slices carry, as whole pages (see the
    module)."""
    dst = shape.dst_pages()
    out: dict[int, Writes] = {}
    for s in shape.topology.targets(rank):
        parts = [
            _pair_runs(shape, s, t.data_ptr(), far, dst)
            for t, far in zip(kv, peers[s.decode]["kv_ptrs"])
        ]
        out[s.decode] = tuple(np.concatenate(c) for c in zip(*parts))  # type: ignore[assignment]
    return out
