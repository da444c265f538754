"""One connector for every transfer engine: all that is not engine-specific.

Control plane in :mod:`transport.connector.mailbox` (rendezvous, queues, heartbeats);
who sends which heads to whom in :mod:`transport.topology`; where writes go in
:mod:`transport.layout`; each side's part of the protocol in
:mod:`transport.connector.prefill` and :mod:`transport.connector.decode` (the
one this rank plays is picked once, as it is built); the clocks in
:mod:`transport.connector.liveness`; a request's handles in
:mod:`transport.connector.handles`. Each of these parts reaches the connector
through the :class:`~transport.connector.port.Port` it implements. An engine
subclass (Mooncake, NIXL) registers memory, issues writes and reads their
completion. Each request moves along the protocol of
:mod:`transport.connector.graph` (the ``phase`` column, fired through its
tables; in batches for timeouts and dead peers), with a :class:`~transport.connector.legs.Leg`
per peer rank. A failed request stays quarantined (Aborted) until no write for
it can land (Drained).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np
from numpy.typing import NDArray

from buffers.kv_args import KVArgs
from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll
from transport.addressing import engine_host
from transport.attempts import Attempts, Route
from transport.connector import liveness as live
from transport.connector.config import ConnectorConfig, check_fit
from transport.connector.decode import DecodeSide
from transport.connector.graph import IS_TERMINAL, POLL, ROLE_ID, TRIGGER_ID, Phase, fire
from transport.connector.handles import ConnectorReceiver, ConnectorSender
from transport.connector.legs import Request, describe
from transport.connector.mailbox import Mailbox
from transport.connector.messages import Msg, check_words
from transport.connector.port import Side
from transport.connector.prefill import PrefillSide
from transport.digest import Views
from transport.errors import DuplicateRoom, TransportError, epoch_of_arg
from transport.layout import Writes, splits_state, state_geometry
from transport.status_arrays import StatusArrays

__all__ = ["Connector"]

T, S, F = int(KVPoll.Transferring), int(KVPoll.Success), int(KVPoll.Failed)
NOW = time.monotonic
logger = logging.getLogger(__name__)

R = TypeVar("R", bound="Request[Any]")

#: each role's part of the protocol
SIDES: dict[str, type[PrefillSide] | type[DecodeSide]] = {
    "prefill": PrefillSide,
    "decode": DecodeSide,
}
check_words({role: (side.SAYS, side.HEARS) for role, side in SIDES.items()})
#: what a connector counts: bytes and writes issued (prefill); fenced: on a silent
#: writer (unfenced: once it spoke); stale: see liveness.received; stale_epoch: an
#: older attempt's words, refused; the KV digest's (transport.digest): legs checked,
#: found differing, bytes hashed, requests corrupted (Connector.corrupt), notes of pages in
STATS = ("bytes_written", "writes", "fenced", "unfenced", "stale", "stale_epoch")
DIGEST_STATS = ("digests_checked", "digest_mismatches", "digest_bytes", "corrupted", "landed")


class Connector(StatusArrays):
    """One per rank. Subclasses provide the engine hooks (``_start_engine`` ... ``_stop_engine``)."""

    NOTIFIES: ClassVar[bool] = False  # whether ``_notified`` reports completions

    COLUMNS: ClassVar[dict[str, tuple[Any, Any]]] = {
        "phase": (np.int8, int(Phase.Drained)),
        "born": (np.float64, np.nan),
        "waited": (np.float64, np.nan),
        "failed_at": (np.float64, np.nan),
        "scatter_left": (np.int32, 0),  # decode: staged pages not yet placed
    }

    def __init__(self, kv_args: KVArgs, config: ConnectorConfig) -> None:
        #: every global head this model has (checked against this rank's KVArgs
        #: with the rest of the pair before anything starts)
        self.kv_heads = check_fit(kv_args, config)
        c = self.config = config
        self.kv_args = kv_args
        self.rank = c.dp_rank * c.tp_size + c.tp_rank  # the global id peers know this rank by
        #: the address this rank's engine advertises (checked to be on this host)
        self.host = engine_host(config, type(self).__name__.replace("Manager", "Config"))
        super().__init__()
        self.phase: NDArray[np.int8]
        self.born: NDArray[np.float64]
        self.waited: NDArray[np.float64]
        self.failed_at: NDArray[np.float64]
        self.scatter_left: NDArray[np.int32]
        self.last_error: Exception | None = None
        self.side: Side[Any] = SIDES[c.role](self)  # (its staging is registered with the rest)
        self.stats = dict.fromkeys(STATS + DIGEST_STATS, 0)  # (see STATS)
        self.views = Views(kv_args)  # this rank's buffers, as the digest reads them
        info = self._start_engine()
        self._stop, self._wake = threading.Event(), threading.Event()
        self._msg_lock = threading.RLock()  # messages are handled one at a time, in order
        self.mail = Mailbox(c.store_host, c.store_port, c.namespace, c.role, self.rank, self._wake)
        self.store = self.mail.store
        a = kv_args
        info.update(kv_ptrs=list(a.kv_data_ptrs), kv_item_lens=list(a.kv_item_lens))
        info.update(aux_ptrs=list(a.aux_data_ptrs), aux_item_lens=list(a.aux_item_lens))
        info.update(kv_lens=list(a.kv_data_lens), aux_lens=list(a.aux_data_lens))  # (bounds)
        info.update(state_ptrs=[list(s.ptrs) for s in a.state], kv_head_num=a.kv_head_num)
        #: this rank's state rows, for the peers' fit check and split-state writes
        self.state_geom = state_geometry(a.state)
        self.split_state = splits_state(a.state)
        info.update(state_geom=self.state_geom)
        #: the live requests by (room, epoch), early words and released rooms
        self.attempts: Attempts[Request[Any]] = Attempts()
        self._reqs = self.attempts.reqs
        self._peer_dead: set[int] = set()
        self.side.start()
        self.mail.publish(info)
        self.mail.start_beating(c.heartbeat_interval)
        self._thread = threading.Thread(target=self._loop, name=f"pd-{c.role}", daemon=True)
        self._thread.start()

    def regions(self) -> list[tuple[int, int]]:
        """Every (address, length) the engine must register: KV, metadata, state, staging."""
        a = self.kv_args
        out = list(zip(a.kv_data_ptrs, a.kv_data_lens)) + list(
            zip(a.aux_data_ptrs, a.aux_data_lens)
        )
        for comp in a.state:
            out += list(zip(comp.ptrs, comp.lens))
        staging = self.side.staging
        return out + (staging.regions() if staging is not None else [])

    # -- engine hooks ---------------------------------------------------------------------
    def _start_engine(self) -> dict[str, Any]:
        """Start the engine and register :meth:`regions`; return what peers need to write here."""
        raise NotImplementedError

    def _connect(self, peer: int, info: dict[str, Any]) -> None: ...  # once, before writes

    def _write(self, info: dict[str, Any], *w_notif: Any) -> Any:
        """Issue writes (src, dst, lens, notification); a token, None if unreachable."""
        raise NotImplementedError

    def _check(self, token: Any) -> int:  # 0 in flight, 1 landed, -1 failed; then _forget
        raise NotImplementedError

    def _forget(self, token: Any) -> None: ...

    def _notified(self) -> list[tuple[int, int, int, tuple[int, int] | None]]:
        """(room, epoch, peer, span) of each note the engine gave this (decode) rank:
        span None for an attempt's last write, else the pages that landed."""
        return []

    def _stop_engine(self) -> None: ...

    # -- requests and the protocol ---------------------------------------------------------
    def _take(self, room: int, make: Callable[[int, int], R], epoch: int = 0) -> R:
        """A new request for ``room`` at attempt ``epoch`` (``make``: its kind, from
        room and slot). A newer attempt of a room may start while an older one
        still drains its writes; the same or an older one is a duplicate."""
        epoch = epoch_of_arg(room, epoch, self.config.role, self.rank)
        with self._msg_lock:  # its early messages go before any later one
            with self._lock:
                if self.attempts.taken(room, epoch):
                    raise DuplicateRoom(room, self.config.role, self.rank)
                req = make(room, self.take(int(KVPoll.Bootstrapping)))
                req.epoch = epoch
                self.phase[req.index] = Phase.Bootstrap
                self.born[req.index] = NOW()
                due = self.attempts.add(room, epoch, req)
                self.stats["stale_epoch"] = self.attempts.stale
            for msg in due:
                self._on_message(msg, self.store)
        return req

    def _live(self, room: int) -> Request[Any] | None:
        """The newest live attempt of ``room`` (None: none)."""
        return self.attempts.live(room)

    def _fire_many(
        self, reqs: Sequence[Request[Any]], trigger: str, reason: FailureReason = FailureReason.NONE
    ) -> NDArray[np.bool_]:
        """Move ``reqs`` along ``trigger`` where it is declared; the mask of those moved.
        A released request's slot may be another's already: it never moves."""
        with self._lock:
            keep = np.fromiter((not r.released for r in reqs), dtype=bool, count=len(reqs))
            idx = np.fromiter((r.index for r in reqs), dtype=np.int64, count=len(reqs))[keep]
            new, illegal = fire(self.phase[idx], trigger, self.config.role)
            moved = idx[~illegal]
            self.phase[moved] = new[~illegal]
            effect = int(POLL[ROLE_ID[self.config.role], TRIGGER_ID[trigger]])
            st = self.status[moved]
            live = moved[(st != S) & (st != F)]
            if effect == F:
                self.status[live], self.reason[live] = F, reason
                self.failed_at[moved] = NOW()
            elif effect >= 0:  # progress raises the status, never lowers it
                self.status[live] = np.maximum(self.status[live], effect)
            out = np.zeros(len(reqs), dtype=bool)
            out[np.flatnonzero(keep)[~illegal]] = True
            return out

    def _fire(
        self, req: Request[Any], trigger: str, reason: FailureReason = FailureReason.NONE
    ) -> bool:
        return bool(self._fire_many([req], trigger, reason)[0])

    def _phase(self, req: Request[Any]) -> int:
        with self._lock:
            return int(Phase.Drained) if req.released else int(self.phase[req.index])

    def _fail(self, req: Request[Any], reason: FailureReason, store: Any) -> None:
        """Fail locally and make the peers stop writing."""
        self.side.fail(req, reason, store)

    def _send(self, peer: int, msg: dict[str, Any], store: Any) -> None:
        """Best effort: a peer that is gone is caught by heartbeats and timeouts."""
        try:
            self.mail.send(peer, msg, store)
        except Exception:
            logger.debug("message %s to rank %d not sent", msg.get("kind"), peer, exc_info=True)

    def _clear(self, req: Request[Any]) -> None:
        with self._lock:
            req.cleared = True
            if IS_TERMINAL[self._phase(req)] and not req.tokens and not req.released:
                req.released = True
                self.scatter_left[req.index] = 0
                self.release(req.index)
                failed = int(self.status[req.index]) == F  # (a Success is never asked about)
                reason = self.reason[req.index] if failed else FailureReason.ABORTED
                self.attempts.release(req.room, req.epoch, int(reason))
                getattr(self.side, "corrupt", {}).pop((req.room, req.epoch), None)

    def fenced(self) -> tuple[int, int]:
        """(requests, KV pages) held fenced on writers that stopped beating."""
        return live.fenced(self)

    def describe(self, room: int) -> str:
        """Where a live request stands on the wire, with each peer (one line)."""
        with self._lock:
            req = self._live(room)
            if req is None:
                return f"room={room}: not live here"
            return describe(req, Phase(self._phase(req)).name, KVPoll(self.status[req.index]).name)

    def corrupt(self, room: int, offset: int = 0, epoch: int = 0) -> None:
        """A test's fault (decode): flip every bit of one byte of attempt ``epoch``
        of ``room`` once it is committed, before its digest is checked (after the
        staging scatter, when staged; with the digest off, just before Success):
        byte ``offset`` of the first row (page, metadata or state row) its first
        sender sends. ``stats["corrupted"]`` counts the requests it hit."""
        if not isinstance(self.side, DecodeSide):
            raise TransportError(
                f"room={room}: prefill rank {self.rank} holds no committed bytes to corrupt; "
                "call corrupt() on a decode connector"
            )
        self.side.corrupt[room, int(epoch)] = int(offset)

    def sender(self, room: int, epoch: int = 0) -> ConnectorSender:
        """Prefill's handle on ``room``'s attempt ``epoch`` (a retry is the next one)."""
        return ConnectorSender(self, room, epoch)

    def receiver(self, room: int, epoch: int = 0) -> ConnectorReceiver:
        """Decode's handle on ``room``'s attempt ``epoch`` (a retry is the next one)."""
        return ConnectorReceiver(self, room, epoch)

    # -- the staging gate (decode; see lifecycle.protocols.StagingGate) ----------------------
    def advance(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> None:
        """Place the next pages of every staged request whose data all landed."""
        self.side.advance(rooms, indices)

    def pending(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.bool_]:
        """True where a request's scatter is not done yet."""
        with self._lock:
            out: NDArray[np.bool_] = self.scatter_left[indices] > 0
            return out

    # -- messages ------------------------------------------------------------------------
    def _peer_info(self, peer: int, store: Any) -> dict[str, Any] | None:
        c = self.config  # (a dead peer is named after heartbeat_misses: only a live one errs)
        tries = 3 * c.heartbeat_misses + 1
        return self.mail.connected(peer, store, self._connect, c.heartbeat_interval, tries)

    def _on_message(self, msg: dict[str, Any], store: Any) -> None:
        with self._msg_lock:  # one message at a time, whichever thread (see _take)
            self._handle(msg, store)

    def _handle(self, msg: dict[str, Any], store: Any) -> None:
        if "from" in msg and not live.received(self, msg, store):
            return  # from an old incarnation of a restarted peer: refused
        with self._lock:
            route, req, reason = self.attempts.route(msg)
            self.stats["stale_epoch"] = self.attempts.stale
        if route is Route.STALE:  # an older attempt's word, that attempt gone: never applied
            logger.debug("room=%s: %s of another attempt refused", msg["room"], msg["kind"])
        elif route is Route.LATE:  # released here: the side answers what needs an answer
            self.side.late(msg["room"], msg, reason, store)
        elif req is not None:
            self.side.on_message(req, msg, store)

    # -- the background loop --------------------------------------------------------------------
    def _loop(self) -> None:
        store = self.mail.client()
        cfg, last_look, interval = self.config, 0.0, self.config.idle_interval
        while not self._stop.is_set():
            now = NOW()
            try:
                if now - last_look >= cfg.heartbeat_interval:
                    self._check_peers(store)
                    last_look = now
                for msg in self.mail.received():
                    self._on_message(msg, store)
                for room, epoch, peer, span in self._notified():
                    word = {"kind": Msg.landed if span else Msg.done, "room": room, "epoch": epoch}
                    self._on_message({**word, "from": peer, "notified": True, "span": span}, store)
                self.side.every_pass(store)
                self._timeouts(now, store)
                with self._lock:
                    reqs = list(self._reqs.values())
                # poll the engine closely only while writes are in flight; otherwise sleep
                # until a message wakes us (the engine's threads need the CPU)
                busy = [self._advance(r, store) for r in reqs]
                interval = cfg.poll_interval if any(busy) else cfg.idle_interval
            except Exception as e:  # the loop must survive anything one request does
                self.last_error = e  # first: whoever sees a request failed sees why
                with self._lock:
                    reqs = list(self._reqs.values())
                for r in reqs:
                    self._fail(r, FailureReason.TRANSFER_ERROR, store)
                logger.debug("connector loop failed every live request", exc_info=True)
            self._wake.wait(interval)
            self._wake.clear()

    def _check_peers(self, store: Any) -> None:
        live.check_peers(self, store)

    def _timeouts(self, now: float, store: Any) -> None:
        live.timeouts(self, now, store)

    def _reap(self, req: Request[Any], store: Any) -> None:
        for tok in list(req.tokens):
            s = self._check(tok)
            if s != 0:
                req.tokens.remove(tok)
                self._forget(tok)
            if s < 0:
                self._fail(req, FailureReason.TRANSFER_ERROR, store)

    def _advance(self, req: Request[Any], store: Any) -> bool:
        """Move one request on; True while it wants close polling (writes in flight)."""
        if req.released:
            return False
        watch = self.side.steps(req, store)
        if req.cleared:
            self._clear(req)
        return watch or bool(req.tokens)

    def _submit(
        self, req: Request[Any], info: dict[str, Any], w: Writes, notif: bytes, st: Any
    ) -> None:
        if w[0].size == 0 or self._phase(req) not in (Phase.Metadata, Phase.Writing):
            return
        token = self._write(info, *w, notif)
        if token is None:
            self._fail(req, FailureReason.PEER_DEAD, st)
        else:
            req.tokens.append(token)
            self.stats["bytes_written"] += int(w[2].sum())
            self.stats["writes"] += int(w[2].size)

    def close(self, wait: float | None = None) -> None:
        """Shut down: fail every request still live (reason aborted), let the
        loop finish their protocol for up to ``wait`` seconds (default: the
        drain timeout) -- each tells its peers once none of its writes is in
        flight, so they need not wait for this rank's heartbeat to stop --
        then stop the loop and the engine. A request whose unfinished legs are
        all silent peers is not waited for; ``wait=0`` stops at once."""
        deadline = NOW() + (self.config.drain_timeout if wait is None else wait)
        with self._lock:
            held = [r for r in self._reqs.values() if not r.released]
        for r in held:  # (a store that stopped answering must not hold this up)
            if not IS_TERMINAL[self._phase(r)] and NOW() < deadline:
                self._fail(r, FailureReason.ABORTED, self.store)
        self._wake.set()
        while self._thread.is_alive() and live.owing(self) and NOW() < deadline:
            time.sleep(0.005)
        self._stop.set()
        self._wake.set()
        self.mail.close()
        self._thread.join(timeout=2)
        self.views.close()  # (its digest threads read the buffers the engine lets go)
        self._stop_engine()
