"""The parts of one leg of a request, on either side: the connector's side
of the KV digest (:mod:`transport.digest.hashing` hashes them).

A leg's parts are, in order: its head slice of every KV page it carries (KV
buffer by buffer, page by page in request order), the metadata row on the
primary leg (its fields, then its room column), then the state rows the leg
carries (component by component, tensor by tensor, the row span the leg
owes). Prefill names them in its source buffers, decode in the buffers they
were committed to; both derive the same stream on their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from buffers.kv_args import split_blocks
from transport.digest.hashing import PIECE, Part, Pending, Progress, Views
from transport.layout import share_spans

__all__ = [
    "state_parts",
    "leg_parts",
    "prefill_parts",
    "decode_parts",
    "prefill_digest",
    "decode_progress",
    "landing_note",
    "SLICES",
]

#: about this many noted writes of a leg's KV (see :func:`landing_note`)
SLICES = 8


def state_parts(
    views: Views,
    rows: Sequence[NDArray[np.int64]],
    peer_geom: Sequence[Sequence[Any]],
    share: tuple[int, int, bool] | None,
    prefill: bool,
) -> list[Part]:
    """The state rows a leg carries, on either side: ``rows`` per component,
    ``peer_geom`` the other side's :func:`~transport.layout.state_geometry`;
    ``share`` None for whole rows, else (prefill TP rank, decode TP rank, whole
    tensors too) for split state (as :func:`~transport.layout.state_writes`)."""
    out: list[Part] = []
    for c, (comp, r) in enumerate(zip(views.state, rows)):
        for i, v in enumerate(comp):
            if share is None:
                out.append((v, r, (slice(None),)))
                continue
            blocks = split_blocks(views.state_dims[c], i)
            if not blocks:
                if share[2]:  # held whole: on the primary leg
                    out.append((v, r, (slice(None),)))
                continue
            far = split_blocks(peer_geom[c][1], i)
            pre, dec = (blocks, far) if prefill else (far, blocks)
            unit = v.shape[1] // sum(blocks)
            for p_off, d_off, n in share_spans(pre, dec, share[0], share[1], unit):
                at = p_off if prefill else d_off
                out.append((v, r, (slice(at, at + n),)))
    return out


def leg_parts(
    views: Views,
    pages: NDArray[np.int64],
    heads: tuple[int, int],
    slot: int,
    rows: Sequence[NDArray[np.int64]] | None,
    state: tuple[Sequence[Sequence[Any]], tuple[int, int, bool] | None, bool],
) -> list[Part]:
    """A leg's parts on either side, in the order of the module's docstring:
    ``pages`` (this side's, after any cached prefix) and ``heads`` (first head
    here, count) of the KV, metadata row ``slot`` (-1: none), state ``rows``
    (None: none) with ``state`` = (the other side's state geometry, the split
    share or None, whether this is prefill)."""
    parts = views.kv_parts(pages, *heads) if pages.size else []
    if slot >= 0:
        parts += views.row_parts(slot)
    if rows is not None:
        parts += state_parts(views, rows, *state)
    return parts


def prefill_parts(views: Views, port: Any, req: Any, leg: Any, info: dict[str, Any]) -> list[Part]:
    """What prefill rank ``port`` sends on ``leg`` of ``req`` (see
    :mod:`transport.connector.core.prefill`): its source bytes."""
    pages = req.src[leg.skip :] if leg.sends else req.src[:0]
    slot = req.local_slot if leg.primary and req.local_slot >= 0 and leg.dst_slot >= 0 else -1
    rows = req.src_state if leg.state and leg.dst_state is not None else None
    share = (port.config.tp_rank, leg.peer % req.decode_tp, leg.primary)
    split = share if port.split_state else None
    return leg_parts(
        views, pages, (leg.src_head, leg.count), slot, rows, (info["state_geom"], split, True)
    )


def decode_parts(views: Views, port: Any, req: Any, leg: Any) -> list[Part]:
    """What decode rank ``port`` holds of ``leg`` of ``req`` once committed (see
    :mod:`transport.connector.core.decode`): the same bytes, in its own buffers."""
    pages = req.pages if leg.sends else req.pages[:0]
    slot = req.slot if leg.sends and leg.primary else -1
    rows = req.rows if leg.state else None
    group = port.group(req.dp) or {}
    ptp = int(group.get("tp_size", 1))
    split = (leg.peer % ptp, port.config.tp_rank, leg.primary) if port.split_state else None
    return leg_parts(
        views, pages, (leg.dst_head, leg.count), slot, rows, (group.get("state", []), split, False)
    )


def prefill_digest(port: Any, req: Any, leg: Any, info: dict[str, Any]) -> Pending:
    """Start hashing (:meth:`Views.start`) what prefill rank ``port`` sends on
    ``leg``: on one thread, beside the engine moving those bytes."""
    parts = prefill_parts(port.views, port, req, leg, info)
    return port.views.start(parts, at_once=1)  # type: ignore[no-any-return]


def decode_progress(port: Any, req: Any, leg: Any) -> Progress:
    """What decode rank ``port`` holds of ``leg``, hashed as its pages land
    (:class:`~transport.digest.hashing.Progress`)."""
    # (its KV parts: one per KV buffer, or per head group of one cut in groups)
    kv = port.views.kv_parts(req.pages[:0], leg.dst_head, leg.count)
    paged = len(kv) if leg.sends and req.pages.size else 0
    return Progress(port.views, decode_parts(port.views, port, req, leg), paged)


def landing_note(port: Any, req: Any, leg: Any, first: int, count: int) -> tuple[int, bytes]:
    """How many of the leg's pages ``[first, first + count)`` (its pages on
    decode, after any prefix) prefill rank ``port`` writes now, and the
    engine's completion note for that write. All of them and no note, unless
    the digest is on and the engine notes each write's landing (NIXL): then a
    slice of about 1/``SLICES`` of the leg (a piece at least), noted
    ``room:epoch:first:end``, so that decode hashes it as it lands while the
    next moves (prefill polls each slice once issued, so the engine sends
    its note before the next goes)."""
    if not (port.config.digest and port.notifies):
        return count, b""
    kv = port.kv_args
    page = max(sum(kv.kv_item_lens) * leg.count // max(kv.kv_head_num, 1), 1)
    take = min(count, max(-(-leg.dst_pages.size // SLICES), -(-PIECE // page)))
    return take, f"{req.room}:{req.epoch}:{first}:{first + take}".encode()
