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
:mod:`transport.connector.core.liveness`).

With ``ConnectorConfig.digest`` the register asks each prefill rank for a
digest of its leg's bytes (:mod:`transport.digest`). Once every sender said
"done" the request is Verifying: each sender's digest is checked against the
bytes where they are final (after the staging scatter, when staged), and
every leg is told "verified" before Done. A digest that differs, one of
another signature, or none at all fails the request (reason checksum
mismatch) and every leg is told so: the check fails closed.

:class:`DecodeSide` plays this part on a decode rank; it reaches its connector
through its public calls (:class:`~transport.connector.core.machine.ConnectorCore`),
and does no I/O: what it says, the core hands its driver.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from lifecycle.reasons import FailureReason
from transport.connector.core.graph import Phase
from transport.connector.core.legs import DecodeLeg, DecodeRequest
from transport.connector.core.machine import ConnectorCore
from transport.connector.core.messages import (
    Abort,
    Done,
    Failed,
    GaveUp,
    Incoming,
    Landed,
    Msg,
    Pages,
    Register,
    Stopped,
    Verified,
)
from transport.connector.peer_legs import PeerLegs
from transport.digest import decode_parts, decode_progress, flip
from transport.errors import ChecksumMismatch
from transport.layout import layout_misfit, page_layout, state_misfit
from transport.staging import Scatter, Staging
from transport.topology import Topology, TopologyError

__all__ = ["DecodeSide"]

logger = logging.getLogger(__name__)


class DecodeSide:
    """Decode's part of the protocol on one rank (see the module)."""

    RECEIVES: ClassVar[bool] = True  # prefill ranks write into decode's memory
    SAYS: ClassVar[frozenset[Msg]] = frozenset({Msg.register, Msg.pages, Msg.abort, Msg.verified})
    HEARS: ClassVar[frozenset[Msg]] = frozenset(
        {Msg.done, Msg.landed, Msg.failed, Msg.gave_up, Msg.stopped}
    )

    def __init__(self, core: ConnectorCore) -> None:
        self.core = core
        c = core.config
        self.staging: Staging | None = None
        if c.staging:
            a = core.kv_args
            slots = a.aux_data_lens[0] // a.aux_item_lens[0] if a.aux_data_lens else 0
            self.staging = Staging(a, slots, c.staging_pages)
        self.expected: frozenset[int] = frozenset()  # a request waits for no one unplanned
        #: failures to tell prefill ranks whose group's record was not up yet
        self.owed: list[DecodeRequest] = []
        #: room -> byte offset: flip that byte of its committed data before the check
        self.corrupt: dict[tuple[int, int], int] = {}  # (room, epoch) -> byte offset
        #: the legs by prefill peer: asked, done (and how long), failed (and why)
        self.peer_legs = PeerLegs()

    def group_record(self) -> dict[str, Any] | None:
        """Nothing: decode reads prefill's group record, it publishes none."""
        return None

    def ask_stop(self, req: DecodeRequest, reason: FailureReason) -> None:
        """Ask every leg that has not stopped yet to stop writing ``req``."""
        msg = Abort(req.room, req.epoch, reason, req.why)
        for leg in req.legs.values():
            if not leg.stopped:
                self.core.send(leg.peer, msg)

    def _drain_if_stopped(self, req: DecodeRequest) -> None:
        p = self.core
        if p.phase_of(req) in (Phase.Aborted, Phase.Fenced) and all(
            leg.stopped for leg in req.senders()
        ):
            p.fire(req, "drain")

    def fail(self, req: DecodeRequest, reason: FailureReason, named: tuple[int, ...] = ()) -> None:
        """Fail here and make every leg stop writing; Drained once every sender
        stopped. ``named``: the peers it failed for (a digest that differed)."""
        p = self.core
        before = p.phase_of(req)
        if not p.fire(req, "abort", reason):
            return
        req.reason = reason
        self.peer_legs.failed(req.room, req.epoch, reason, p.now, dead=p.peer_dead, named=named)
        # not registered yet: plan the legs anyway, so that prefill hears of it
        # instead of waiting for a register that never comes; if the group's record
        # is not up yet (its ranks still starting), the loop tells them once it is
        if req.want_register and not self._plan(req, failing=True):
            self.owed.append(req)
        self.ask_stop(req, reason)
        if before < Phase.Metadata:  # no page list was sent: nothing can land
            for leg in req.legs.values():
                leg.move("stop")
        self._drain_if_stopped(req)

    def every_pass(self) -> None:
        """Tell the prefill ranks of every request failed before its group's record
        was up, once it is (the request itself is long released: nothing of it
        could land, as no page list was sent)."""
        if not self.owed:
            return
        owed, self.owed = self.owed, []
        for req in owed:
            if self._plan(req, failing=True):
                self.ask_stop(req, req.reason)
            else:
                self.owed.append(req)

    def on_message(self, req: DecodeRequest, came: Incoming) -> None:
        p, msg, leg = self.core, came.msg, req.legs.get(came.peer)
        if leg is None:
            return  # not a rank this request is paired with (or not planned yet)
        if isinstance(msg, Landed):  # (this side's parse of the engine's note: pages in)
            p.stats["landed"] += 1
            first, end = msg.span
            hashing = p.config.digest and req.scatter is None and leg.pending is None
            if hashing and 0 <= first < end <= req.pages.size:
                leg.progress = leg.progress or decode_progress(p, req, leg)
                leg.progress.landed(first, end)  # hashed while the rest moves
        elif isinstance(msg, Done):  # every write of this sender landed
            if p.config.digest and req.scatter is None and leg.pending is None:
                leg.pending = (leg.progress or decode_progress(p, req, leg)).finish()
            if came.notified and p.config.digest:
                return  # the engine's own word carries no digest: prefill's will
            leg.move("done")
            self.peer_legs.done(req.room, req.epoch, leg.peer, p.now)
            leg.digest = msg.leg_digest()
            if all(x.done for x in req.senders()):
                self._landed(req)
            self._drain_if_stopped(req)
        elif isinstance(msg, Failed | GaveUp):
            # the sender failed it: "failed" once its writes drained; "gave_up" when a
            # write of it may still land (the pages wait for this rank's drain timeout);
            # a sender that said every write landed has nothing left to fail (a copy,
            # or its other legs' failure: this leg's bytes are all here)
            if leg.done:
                return
            if isinstance(msg, Failed):
                leg.move("stop")
            reason = msg.reason
            self.peer_legs.failed(req.room, req.epoch, reason, p.now, named=(leg.peer,))
            if leg.stopped and all(x.stopped for x in req.senders()):
                _ = p.fire(req, "peer_failed", reason) or p.fire(req, "drain")
            elif p.fire(req, "abort", reason):
                self.ask_stop(req, reason)
        elif isinstance(msg, Stopped):  # a sender acknowledged our abort: nothing more from it
            leg.move("stop")
            self._drain_if_stopped(req)

    def late(self, came: Incoming, reason: int) -> None:
        """Nothing: a prefill rank's word about a room released here needs no answer."""

    def corrupt_at(self, room: int, epoch: int, offset: int) -> None:
        """A test's fault: see :meth:`_corrupt`."""
        self.corrupt[room, epoch] = offset

    def released(self, req: DecodeRequest) -> None:
        self.corrupt.pop((req.room, req.epoch), None)
        self.peer_legs.forget(req.room, req.epoch)

    def _plan(self, req: DecodeRequest, failing: bool = False) -> bool:
        """The legs of ``req`` once its prefill DP group is known; False until then."""
        if req.legs:
            return True
        p = self.core
        group = p.group(req.dp)
        if group is None:
            return False
        c = p.config
        ptp = int(group["tp_size"])
        if (int(group["kv_heads"]), bool(group["mla"])) != (p.kv_heads, c.mla):
            why: str | None = (
                f"{group['kv_heads']} KV heads (mla={group['mla']}), decode {p.kv_heads} "
                f"(mla={c.mla})"
            )
        else:
            why = layout_misfit(group, p.kv_args)
            why = why or state_misfit(group.get("state", []), ptp, p.state_geom, c.tp_size)
        if why is not None and failing:
            # refused for a misfit: every rank of the group is told why, at once,
            # instead of waiting for a register that never comes (bootstrap timeout)
            base = req.dp * ptp
            req.legs = {base + q: DecodeLeg(base + q, sends=False) for q in range(ptp)}
            req.why = f"decode rank {p.rank} refused it: {why}"
            return True
        if why is not None:
            err = TopologyError(
                f"room={req.room} on decode rank {p.rank}: prefill DP group {req.dp} does not "
                f"fit: {why}; both sides must serve the same model"
            )
            p.last_error = err
            logger.error("%s", err)
            self.fail(req, FailureReason.TRANSFER_ERROR)
            return False
        topo = Topology(ptp, c.tp_size, p.kv_heads, c.mla, p.split_state)
        base = req.dp * topo.prefill_tp
        send = {s.prefill: s for s in topo.senders(c.tp_rank)}
        share = set(topo.state_sources(c.tp_rank))  # the primary alone unless state is split
        req.legs = {
            base + q: DecodeLeg.of(base + q, send.get(q), q in share)
            for q in topo.contacts(c.tp_rank)
        }
        # TP sizes that differ cut pages into head slices: those land in staging if asked
        req.staged = self.staging is not None and not c.mla and topo.prefill_tp != topo.decode_tp
        return True

    def steps(self, req: DecodeRequest) -> bool:
        """Register once the legs and their endpoints are known; True while data is due
        from an engine that notifies completion."""
        p = self.core
        ph = p.phase_of(req)
        if ph == Phase.Bootstrap and req.want_register and self._plan(req):
            if all(p.peer(q) is not None for q in req.legs):
                c = p.config
                # Handshaken before any register leaves: whoever sees a prefill
                # rank registered then sees decode ready for pages too
                if not p.fire(req, "handshake"):
                    return False  # failed or aborted meanwhile: nothing to register
                heads_major, head_group = page_layout(p.kv_args)
                for leg in req.legs.values():
                    info = p.peer(leg.peer) or {}
                    leg.inc = info.get("inc")  # whom it registers with
                    msg = Register(
                        req.room,
                        req.epoch,
                        decode_tp=c.tp_size,
                        dp=c.dp_rank,
                        kv_heads=p.kv_heads,
                        mla=c.mla,
                        slice=leg.slice,
                        heads_major=heads_major,
                        head_group=head_group,
                        state=p.state_geom,
                        state_leg=leg.state,
                        digest=c.digest,
                    )
                    p.send(leg.peer, msg)
            return False
        return p.notifies and ph == Phase.Metadata

    def give_up(self, req: DecodeRequest) -> None:
        """Nothing: decode issues no writes, and its peers' fate is theirs to tell."""

    def tell_pages(
        self,
        req: DecodeRequest,
        pages: NDArray[np.int64],
        slot: int,
        state: list[NDArray[np.int64]] | None,
        skip: int,
    ) -> None:
        """Tell every leg where to write (the arguments are checked by the caller)."""
        p = self.core
        messages = []
        blocks = []
        none = np.empty(0, dtype=np.int64)
        for leg in req.legs.values():
            ptrs = None
            if not leg.sends:
                dst, heads = none, 0
            elif req.staged and self.staging is not None:
                dst, heads = np.arange(pages.size, dtype=np.int64), leg.count
                ptrs = np.asarray(self.staging.block(slot, leg.dst_head), dtype=np.int64)
                blocks.append((leg.dst_head, leg.count))
            else:
                dst, heads = pages, p.kv_args.kv_head_num
            row = slot if leg.sends and leg.primary else -1
            # whole rows (primary) or this leg's share of split ones
            rows = state if leg.state else None
            msg = Pages(req.room, req.epoch, dst, row, skip, heads, ptrs, rows)
            messages.append((leg.peer, msg))
        if not p.fire(req, "metadata"):
            # failed meanwhile (a timeout, a dead peer): its legs may be stopped and
            # its pages released already, so no page list may go out
            return
        p.waited[req.index] = p.now
        req.num_pages = int(pages.size)  # what a fence on its writer holds
        req.pages, req.slot, req.rows = pages.copy(), slot, state
        if blocks:
            req.scatter = Scatter(slot, pages.copy(), sorted(blocks))
            p.scatter_left[req.index] = pages.size
        for peer, msg in messages:
            p.send(peer, msg)
        self.peer_legs.asked(req.room, req.epoch, (x.peer for x in req.senders()), p.now)

    def advance(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> None:
        """Scatter the next pages of every staged request whose senders are all done."""
        p = self.core
        if self.staging is None or indices.size == 0:
            return
        ph = p.phase[indices]
        due = (p.scatter_left[indices] > 0) & ((ph == Phase.Done) | (ph == Phase.Verifying))
        reqs = [p.live(int(r)) for r in rooms[due].tolist()]
        for req in reqs:
            if not isinstance(req, DecodeRequest):
                continue  # released meanwhile: the room is gone
            if req.scatter is None or p.phase_of(req) not in (Phase.Done, Phase.Verifying):
                continue
            self.staging.scatter(req.scatter, p.config.scatter_pages)
            if req.scatter.left == 0:  # the bytes are final
                self._corrupt(req)
                self._check(req)
            if not req.released:
                p.scatter_left[req.index] = req.scatter.left

    def _landed(self, req: DecodeRequest) -> None:
        """Every sender said "done": Success, or with a digest, the check (once the
        scatter placed the bytes, when staged)."""
        p = self.core
        if req.scatter is None:  # the bytes are final
            self._corrupt(req)
        if p.fire(req, "verify" if p.config.digest else "complete") and req.scatter is None:
            self._check(req)

    def _corrupt(self, req: DecodeRequest) -> None:
        """A test asked (``Connector.corrupt``): flip one byte of the committed data."""
        p, at = self.core, self.corrupt.pop((req.room, req.epoch), None)
        if at is None:
            return
        for leg in sorted(req.senders(), key=lambda x: x.peer):
            if flip(decode_parts(p.views, p, req, leg), at):  # the first leg with a byte
                p.stats["corrupted"] += 1
                leg.pending = leg.progress = None  # hashed before the flip: hashed again
                return

    def _check(self, req: DecodeRequest) -> None:
        """The bytes are final: compare each sender's digest (if Verifying) and
        say whether they matched."""
        p = self.core
        if p.phase_of(req) != Phase.Verifying:
            return
        why, bad = [], []
        for leg in req.senders():  # every leg's hash under way before any is waited for
            leg.pending = leg.pending or decode_progress(p, req, leg).finish()
        for leg in req.senders():
            mine, theirs = leg.pending.result(), leg.digest
            p.stats["digests_checked"] += 1
            p.stats["digest_bytes"] += mine.nbytes
            if theirs is None or theirs.sig != mine.sig or theirs.value != mine.value:
                bad.append(leg.peer)
            if theirs is None:
                why.append(f"prefill rank {leg.peer} sent no digest (is its digest off?)")
            elif theirs.sig != mine.sig:
                why.append(
                    f"prefill rank {leg.peer} digested another layout (signature "
                    f"{theirs.sig:#x}, here {mine.sig:#x}: another hash or part shape)"
                )
            elif theirs.value != mine.value:
                why.append(
                    f"prefill rank {leg.peer}'s {mine.nbytes} bytes differ here (digest "
                    f"{theirs.value:#x} sent, {mine.value:#x} committed)"
                )
        if not why:
            if p.fire(req, "matched"):
                for peer in req.legs:
                    p.send(peer, Verified(req.room, req.epoch))
            return
        p.stats["digest_mismatches"] += len(why)
        err = ChecksumMismatch(req.room, p.rank, "; ".join(why))
        p.last_error = err
        logger.info("%s", err)  # (a typed failure and a count: the table may retry it)
        req.why = str(err)
        self.fail(req, FailureReason.CHECKSUM_MISMATCH, tuple(bad))
        word = Abort(req.room, req.epoch, FailureReason.CHECKSUM_MISMATCH, req.why)
        for peer in req.legs:  # every one said "done" (stopped): told all the same
            p.send(peer, word)
