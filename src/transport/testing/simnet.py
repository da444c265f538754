"""A simulated network for the connector's core: seeded, deterministic, in one thread.

Ranks are :class:`~transport.connector.core.machine.ConnectorCore` s over real
buffers (the writes copy real bytes); everything a driver would do with a
store, a mailbox, heartbeats and an engine, :class:`SimNet` does on a virtual
clock, drawing every choice from one seeded generator, so a run is replayed
exactly from its seed. It delivers, drops, duplicates, delays (so reorders)
messages; pauses a rank (it neither beats nor handles anything, but its
writes already issued still land) and thaws it; kills one; lets writes land
late, fail, never land, or land with a byte flipped; and jumps the clock.

Each rank also stands in for its scheduler's side of the handles
(:class:`~transport.connector.handles.Requests`): ``rank.sender(room)`` and
``rank.receiver(room)`` are the real handles. Decode's pages remember which
request and attempt wrote each of their bytes last, and the test says which
request a page belongs to (``net.fence.assign``, a
:class:`~transport.testing.fence.PageFence`): a write into a page that belongs
to another request or attempt, or to none, is recorded in
``net.fence.violations`` (the fence the protocol must keep).
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import random
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np
from numpy.typing import NDArray

from buffers.kv_args import KVArgs
from lifecycle.reasons import FailureReason
from transport.connector.config import ConnectorConfig, check_fit
from transport.connector.core.events import (
    FAILED,
    LANDED,
    Arrived,
    Event,
    Forget,
    GroupKnown,
    PeerReady,
    Send,
    Silence,
    Write,
    Written,
)
from transport.connector.core.legs import Request
from transport.connector.core.machine import ConnectorCore
from transport.connector.core.messages import Done, Incoming, Landed, parse
from transport.connector.core.sides import SIDES
from transport.connector.core.wire import MalformedMessage
from transport.connector.handles import ConnectorReceiver, ConnectorSender
from transport.staging import Staging
from transport.status_arrays import Statuses
from transport.testing.fence import PageFence

__all__ = ["Faults", "SimNet", "SimRank"]

R = TypeVar("R", bound="Request[Any]")


@attrs.frozen
class Faults:
    """What the network does to messages and writes (probabilities per item)."""

    drop: float = 0.0  # a message is lost
    duplicate: float = 0.0  # a message arrives twice
    delay: tuple[float, float] = (0.0002, 0.002)  # seconds a message travels (uniform)
    write_delay: tuple[float, float] = (0.0002, 0.003)  # seconds a write takes to land
    write_fails: float = 0.0  # the engine reports the write failed; nothing lands
    write_lost: float = 0.0  # the write never lands and the engine never answers
    corrupt: float = 0.0  # the write lands with one byte flipped


@attrs.define
class _Flight:
    """A write in flight on the simulated wire."""

    writer: SimRank
    target: SimRank | None
    effect: Write
    lands: bool
    fails: bool
    corrupt: bool
    forgotten: bool = False
    done: bool = False


class SimRank:
    """One rank of the simulated network: a core, its buffers, its scheduler's handles."""

    def __init__(self, net: SimNet, kv_args: KVArgs, config: ConnectorConfig, notifies: bool):
        self.net, self.kv_args, self.config = net, kv_args, config
        self.role = config.role
        self.core = ConnectorCore(
            kv_args, config, check_fit(kv_args, config), SIDES[config.role], notifies
        )
        self.rank = self.core.rank
        self.inc = net.rng.getrandbits(62)
        self.paused = False
        self.dead = False
        self.last_beat = 0.0
        self.last_look = float("-inf")
        self.inbox: list[Any] = []  # raw messages delivered, in arrival order
        self.results: list[Event] = []  # the engine's answers and notes for this rank
        self.lock: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()

    # -- the handles' side (transport.connector.handles.Requests) ---------------------------
    @property
    def arrays(self) -> Statuses:
        return self.core

    @property
    def staging(self) -> Staging | None:
        return self.core.side.staging

    def sender(self, room: int, epoch: int = 0) -> ConnectorSender:
        return ConnectorSender(self, room, epoch)

    def receiver(self, room: int, epoch: int = 0) -> ConnectorReceiver:
        return ConnectorReceiver(self, room, epoch)

    def take(self, room: int, make: Callable[[int, int], R], epoch: int = 0) -> R:
        return self.core.admit(room, make, epoch, self.net.now)

    def fail(self, req: Request[Any], reason: FailureReason) -> None:
        self.core.now = self.net.now
        self.core.fail(req, reason)

    def clear(self, req: Request[Any]) -> None:
        self.core.clear(req)

    def drained_many(self, reqs: Sequence[Request[Any]]) -> list[bool]:
        return self.core.drained_many(reqs)

    def clear_many(self, reqs: Sequence[Request[Any]]) -> None:
        self.core.clear_many(reqs)

    def phase_of(self, req: Request[Any]) -> int:
        return self.core.phase_of(req)

    def set_status(self, index: int, status: int) -> None:
        self.core.set(index, status)

    def tell_pages(
        self,
        req: Request[Any],
        pages: NDArray[np.int64],
        slot: int,
        state: list[NDArray[np.int64]] | None,
        skip: int,
    ) -> None:
        self.core.tell_pages(req, pages, slot, state, skip, self.net.now)

    def wake(self) -> None:
        """Nothing: the network steps every rank."""

    def record(self) -> dict[str, Any]:
        return {**self.core.record(), "inc": self.inc}

    @property
    def up(self) -> bool:
        return not (self.paused or self.dead)


class SimNet:
    """Ranks on a virtual clock (see the module). ``heartbeat``: (interval, misses)."""

    def __init__(
        self,
        seed: int,
        faults: Faults = Faults(),
        dt: float = 0.0005,
        heartbeat: tuple[float, int] = (0.05, 3),
    ) -> None:
        self.rng = random.Random(seed)
        self.seed, self.faults, self.dt = seed, faults, dt
        self.heartbeat = heartbeat
        self.now = 0.0
        self.ranks: dict[tuple[str, int], SimRank] = {}
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.flights: list[_Flight] = []
        #: which request each of decode's pages belongs to, and the writes that broke it
        self.fence = PageFence()
        #: every message a rank handled: (time, role, rank, kind, room), for checks
        #: of what a rank could have known when it decided
        self.handled: list[tuple[float, str, int, str, int]] = []
        self.sent = self.dropped = self.duplicated = 0

    def add(self, kv_args: KVArgs, config: ConnectorConfig, notifies: bool = False) -> SimRank:
        r = SimRank(self, kv_args, config, notifies)
        self.ranks[r.role, r.rank] = r
        return r

    # -- faults the test steers ----------------------------------------------------------------
    def pause(self, rank: SimRank, seconds: float | None) -> None:
        """Stop ``rank`` (no beats, nothing handled) for ``seconds`` (None: for ever)."""
        rank.paused = True
        if seconds is not None:
            self._at(self.now + seconds, lambda: setattr(rank, "paused", False))

    def kill(self, rank: SimRank) -> None:
        rank.dead = True

    def jump(self, seconds: float) -> None:
        """Move the clock on at once (every rank sees the time pass)."""
        self.now += seconds

    # -- writes in flight ------------------------------------------------------------------------
    def in_flight(self, rank: SimRank, room: int, epoch: int) -> int:
        """Writes of that attempt towards ``rank`` that may still land."""
        return sum(
            1
            for f in self.flights
            if not f.done
            and f.lands
            and f.target is rank
            and (f.effect.room, f.effect.epoch) == (room, epoch)
        )

    # -- running -----------------------------------------------------------------------------
    def run(self, until: Callable[[], bool], limit: float) -> bool:
        """Step until ``until()`` holds (True) or ``limit`` virtual seconds passed (False)."""
        end = self.now + limit
        while self.now < end:
            if until():
                return True
            self.step()
        return until()

    def step(self) -> None:
        """One tick of the virtual clock: what is due lands or arrives, then every
        rank that is up takes a pass, in a seeded order."""
        self.now += self.dt
        while self._queue and self._queue[0][0] <= self.now:
            _, _, what = heapq.heappop(self._queue)
            what()
        order = sorted(self.ranks.values(), key=lambda r: (r.role, r.rank))
        self.rng.shuffle(order)
        for r in order:
            if r.up:
                r.last_beat = self.now
                self._pass(r)

    def _at(self, when: float, what: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (when, self._seq, what))

    def _peer(self, r: SimRank, peer: int) -> SimRank | None:
        return self.ranks.get(("decode" if r.role == "prefill" else "prefill", peer))

    def _pass(self, r: SimRank) -> None:
        core, now = r.core, self.now
        hb, misses = self.heartbeat
        events: list[Event] = []
        if now - r.last_look >= hb:
            r.last_look = now
            silent = {p for p in core.watched() if self._silent(r, p, hb * misses)}
            events.append(Silence(frozenset(silent)))
        inbox, r.inbox = r.inbox, []
        for raw in inbox:
            try:
                came = parse(raw)
            except MalformedMessage:
                core.stats["malformed"] += 1
                continue
            events.append(Arrived(came))
            self.handled.append((now, r.role, r.rank, str(came.msg.KIND), came.room))
        results, r.results = r.results, []
        events += results
        peers, groups = core.wanted()
        for p in sorted(peers):
            peer = self._peer(r, p)
            if peer is not None and not peer.dead:
                events.append(PeerReady(p, peer.record()))
        for dp in sorted(groups):
            first = self.ranks.get(("prefill", dp * self._prefill_tp()))
            if first is not None and (record := first.core.side.group_record()) is not None:
                events.append(GroupKnown(dp, record))
        for ev in events:
            core.handle(ev, now)
        core.tick(now)
        for e in core.take_effects():
            self._perform(r, e)

    def _prefill_tp(self) -> int:
        return next(
            (r.config.tp_size for (role, _), r in sorted(self.ranks.items()) if role == "prefill"),
            1,
        )

    def _silent(self, r: SimRank, peer: int, limit: float) -> bool:
        p = self._peer(r, peer)
        return p is not None and not p.up and self.now - p.last_beat > limit

    def _perform(self, r: SimRank, e: Any) -> None:
        f = self.faults
        if isinstance(e, Send):
            target = self._peer(r, e.peer)
            raw = {**e.msg.to_wire(), "from": r.rank, "inc": r.inc}
            self.sent += 1
            if target is None or self.rng.random() < f.drop:
                self.dropped += 1
                return
            copies = 2 if self.rng.random() < f.duplicate else 1
            self.duplicated += copies - 1
            for _ in range(copies):
                self._at(self.now + self.rng.uniform(*f.delay), self._deliver(target, dict(raw)))
        elif isinstance(e, Write):
            target = self._peer(r, e.peer)
            fails = self.rng.random() < f.write_fails
            lost = not fails and self.rng.random() < f.write_lost
            flight = _Flight(
                r,
                target,
                e,
                lands=not (fails or lost) and target is not None,
                fails=fails,
                corrupt=self.rng.random() < f.corrupt,
            )
            self.flights.append(flight)
            if not lost:
                self._at(self.now + self.rng.uniform(*f.write_delay), lambda: self._land(flight))
        elif isinstance(e, Forget):
            for fl in self.flights:
                if fl.writer is r and fl.effect.write == e.write:
                    fl.forgotten = True

    def _deliver(self, target: SimRank, raw: dict[str, Any]) -> Callable[[], None]:
        def arrive() -> None:
            if not target.dead:  # (a paused rank's queue keeps it for when it thaws)
                target.inbox.append(raw)

        return arrive

    def _land(self, fl: _Flight) -> None:
        fl.done = True
        e, writer = fl.effect, fl.writer
        if fl.fails or fl.target is None:
            if not fl.forgotten:
                writer.results.append(Written(e.write, FAILED))
            return
        src, dst, lens = (a.tolist() for a in e.writes)
        for i, (s, d, n) in enumerate(zip(src, dst, lens)):
            self.fence.check(fl.target, d, n, e.room, e.epoch, self.now)
            ctypes.memmove(d, s, n)
            if fl.corrupt and i == 0 and n:
                b = ctypes.c_uint8.from_address(d)
                b.value ^= 0xFF
        if not fl.forgotten:
            writer.results.append(Written(e.write, LANDED))
        if fl.target.core.notifies and e.note:
            note = self._note(e.note)
            if note is not None:
                fl.target.results.append(Arrived(Incoming(writer.rank, None, note, notified=True)))

    @staticmethod
    def _note(note: bytes) -> Done | Landed | None:
        parts = [int(x) for x in note.decode().split(":")]
        if len(parts) == 2:
            return Done(parts[0], parts[1])
        if len(parts) == 4:
            return Landed(parts[0], parts[1], (parts[2], parts[3]))
        return None
