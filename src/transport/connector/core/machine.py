"""The connector's core: every request of one rank and its protocol, without I/O.

Theory of operation
-------------------
The core holds a rank's live requests (a :class:`~transport.connector.core.legs.Request`
each, with a :class:`~transport.connector.core.legs.Leg` per peer rank), their
phases along :mod:`transport.connector.core.graph` (a column, fired through its
tables, in batches for timeouts and dead peers) and their statuses (the
columns of :class:`~transport.status_arrays.StatusArrays` the scheduler
polls). It never reads a clock, a socket, the store or the engine, and
starts no thread: its driver (:class:`~transport.connector.hub.Connector`)
hands it what happened as :mod:`~transport.connector.core.events` with the time
(:meth:`ConnectorCore.handle`, :meth:`ConnectorCore.tick`, and the calls
the scheduler's handles make), and performs what it asks for
(:meth:`ConnectorCore.take_effects`): messages to send, writes to issue
and to let go of. What it needs to know of the world, a peer's endpoint
record or a prefill DP group's, it asks for (:meth:`ConnectorCore.wanted`)
and is told as an event; until then the request waits.

Each side's part of the protocol (:mod:`transport.connector.core.prefill`,
:mod:`transport.connector.core.decode`) is a :class:`Side` the core hands every
message, every pass and every failure of a request; the clocks (heartbeats,
timeouts, fencing) are :mod:`transport.connector.core.liveness`. A failed
request stays quarantined (Aborted) until no write for it can land
(Drained). The driver calls the core under one lock: the core keeps none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np
from numpy.typing import NDArray

from buffers.kv_args import KVArgs
from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll
from transport.attempts import Attempts, Route
from transport.connector.config import ConnectorConfig
from transport.connector.core import liveness as live
from transport.connector.core.events import (
    FAILED,
    UNREACHABLE,
    Arrived,
    Effect,
    Event,
    Forget,
    GroupKnown,
    PeerReady,
    PeerUnreachable,
    Restarted,
    Send,
    Silence,
    Stale,
    Tick,
    Write,
    Written,
)
from transport.connector.core.graph import (
    IS_TERMINAL,
    POLL,
    ROLE_ID,
    TRIGGER_ID,
    Phase,
    fire,
    fire_one,
)
from transport.connector.core.legs import Request, describe
from transport.connector.core.messages import Incoming, Message, Register
from transport.connector.core.side import Side
from transport.digest import Views
from transport.errors import DuplicateRoom, TransportError, epoch_of_arg
from transport.layout import Writes, splits_state, state_geometry
from transport.status_arrays import FEW, StatusArrays

__all__ = ["ConnectorCore", "STATS", "DIGEST_STATS"]

S, F = int(KVPoll.Success), int(KVPoll.Failed)
logger = logging.getLogger(__name__)

#: the reason a register of an attempt this rank has moved past is answered with
#: (one a new attempt can cure: the peer moves on to the next attempt)
SUPERSEDED = FailureReason.TRANSFER_ERROR

R = TypeVar("R", bound="Request[Any]")

#: (the POLL table, as nested lists): what one request's move reads
_POLL_SEEN: list[Any] = [None, None]


def _poll_lists() -> list[list[int]]:
    """:data:`POLL` as nested lists (an element of a list costs less to read
    than a numpy one), made again if this module's table was replaced (as a
    negative control replaces it, to switch a rule off in code)."""
    if _POLL_SEEN[0] is not POLL:
        _POLL_SEEN[:] = [POLL, POLL.tolist()]
    out: list[list[int]] = _POLL_SEEN[1]
    return out


#: what a connector counts: bytes and writes issued (prefill); fenced: on a silent
#: writer (unfenced: once it spoke); stale: a word from an old incarnation of a
#: restarted peer, refused; stale_epoch: an older attempt's words, refused;
#: malformed: messages that did not parse, dropped; the KV digest's
#: (transport.digest): legs checked, found differing, bytes hashed, requests
#: corrupted (ConnectorCore.corrupt), notes of pages in
STATS = ("bytes_written", "writes", "fenced", "unfenced", "stale", "stale_epoch", "malformed")
DIGEST_STATS = ("digests_checked", "digest_mismatches", "digest_bytes", "corrupted", "landed")


class ConnectorCore(StatusArrays):
    """One rank's requests and protocol; see the module. ``side`` builds this
    role's :class:`Side` over the core; ``notifies``: whether the engine
    itself reports a peer's writes landing (decode then polls closely while
    data is due)."""

    COLUMNS: ClassVar[dict[str, tuple[Any, Any]]] = {
        "phase": (np.int8, int(Phase.Drained)),
        "born": (np.float64, np.nan),
        "waited": (np.float64, np.nan),
        "failed_at": (np.float64, np.nan),
        "scatter_left": (np.int32, 0),  # decode: staged pages not yet placed
    }

    def __init__(
        self,
        kv_args: KVArgs,
        config: ConnectorConfig,
        kv_heads: int,
        side: Callable[[ConnectorCore], Side[Any]],
        notifies: bool = False,
        views: Views | None = None,
    ) -> None:
        super().__init__()
        self.phase: NDArray[np.int8]
        self.born: NDArray[np.float64]
        self.waited: NDArray[np.float64]
        self.failed_at: NDArray[np.float64]
        self.scatter_left: NDArray[np.int32]
        self.config, self.kv_args, self.kv_heads = config, kv_args, kv_heads
        self.rank = config.dp_rank * config.tp_size + config.tp_rank  # as peers know it
        self.notifies = notifies
        #: this rank's state rows, for the peers' fit check and split-state writes
        self.state_geom = state_geometry(kv_args.state)
        self.split_state = splits_state(kv_args.state)
        self.views = views if views is not None else Views(kv_args)  # as the digest reads them
        self.stats = dict.fromkeys(STATS + DIGEST_STATS, 0)
        self.last_error: Exception | None = None
        #: the time of the call being handled (seconds, the driver's monotonic clock)
        self.now = 0.0
        #: the live requests by (room, epoch), early words and released rooms
        self.attempts: Attempts[Request[Any], Incoming] = Attempts()
        self.reqs = self.attempts.reqs
        self.peer_dead: set[int] = set()
        #: what the driver told of the world, and what the core still asks for
        self.peers: dict[int, dict[str, Any]] = {}
        self.groups: dict[int, dict[str, Any]] = {}
        self._want_peers: set[int] = set()
        self._want_groups: set[int] = set()
        self._out: list[Effect] = []
        self._writes: dict[int, Request[Any]] = {}  # write id -> its request
        self._next_write = 0
        self.side: Side[Any] = side(self)

    # -- what the driver asks --------------------------------------------------------------
    def record(self) -> dict[str, Any]:
        """What a peer needs to write here (published beside the engine's own keys):
        this rank's buffers, their bounds, and its state rows' geometry."""
        a = self.kv_args
        return {
            "kv_ptrs": list(a.kv_data_ptrs),
            "kv_item_lens": list(a.kv_item_lens),
            "aux_ptrs": list(a.aux_data_ptrs),
            "aux_item_lens": list(a.aux_item_lens),
            "kv_lens": list(a.kv_data_lens),  # (bounds)
            "aux_lens": list(a.aux_data_lens),
            "state_ptrs": [list(s.ptrs) for s in a.state],
            "kv_head_num": a.kv_head_num,
            "state_geom": self.state_geom,
        }

    def sends_only(self) -> bool:
        """Whether every effect not taken yet is a message (none: True)."""
        return all(isinstance(e, Send) for e in self._out)

    def take_effects(self) -> list[Effect]:
        """What to do, in order, since the last call: each effect once."""
        out, self._out = self._out, []
        return out

    def wanted(self) -> tuple[set[int], set[int]]:
        """(peers, prefill DP groups) whose records a request waits for."""
        return self._want_peers - self.peers.keys(), self._want_groups - self.groups.keys()

    def watched(self) -> set[int]:
        """The peers whose heartbeat matters: the live requests' and the dead ones."""
        expected = self.side.expected
        return {p for r in self.reqs.values() for p in r.legs or expected} | self.peer_dead

    def handle(self, event: Event, now: float) -> None:
        """One event (see :mod:`transport.connector.core.events`), taken at ``now``."""
        self.now = now
        if isinstance(event, Arrived):
            self._arrived(event.msg)
        elif isinstance(event, Written):
            self._written(event.write, event.outcome)
        elif isinstance(event, PeerReady):
            self.peers[event.peer] = event.info
            self._want_peers.discard(event.peer)
        elif isinstance(event, GroupKnown):
            self.groups[event.dp] = event.record
            self._want_groups.discard(event.dp)
        elif isinstance(event, Silence):
            live.silence(self, event.peers)
        elif isinstance(event, Restarted):
            live.restarted(self, event.incarnations)
        elif isinstance(event, Stale):
            live.stale(self, event.msg)
        elif isinstance(event, PeerUnreachable):
            self._unreachable(event.peer, event.why)
        elif not isinstance(event, Tick):
            raise TypeError(f"rank {self.rank}: {event!r} is not a connector event")

    def tick(self, now: float) -> bool:
        """A pass over every live request: what each side retries, the timeouts,
        each request moved on. True while a request wants close polling (writes
        in flight, or data due from an engine that notifies)."""
        self.now = now
        self.side.every_pass()
        live.timeouts(self, now)
        busy = False
        for req in list(self.reqs.values()):
            if req.released:
                continue
            watch = self.side.steps(req)
            if req.cleared:
                self.clear(req)
            busy = busy or watch or bool(req.tokens)
        return busy

    def fail_all(self, reason: FailureReason, now: float, error: Exception | None = None) -> None:
        """Fail every live request (the driver's loop hit ``error``: it is kept first,
        so whoever sees a request failed sees why)."""
        self.now = now
        if error is not None:
            self.last_error = error
        for r in list(self.reqs.values()):
            if not r.released and not IS_TERMINAL[self.phase_of(r)]:
                self.fail(r, reason)

    # -- requests ---------------------------------------------------------------------------
    def admit(self, room: int, make: Callable[[int, int], R], epoch: int, now: float) -> R:
        """A new request for ``room`` at attempt ``epoch`` (``make``: its kind, from
        room and slot). A newer attempt of a room may start while an older one
        still drains its writes; the same or an older one is a duplicate. The
        words that came for it before it was taken are handled first."""
        epoch = epoch_of_arg(room, epoch, self.config.role, self.rank)
        self.now = now
        if self.attempts.taken(room, epoch):
            raise DuplicateRoom(room, self.config.role, self.rank)
        req = make(room, self.take(int(KVPoll.Bootstrapping)))
        req.epoch = epoch
        self.phase[req.index] = Phase.Bootstrap
        self.born[req.index] = now
        due = self.attempts.add(room, epoch, req)
        self.stats["stale_epoch"] = self.attempts.stale
        for msg in due:
            self._arrived(msg)
        return req

    def live(self, room: int) -> Request[Any] | None:
        """The newest live attempt of ``room`` (None: none)."""
        return self.attempts.live(room)

    def fire_many(
        self, reqs: Sequence[Request[Any]], trigger: str, reason: FailureReason = FailureReason.NONE
    ) -> NDArray[np.bool_]:
        """Move ``reqs`` along ``trigger`` where it is declared; the mask of those moved.
        A released request's slot may be another's already: it never moves."""
        keep = np.fromiter((not r.released for r in reqs), dtype=bool, count=len(reqs))
        idx = np.fromiter((r.index for r in reqs), dtype=np.int64, count=len(reqs))[keep]
        new, illegal = fire(self.phase[idx], trigger, self.config.role)
        moved = idx[~illegal]
        self.phase[moved] = new[~illegal]
        effect = int(POLL[ROLE_ID[self.config.role], TRIGGER_ID[trigger]])
        st = self.status[moved]
        going = moved[(st != S) & (st != F)]
        if effect == F:
            self.status[going], self.reason[going] = F, reason
            self.failed_at[moved] = self.now
        elif effect >= 0:  # progress raises the status, never lowers it
            self.status[going] = np.maximum(self.status[going], effect)
        out = np.zeros(len(reqs), dtype=bool)
        out[np.flatnonzero(keep)[~illegal]] = True
        return out

    def fire(
        self, req: Request[Any], trigger: str, reason: FailureReason = FailureReason.NONE
    ) -> bool:
        """:meth:`fire_many` of one request, in Python integers (held equal to it
        by a test over every phase, trigger, status and side)."""
        role = self.config.role
        if req.released:
            fire_one(0, trigger, role)  # (raises for an unknown trigger, as fire_many does)
            return False
        i = req.index
        new = fire_one(int(self.phase[i]), trigger, role)
        if new < 0:
            return False
        self.phase[i] = new
        effect = _poll_lists()[ROLE_ID[role]][TRIGGER_ID[trigger]]
        st = int(self.status[i])
        if effect == F:
            if st != S and st != F:
                self.status[i], self.reason[i] = F, reason
            self.failed_at[i] = self.now
        elif effect >= 0 and st != S and st != F and effect > st:
            self.status[i] = effect
        return True

    def phase_of(self, req: Request[Any]) -> int:
        return int(Phase.Drained) if req.released else int(self.phase[req.index])

    def fail(self, req: Request[Any], reason: FailureReason) -> None:
        """Fail locally and make the peers stop writing."""
        self.side.fail(req, reason)

    def drained_many(self, reqs: Sequence[Request[Any]]) -> list[bool]:
        """For each of ``reqs``: can nothing of it land any more (its phase terminal)?"""
        if len(reqs) < FEW:
            return [bool(IS_TERMINAL[self.phase_of(r)]) for r in reqs]
        at = np.fromiter([r.index for r in reqs], dtype=np.int64, count=len(reqs))
        out: list[bool] = IS_TERMINAL[self.phase[at]].tolist()
        for i, r in enumerate(reqs):
            if r.released:  # (its slot may be another request's now)
                out[i] = True
        return out

    def clear_many(self, reqs: Sequence[Request[Any]]) -> None:
        """:meth:`clear` of each of ``reqs``, in turn, with one read of the
        columns for the lot."""
        if len(reqs) < FEW:
            for r in reqs:
                self.clear(r)
            return
        for r in reqs:
            r.cleared = True
        go = [r for r in reqs if not r.released and not r.tokens]
        if not go:
            return
        if len({id(r) for r in go}) < len(go):  # one request twice: released once
            go = list({id(r): r for r in go}.values())
        at = np.fromiter([r.index for r in go], dtype=np.int64, count=len(go))
        ends = IS_TERMINAL[self.phase[at]]
        if not ends.all():
            go = [r for r, e in zip(go, ends.tolist()) if e]
            at = at[ends]
        self.scatter_left[at] = 0
        # a Success is told apart from a failure by its reason: NONE
        why = np.where(self.status[at] == F, self.reason[at], int(FailureReason.NONE)).tolist()
        slots = at.tolist()
        with self._lock:
            self._free.extend(slots)
        release, released = self.attempts.release, self.side.released
        for r, reason in zip(go, why):
            r.released = True
            release(r.room, r.epoch, reason)
            released(r)

    def clear(self, req: Request[Any]) -> None:
        """The scheduler let go of ``req``: released once nothing of it can land."""
        req.cleared = True
        if IS_TERMINAL[self.phase_of(req)] and not req.tokens and not req.released:
            req.released = True
            self.scatter_left[req.index] = 0
            self.release(req.index)
            failed = int(self.status[req.index]) == F  # (a Success is told apart: NONE)
            reason = self.reason[req.index] if failed else FailureReason.NONE
            self.attempts.release(req.room, req.epoch, int(reason))
            self.side.released(req)

    # -- what a side asks of the world ---------------------------------------------------------
    def send(self, peer: int, msg: Message) -> None:
        """Say ``msg`` to ``peer`` (best effort: a peer that is gone is caught by
        heartbeats and timeouts)."""
        self._out.append(Send(peer, msg))

    def peer(self, peer: int) -> dict[str, Any] | None:
        """``peer``'s endpoint record, connected to; None (asked for) until then."""
        info = self.peers.get(peer)
        if info is None:
            self._want_peers.add(peer)
        return info

    def group(self, dp: int) -> dict[str, Any] | None:
        """Prefill DP group ``dp``'s record; None (asked for) until it is known."""
        got = self.groups.get(dp)
        if got is None:
            self._want_groups.add(dp)
        return got

    def submit(
        self, req: Request[Any], peer: int, info: dict[str, Any], w: Writes, note: bytes
    ) -> None:
        """Write ``w`` into ``peer`` for ``req`` (while it may still write)."""
        if w[0].size == 0 or self.phase_of(req) not in (Phase.Metadata, Phase.Writing):
            return
        self._next_write += 1
        wid = self._next_write
        self._writes[wid] = req
        req.tokens.append(wid)
        self.stats["bytes_written"] += int(w[2].sum())
        self.stats["writes"] += int(w[2].size)
        self._out.append(Write(wid, req.room, req.epoch, peer, info, w, note))

    def forget(self, req: Request[Any]) -> None:
        """Let go of ``req``'s writes still in flight (the drain timeout passed)."""
        for wid in req.tokens:
            self._writes.pop(wid, None)
            self._out.append(Forget(wid))
        req.tokens.clear()

    # -- the scheduler's calls (through its handles and the gate) -----------------------------
    def tell_pages(
        self,
        req: Request[Any],
        pages: NDArray[np.int64],
        slot: int,
        state: list[NDArray[np.int64]] | None,
        skip: int,
        now: float,
    ) -> None:
        self.now = now
        self.side.tell_pages(req, pages, slot, state, skip)

    def advance(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64], now: float) -> None:
        """Place the next pages of every staged request whose data all landed."""
        self.now = now
        self.side.advance(rooms, indices)

    def pending(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.bool_]:
        """True where a request's scatter is not done yet."""
        out: NDArray[np.bool_] = self.scatter_left[indices] > 0
        return out

    def corrupt(self, room: int, offset: int = 0, epoch: int = 0) -> None:
        """A test's fault (decode): see :meth:`transport.connector.hub.Connector.corrupt`."""
        if not self.side.RECEIVES:
            raise TransportError(
                f"room={room}: prefill rank {self.rank} holds no committed bytes to corrupt; "
                "call corrupt() on a decode connector"
            )
        self.side.corrupt_at(room, int(epoch), int(offset))

    def describe(self, room: int) -> str:
        """Where a live request stands on the wire, with each peer (one line)."""
        req = self.live(room)
        if req is None:
            return f"room={room}: not live here"
        return describe(req, Phase(self.phase_of(req)).name, KVPoll(self.status[req.index]).name)

    def fenced(self) -> tuple[int, int]:
        """(requests, KV pages) held fenced on writers that stopped beating."""
        return live.fenced(self)

    def owing(self) -> bool:
        """Whether a request still owes a live peer a word (or has writes in flight)."""
        return live.owing(self)

    # -- events ----------------------------------------------------------------------------------
    def _arrived(self, msg: Incoming) -> None:
        live.heard(self, msg.peer)
        route, req, reason = self.attempts.route(msg.room, msg.epoch, msg)
        self.stats["stale_epoch"] = self.attempts.stale
        if route is Route.STALE:  # an older attempt's word, that attempt gone: never applied
            logger.debug("room=%s: %s of another attempt refused", msg.room, msg.msg.KIND)
            if isinstance(msg.msg, Register):
                # a peer still on an attempt this rank has moved past: nothing of it was
                # or will be written here (it was drained and cleared, or never held), so
                # it is told it failed, with a reason that lets it move to the next one
                self.side.late(msg, SUPERSEDED)
        elif route is Route.LATE:  # released here: the side answers what needs an answer
            self.side.late(msg, reason)
        elif req is not None:
            self.side.on_message(req, msg)

    def _written(self, wid: int, outcome: str) -> None:
        req = self._writes.pop(wid, None)
        if req is None:
            return  # given up already (the drain timeout): nothing waits for it
        if wid in req.tokens:
            req.tokens.remove(wid)
        if outcome == FAILED:
            self.fail(req, FailureReason.TRANSFER_ERROR)
        elif outcome == UNREACHABLE:
            self.fail(req, FailureReason.PEER_DEAD)

    def _unreachable(self, peer: int, why: str) -> None:
        """A peer that beats yet cannot be reached: the requests waiting for it fail."""
        err = ConnectionError(why)
        self.last_error = err
        logger.warning("rank %d: %s", self.rank, why)
        self._want_peers.discard(peer)
        expected = self.side.expected
        for r in list(self.reqs.values()):
            if r.released or IS_TERMINAL[self.phase_of(r)]:
                continue
            if peer in (r.legs or expected):
                self.fail(r, FailureReason.TRANSFER_ERROR)
