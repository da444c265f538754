"""One connector for every transfer engine: the driver of the connector's core.

The protocol lives in :class:`~transport.connector.core.machine.ConnectorCore`,
which does no I/O. :class:`Connector` owns what does: the mailbox and the
store (:mod:`transport.connector.mailbox`: rendezvous, queues, heartbeats),
the :class:`~transport.engine.Engine` (Mooncake, NIXL, or any object with
that protocol's methods), a background thread, a clock and the one lock
every call into the core is made under. It is to the core what
:class:`~lifecycle.drive.stepper.Stepper` is to the step's ``RawStepper``.

Every pass of the thread: read what arrived (each message parsed, its
sender's incarnation checked against the store, then handed to the core),
the engine's notes and the writes that finished; look at the heartbeats
every heartbeat interval; fetch the records the core asks for (a peer's
endpoint, connected to; a prefill DP group's); let the core move every
request on (:meth:`~transport.connector.core.machine.ConnectorCore.tick`); then
perform what it asked: messages to send, writes to issue, writes to let go
of. The engine is only ever called from the thread (see
:mod:`transport.engine`). The scheduler's calls (through
:mod:`transport.connector.handles`) change the core under the lock and wake
the thread; a call whose effects are messages alone (decode telling prefill
where to write) sends them itself, sparing the page list a wake of the
thread. Effects are taken from the core and then performed in one order
(:attr:`Connector.order` is taken before the core's lock is let go), so no
two messages to a peer are reordered, whichever thread sends them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray

from buffers.kv_args import KVArgs
from lifecycle.reasons import FailureReason
from transport.addressing import engine_host
from transport.connector.config import ConnectorConfig, check_fit
from transport.connector.core.events import (
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
    Write,
)
from transport.connector.core.graph import IS_TERMINAL
from transport.connector.core.legs import Request
from transport.connector.core.machine import ConnectorCore
from transport.connector.core.messages import Done, Incoming, Landed, parse
from transport.connector.core.sides import SIDES
from transport.connector.core.wire import MalformedMessage
from transport.connector.handles import ConnectorReceiver, ConnectorSender
from transport.connector.inflight import InFlight
from transport.connector.mailbox import NEW, STALE, Mailbox
from transport.connector.peer_legs import PeerLegs
from transport.connector.timeline import Timeline
from transport.digest import Views
from transport.engine import Engine, check_engine
from transport.staging import Staging
from transport.status_arrays import Statuses

__all__ = ["Connector"]

logger = logging.getLogger(__name__)

R = TypeVar("R", bound="Request[Any]")

#: rounds of effects a pass performs at most (a write that landed at once, a
#: record just fetched, lets the next step go in the same pass); what comes back
#: of the last round is handed to the core, never dropped
ROUNDS = 8


class Connector:
    """One per rank, driving ``engine`` (see :mod:`transport.engine`). A backend's
    manager class is a subclass that only builds its engine in ``__init__``.
    ``clock``: seconds, monotonic (every time the core is told)."""

    def __init__(
        self,
        kv_args: KVArgs,
        config: ConnectorConfig,
        engine: Engine,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: every global head this model has (checked against this rank's KVArgs
        #: with the rest of the pair before anything starts)
        self.kv_heads = check_fit(kv_args, config)
        c = self.config = config
        self.kv_args = kv_args
        check_engine(engine)
        self.engine = engine
        self.clock = clock
        #: the address this rank's engine advertises (checked to be on this host)
        self.host = engine_host(config, type(self).__name__.replace("Manager", "Config"))
        #: every call into the core is made under it (the core keeps no lock)
        self.lock = threading.RLock()
        #: held from taking effects (under :attr:`lock`) to having performed them,
        #: so effects are performed in the order they were taken
        self.order = threading.Lock()
        self.core = ConnectorCore(
            kv_args, config, self.kv_heads, SIDES[c.role], bool(engine.NOTIFIES), Views(kv_args)
        )
        self.rank = self.core.rank  # the global id peers know this rank by
        info = engine.start(self.regions(), self.host)
        self._stop, self._wake = threading.Event(), threading.Event()
        self.mail = Mailbox(c.store_host, c.store_port, c.namespace, c.role, self.rank, self._wake)
        self.store = self.mail.store
        #: the store client of the scheduler's own sends (used under :attr:`order` alone)
        self._caller_store = self.mail.client()
        info.update(self.core.record())
        #: where requests' time goes, if set (see :mod:`transport.connector.timeline`)
        self.timeline: Timeline | None = None
        #: the engine's writes in flight (the thread's alone)
        self.inflight = InFlight(engine)
        # a first beat before any record: a peer that finds one can always tell,
        # later, that this rank stopped beating (one killed before its heartbeat
        # thread's first beat would otherwise wait out the bootstrap timeout)
        self.mail.beat(self.store)
        group = self.core.side.group_record()
        if group is not None:
            self.mail.publish_group(c.dp_rank, group)
        self.mail.publish(info)
        self.mail.start_beating(c.heartbeat_interval)
        self._thread = threading.Thread(target=self._loop, name=f"pd-{c.role}", daemon=True)
        self._thread.start()

    # -- what the core holds, read by the scheduler's gate, the tools and the tests ---------
    @property
    def stats(self) -> dict[str, int]:
        return self.core.stats

    @property
    def peer_legs(self) -> PeerLegs | None:
        """This rank's legs by peer (decode's by prefill peer, prefill's by decode
        peer); ``take()`` is safe beside the connector's thread."""
        legs = getattr(self.core.side, "peer_legs", None)
        return legs if isinstance(legs, PeerLegs) else None

    @property
    def last_error(self) -> Exception | None:
        return self.core.last_error

    @property
    def status(self) -> NDArray[np.int8]:
        return self.core.status

    @property
    def reason(self) -> NDArray[np.int8]:
        return self.core.reason

    def poll_many(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.int8]:
        """Every request's status in one gather (the step's batch poll)."""
        return self.core.poll_many(rooms, indices)

    def failure_reasons(
        self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]
    ) -> NDArray[np.int8]:
        return self.core.failure_reasons(rooms, indices)

    @property
    def arrays(self) -> Statuses:
        """The status and reason columns a request's handle reads."""
        return self.core

    @property
    def phase(self) -> NDArray[np.int8]:
        return self.core.phase

    @property
    def staging(self) -> Staging | None:
        return self.core.side.staging

    def regions(self) -> list[tuple[int, int]]:
        """Every (address, length) the engine must register: KV, metadata, state, staging."""
        a = self.kv_args
        out = list(zip(a.kv_data_ptrs, a.kv_data_lens)) + list(
            zip(a.aux_data_ptrs, a.aux_data_lens)
        )
        for comp in a.state:
            out += list(zip(comp.ptrs, comp.lens))
        staging = self.staging
        return out + (staging.regions() if staging is not None else [])

    # -- the scheduler's calls --------------------------------------------------------------------
    def sender(self, room: int, epoch: int = 0) -> ConnectorSender:
        """Prefill's handle on ``room``'s attempt ``epoch`` (a retry is the next one)."""
        return ConnectorSender(self, room, epoch)

    def receiver(self, room: int, epoch: int = 0) -> ConnectorReceiver:
        """Decode's handle on ``room``'s attempt ``epoch`` (a retry is the next one)."""
        return ConnectorReceiver(self, room, epoch)

    def take(self, room: int, make: Callable[[int, int], R], epoch: int = 0) -> R:
        """A new request (see :meth:`ConnectorCore.admit`)."""
        with self.lock:
            req = self.core.admit(room, make, epoch, self.clock())
        self._wake.set()
        return req

    def fail(self, req: Request[Any], reason: FailureReason) -> None:
        """The scheduler gave up on ``req``: fail it and make its peers stop writing."""
        with self.lock:
            self.core.now = self.clock()
            self.core.fail(req, reason)
        self._wake.set()

    def clear(self, req: Request[Any]) -> None:
        with self.lock:
            self.core.clear(req)

    def drained_many(self, reqs: Sequence[Request[Any]]) -> list[bool]:
        with self.lock:
            return self.core.drained_many(reqs)

    def clear_many(self, reqs: Sequence[Request[Any]]) -> None:
        with self.lock:
            self.core.clear_many(reqs)

    def phase_of(self, req: Request[Any]) -> int:
        with self.lock:
            return self.core.phase_of(req)

    def set_status(self, index: int, status: int) -> None:
        with self.lock:
            self.core.set(index, status)
        self._wake.set()

    def tell_pages(
        self,
        req: Request[Any],
        pages: NDArray[np.int64],
        slot: int,
        state: list[NDArray[np.int64]] | None,
        skip: int,
    ) -> None:
        with self.lock:
            self.core.tell_pages(req, pages, slot, state, skip, self.clock())
            sends = self._take_sends()
        if sends:
            self._perform_taken(sends, self._caller_store)
        self._wake.set()  # data is due: an engine that notes its landing is polled closely

    def _take_sends(self) -> list[Effect]:
        """Under :attr:`lock`: the core's effects if they are messages alone (then
        :attr:`order` is held, for :meth:`_perform_taken`), else none (the thread
        performs them)."""
        if not self.core.sends_only():
            return []
        effects = self.core.take_effects()
        if effects:
            self.order.acquire()
        return effects

    def _perform_taken(self, effects: list[Effect], store: Any) -> list[Event]:
        """Perform effects taken with :attr:`order` held, then let it go."""
        try:
            return self._perform(effects, store)
        finally:
            self.order.release()

    def wake(self) -> None:
        self._wake.set()

    # -- the staging gate (decode; see lifecycle.protocols.StagingGate) ----------------------
    def advance(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> None:
        """Place the next pages of every staged request whose data all landed."""
        with self.lock:
            self.core.advance(rooms, indices, self.clock())
        self._wake.set()

    def pending(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.bool_]:
        """True where a request's scatter is not done yet."""
        with self.lock:
            return self.core.pending(rooms, indices)

    # -- what operators and tests ask ---------------------------------------------------------
    def fenced(self) -> tuple[int, int]:
        """(requests, KV pages) held fenced on writers that stopped beating."""
        with self.lock:
            return self.core.fenced()

    def describe(self, room: int) -> str:
        """Where a live request stands on the wire, with each peer (one line)."""
        with self.lock:
            return self.core.describe(room)

    def corrupt(self, room: int, offset: int = 0, epoch: int = 0) -> None:
        """A test's fault (decode): flip every bit of one byte of attempt ``epoch``
        of ``room`` once it is committed, before its digest is checked (after the
        staging scatter, when staged; with the digest off, just before Success):
        byte ``offset`` of the first row (page, metadata or state row) its first
        sender sends. ``stats["corrupted"]`` counts the requests it hit."""
        with self.lock:
            self.core.corrupt(room, offset, epoch)

    def peer_record(self, peer: int) -> dict[str, Any] | None:
        """``peer``'s endpoint record once this rank's engine connected to it;
        None (asked for: the thread fetches and connects) until then."""
        with self.lock:
            info = self.core.peer(peer)
        if info is None:
            self._wake.set()
        return info

    def deliver(self, raw: Any) -> None:
        """Hand the core a message as it came off the mailbox (JSON read): what the
        thread does with every message; a test may call it too. The effects it
        causes are performed by the thread."""
        self._take_message(raw, self.mail.store)
        self._wake.set()

    # -- the background thread ------------------------------------------------------------------
    def _handle(self, events: list[Event], now: float) -> None:
        if self.timeline is not None:
            self.timeline.events(events, self.clock())
        with self.lock:
            for ev in events:
                self.core.handle(ev, now)

    def _take_message(self, raw: Any, store: Any) -> None:
        """Parse one message, check its sender's incarnation, and hand it over."""
        try:
            msg = parse(raw)
        except MalformedMessage as e:
            with self.lock:
                self.core.stats["malformed"] += 1
            logger.warning("rank %d: %s", self.rank, e)
            return
        self._incoming(msg, store)

    def _incoming(self, msg: Incoming, store: Any) -> None:
        now = self.clock()
        seen = self.mail.incarnation_of(msg.peer, msg.inc, store)
        if seen == STALE:
            self._handle([Stale(msg)], now)
            return
        events: list[Event] = []
        if seen == NEW:
            events.append(self._restarted())
        self.mail.heard(msg.peer)
        self._handle([*events, Arrived(msg)], now)

    def _restarted(self) -> Restarted:
        peers = self.mail.take_restarted()
        return Restarted({p: self.mail.incarnation_known(p) for p in peers})

    def _records(self, store: Any) -> list[Event]:
        """The records the core asks for that can be had now."""
        with self.lock:
            peers, groups = self.core.wanted()
        c, out = self.config, list[Event]()
        tries = 3 * c.heartbeat_misses + 1  # (a dead peer is named first: only a live one errs)
        for p in sorted(peers):
            try:
                info = self.mail.connected(
                    p, store, self.engine.connect, c.heartbeat_interval, tries
                )
            except ConnectionError as e:
                out.append(PeerUnreachable(p, str(e)))
                continue
            if info is not None:
                out.append(PeerReady(p, info))
        for dp in sorted(groups):
            try:
                record = self.mail.group(dp, store)
            except Exception:  # the store is gone (shutting down): nothing to plan with
                continue
            if record is not None:
                out.append(GroupKnown(dp, record))
        return out

    def _perform(self, effects: list[Effect], store: Any) -> list[Event]:
        """Do what the core asked, in order; writes found unreachable at once."""
        out: list[Event] = []
        tl = self.timeline
        for e in effects:
            if isinstance(e, Send):
                try:
                    self.mail.send(e.peer, e.msg.to_wire(), store)
                except Exception:  # best effort: a peer gone is caught by heartbeats
                    logger.debug(
                        "message %s to rank %d not sent", e.msg.KIND, e.peer, exc_info=True
                    )
                    continue  # (not sent: not on the timeline)
            elif isinstance(e, Write):
                if tl is not None:  # (as it is handed over: an engine may copy inline)
                    tl.effect(e, self.clock())
                if (now_known := self.inflight.issue(e)) is not None:
                    out.append(now_known)
                continue
            elif isinstance(e, Forget):
                self.inflight.forget(e.write)
            if tl is not None:
                tl.effect(e, self.clock())
        return out

    def _pass(self, store: Any, look: bool) -> bool:
        """One pass (see the module); True while a request wants close polling."""
        now = self.clock()
        if look:
            with self.lock:
                watched = self.core.watched()
            limit = self.config.heartbeat_interval * self.config.heartbeat_misses
            silent = frozenset(self.mail.silent(watched, limit, store))
            self._handle([Silence(silent), self._restarted()], now)
        for raw in self.mail.received():
            self._take_message(raw, store)
        notes: list[Event] = []
        for room, epoch, peer, span in self.engine.notified():
            note = Landed(room, epoch, span) if span else Done(room, epoch)
            notes.append(Arrived(Incoming(peer, None, note, notified=True)))
        events = notes + list[Event](self.inflight.reap()) + self._records(store)
        busy = False
        for _ in range(ROUNDS):
            if self.timeline is not None:  # (when each round's events are handed over)
                self.timeline.events(events, self.clock())
            with self.lock:
                for ev in events:
                    self.core.handle(ev, now)
                busy = self.core.tick(now)
                effects = self.core.take_effects()
                self.order.acquire()
            events = self._perform_taken(effects, store) + list[Event](self.inflight.reap())
            if effects:
                events += self._records(store)
            if not events:
                break
        else:  # the rounds ran out: what came back is handed over now, moved on next pass
            self._handle(events, now)
            busy = True
        return busy

    def _loop(self) -> None:
        store = self.mail.client()
        cfg, last_look = self.config, float("-inf")
        while not self._stop.is_set():
            # cleared before the pass, not after the wait: a wake during the pass (a
            # message, a scheduler's call whose effects wait for this thread) makes the
            # wait below return at once instead of being lost for an idle interval
            self._wake.clear()
            now = self.clock()
            look = now - last_look >= cfg.heartbeat_interval
            if look:
                last_look = now
            try:
                busy = self._pass(store, look)
            except Exception as e:  # the loop must survive anything one request does
                with self.lock:  # (the error first: whoever sees a request failed sees why)
                    self.core.fail_all(FailureReason.TRANSFER_ERROR, self.clock(), e)
                logger.debug("connector loop failed every live request", exc_info=True)
                busy = False
            # poll the engine closely only while writes are in flight; otherwise sleep
            # until a message wakes us (the engine's threads need the CPU)
            self._wake.wait(cfg.poll_interval if busy else cfg.idle_interval)

    def close(self, wait: float | None = None) -> None:
        """Shut down: fail every request still live (reason aborted), let the
        loop finish their protocol for up to ``wait`` seconds (default: the
        drain timeout) -- each tells its peers once none of its writes is in
        flight, so they need not wait for this rank's heartbeat to stop --
        then stop the loop and the engine. A request whose unfinished legs are
        all silent peers is not waited for; ``wait=0`` stops at once."""
        deadline = self.clock() + (self.config.drain_timeout if wait is None else wait)
        with self.lock:
            held = [r for r in self.core.reqs.values() if not r.released]
        for r in held:  # (a store that stopped answering must not hold this up)
            if self.clock() >= deadline:
                break
            with self.lock:
                if not IS_TERMINAL[self.core.phase_of(r)]:
                    self.core.now = self.clock()
                    self.core.fail(r, FailureReason.ABORTED)
        self._wake.set()
        while self._thread.is_alive() and self.clock() < deadline:
            with self.lock:
                if not self.core.owing():
                    break
            time.sleep(0.005)
        self._stop.set()
        self._wake.set()
        self.mail.close()
        self._thread.join(timeout=2)
        self.core.views.close()  # (its digest threads read the buffers the engine lets go)
        self.engine.stop()
