"""One connector for every transfer engine: all that is not engine-specific.

Control plane in :mod:`transport.mailbox` (rendezvous, queues, heartbeats);
where writes go in :mod:`transport.layout`; an engine subclass (Mooncake,
NIXL) registers memory, issues writes and reads their completion. Each
request moves along the protocol of :mod:`transport.connector_graph` (the
``phase`` column, fired through its tables; in batches for timeouts and dead
peers). Prefill TP rank *r* pairs with decode TP rank *r*. A failed request
stays quarantined (Aborted) until no write for it can land (Drained).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from buffers.kv_args import KVArgs
from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll
from transport.addressing import engine_host
from transport.connector_config import ConnectorConfig
from transport.connector_graph import IS_TERMINAL, POLL, TRIGGER_ID, Phase, fire
from transport.layout import Writes, page_writes, row_writes
from transport.mailbox import Mailbox
from transport.status_arrays import StatusArrays

if TYPE_CHECKING:
    from transport.connector_handles import ConnectorReceiver, ConnectorSender

__all__ = ["ConnectorConfig", "Connector"]

T, S, F = int(KVPoll.Transferring), int(KVPoll.Success), int(KVPoll.Failed)
NOW = time.monotonic
logger = logging.getLogger(__name__)


class _Req:
    """One request's bookkeeping; its phase and clocks live in the manager's columns."""

    def __init__(self, room: int, index: int, peer: int) -> None:
        self.room, self.index, self.peer = room, index, peer
        self.num_pages = self.local_slot = -1
        self.chunks: list[NDArray[np.int64]] = []
        self.sent_pages, self.dst_slot = 0, -1
        self.dst_pages: NDArray[np.int64] | None = None
        self.tokens: list[Any] = []  # the engine's handles of writes in flight
        self.fields_out = self.want_register = self.cleared = self.released = False
        self.reply: dict[str, Any] | None = None  # told to the peer once drained


class Connector(StatusArrays):
    """One per rank. Subclasses provide the engine hooks (``_start_engine`` ... ``_stop_engine``)."""

    NOTIFIES: ClassVar[bool] = False  # whether ``_notified`` reports completions

    COLUMNS: ClassVar[dict[str, tuple[Any, Any]]] = {
        "phase": (np.int8, int(Phase.Drained)),
        "born": (np.float64, np.nan),
        "waited": (np.float64, np.nan),
        "failed_at": (np.float64, np.nan),
    }

    def __init__(self, kv_args: KVArgs, config: ConnectorConfig) -> None:
        self.config, self.kv_args = config, kv_args
        #: the address this rank's engine advertises (checked to be on this host)
        self.host = engine_host(config, type(self).__name__.replace("Manager", "Config"))
        super().__init__()
        self.phase: NDArray[np.int8]
        self.born: NDArray[np.float64]
        self.waited: NDArray[np.float64]
        self.failed_at: NDArray[np.float64]
        info = self._start_engine()
        self._stop, self._wake = threading.Event(), threading.Event()
        c = config
        self.mail = Mailbox(c.store_host, c.store_port, c.namespace, c.role, c.tp_rank, self._wake)
        self.store = self.mail.store
        info.update(kv_ptrs=list(kv_args.kv_data_ptrs), kv_item_lens=list(kv_args.kv_item_lens))
        info.update(aux_ptrs=list(kv_args.aux_data_ptrs), aux_item_lens=list(kv_args.aux_item_lens))
        self._reqs: dict[int, _Req] = {}  # room -> request
        self._early: dict[int, list[dict[str, Any]]] = {}
        self._cleared: set[int] = set()
        self._peer_dead: set[int] = set()
        self.last_error: Exception | None = None
        self.mail.publish(info)
        self._thread = threading.Thread(target=self._loop, name=f"pd-{c.role}", daemon=True)
        self._thread.start()

    # -- engine hooks ---------------------------------------------------------------------
    def _start_engine(self) -> dict[str, Any]:
        """Start the engine and register ``kv_args``; return what peers need to write here."""
        raise NotImplementedError

    def _connect(self, peer: int, info: dict[str, Any]) -> None: ...  # once, before writes

    def _write(self, info: dict[str, Any], *w_notif: Any) -> Any:
        """Issue writes (src, dst, lens, notification); a token, None if unreachable."""
        raise NotImplementedError

    def _check(self, token: Any) -> int:  # 0 in flight, 1 landed, -1 failed; then _forget
        raise NotImplementedError

    def _forget(self, token: Any) -> None: ...

    def _notified(self) -> list[int]:
        """Rooms whose completion the engine itself told this (decode) rank about."""
        return []

    def _stop_engine(self) -> None: ...

    # -- requests and the protocol ---------------------------------------------------------
    def _take(self, room: int, peer: int) -> _Req:
        with self._lock:
            if room in self._reqs:
                raise ValueError(f"room={room} already has a live request on this manager")
            req = _Req(room, self.take(int(KVPoll.Bootstrapping)), peer)
            self.phase[req.index] = Phase.Bootstrap
            self.born[req.index] = NOW()
            self._reqs[room] = req
            self._cleared.discard(room)
            early = self._early.pop(room, [])
        for msg in early:
            self._on_message(msg, self.store)
        return req

    def _fire_many(
        self, reqs: Sequence[_Req], trigger: str, reason: FailureReason = FailureReason.NONE
    ) -> NDArray[np.bool_]:
        """Move ``reqs`` along ``trigger`` where it is declared; the mask of those moved.
        A released request's slot may be another's already: it never moves."""
        with self._lock:
            keep = np.fromiter((not r.released for r in reqs), dtype=bool, count=len(reqs))
            idx = np.fromiter((r.index for r in reqs), dtype=np.int64, count=len(reqs))[keep]
            new, illegal = fire(self.phase[idx], trigger)
            moved = idx[~illegal]
            self.phase[moved] = new[~illegal]
            effect = int(POLL[TRIGGER_ID[trigger]])
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

    def _fire(self, req: _Req, trigger: str, reason: FailureReason = FailureReason.NONE) -> bool:
        return bool(self._fire_many([req], trigger, reason)[0])

    def _phase(self, req: _Req) -> int:
        with self._lock:
            return int(Phase.Drained) if req.released else int(self.phase[req.index])

    def _fail(self, req: _Req, reason: FailureReason, store: Any) -> None:
        """Fail locally and make the peer stop writing."""
        before = self._phase(req)
        if not self._fire(req, "abort", reason):
            return
        if self.config.role == "prefill":  # decode hears of it once our writes drained
            req.reply = {"kind": "failed", "room": req.room, "reason": int(reason)}
            return
        if before < Phase.Metadata:  # decode told no pages yet: nothing can land
            self._fire(req, "drain")
        with contextlib.suppress(Exception):  # else heartbeats and timeouts catch up
            self.mail.send(
                req.peer, {"kind": "abort", "room": req.room, "reason": int(reason)}, store
            )

    def _clear(self, req: _Req) -> None:
        with self._lock:
            req.cleared = True
            if IS_TERMINAL[self._phase(req)] and not req.tokens and not req.released:
                req.released = True
                del self._reqs[req.room]
                self.release(req.index)
                self._cleared.add(req.room)
                if len(self._cleared) > 100_000:
                    self._cleared.clear()

    def sender(self, room: int, peer: int | None = None) -> ConnectorSender:
        from transport.connector_handles import ConnectorSender

        return ConnectorSender(self, room, self.config.tp_rank if peer is None else peer)

    def receiver(self, room: int, peer: int | None = None) -> ConnectorReceiver:
        from transport.connector_handles import ConnectorReceiver

        return ConnectorReceiver(self, room, self.config.tp_rank if peer is None else peer)

    # -- messages ------------------------------------------------------------------------
    def _peer_info(self, peer: int, store: Any) -> dict[str, Any] | None:
        info, new = self.mail.peer(peer, store)
        if new and info is not None:
            self._connect(peer, info)
        return info

    def _on_message(self, msg: dict[str, Any], store: Any) -> None:
        room, kind = msg["room"], msg["kind"]
        reason = FailureReason(int(msg.get("reason", FailureReason.ABORTED)))
        with self._lock:
            req = self._reqs.get(room)
            if req is None:
                if room not in self._cleared:  # the peer is ahead of our scheduler
                    self._early.setdefault(room, []).append(msg)
                elif kind == "abort":  # finished and drained here: nothing more is written
                    self.mail.send(int(msg["from"]), {"kind": "stopped", "room": room}, store)
                return
        if kind == "register":
            self._fire(req, "handshake")
        elif kind == "pages":
            req.dst_pages = np.asarray(msg["pages"], dtype=np.int64)
            req.dst_slot = int(msg["slot"])
            self._fire(req, "metadata")
        elif kind == "done":
            _ = self._fire(req, "complete") or self._fire(req, "drain")
        elif kind == "failed":  # prefill failed it and its writes have drained
            _ = self._fire(req, "peer_failed", reason) or self._fire(req, "drain")
        elif kind == "stopped":  # prefill acknowledged our abort: nothing more will land
            self._fire(req, "drain")
        elif kind == "abort":  # decode gave up: stop writing, say so once drained
            if self._fire(req, "abort", reason):
                req.reply = {"kind": "stopped", "room": room}
            elif IS_TERMINAL[self._phase(req)]:
                self.mail.send(req.peer, {"kind": "stopped", "room": room}, store)

    # -- the background loop --------------------------------------------------------------------
    def _loop(self) -> None:
        store = self.mail.client()
        cfg, last_beat, interval = self.config, 0.0, self.config.idle_interval
        while not self._stop.is_set():
            now = NOW()
            try:
                if now - last_beat >= cfg.heartbeat_interval:
                    self.mail.beat(store)
                    self._check_peers(store)
                    last_beat = now
                for msg in self.mail.received():
                    self._on_message(msg, store)
                for room in self._notified():
                    self._on_message({"kind": "done", "room": room}, store)
                self._timeouts(now, store)
                with self._lock:
                    reqs = list(self._reqs.values())
                # poll the engine closely only while writes are in flight; otherwise sleep
                # until a message wakes us (the engine's threads need the CPU)
                busy = [self._advance(r, store) for r in reqs]
                interval = cfg.poll_interval if any(busy) else cfg.idle_interval
            except Exception as e:  # the loop must survive anything one request does
                with self._lock:
                    reqs = list(self._reqs.values())
                for r in reqs:
                    self._fail(r, FailureReason.TRANSFER_ERROR, store)
                self.last_error = e
                logger.debug("connector loop failed every live request", exc_info=True)
            self._wake.wait(interval)
            self._wake.clear()

    def _live(self) -> tuple[list[_Req], NDArray[np.int8], NDArray[np.int64]]:
        with self._lock:
            reqs = list(self._reqs.values())
            idx = np.fromiter((r.index for r in reqs), dtype=np.int64, count=len(reqs))
            return reqs, self.phase[idx], idx

    def _check_peers(self, store: Any) -> None:
        limit = self.config.heartbeat_interval * self.config.heartbeat_misses
        reqs, _, _ = self._live()
        self._peer_dead |= self.mail.silent({r.peer for r in reqs} - self._peer_dead, limit, store)
        dead = np.fromiter((r.peer in self._peer_dead for r in reqs), dtype=bool, count=len(reqs))
        if dead.any():
            self._fire_many(
                [r for r, d in zip(reqs, dead) if d], "peer_dead", FailureReason.PEER_DEAD
            )

    def _timeouts(self, now: float, store: Any) -> None:
        cfg = self.config
        reqs, ph, idx = self._live()
        late = np.zeros(idx.size, dtype=bool)
        if cfg.bootstrap_timeout is not None:
            late = (ph == Phase.Bootstrap) & (now - self.born[idx] > cfg.bootstrap_timeout)
        for i in np.flatnonzero(late):
            self._fail(reqs[i], FailureReason.BOOTSTRAP_TIMEOUT, store)
        if cfg.waiting_timeout is not None and cfg.role == "decode":
            late = (ph == Phase.Metadata) & (now - self.waited[idx] > cfg.waiting_timeout)
            for i in np.flatnonzero(late):
                self._fail(reqs[i], FailureReason.WAITING_TIMEOUT, store)
        # last resort, so that a lost peer cannot pin memory forever
        stale = (ph == Phase.Aborted) & (now - self.failed_at[idx] > cfg.drain_timeout)
        self._fire_many([reqs[i] for i in np.flatnonzero(stale)], "drain")

    def _reap(self, req: _Req, store: Any) -> None:
        for tok in list(req.tokens):
            s = self._check(tok)
            if s != 0:
                req.tokens.remove(tok)
                self._forget(tok)
            if s < 0:
                self._fail(req, FailureReason.TRANSFER_ERROR, store)

    def _advance(self, req: _Req, store: Any) -> bool:
        """Move one request on; True while it wants close polling (writes in flight)."""
        if req.released:
            return False
        ph, watch = self._phase(req), False
        if self.config.role == "prefill":
            self._prefill_steps(req, store)
        elif ph == Phase.Bootstrap and req.want_register and self._peer_info(req.peer, store):
            self.mail.send(req.peer, {"kind": "register", "room": req.room}, store)
            self._fire(req, "handshake")
        else:  # an engine that notifies completion is watched closely while data is due
            watch = self.NOTIFIES and ph == Phase.Metadata
        if req.cleared:
            self._clear(req)
        return watch or bool(req.tokens)

    def _prefill_steps(self, req: _Req, store: Any) -> None:
        before = -1  # a write that landed at once lets the next step go in the same pass
        while self._phase(req) != before:
            self._reap(req, store)
            before = ph = self._phase(req)
            if ph in (Phase.Metadata, Phase.Writing) and req.num_pages >= 0:
                self._issue(req, store)
            elif ph == Phase.RoomWritten and not req.tokens:
                self.mail.send(req.peer, {"kind": "done", "room": req.room}, store)
                self._fire(req, "complete")
            elif ph == Phase.Aborted and not req.tokens:
                if req.reply is not None and req.peer not in self._peer_dead:
                    self.mail.send(req.peer, req.reply, store)
                req.reply = None
                self._fire(req, "drain")

    def _issue(self, req: _Req, store: Any) -> None:
        info = self._peer_info(req.peer, store)
        if info is None or req.dst_pages is None:
            return
        while req.chunks and self._phase(req) in (Phase.Metadata, Phase.Writing):
            chunk = req.chunks.pop(0)
            dst = req.dst_pages[req.sent_pages : req.sent_pages + chunk.size]
            if dst.size != chunk.size:
                self._fail(req, FailureReason.TRANSFER_ERROR, store)
                return
            self._submit(req, info, page_writes(self.kv_args, info, chunk, dst), b"", store)
            req.sent_pages += chunk.size
        if req.sent_pages >= req.num_pages and not req.fields_out:
            # the row's fields travel with the last pages; only the room waits for all
            self._submit_row(req, info, False, store)
            req.fields_out = True
        if self._phase(req) == Phase.Metadata and (req.tokens or req.fields_out):
            self._fire(req, "write")
        if self._phase(req) == Phase.Writing and req.fields_out and not req.tokens:
            self._submit_row(req, info, True, store)
            self._fire(req, "write_room")

    def _submit(self, req: _Req, info: dict[str, Any], w: Writes, notif: bytes, st: Any) -> None:
        if w[0].size == 0 or self._phase(req) not in (Phase.Metadata, Phase.Writing):
            return
        token = self._write(info, *w, notif)
        if token is None:
            self._fail(req, FailureReason.PEER_DEAD, st)
        else:
            req.tokens.append(token)

    def _submit_row(self, req: _Req, info: dict[str, Any], room_field: bool, st: Any) -> None:
        if req.local_slot < 0 or req.dst_slot < 0:
            return  # no row to write: decode's metadata gate will hold the request
        w = row_writes(self.kv_args, info, req.local_slot, req.dst_slot, room_field)
        self._submit(req, info, w, str(req.room).encode() if room_field else b"", st)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self.mail.close()
        self._thread.join(timeout=2)
        self._stop_engine()
