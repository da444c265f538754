"""The prefill side of the connector protocol: one request, several decode ranks.

A request waits for every decode rank the topology names (its legs) to
register it (Handshaken) and to say where to write (Metadata). It then writes
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

from lifecycle.reasons import FailureReason
from transport.connector_graph import IS_TERMINAL, Phase
from transport.layout import row_writes, state_writes
from transport.legs import Leg, kv_writes, leg_of
from transport.topology import Topology, TopologyError

if TYPE_CHECKING:
    from transport.connector import Connector, _Req

__all__ = ["fail", "on_message", "steps"]

logger = logging.getLogger(__name__)


def fail(m: Connector, req: _Req, reason: FailureReason) -> None:
    """Fail here; every leg is told once no write is in flight (see :func:`steps`)."""
    if m._fire(req, "abort", reason):
        req.reason = reason


def _refuse(m: Connector, req: _Req, why: str) -> None:
    """A peer's message does not fit this rank's topology: fail the request, loudly."""
    err = TopologyError(f"room={req.room} on prefill rank {m.rank}: {why}")
    m.last_error = err
    logger.error("%s", err)
    fail(m, req, FailureReason.TRANSFER_ERROR)


def _plan(m: Connector, req: _Req, msg: dict[str, Any]) -> bool:
    """The legs of ``req`` from the first register message: every decode rank of
    the registering DP group that the topology pairs with this rank."""
    c = m.config
    if (int(msg["kv_heads"]), bool(msg["mla"])) != (m.kv_heads, c.mla):
        _refuse(
            m,
            req,
            f"decode has {msg['kv_heads']} KV heads (mla={msg['mla']}), "
            f"prefill {m.kv_heads} (mla={c.mla}); both sides must serve the same model",
        )
        return False
    topo = Topology(c.tp_size, int(msg["decode_tp"]), m.kv_heads, c.mla)
    base = int(msg["dp"]) * topo.decode_tp
    by_decode = {s.decode: s for s in topo.targets(c.tp_rank)}
    req.legs = {base + d: leg_of(base + d, by_decode.get(d)) for d in topo.peers(c.tp_rank)}
    m.expected = frozenset(req.legs)
    return True


def on_message(m: Connector, req: _Req, msg: dict[str, Any], store: Any) -> None:
    kind, peer = msg["kind"], int(msg["from"])
    if kind == "abort":  # a decode rank gave up: stop writing, say so once drained
        reason = FailureReason(int(msg.get("reason", FailureReason.ABORTED)))
        leg = req.legs.get(peer)
        if leg is None and not req.legs:  # before any register: it is told once drained
            leg = req.legs[peer] = Leg(peer, sends=False)
        if leg is not None:
            leg.asked_stop = True
        if m._fire(req, "abort", reason):
            req.reason = reason
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
        if leg is None or leg.slice != msg.get("slice"):
            _refuse(
                m,
                req,
                f"decode rank {peer} registered slice {msg.get('slice')}, expected "
                f"{None if leg is None else leg.slice}",
            )
            return
        leg.registered = True
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


def steps(m: Connector, req: _Req, store: Any) -> None:
    before = -1  # a write that landed at once lets the next step go in the same pass
    while m._phase(req) != before:
        m._reap(req, store)
        before = ph = m._phase(req)
        if ph in (Phase.Metadata, Phase.Writing) and req.num_pages >= 0:
            _issue(m, req, store)
        elif ph == Phase.RoomWritten and not req.tokens:
            for peer in req.legs:
                m._send(peer, {"kind": "done", "room": req.room}, store)
            m._fire(req, "complete")
        elif ph == Phase.Aborted and not req.tokens:
            for leg in req.legs.values():
                if leg.peer in m._peer_dead:
                    continue
                told = {"kind": "stopped"} if leg.asked_stop else {"kind": "failed"}
                m._send(leg.peer, {**told, "room": req.room, "reason": int(req.reason)}, store)
            m._fire(req, "drain")


def _issue_leg(m: Connector, req: _Req, leg: Leg, store: Any) -> bool:
    """Write what ``leg`` has not had yet; False if the request failed."""
    info = m._peer_info(leg.peer, store)
    if info is None or leg.dst_pages is None:
        return True
    src = req.src  # the scheduler may swap in a longer one meanwhile
    n = src.size
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
        if leg.primary and req.src_state is not None and leg.dst_state is not None:
            w = state_writes(m.kv_args, info["state_ptrs"], req.src_state, leg.dst_state)
            m._submit(req, info, w, b"", store)
        leg.fields_out = True
    return True


def _issue(m: Connector, req: _Req, store: Any) -> None:
    for leg in req.legs.values():
        if not leg.sends:
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
