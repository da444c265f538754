"""The prefill side of the connector protocol: one request, several decode ranks.

A request waits for every decode rank the topology names (its legs) to
register it (Handshaken) and to say where to write (Metadata). It reports
Bootstrapping until every leg's page list is in, and WaitingForInput from
then on: only then may the scheduler take a metadata row for it (taken at
the handshake, the two sides' rows can each go to requests the other holds
none for, and both wait for ever; see :mod:`transport.connector_graph`).
The bootstrap timeout covers the whole wait. It then writes
each leg's slice of every page handed to ``send()`` (pages of a cached prefix
skipped), the metadata row's fields and the state rows on each primary leg;
once all of that landed, each primary leg's room column (RoomWritten); once
that landed too, every leg is told "done" (Done). A failed request tells every
leg why, once none of its writes is in flight (a leg that aborted it is told
"stopped").
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from lifecycle.reasons import FailureReason
from transport.connector_graph import IS_TERMINAL, Phase
from transport.layout import StateShare, row_writes, state_misfit, state_writes
from transport.legs import Leg, Request, kv_writes, leg_of
from transport.topology import Topology, TopologyError

if TYPE_CHECKING:
    from transport.connector import Connector

__all__ = ["fail", "gave_up", "on_message", "steps", "tell_legs"]

logger = logging.getLogger(__name__)


def fail(m: Connector, req: Request, reason: FailureReason) -> None:
    """Fail here; every leg is told once no write is in flight (see :func:`steps`)."""
    if m._fire(req, "abort", reason):
        req.reason = reason


def _refuse(m: Connector, req: Request, why: str) -> None:
    """A peer's message does not fit this rank's topology: fail the request, loudly."""
    err = TopologyError(f"room={req.room} on prefill rank {m.rank}: {why}")
    m.last_error = err
    logger.error("%s", err)
    fail(m, req, FailureReason.TRANSFER_ERROR)


def _plan(m: Connector, req: Request, msg: dict[str, Any]) -> bool:
    """The legs of ``req`` from the first register message: every decode rank of
    the registering DP group that the topology pairs with this rank."""
    c = m.config
    dtp = int(msg["decode_tp"])
    if (int(msg["kv_heads"]), bool(msg["mla"])) != (m.kv_heads, c.mla):
        why: str | None = (
            f"decode has {msg['kv_heads']} KV heads (mla={msg['mla']}), "
            f"prefill {m.kv_heads} (mla={c.mla})"
        )
    else:
        why = state_misfit(m.state_geom, c.tp_size, msg.get("state", []), dtp)
    if why is not None:
        _refuse(m, req, f"{why}; both sides must serve the same model")
        return False
    topo = Topology(c.tp_size, dtp, m.kv_heads, c.mla, m.split_state)
    base = int(msg["dp"]) * topo.decode_tp
    by_decode = {s.decode: s for s in topo.targets(c.tp_rank)}
    req.legs = {
        base + d: leg_of(
            base + d,
            by_decode.get(d),
            c.tp_rank in topo.state_sources(d),  # the primary alone unless state is split
        )
        for d in topo.peers(c.tp_rank)
    }
    req.decode_tp = dtp
    m.expected = frozenset(req.legs)
    return True


def on_message(m: Connector, req: Request, msg: dict[str, Any], store: Any) -> None:
    kind, peer = msg["kind"], int(msg["from"])
    if kind == "abort":  # a decode rank gave up: stop writing, say so once drained
        reason = FailureReason(int(msg.get("reason", FailureReason.ABORTED)))
        if msg.get("why") and m._phase(req) < Phase.Done:  # a live request: this is why
            m.last_error = TopologyError(f"room={req.room} on prefill rank {m.rank}: {msg['why']}")
            logger.error("%s", m.last_error)
        leg = req.legs.get(peer)
        if leg is None and not req.legs:  # before any register: it is told once drained
            leg = req.legs[peer] = Leg(peer, sends=False)
        if leg is not None:
            leg.asked_stop = True
        if m._fire(req, "abort", reason):
            req.reason = reason
        elif req.abandoned:  # released with writes the engine never finished
            m._send(peer, gave_up(req.room, req.reason), store)
        elif IS_TERMINAL[m._phase(req)] or leg is None:
            m._send(peer, {"kind": "stopped", "room": req.room}, store)
        return
    if m._phase(req) >= Phase.Aborted:  # failed here already: the leg hears why
        if kind == "register":
            m._send(peer, {"kind": "failed", "room": req.room, "reason": int(req.reason)}, store)
        return
    if kind == "register":
        if not req.legs and not _plan(m, req, msg):
            return
        leg = req.legs.get(peer)
        if leg is None or (leg.slice, leg.state) != (msg.get("slice"), msg.get("state_leg")):
            _refuse(
                m,
                req,
                f"decode rank {peer} registered slice {msg.get('slice')} (state "
                f"{msg.get('state_leg')}), expected "
                f"{None if leg is None else (leg.slice, leg.state)}",
            )
            return
        leg.registered, leg.inc = True, msg.get("inc")
        if all(x.registered for x in req.legs.values()):
            m._fire(req, "handshake")
        for held in [h for h in req.held if int(h["from"]) == peer]:
            req.held.remove(held)
            on_message(m, req, held, store)
    elif kind == "pages":
        leg = req.legs.get(peer)
        if leg is None or not leg.registered:
            # decode's scheduler sends this on another connection than its loop's
            # register, so it may overtake it: held until that register is in
            req.held.append(msg)
            return
        leg.dst_pages = np.asarray(msg["pages"], dtype=np.int64)
        leg.dst_slot, leg.skip = int(msg["slot"]), int(msg["skip"])
        leg.dst_ptrs, leg.dst_heads = msg.get("dst_ptrs"), int(msg["dst_heads"])
        st = msg.get("state")
        leg.dst_state = None if st is None else [np.asarray(r, dtype=np.int64) for r in st]
        leg.told = True
        if all(x.told for x in req.legs.values()):
            m._fire(req, "metadata")


def steps(m: Connector, req: Request, store: Any) -> None:
    before = -1  # a write that landed at once lets the next step go in the same pass
    while m._phase(req) != before:
        m._reap(req, store)
        before = ph = m._phase(req)
        if ph in (Phase.Metadata, Phase.Writing) and req.num_pages >= 0:
            _issue(m, req, store)
        elif ph == Phase.RoomWritten and not req.tokens:
            if m._fire(req, "complete"):  # (close() may have failed it meanwhile)
                for peer in req.legs:
                    m._send(peer, {"kind": "done", "room": req.room}, store)
        elif ph == Phase.Aborted and not req.tokens:
            tell_legs(m, req, store)
            m._fire(req, "drain")


def gave_up(room: int, reason: int) -> dict[str, Any]:
    """The word for a leg when this rank released a request whose writes the
    engine never finished: it failed, yet a write of it may still land."""
    return {"kind": "gave_up", "room": room, "reason": int(reason)}


def tell_legs(m: Connector, req: Request, store: Any) -> None:
    """Tell every leg why the request failed ("stopped" to one that asked), a
    silent one too: it may only be paused."""
    for leg in req.legs.values():
        told = {"kind": "stopped"} if leg.asked_stop else {"kind": "failed"}
        m._send(leg.peer, {**told, "room": req.room, "reason": int(req.reason)}, store)


def _issue_leg(m: Connector, req: Request, leg: Leg, store: Any) -> bool:
    """Write what ``leg`` has not had yet; False if the request failed."""
    info = m._peer_info(leg.peer, store)
    if info is None or leg.dst_pages is None:
        return True
    why = _rows_misfit(req, leg)
    if why is not None:
        _refuse(m, req, why)
        return False
    if leg.skip < req.first_page:
        _refuse(
            m,
            req,
            f"decode rank {leg.peer} holds a prefix of {leg.skip} pages, but send() is "
            f"handed the request's pages from page {req.first_page} on",
        )
        return False
    if req.num_pages == req.first_page and not req.sent and leg.state and leg.dst_state is not None:
        # no page to wait for, yet the state rows come with the send() after init(0):
        # the loop may run between the two calls
        return True
    src = req.src  # the scheduler may swap in a longer one meanwhile
    n = src.size
    why = _refs_misfit(m, req, leg, info, src[max(leg.issued, req.first_page) : n])
    if why is not None:
        _refuse(m, req, why)
        return False
    if not leg.sends:  # no KV: a share of split state only, once the pages are all in
        if n >= req.num_pages and not leg.fields_out:
            if not _state_out(m, req, leg, info, store):
                return False
            leg.fields_out = True
        return True
    if leg.issued < n:
        at = np.arange(leg.issued, n)
        keep = at >= leg.skip
        dst_at = at[keep] - leg.skip
        if dst_at.size and dst_at[-1] >= leg.dst_pages.size:
            _refuse(
                m,
                req,
                f"page {int(dst_at[-1])} has no page on decode rank {leg.peer} "
                f"(it gave {leg.dst_pages.size} after a prefix of {leg.skip})",
            )
            return False
        if keep.any():
            w = kv_writes(m.kv_args, info, leg, src[leg.issued : n][keep], leg.dst_pages[dst_at])
            m._submit(req, info, w, b"", store)
        leg.issued = n
    if n >= req.num_pages and not leg.fields_out:
        if max(req.num_pages - leg.skip, 0) != leg.dst_pages.size:
            _refuse(
                m,
                req,
                f"{req.num_pages} pages after a prefix of {leg.skip} do not fit "
                f"the {leg.dst_pages.size} pages decode rank {leg.peer} gave",
            )
            return False
        if leg.primary and req.local_slot >= 0 and leg.dst_slot >= 0:
            # the row's fields travel with the last pages; only the room waits for all
            m._submit(
                req,
                info,
                row_writes(m.kv_args, info, req.local_slot, leg.dst_slot, False),
                b"",
                store,
            )
        if not _state_out(m, req, leg, info, store):
            return False
        leg.fields_out = True
    return True


def _count(lens: Any, items: Any) -> int | None:
    """How many pages (or rows) every buffer holds; None if not known (an older peer)."""
    if not lens or not items:
        return None
    return min(int(b) // int(i) for b, i in zip(lens, items))


def _refs_misfit(
    m: Connector, req: Request, leg: Leg, info: dict[str, Any], new: NDArray[np.int64]
) -> str | None:
    """Why a page or metadata row named for ``leg`` lies outside the buffers it
    indexes (a stale, consumed or unknown reference), or None: never written."""
    a = m.kv_args
    here = [
        ("page", new, _count(a.kv_data_lens, a.kv_item_lens), f"prefill rank {m.rank}"),
        (
            "metadata slot",
            np.array([req.local_slot]),
            _count(a.aux_data_lens, a.aux_item_lens),
            f"prefill rank {m.rank}",
        ),
    ]
    there = f"decode rank {leg.peer}"
    if leg.issued == 0 and leg.dst_pages is not None and leg.dst_ptrs is None and leg.sends:
        here.append(
            ("page", leg.dst_pages, _count(info.get("kv_lens"), info["kv_item_lens"]), there)
        )
    if leg.primary:
        rows = _count(info.get("aux_lens"), info["aux_item_lens"])
        here.append(("metadata slot", np.array([leg.dst_slot]), rows, there))
    for what, refs, count, who in here:
        bad = refs[(refs < -1) | (refs >= (count if count is not None else np.iinfo(np.int64).max))]
        if what == "page":
            bad = np.concatenate((bad, refs[refs == -1]))
        if bad.size:
            return (
                f"{what} {int(bad[0])} is outside the {count} that {who} holds "
                "(a stale or unknown reference); nothing of the request is written"
            )
    return None


def _rows_misfit(req: Request, leg: Leg) -> str | None:
    """Why the state rows handed to send() do not pair one to one with those the
    leg's decode rank gave, or None (more rows would run past decode's own)."""
    if not leg.state or req.src_state is None or leg.dst_state is None:
        return None
    for c, (src, dst) in enumerate(zip(req.src_state, leg.dst_state)):
        if src.size != dst.size:
            return (
                f"{src.size} state rows of component {c} were handed to send(), but decode "
                f"rank {leg.peer} gave {dst.size}; give both sides one row per state row"
            )
    return None


def _state_out(m: Connector, req: Request, leg: Leg, info: dict[str, Any], store: Any) -> bool:
    """The state rows this leg owes, once every page is handed over: whole rows
    on the primary leg, and with split state this rank's share of the decode
    rank's. False if only one side named rows (the request is refused: decode
    would commit it holding another request's state)."""
    if not leg.state or (req.src_state is None and leg.dst_state is None):
        return True
    if req.src_state is None or leg.dst_state is None:
        _refuse(
            m,
            req,
            f"decode rank {leg.peer} gave state rows but send() was handed none with the "
            "request's pages; pass state_indices to send() (with the last pages at the latest)"
            if req.src_state is None
            else f"send() was handed state rows but decode rank {leg.peer} gave none; "
            "pass state_indices to send_metadata()",
        )
        return False
    share = None
    if m.split_state:
        c, dtp = m.config, req.decode_tp
        d = leg.peer % dtp
        share = StateShare(c.tp_rank, c.tp_size, d, dtp, leg.primary, info["state_geom"])
    w = state_writes(m.kv_args, info["state_ptrs"], req.src_state, leg.dst_state, share)
    if w[0].size:
        m._submit(req, info, w, b"", store)
    return True


def _issue(m: Connector, req: Request, store: Any) -> None:
    for leg in req.legs.values():
        if not leg.sends and not leg.state:
            leg.fields_out = True
        elif not _issue_leg(m, req, leg, store):
            return
    out = all(leg.fields_out for leg in req.legs.values())
    if m._phase(req) == Phase.Metadata and (req.tokens or out):
        m._fire(req, "write")
    if m._phase(req) == Phase.Writing and out and not req.tokens:
        for leg in req.legs.values():
            info = m._peer_info(leg.peer, store)
            if leg.primary and info is not None and req.local_slot >= 0 and leg.dst_slot >= 0:
                w = row_writes(m.kv_args, info, req.local_slot, leg.dst_slot, True)
                m._submit(req, info, w, str(req.room).encode(), store)
        m._fire(req, "write_room")
