"""Where each write of a request goes, as arrays of (source address,
destination address, length): KV pages coalesced into runs contiguous on both
sides, head slices of pages when the two sides' TP sizes differ (a run per
token of a token-major page, one per head-major page, one per head group of
consecutive pages when the buffers are cut in head groups), state rows,
and a metadata row split into its fields and its room column, which is
written alone and last so that a row whose room matches is complete."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray

from buffers.kv_args import KVArgs, StateComponent, split_blocks

__all__ = [
    "runs",
    "coalesce",
    "page_writes",
    "sliced_page_writes",
    "layout_misfit",
    "page_layout",
    "state_writes",
    "state_geometry",
    "splits_state",
    "state_misfit",
    "StateShare",
    "share_spans",
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


def _in_page(ps: int, hb: int, heads: int, head: int, count: int) -> Any:
    """Where heads ``[head, head + count)`` lie in a head-major page of ``heads``
    heads: the offset of the slice's one run in the page, and its length."""
    return np.array([head * ps * hb], dtype=np.int64), count * ps * hb


def _layout_name(layout: tuple[bool, int]) -> str:
    heads_major, group = layout
    if group:
        return f"cut in head groups of {group}"
    return "head-major" if heads_major else "token-major"


def page_layout(of: KVArgs | dict[str, Any] | bool) -> tuple[bool, int]:
    """How a side lays out a page's heads, (``heads_major``, ``head_group``): from
    its KVArgs, or from the record or message it published them in (a peer that
    names neither is token-major without head groups), or ``heads_major`` alone."""
    if isinstance(of, KVArgs):
        return of.heads_major, of.head_group
    if isinstance(of, bool):
        return of, 0
    return bool(of.get("heads_major", False)), int(of.get("head_group", 0) or 0)


def layout_misfit(
    prefill: KVArgs | dict[str, Any] | bool, decode: KVArgs | dict[str, Any] | bool
) -> str | None:
    """Why the two sides' pages cannot be cut into each other's head slices, or
    None: each side's :func:`page_layout` (from its KVArgs, or from what it
    published) must be the same."""
    mine, theirs = page_layout(prefill), page_layout(decode)
    if mine == theirs:
        return None
    return (
        f"prefill's KV pages are {_layout_name(mine)}, decode's "
        f"{_layout_name(theirs)}; both sides must lay out a page's heads alike "
        "(KVArgs.heads_major) and cut them in the same head groups (KVArgs.head_group)"
    )


def _chunks(head: int, group: int, far_head: int, far_group: int, count: int) -> list[int]:
    """Where a slice of ``count`` heads breaks at either side's head groups
    (``head``/``far_head``: its first head on each side): the slice-relative
    cuts, 0 and ``count`` included."""
    cuts = {0, count}
    for h0, k in ((head, group), (far_head, far_group)):
        cuts.update(range((h0 // k + 1) * k - h0, count, k))
    return sorted(cuts)


def _group_at(
    pages: NDArray[np.int64], geom: tuple[int, int, int, int], head: int, count: int, whole: bool
) -> Any:
    """Where heads ``[head, head + count)`` (inside one head group) of ``pages`` lie
    in a buffer cut in head groups (``geom``: page_size, head bytes, heads per
    group, bytes per region): their offsets in the buffer, one per page
    (``whole``: the piece is a whole group on both sides) or one per token."""
    ps, hb, k, region = geom
    g, o = divmod(head, k)
    start = pages[:, None] * (ps * k * hb) + g * region + o * hb
    return start if whole else start + np.arange(ps, dtype=np.int64) * (k * hb)


def _grouped_writes(
    local: KVArgs,
    far: tuple[Sequence[int], int, Sequence[int] | None],
    src: NDArray[np.int64],
    dst: NDArray[np.int64],
    heads: tuple[int, int, int],
) -> Writes:
    """:func:`sliced_page_writes` for token-major pages, cut in head groups or
    not (a page without groups is one group of all its heads): a run per token
    of each piece of the slice that lies inside one group on both sides, or a
    run per page where the piece is a whole group on both; coalesced per
    buffer, so a whole group of consecutive pages is one run."""
    dst_ptrs, dst_heads, dst_lens = far
    src_head, dst_head, count = heads
    ps, n = local.page_size, local.kv_head_num
    k, far_k = local.head_group or n, local.head_group or dst_heads
    if far_k < dst_heads and dst_lens is None:
        raise ValueError("head-group writes need the peer's KV buffer sizes (kv_lens)")
    cuts = _chunks(src_head, k, dst_head, far_k, count)
    parts = []
    for b, (base, to, hb) in enumerate(zip(local.kv_data_ptrs, dst_ptrs, local.head_bytes)):
        mine = (ps, hb, k, local.kv_data_lens[b] // local.head_groups)
        theirs = (ps, hb, far_k, int(dst_lens[b]) // (dst_heads // far_k) if dst_lens else 0)
        s_, d_, n_ = [], [], []
        for lo, hi in itertools.pairwise(cuts):
            whole = hi - lo == k == far_k
            s = base + _group_at(src, mine, src_head + lo, hi - lo, whole)
            d = int(to) + _group_at(dst, theirs, dst_head + lo, hi - lo, whole)
            s_.append(s.reshape(-1))
            d_.append(d.reshape(-1))
            n_.append(np.full(s.size, (ps if whole else 1) * (hi - lo) * hb, np.int64))
        # coalesced per buffer: a run must stay inside one registered region, even
        # where two buffers happen to lie back to back in memory on both sides
        parts.append(coalesce(*(np.concatenate(x).astype(np.int64) for x in (s_, d_, n_))))
    if not parts:
        return runs(src[:0], dst[:0])
    s, d, ln = (np.concatenate(c).astype(np.int64) for c in zip(*parts))
    return s, d, ln


def sliced_page_writes(
    local: KVArgs,
    dst_ptrs: Sequence[int],
    dst_heads: int,
    src: NDArray[np.int64],
    dst: NDArray[np.int64],
    src_head: int,
    dst_head: int,
    count: int,
    dst_lens: Sequence[int] | None = None,
) -> Writes:
    """Heads ``[src_head, src_head + count)`` of local pages ``src`` to heads
    ``[dst_head, dst_head + count)`` of the peer's pages ``dst``, whose pages hold
    ``dst_heads`` heads of the same size, laid out as the local ones (token-major:
    one run per token; head-major, ``local.heads_major``: one run per page; cut
    in head groups, ``local.head_group``: one run per whole group of consecutive
    pages, ``dst_lens`` the peer's KV buffer sizes), coalesced where both sides
    are contiguous (whole pages when both hold exactly the slice)."""
    if not local.heads_major:
        far = (dst_ptrs, dst_heads, dst_lens)
        return _grouped_writes(local, far, src, dst, (src_head, dst_head, count))
    ps, heads = local.page_size, local.kv_head_num
    parts = []
    for base, far_base, hb in zip(local.kv_data_ptrs, dst_ptrs, local.head_bytes):
        at, run = _in_page(ps, hb, heads, src_head, count)
        to, _ = _in_page(ps, hb, dst_heads, dst_head, count)
        s = base + src[:, None] * (ps * heads * hb) + at
        d = far_base + dst[:, None] * (ps * dst_heads * hb) + to
        parts.append(coalesce(s.reshape(-1), d.reshape(-1), np.full(s.size, run, np.int64)))
    if not parts:
        return runs(src[:0], dst[:0])
    s, d, n = (np.concatenate(c).astype(np.int64) for c in zip(*parts))
    return s, d, n


def state_geometry(state: Sequence[StateComponent]) -> list[list[Any]]:
    """What a peer needs to know of this rank's state rows to write into them:
    per component, its row bytes and split dims (JSON-friendly)."""
    return [
        [list(c.item_lens), None if c.split_dims is None else [_json(d) for d in c.split_dims]]
        for c in state
    ]


def _json(d: int | tuple[int, ...]) -> Any:
    return list(d) if isinstance(d, tuple) else d


def splits_state(state: Sequence[StateComponent]) -> bool:
    """Some tensor of the state is split by TP (a non-zero split dim)."""
    return any(split_blocks(c.split_dims, i) for c in state for i in range(len(c.split_dims or ())))


def state_misfit(
    prefill: Sequence[Sequence[Any]],
    prefill_tp: int,
    decode: Sequence[Sequence[Any]],
    decode_tp: int,
) -> str | None:
    """Why the two sides' state rows cannot be moved into each other, or None.

    A tensor held whole must have rows of the same bytes on both sides. A split
    tensor must cut the same global rows into units of the same bytes: the
    same blocks, ``units * tp`` equal per block and ``row bytes / units`` equal
    on both sides."""
    if len(prefill) != len(decode):
        return f"prefill has {len(prefill)} state components, decode {len(decode)}"
    for c, ((pi, pd), (di, dd)) in enumerate(zip(prefill, decode)):
        if len(pi) != len(di):
            return f"state component {c}: prefill has {len(pi)} tensors, decode {len(di)}"
        for i, (p_item, d_item) in enumerate(zip(pi, di)):
            where, pb, db = (
                f"state component {c} tensor {i}",
                split_blocks(pd, i),
                split_blocks(dd, i),
            )
            if bool(pb) != bool(db):
                return f"{where}: split on one side only (prefill split dims {pd}, decode {dd})"
            why = _tensor_misfit(where, (p_item, pb, prefill_tp), (d_item, db, decode_tp))
            if why is not None:
                return why
    return None


def _tensor_misfit(
    where: str, prefill: tuple[int, tuple[int, ...], int], decode: tuple[int, tuple[int, ...], int]
) -> str | None:
    (p_item, pb, ptp), (d_item, db, dtp) = prefill, decode
    if not pb:  # held whole on both sides
        if p_item != d_item:
            return f"{where}: rows of {p_item} bytes on prefill, {d_item} on decode"
        return None
    if len(pb) != len(db):
        return f"{where}: prefill splits its rows in {len(pb)} block(s), decode in {len(db)}"
    pu, du = sum(pb), sum(db)
    if p_item % pu or d_item % du or p_item // pu != d_item // du:
        return (
            f"{where}: prefill cuts {p_item}-byte rows into {pu} units, decode "
            f"{d_item}-byte rows into {du}; a unit must have the same bytes on both"
        )
    for b, (p, d) in enumerate(zip(pb, db)):
        if p * ptp != d * dtp:
            block = f" block {b}" if len(pb) > 1 else ""
            return (
                f"{where}{block}: prefill TP {ptp} x {p} units is not decode TP "
                f"{dtp} x {d}: the two sides split different rows"
            )
    return None


@attrs.frozen
class StateShare:
    """What of each state row prefill TP rank ``prefill`` writes to decode TP rank
    ``decode``: the overlap of their shares of every split tensor, and, if
    ``whole`` (the primary leg), the tensors every rank holds whole."""

    prefill: int
    prefill_tp: int
    decode: int
    decode_tp: int
    whole: bool
    peer: Sequence[Sequence[Any]]  # the decode rank's state_geometry


def share_spans(
    blocks: Sequence[int], far_blocks: Sequence[int], prefill: int, decode: int, unit: int
) -> list[tuple[int, int, int]]:
    """What of a split row prefill TP rank ``prefill`` (``blocks``: its units per
    block) owes decode TP rank ``decode`` (``far_blocks``): (byte offset in the
    prefill row, byte offset in the decode row, bytes) per overlapping span."""
    out = []
    at = far_at = 0  # where the block starts in the prefill row and in the decode row
    for units, far_units in zip(blocks, far_blocks):
        mine, theirs = prefill * units, decode * far_units
        lo, hi = max(mine, theirs), min(mine + units, theirs + far_units)
        if hi > lo:
            out.append(((at + lo - mine) * unit, (far_at + lo - theirs) * unit, (hi - lo) * unit))
        at, far_at = at + units, far_at + far_units
    return out


def state_writes(
    local: KVArgs,
    peer_state: Sequence[Sequence[int]],
    src_rows: Sequence[NDArray[np.int64]],
    dst_rows: Sequence[NDArray[np.int64]],
    share: StateShare | None = None,
) -> Writes:
    """Rows ``src_rows[c]`` of every tensor of state component ``c`` to the peer's
    rows ``dst_rows[c]`` (``peer_state[c]``: the peer's pointers of component c):
    whole rows, or with ``share`` what of each row this rank owes that peer
    (the sides' fit is checked by :func:`state_misfit` first)."""
    parts = []
    for c, (comp, far_ptrs, sr, dr) in enumerate(zip(local.state, peer_state, src_rows, dst_rows)):
        for i, (base, far, item) in enumerate(zip(comp.ptrs, far_ptrs, comp.item_lens)):
            blocks = () if share is None else split_blocks(comp.split_dims, i)
            if not blocks:
                if share is None or share.whole:
                    parts.append(
                        coalesce(
                            base + sr * item, far + dr * item, np.full(sr.size, item, np.int64)
                        )
                    )
                continue
            assert share is not None
            far_item, far_blocks = int(share.peer[c][0][i]), split_blocks(share.peer[c][1], i)
            unit = item // sum(blocks)
            for off, far_off, nb in share_spans(
                blocks, far_blocks, share.prefill, share.decode, unit
            ):
                s = base + sr * item + off
                d = far + dr * far_item + far_off
                parts.append((s, d, np.full(sr.size, nb, np.int64)))
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
    heads_major: bool = False,
    head_group: int = 0,
) -> KVArgs:
    """KVArgs from a list of KV tensors shaped (num_pages, ...) and metadata
    ``buf_infos()``; a tensor shaped (num_pages, page_size, kv_head_num, head
    bytes) is what head slicing expects, or (num_pages, kv_head_num, page_size,
    head bytes) with ``heads_major``, or, cut in head groups of ``head_group``
    heads, (kv_head_num / head_group, num_pages, page_size, head_group, head
    bytes)."""
    return KVArgs(
        head_group=head_group,
        page_size=page_size,
        kv_head_num=kv_head_num,
        heads_major=heads_major,
        state=tuple(state),
        engine_rank=engine_rank,
        kv_data_ptrs=[t.data_ptr() for t in tensors],
        kv_data_lens=[t.nbytes for t in tensors],
        kv_item_lens=[t.nbytes // t.shape[1 if head_group else 0] for t in tensors],
        aux_data_ptrs=aux[0],
        aux_data_lens=aux[1],
        aux_item_lens=aux[2],
    )
