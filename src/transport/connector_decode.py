"""The decode side of the connector protocol: one request, several prefill ranks.

Once ``init()`` named the prefill DP group, the request waits for that group's
record (its TP size), plans its legs from the topology (its senders, and the
idle prefill ranks it informs), registers with every one of them
(Handshaken: it reports WaitingForInput, and the scheduler may give it pages
and a metadata row), and on ``send_metadata`` tells each where to write
(Metadata): its own KV pages, or a block of the staging region when head
slices are staged. A prefill rank reports WaitingForInput only once every
decode rank's page list for the request is in. It is Done when every sender said "done"; a staged request is then
scattered a bounded amount per scheduler step (the staging gate holds its
Success meanwhile). A failed request tells every leg to stop and stays
Aborted until every sender stopped (Drained), or the drain timeout passed
(Drained; Fenced while the writer it failed for stopped beating, see
:mod:`transport.liveness`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from lifecycle.reasons import FailureReason
from transport.connector_graph import Phase
from transport.layout import state_misfit
from transport.legs import Leg, Request, leg_of
from transport.staging import Scatter
from transport.topology import Topology, TopologyError

if TYPE_CHECKING:
    from transport.connector import Connector

__all__ = ["fail", "stop_all", "on_message", "steps", "tell_owed", "tell_pages", "advance"]

logger = logging.getLogger(__name__)


def stop_all(m: Connector, req: Request, reason: FailureReason, store: Any) -> None:
    """Ask every leg that has not stopped yet to stop writing ``req``."""
    msg: dict[str, Any] = {"kind": "abort", "room": req.room, "reason": int(reason)}
    if req.why is not None:
        msg["why"] = req.why
    for leg in req.legs.values():
        if not leg.stopped:
            m._send(leg.peer, msg, store)


def _drain_if_stopped(m: Connector, req: Request) -> None:
    if m._phase(req) in (Phase.Aborted, Phase.Fenced) and all(leg.stopped for leg in req.senders()):
        m._fire(req, "drain")


def fail(m: Connector, req: Request, reason: FailureReason, store: Any) -> None:
    """Fail here and make every leg stop writing; Drained once every sender stopped."""
    with m._lock:  # the phase it leaves, read with the move (tell_pages races it)
        before = m._phase(req)
        if not m._fire(req, "abort", reason):
            return
        req.reason = reason
    # not registered yet: plan the legs anyway, so that prefill hears of it
    # instead of waiting for a register that never comes; if the group's record
    # is not up yet (its ranks still starting), the loop tells them once it is
    if req.want_register and not _plan(m, req, store, failing=True):
        with m._lock:
            m.owed.append(req)
    stop_all(m, req, reason, store)
    if before < Phase.Metadata:  # no page list was sent: nothing can land
        for leg in req.legs.values():
            leg.stopped = True
    _drain_if_stopped(m, req)


def tell_owed(m: Connector, store: Any) -> None:
    """Tell the prefill ranks of every request failed before its group's record
    was up, once it is (the request itself is long released: nothing of it
    could land, as no page list was sent)."""
    with m._lock:
        owed, m.owed = m.owed, []
    later = []
    for req in owed:
        if _plan(m, req, store, failing=True):
            stop_all(m, req, req.reason, store)
        else:
            later.append(req)
    if later:
        with m._lock:
            m.owed = later + m.owed


def on_message(m: Connector, req: Request, msg: dict[str, Any], store: Any) -> None:
    kind, leg = msg["kind"], req.legs.get(int(msg.get("from", -1)))
    if leg is None:
        return  # not a rank this request is paired with (or not planned yet)
    if kind == "done":  # every write of this sender landed
        leg.done = leg.stopped = True
        if all(x.done for x in req.senders()):
            m._fire(req, "complete")
        _drain_if_stopped(m, req)
    elif kind in ("failed", "gave_up"):
        # the sender failed it: "failed" once its writes drained; "gave_up" when a
        # write of it may still land (the pages wait for this rank's drain timeout)
        leg.stopped = leg.stopped or kind == "failed"
        reason = FailureReason(int(msg.get("reason", FailureReason.UNKNOWN)))
        if leg.stopped and all(x.stopped for x in req.senders()):
            _ = m._fire(req, "peer_failed", reason) or m._fire(req, "drain")
        elif m._fire(req, "abort", reason):
            stop_all(m, req, reason, store)
    elif kind == "stopped":  # a sender acknowledged our abort: nothing more from it
        leg.stopped = True
        _drain_if_stopped(m, req)


def _plan(m: Connector, req: Request, store: Any, failing: bool = False) -> bool:
    """The legs of ``req`` once its prefill DP group is known; False until then."""
    if req.legs:
        return True
    try:
        group = m.mail.group(req.dp, store)
    except Exception:  # the store is gone (shutting down): nobody is left to tell
        return False
    if group is None:
        return False
    c = m.config
    ptp = int(group["tp_size"])
    if (int(group["kv_heads"]), bool(group["mla"])) != (m.kv_heads, c.mla):
        why: str | None = (
            f"{group['kv_heads']} KV heads (mla={group['mla']}), decode {m.kv_heads} (mla={c.mla})"
        )
    else:
        why = state_misfit(group.get("state", []), ptp, m.state_geom, c.tp_size)
    if why is not None and failing:
        # refused for a misfit: every rank of the group is told why, at once,
        # instead of waiting for a register that never comes (bootstrap timeout)
        base = req.dp * ptp
        req.legs = {base + p: Leg(base + p, sends=False) for p in range(ptp)}
        req.why = f"decode rank {m.rank} refused it: {why}"
        return True
    if why is not None:
        err = TopologyError(
            f"room={req.room} on decode rank {m.rank}: prefill DP group {req.dp} does not "
            f"fit: {why}; both sides must serve the same model"
        )
        m.last_error = err
        logger.error("%s", err)
        fail(m, req, FailureReason.TRANSFER_ERROR, store)
        return False
    topo = Topology(ptp, c.tp_size, m.kv_heads, c.mla, m.split_state)
    base = req.dp * topo.prefill_tp
    send = {s.prefill: s for s in topo.senders(c.tp_rank)}
    share = set(topo.state_sources(c.tp_rank))  # the primary alone unless state is split
    req.legs = {
        base + p: leg_of(base + p, send.get(p), p in share) for p in topo.contacts(c.tp_rank)
    }
    # TP sizes that differ cut pages into head slices: those land in staging if asked
    req.staged = m.staging is not None and not c.mla and topo.prefill_tp != topo.decode_tp
    return True


def steps(m: Connector, req: Request, store: Any) -> bool:
    """Register once the legs and their endpoints are known; True while data is due
    from an engine that notifies completion."""
    ph = m._phase(req)
    if ph == Phase.Bootstrap and req.want_register and _plan(m, req, store):
        if all(m._peer_info(p, store) is not None for p in req.legs):
            c = m.config
            # Handshaken before any register leaves: whoever sees a prefill rank
            # registered then sees decode ready for pages too (not a moment later)
            if not m._fire(req, "handshake"):
                return False  # failed or aborted meanwhile: nothing to register
            for leg in req.legs.values():
                leg.inc = (m._peer_info(leg.peer, store) or {}).get("inc")  # whom it registers with
                msg = {"kind": "register", "room": req.room, "decode_tp": c.tp_size}
                msg.update(dp=c.dp_rank, kv_heads=m.kv_heads, mla=c.mla, slice=leg.slice)
                msg.update(state=m.state_geom, state_leg=leg.state)
                m._send(leg.peer, msg, store)
        return False
    return m.NOTIFIES and ph == Phase.Metadata


def tell_pages(
    m: Connector,
    req: Request,
    pages: NDArray[np.int64],
    slot: int,
    state: list[NDArray[np.int64]] | None,
    skip: int,
) -> None:
    """Tell every leg where to write (the arguments are checked by the caller)."""
    messages = []
    blocks = []
    for leg in req.legs.values():
        msg: dict[str, Any] = {"kind": "pages", "room": req.room, "skip": skip}
        if not leg.sends:
            msg.update(pages=[], slot=-1, dst_heads=0)
        elif req.staged and m.staging is not None:
            msg.update(pages=list(range(pages.size)), dst_heads=leg.count)
            msg.update(dst_ptrs=m.staging.block(slot, leg.dst_head))
            blocks.append((leg.dst_head, leg.count))
        else:
            msg.update(pages=pages.tolist(), dst_heads=m.kv_args.kv_head_num)
        msg.setdefault("slot", slot if leg.sends and leg.primary else -1)
        if leg.state:  # whole rows (primary) or this leg's share of split ones
            msg.update(state=None if state is None else [r.tolist() for r in state])
        messages.append((leg.peer, msg))
    with m._lock:  # growth replaces the columns: write them under the lock
        if not m._fire(req, "metadata"):
            # failed meanwhile (the loop, a dead peer): its legs may be stopped and
            # its pages released already, so no page list may go out
            return
        m.waited[req.index] = time.monotonic()
        req.num_pages = int(pages.size)  # what a fence on its writer holds
        if blocks:
            req.scatter = Scatter(slot, pages.copy(), sorted(blocks))
            m.scatter_left[req.index] = pages.size
    for peer, msg in messages:
        m._send(peer, msg, m.store)


def advance(m: Connector, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> None:
    """Scatter the next pages of every staged request whose senders are all done."""
    if m.staging is None or indices.size == 0:
        return
    with m._lock:
        due = (m.scatter_left[indices] > 0) & (m.phase[indices] == Phase.Done)
        reqs = [m._reqs.get(int(r)) for r in rooms[due].tolist()]
    for req in reqs:
        if req is None or req.scatter is None or m._phase(req) != Phase.Done:
            continue
        m.staging.scatter(req.scatter, m.config.scatter_pages)
        with m._lock:
            if not req.released:
                m.scatter_left[req.index] = req.scatter.left
