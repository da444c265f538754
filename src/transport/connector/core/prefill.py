"""The prefill side of the connector protocol: one request, several decode ranks.

A request waits for every decode rank the topology names (its legs) to
register it (Handshaken) and to say where to write (Metadata). It reports
Bootstrapping until every leg's page list is in, and WaitingForInput from
then on: only then may the scheduler take a metadata row for it (taken at
the handshake, the two sides' rows can each go to requests the other holds
none for, and both wait for ever; see :mod:`transport.connector.core.graph`).
The bootstrap timeout covers the whole wait. It then writes each leg's
slice of every page handed to ``send()`` (pages of a cached prefix skipped),
the metadata row's fields and the state rows on each primary leg; once all
of that landed, each primary leg's room column (RoomWritten); once that
landed too, every leg is told "done" (Done). A decode rank that asked for a
digest in its register is sent the digest of its leg's bytes with the "done"
(:mod:`transport.digest`), and the request waits in Verifying until every
such leg said "verified". A failed request tells every leg why, once none of
its writes is in flight (a leg that aborted it is told "stopped").

:class:`PrefillSide` plays this part on a prefill rank; it reaches its connector
through its public calls (:class:`~transport.connector.core.machine.ConnectorCore`),
and does no I/O: what it says and writes, the core hands its driver.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from lifecycle.reasons import FailureReason
from transport.connector.core.graph import IS_TERMINAL, LIVE, Phase
from transport.connector.core.legs import (
    PrefillLeg,
    PrefillRequest,
    kv_writes,
    leg_of,
    refs_misfit,
    rows_misfit,
)
from transport.connector.core.machine import ConnectorCore
from transport.connector.core.messages import (
    Abort,
    Done,
    Failed,
    GaveUp,
    Incoming,
    Msg,
    Pages,
    Register,
    Stopped,
    Verified,
)
from transport.connector.peer_legs import PeerLegs
from transport.digest import landing_note, prefill_digest
from transport.errors import TransportError
from transport.layout import StateShare, layout_misfit, row_writes, state_misfit, state_writes
from transport.staging import Staging
from transport.topology import Topology, TopologyError

__all__ = ["PrefillSide"]

logger = logging.getLogger(__name__)


class PrefillSide:
    """Prefill's part of the protocol on one rank (see the module)."""

    RECEIVES: ClassVar[bool] = False  # prefill's memory is only read
    SAYS: ClassVar[frozenset[Msg]] = frozenset(
        {Msg.done, Msg.landed, Msg.failed, Msg.gave_up, Msg.stopped}
    )
    HEARS: ClassVar[frozenset[Msg]] = frozenset({Msg.register, Msg.pages, Msg.abort, Msg.verified})

    def __init__(self, core: ConnectorCore) -> None:
        self.core = core
        self.staging: Staging | None = None
        #: the decode ranks the last registered request paired with; a request
        #: not registered yet is expected from them (a dead one fails it: peer dead)
        self.expected: frozenset[int] = frozenset()
        #: rooms given up at the drain timeout with writes the engine never finished
        self.abandoned: set[int] = set()
        #: the legs by decode peer: asked (a page list came), done (every write
        #: landed, and how long it took), failed (and why)
        self.peer_legs = PeerLegs()

    def group_record(self) -> dict[str, Any] | None:
        """This DP group's record (published before pairing): decode plans its legs from it."""
        p, c = self.core, self.core.config
        group = {"tp_size": c.tp_size, "kv_heads": p.kv_heads, "mla": c.mla}
        group.update(heads_major=p.kv_args.heads_major, head_group=p.kv_args.head_group)
        return {**group, "state": p.state_geom}

    def fail(self, req: PrefillRequest, reason: FailureReason) -> None:
        """Fail here; every leg is told once no write is in flight (see :meth:`steps`)."""
        self._fail(req, reason)

    def _fail(
        self, req: PrefillRequest, reason: FailureReason, named: tuple[int, ...] = ()
    ) -> bool:
        """:meth:`fail`; a leg is blamed only on a decode peer that is dead or
        that said why (``named``: its abort with a finding), never for being
        open: prefill's own failures (its side's agreed ones) are not its
        peers' doing. False if it had ended already."""
        p = self.core
        if not p.fire(req, "abort", reason):
            return False
        req.reason = reason
        legs = self.peer_legs
        legs.failed(req.room, req.epoch, reason, p.now, dead=p.peer_dead, named=named,
                    open_blamed=False)  # fmt: skip
        return True

    def _refuse(self, req: PrefillRequest, why: str) -> None:
        """A peer's message does not fit this rank's topology: fail the request, loudly."""
        p = self.core
        err = TopologyError(f"room={req.room} on prefill rank {p.rank}: {why}")
        p.last_error = err
        logger.error("%s", err)
        self.fail(req, FailureReason.TRANSFER_ERROR)

    def _plan(self, req: PrefillRequest, msg: Register) -> bool:
        """The legs of ``req`` from the first register message: every decode rank of
        the registering DP group that the topology pairs with this rank."""
        p, c = self.core, self.core.config
        dtp = msg.decode_tp
        if (msg.kv_heads, msg.mla) != (p.kv_heads, c.mla):
            why: str | None = (
                f"decode has {msg.kv_heads} KV heads (mla={msg.mla}), "
                f"prefill {p.kv_heads} (mla={c.mla})"
            )
        else:
            why = layout_misfit(p.kv_args, msg.layout())
            why = why or state_misfit(p.state_geom, c.tp_size, msg.state, dtp)
        if why is not None:
            self._refuse(req, f"{why}; both sides must serve the same model")
            return False
        topo = Topology(c.tp_size, dtp, p.kv_heads, c.mla, p.split_state)
        base = msg.dp * topo.decode_tp
        by_decode = {s.decode: s for s in topo.targets(c.tp_rank)}
        sources = {d: c.tp_rank in topo.state_sources(d) for d in topo.peers(c.tp_rank)}
        # (state rows go on the primary leg alone unless state is split)
        req.legs = {base + d: leg_of(base + d, by_decode.get(d), s) for d, s in sources.items()}
        req.decode_tp = dtp
        self.expected = frozenset(req.legs)
        return True

    def on_message(self, req: PrefillRequest, came: Incoming) -> None:
        p, msg, peer = self.core, came.msg, came.peer
        if isinstance(msg, Abort):  # a decode rank gave up: stop writing, say so once drained
            self._aborted(req, msg, peer)
            return
        if p.phase_of(req) in (Phase.Aborted, Phase.Drained):  # failed here: the leg hears why
            # ("failed" says no write of it can land: with writes in flight every
            # leg hears it once they drained, see steps)
            if isinstance(msg, Register) and not req.tokens:
                p.send(peer, Failed(req.room, req.epoch, req.reason))
            return
        if isinstance(msg, Register):
            self._registered(req, came, msg)
        elif isinstance(msg, Pages):
            leg = req.legs.get(peer)
            if leg is None or not leg.registered:
                # decode's scheduler sends this on another connection than its loop's
                # register, so it may overtake it: held until that register is in
                req.held.append(came)
                return
            if not leg.move("pages"):
                return  # a copy of a page list already taken
            leg.dst_pages, leg.dst_slot, leg.skip = msg.pages, msg.slot, msg.skip
            leg.dst_heads = msg.dst_heads
            leg.dst_ptrs = None if msg.dst_ptrs is None else msg.dst_ptrs.tolist()
            leg.dst_state = msg.state
            self.peer_legs.asked(req.room, req.epoch, (peer,), p.now)
            if all(x.told for x in req.legs.values()):
                p.fire(req, "metadata")
        elif isinstance(msg, Verified) and peer in req.legs:  # that leg's bytes matched
            req.legs[peer].move("verified")
            if all(x.verified or not x.verify for x in req.legs.values()):
                p.fire(req, "matched")

    def _aborted(self, req: PrefillRequest, msg: Abort, peer: int) -> None:
        p, reason = self.core, msg.reason
        if msg.why and p.phase_of(req) in LIVE:  # a live request: this is why
            mismatch = reason == FailureReason.CHECKSUM_MISMATCH  # (the table may retry it)
            kind = TransportError if mismatch else TopologyError
            p.last_error = kind(f"room={req.room} on prefill rank {p.rank}: {msg.why}")
            logger.log(logging.INFO if mismatch else logging.ERROR, "%s", p.last_error)
        leg = req.legs.get(peer)
        if leg is None and not req.legs:  # before any register: it is told once drained
            leg = req.legs[peer] = PrefillLeg(peer, sends=False)
        if leg is not None:
            leg.move("ask_stop")
        # blamed on that peer only for what it found itself (its "why": a digest
        # that differed, say), not for echoing a failure agreed elsewhere
        if self._fail(req, reason, named=(peer,) if msg.why else ()):
            return  # (the leg hears "stopped" once no write is in flight)
        if req.abandoned:  # released with writes the engine never finished
            p.send(peer, GaveUp(req.room, req.epoch, req.reason))
        elif IS_TERMINAL[p.phase_of(req)] or leg is None:
            p.send(peer, Stopped(req.room, req.epoch))

    def _registered(self, req: PrefillRequest, came: Incoming, msg: Register) -> None:
        p, peer = self.core, came.peer
        if not req.legs and not self._plan(req, msg):
            return
        leg = req.legs.get(peer)
        if leg is None or (leg.slice, leg.state) != (msg.slice, msg.state_leg):
            self._refuse(
                req,
                f"decode rank {peer} registered slice {msg.slice} (state "
                f"{msg.state_leg}), expected "
                f"{None if leg is None else (leg.slice, leg.state)}",
            )
            return
        if not leg.move("register"):
            return  # a copy of a register already taken
        leg.inc, leg.verify = came.inc, msg.digest
        if all(x.registered for x in req.legs.values()):
            p.fire(req, "handshake")
        for held in [h for h in req.held if h.peer == peer]:
            req.held.remove(held)
            self.on_message(req, held)

    def late(self, came: Incoming, reason: int) -> None:
        """A decode rank's word about a room released here: nothing more is written."""
        msg, send, peer = came.msg, self.core.send, came.peer
        room, epoch = msg.room, msg.epoch
        if isinstance(msg, Abort) and room in self.abandoned:
            send(peer, GaveUp(room, epoch, FailureReason(reason)))
        elif isinstance(msg, Abort):  # finished and drained here
            send(peer, Stopped(room, epoch))
        elif isinstance(msg, Register) and reason != FailureReason.NONE:
            # it failed and was cleared before this rank knew (a register of an attempt
            # that succeeded here is a copy of one it served: its leg heard "done")
            send(peer, Failed(room, epoch, FailureReason(reason)))

    def steps(self, req: PrefillRequest) -> bool:
        p = self.core
        before = -1  # a write that landed at once lets the next step go in the same pass
        while p.phase_of(req) != before:
            before = ph = p.phase_of(req)
            if ph in (Phase.Metadata, Phase.Writing) and req.num_pages >= 0:
                self._issue(req)
            elif ph == Phase.RoomWritten and not req.tokens:
                self._done(req)
            elif ph == Phase.Aborted and not req.tokens:
                self.tell_legs(req)
                p.fire(req, "drain")
        return False  # no engine notifies prefill: its writes are polled

    def _done(self, req: PrefillRequest) -> None:
        """Every write landed: tell every leg "done", with the digest of its bytes
        when this rank digests; wait for the verdict of the legs that asked."""
        p, words = self.core, {}
        for peer, leg in req.legs.items():
            words[peer] = Done(req.room, req.epoch)
            if p.config.digest:
                info = p.peer(peer) or {"state_geom": []}
                d = (leg.pending or prefill_digest(p, req, leg, info)).result()
                p.stats["digest_bytes"] += d.nbytes
                words[peer] = Done.of(req.room, req.epoch, d)
        asked = any(leg.verify for leg in req.legs.values())
        if p.fire(req, "verify" if asked else "complete"):  # (close() may have failed it)
            for peer, msg in words.items():
                p.send(peer, msg)
                self.peer_legs.done(req.room, req.epoch, peer, p.now)

    def tell_legs(self, req: PrefillRequest) -> None:
        """Tell every leg why the request failed ("stopped" to one that asked), a
        silent one too: it may only be paused."""
        for leg in req.legs.values():
            told = Stopped if leg.asked_stop else Failed
            self.core.send(leg.peer, told(req.room, req.epoch, req.reason))

    def give_up(self, req: PrefillRequest) -> None:
        """Released at the drain timeout with writes the engine never finished:
        every leg hears so (they may still land: a decode rank keeps its pages
        until its own drain timeout)."""
        req.abandoned = True
        if len(self.abandoned) > 100_000:
            self.abandoned.clear()
        self.abandoned.add(req.room)
        for leg in req.legs.values():
            self.core.send(leg.peer, GaveUp(req.room, req.epoch, req.reason))

    def every_pass(self) -> None:
        """Nothing: prefill owes no word beyond its requests' own."""

    def ask_stop(self, req: PrefillRequest, reason: FailureReason) -> None:
        """Nothing: no peer writes into prefill's memory."""

    def advance(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> None:
        """Nothing: prefill stages nothing."""

    def corrupt_at(self, room: int, epoch: int, offset: int) -> None:
        """Nothing: prefill holds no committed bytes (the core refuses the call)."""

    def released(self, req: PrefillRequest) -> None:
        """Its legs still open close uncounted."""
        self.peer_legs.forget(req.room, req.epoch)

    def tell_pages(
        self,
        req: PrefillRequest,
        pages: NDArray[np.int64],
        slot: int,
        state: list[NDArray[np.int64]] | None,
        skip: int,
    ) -> None:
        raise TransportError(
            f"room={req.room}: prefill rank {self.core.rank} is told where to write; "
            "a page list is a decode receiver's to send"
        )

    def _issue_leg(self, req: PrefillRequest, leg: PrefillLeg) -> bool:
        """Write what ``leg`` has not had yet; False if the request failed."""
        p = self.core
        info = p.peer(leg.peer)
        if info is None or leg.dst_pages is None:
            return True
        if leg.fields_out and leg.issued >= req.src.size:
            return True  # all of it went out, and was checked as it went: nothing new
        why = rows_misfit(req, leg)
        if why is not None:
            self._refuse(req, why)
            return False
        if leg.skip < req.first_page:
            self._refuse(
                req,
                f"decode rank {leg.peer} holds a prefix of {leg.skip} pages, but send() is "
                f"handed the request's pages from page {req.first_page} on",
            )
            return False
        if (
            req.num_pages == req.first_page
            and not req.sent
            and leg.state
            and leg.dst_state is not None
        ):
            # no page to wait for, yet the state rows come with the send() after init(0):
            # the loop may run between the two calls
            return True
        src = req.src  # the scheduler may swap in a longer one meanwhile
        n = src.size
        why = refs_misfit(
            p.kv_args, p.rank, req, leg, info, src[max(leg.issued, req.first_page) : n]
        )
        if why is not None:
            self._refuse(req, why)
            return False
        if p.config.digest and leg.pending is None and n >= req.num_pages:
            leg.pending = prefill_digest(p, req, leg, info)  # every byte known: hashed as it moves
        if not leg.sends:  # no KV: a share of split state only, once the pages are all in
            if n >= req.num_pages and not leg.fields_out:
                if not self._state_out(req, leg, info):
                    return False
                leg.move("out")
            return True
        w: Any = None  # (src, dst, lengths) this pass writes on the leg
        if leg.issued < n:
            at = np.arange(max(leg.issued, leg.skip), n)  # (a cached prefix is not written)
            dst_at = at - leg.skip
            if dst_at.size and dst_at[-1] >= leg.dst_pages.size:
                self._refuse(
                    req,
                    f"page {int(dst_at[-1])} has no page on decode rank {leg.peer} "
                    f"(it gave {leg.dst_pages.size} after a prefix of {leg.skip})",
                )
                return False
            while at.size:  # (noted slices: the engine sends each note as it sees it landed)
                take, note = landing_note(p, req, leg, int(dst_at[0]), dst_at.size)
                w = kv_writes(p.kv_args, info, leg, src[at[:take]], leg.dst_pages[dst_at[:take]])
                at, dst_at = at[take:], dst_at[take:]
                if note or at.size:  # (an unnoted last write waits: the row's fields join it)
                    p.submit(req, leg.peer, info, w, note)
                    w = None
            leg.issued = n
        if n >= req.num_pages and not leg.fields_out:
            if max(req.num_pages - leg.skip, 0) != leg.dst_pages.size:
                self._refuse(
                    req,
                    f"{req.num_pages} pages after a prefix of {leg.skip} do not fit "
                    f"the {leg.dst_pages.size} pages decode rank {leg.peer} gave",
                )
                return False
            if leg.primary and req.local_slot >= 0 and leg.dst_slot >= 0:
                # the fields join the last unnoted write (one transfer); the room waits
                row = row_writes(p.kv_args, info, req.local_slot, leg.dst_slot, False)
                w = row if w is None else tuple(np.concatenate(c) for c in zip(w, row))
            if not self._state_out(req, leg, info):
                return False
            leg.move("out")
        if w is not None:
            p.submit(req, leg.peer, info, w, b"")
        return True

    def _state_out(self, req: PrefillRequest, leg: PrefillLeg, info: dict[str, Any]) -> bool:
        """The state rows this leg owes, once every page is handed over: whole rows
        on the primary leg, and with split state this rank's share of the decode
        rank's. False if only one side named rows (the request is refused: decode
        would commit it holding another request's state)."""
        if not leg.state or (req.src_state is None and leg.dst_state is None):
            return True
        if req.src_state is None or leg.dst_state is None:
            self._refuse(
                req,
                f"decode rank {leg.peer} gave state rows but send() was handed none with the "
                "request's pages; pass state_indices to send() (with the last pages at the latest)"
                if req.src_state is None
                else f"send() was handed state rows but decode rank {leg.peer} gave none; "
                "pass state_indices to send_metadata()",
            )
            return False
        p, share = self.core, None
        if p.split_state:
            c, dtp = p.config, req.decode_tp
            d = leg.peer % dtp
            share = StateShare(c.tp_rank, c.tp_size, d, dtp, leg.primary, info["state_geom"])
        w = state_writes(p.kv_args, info["state_ptrs"], req.src_state, leg.dst_state, share)
        if w[0].size:
            p.submit(req, leg.peer, info, w, b"")
        return True

    def _issue(self, req: PrefillRequest) -> None:
        p = self.core
        for leg in req.legs.values():
            if not leg.sends and not leg.state:
                leg.move("out")
            elif not self._issue_leg(req, leg):
                return
        out = all(leg.fields_out for leg in req.legs.values())
        if p.phase_of(req) == Phase.Metadata and (req.tokens or out) and p.fire(req, "write"):
            # the waiting deadline runs from the first write to decode's last word: a
            # write the engine never answers, or a word lost on the way, ends there
            p.waited[req.index] = p.now
        if p.phase_of(req) == Phase.Writing and out and not req.tokens:
            for leg in req.legs.values():
                info = p.peer(leg.peer)
                if leg.primary and info is not None and req.local_slot >= 0 and leg.dst_slot >= 0:
                    w = row_writes(p.kv_args, info, req.local_slot, leg.dst_slot, True)
                    p.submit(req, leg.peer, info, w, f"{req.room}:{req.epoch}".encode())
            p.fire(req, "write_room")
