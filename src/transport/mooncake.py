"""A real Mooncake backend: KV pages and metadata rows written over TCP.

Data plane: a Mooncake ``TransferEngine`` per rank (``P2PHANDSHAKE``, TCP), on
memory registered from the :class:`~buffers.KVArgs` of each side. Control
plane: a ``torch.distributed.TCPStore`` as bootstrap store (endpoint records,
heartbeats) and as mailbox (one queue per rank for handshake, page lists,
completion and abort messages). No server of our own.

Flow of one request (prefill TP rank *r* pairs with decode TP rank *r*):

1. decode ``init``: look up the prefill endpoint (Bootstrapping until it is
   published), register the room with prefill -> WaitingForInput;
2. prefill: Bootstrapping until decode registered the room -> WaitingForInput;
3. decode ``send_metadata(pages, slot)``: tells prefill where to write;
4. prefill ``init(num_pages, slot)`` then ``send(pages)`` per chunk: each chunk
   is written as soon as its destination is known (contiguous runs coalesced),
   Transferring meanwhile; after the last chunk the metadata row is written,
   the room field last; then prefill reports done -> Success on both sides.

Failures: a submit to a dead peer returns batch id 0 (failed, reason peer
dead); a failed write is a transfer error; an abort on either side reaches
the other (reason aborted); a peer whose heartbeat stops for
``heartbeat_misses`` intervals fails every unfinished request with it (peer
dead); bootstrap and waiting timeouts fail requests locally. A transfer's
status can be read only once from the engine, so every read is cached.

All statuses live in numpy arrays indexed by a request's ``index``: the
manager is a batch poller (``poll_many`` is one gather).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

from buffers.kv_args import KVArgs
from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll
from transport.addressing import advertised_host, check_store_reachable
from transport.errors import BackendUnavailable
from transport.status_arrays import StatusArrays, StatusHandle

__all__ = ["MooncakeConfig", "MooncakeManager", "MooncakeSender", "MooncakeReceiver", "probe"]

B, W, T, S, F = (
    int(KVPoll.Bootstrapping),
    int(KVPoll.WaitingForInput),
    int(KVPoll.Transferring),
    int(KVPoll.Success),
    int(KVPoll.Failed),
)


def probe() -> None:
    """Raise BackendUnavailable unless the Mooncake engine imports here."""
    # the engine logs every connection at INFO through glog; keep warnings and up
    # unless the user asked otherwise
    os.environ.setdefault("GLOG_minloglevel", "1")
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(
            "mooncake",
            f"cannot import mooncake.engine ({e})",
            "Install it with `pip install 'pd-lifecycle[mooncake]'` and Debian's libibverbs1",
        ) from None


@attrs.frozen
class MooncakeConfig:
    role: str  # "prefill" | "decode"
    tp_rank: int
    store_host: str = "127.0.0.1"
    store_port: int = 0
    hostname: str | None = None  # None: discovered, see transport.addressing
    namespace: str = "pd"
    heartbeat_interval: float = 0.5
    heartbeat_misses: int = 4
    bootstrap_timeout: float | None = 300.0
    waiting_timeout: float | None = 300.0
    poll_interval: float = 0.0005
    idle_interval: float = 0.05
    drain_timeout: float = 10.0

    def __attrs_post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(
                f"MooncakeConfig.role must be 'prefill' or 'decode', got {self.role!r}"
            )


def _runs(
    src: NDArray[np.int64], dst: NDArray[np.int64]
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """Coalesce page pairs into runs contiguous on both sides: (src start, dst start, length)."""
    if src.size == 0:
        e = np.empty(0, dtype=np.int64)
        return e, e, e
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], brk))
    lens = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], lens


class _Req:
    __slots__ = (
        "batches",
        "chunks",
        "cleared",
        "created",
        "drained",
        "dst_pages",
        "dst_slot",
        "failed_at",
        "index",
        "local_slot",
        "meta_sent_at",
        "meta_stage",
        "notify",
        "num_pages",
        "peer",
        "registered",
        "room",
        "sent_pages",
        "want_register",
    )

    def __init__(self, room: int, index: int, peer: int) -> None:
        self.room, self.index, self.peer = room, index, peer
        self.num_pages = -1
        self.local_slot = -1
        self.chunks: list[NDArray[np.int64]] = []
        self.sent_pages = 0
        self.dst_pages: NDArray[np.int64] | None = None
        self.dst_slot = -1
        self.batches: list[int] = []
        self.meta_stage = 0  # 0 none, 1 fields in flight, 2 room in flight, 3 done
        self.created = time.monotonic()
        self.meta_sent_at = float("nan")
        self.registered = False
        self.want_register = False
        self.drained = False  # no write for this request can land any more
        self.cleared = False  # the scheduler let go; kept until in-flight writes drain
        self.notify: dict[str, Any] | None = None  # told to the peer once drained
        self.failed_at = float("nan")


class MooncakeManager(StatusArrays):
    """One per rank. Create senders (prefill) or receivers (decode) from it."""

    def __init__(self, kv_args: KVArgs, config: MooncakeConfig) -> None:
        probe()
        from mooncake.engine import TransferEngine
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        self.config = config
        self.kv_args = kv_args
        host = advertised_host(
            config.hostname,
            target=config.store_host,
            setting="MooncakeConfig.hostname",
            target_setting="MooncakeConfig.store_host",
        )
        check_store_reachable(config.store_host, config.store_port, "MooncakeConfig.store_host")
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise BackendUnavailable(
                "mooncake", f"engine initialize returned {rc}", "check the host name"
            )
        self.endpoint = f"{host}:{self.engine.get_rpc_port()}"
        ptrs = list(kv_args.kv_data_ptrs) + list(kv_args.aux_data_ptrs)
        lens = list(kv_args.kv_data_lens) + list(kv_args.aux_data_lens)
        if self.engine.batch_register_memory(ptrs, lens) != 0:
            raise BackendUnavailable(
                "mooncake", "registering the KV/metadata buffers failed", "check KVArgs"
            )
        self._store_args = (config.store_host, config.store_port)
        self.store = TCPStore(
            config.store_host, config.store_port, is_master=False, timeout=timedelta(seconds=30)
        )
        ns = config.namespace
        self._me = f"{ns}/{config.role}/{config.tp_rank}"
        self._peer_role = "decode" if config.role == "prefill" else "prefill"
        self.store.set(
            f"{self._me}/endpoint",
            json.dumps(
                {
                    "endpoint": self.endpoint,
                    "kv_ptrs": list(kv_args.kv_data_ptrs),
                    "kv_item_lens": list(kv_args.kv_item_lens),
                    "aux_ptrs": list(kv_args.aux_data_ptrs),
                    "aux_item_lens": list(kv_args.aux_item_lens),
                }
            ),
        )
        super().__init__()
        self._reqs: dict[int, _Req] = {}  # room -> request
        self._lock = threading.Lock()
        self._peers: dict[int, dict[str, Any]] = {}
        self._early: dict[int, list[dict[str, Any]]] = {}
        self._cleared: set[int] = set()
        self._peer_dead: set[int] = set()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._mailbox: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._mailbox_key = f"{config.namespace}/q/{config.role}/{config.tp_rank}"
        self._listener = threading.Thread(target=self._listen, name="mooncake-mailbox", daemon=True)
        self._listener.start()
        self._thread = threading.Thread(
            target=self._loop, name=f"mooncake-{config.role}{config.tp_rank}", daemon=True
        )
        self._thread.start()

    # -- request slots ------------------------------------------------------
    def _take(self, room: int, peer: int, initial: int) -> _Req:
        with self._lock:
            if room in self._reqs:
                raise ValueError(f"room={room} already has a live request on this manager")
            req = _Req(room, self.take(initial), peer)
            self._reqs[room] = req
            self._cleared.discard(room)
            early = self._early.pop(room, [])
        for msg in early:
            self._on_message(msg, None)
        return req

    def _release(self, req: _Req) -> None:
        with self._lock:
            if req.batches or req.notify is not None:
                req.cleared = True  # the loop drops it once its writes have drained
                return
            if self._reqs.get(req.room) is req:
                del self._reqs[req.room]
                self.release(req.index)
                self._cleared.add(req.room)
                if len(self._cleared) > 100_000:
                    self._cleared.clear()

    def _set(self, req: _Req, status: int, reason: FailureReason = FailureReason.NONE) -> None:
        if self.set(req.index, status, reason) and status == F:
            req.failed_at = time.monotonic()

    def sender(self, room: int, peer: int | None = None) -> MooncakeSender:
        return MooncakeSender(self, room, self.config.tp_rank if peer is None else peer)

    def receiver(self, room: int, peer: int | None = None) -> MooncakeReceiver:
        return MooncakeReceiver(self, room, self.config.tp_rank if peer is None else peer)

    # -- messaging -------------------------------------------------------------
    def _send(self, peer: int, msg: dict[str, Any], store: Any) -> None:
        msg.setdefault("from", self.config.tp_rank)
        store.queue_push(
            f"{self.config.namespace}/q/{self._peer_role}/{peer}", json.dumps(msg).encode()
        )

    def _listen(self) -> None:
        """Block on this rank's mailbox (no polling RPCs) and wake the loop."""
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        # a long timeout: close() wakes this pop with a message of our own
        store = TCPStore(*self._store_args, is_master=False, timeout=timedelta(days=1))
        while not self._stop.is_set():
            try:
                raw = store.queue_pop(self._mailbox_key, block=True)
            except Exception:
                return  # the store is gone: so is the group
            msg = json.loads(raw)
            if msg.get("kind") == "_stop":
                return
            self._mailbox.put(msg)
            self._wake.set()

    def _inbox(self, store: Any) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            try:
                out.append(self._mailbox.get_nowait())
            except queue.Empty:
                return out

    def _peer_info(self, peer: int, store: Any) -> dict[str, Any] | None:
        info = self._peers.get(peer)
        if info is None:
            key = f"{self.config.namespace}/{self._peer_role}/{peer}/endpoint"
            if not store.check([key]):
                return None
            info = self._peers[peer] = json.loads(store.get(key))
        return info

    # -- the background loop -------------------------------------------------------
    def _loop(self) -> None:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        store = TCPStore(*self._store_args, is_master=False, timeout=timedelta(seconds=30))
        last_beat = 0.0
        self._batch_results: dict[int, int] = {}
        interval = self.config.poll_interval
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if now - last_beat >= self.config.heartbeat_interval:
                    store.set(f"{self._me}/hb", repr(time.time()))
                    self._check_peers(store)
                    last_beat = now
                msgs = self._inbox(store)
                for msg in msgs:
                    self._on_message(msg, store)
                with self._lock:
                    reqs = list(self._reqs.values())
                for req in reqs:
                    self._advance(req, store, now)
                # poll the engine closely only while writes are in flight; otherwise
                # sleep until a message wakes us (the engine's threads need the CPU)
                inflight = any(r.batches for r in reqs)
                interval = self.config.poll_interval if inflight else self.config.idle_interval
            except Exception as e:  # the loop must survive anything one request does
                with self._lock:
                    reqs = list(self._reqs.values())
                for req in reqs:
                    self._set(req, F, FailureReason.TRANSFER_ERROR)
                self.last_error = e
            self._wake.wait(interval)
            self._wake.clear()

    def _check_peers(self, store: Any) -> None:
        limit = self.config.heartbeat_interval * self.config.heartbeat_misses
        with self._lock:
            peers = {r.peer for r in self._reqs.values() if self.status[r.index] not in (S, F)}
        for peer in peers - self._peer_dead:
            key = f"{self.config.namespace}/{self._peer_role}/{peer}/hb"
            if not store.check([key]):
                continue  # not up yet: the bootstrap timeout covers a peer that never comes
            if time.time() - float(store.get(key).decode()) > limit:
                self._peer_dead.add(peer)
        if self._peer_dead:
            with self._lock:
                reqs = [r for r in self._reqs.values() if r.peer in self._peer_dead]
            for r in reqs:
                self._set(r, F, FailureReason.PEER_DEAD)
                r.drained = True  # a dead peer writes nothing more
                r.notify = None

    def _on_message(self, msg: dict[str, Any], store: Any) -> None:
        room = msg["room"]
        with self._lock:
            req = self._reqs.get(room)
            if req is None:
                if room not in self._cleared:
                    # the peer may be ahead of our scheduler: keep it for the request
                    self._early.setdefault(room, []).append(msg)
                elif msg["kind"] == "abort" and store is not None:
                    # already finished and drained here: nothing more will be written
                    sender = int(msg.get("from", self.config.tp_rank))
                    self._send(sender, {"kind": "stopped", "room": room}, store)
                return  # a late message for a cleared request must not bring it back
        kind = msg["kind"]
        if kind == "register":
            req.registered = True
            if self.status[req.index] == B:
                self._set(req, W)
        elif kind == "pages":
            req.dst_pages = np.asarray(msg["pages"], dtype=np.int64)
            req.dst_slot = int(msg["slot"])
        elif kind == "done":
            req.drained = True
            self._set(req, S)
        elif kind == "failed":  # prefill failed it and its writes have drained
            req.drained = True
            self._set(req, F, FailureReason(int(msg["reason"])))
        elif kind == "stopped":  # prefill acknowledged our abort; nothing more will land
            req.drained = True
        elif kind == "abort":  # decode gave up: stop writing, say so once drained
            self._set(req, F, FailureReason(int(msg.get("reason", FailureReason.ABORTED))))
            req.notify = {"kind": "stopped", "room": req.room}

    def _check_batch(self, bid: int) -> int:
        # the engine reports a finished batch once; later reads say "in progress"
        done = self._batch_results.get(bid)
        if done is not None:
            return done
        s = int(self.engine.transfer_check_status(bid))
        if s != 0:
            self._batch_results[bid] = s
        return s

    def _advance(self, req: _Req, store: Any, now: float) -> None:
        st = int(self.status[req.index])
        if st == F and self.config.role == "prefill":
            self._drain(req, store)
            return
        if st in (S, F):
            return
        cfg = self.config
        if cfg.role == "decode":
            if (
                st == B
                and req.want_register
                and not req.registered
                and self._peer_info(req.peer, store) is not None
            ):
                self._send(req.peer, {"kind": "register", "room": req.room}, store)
                req.registered = True
                self._set(req, W)
            if (
                cfg.bootstrap_timeout is not None
                and st == B
                and now - req.created > cfg.bootstrap_timeout
            ):
                self._set(req, F, FailureReason.BOOTSTRAP_TIMEOUT)
            if cfg.waiting_timeout is not None and now - req.meta_sent_at > cfg.waiting_timeout:
                self._set(req, F, FailureReason.WAITING_TIMEOUT)
            return
        # prefill
        if (
            cfg.bootstrap_timeout is not None
            and st == B
            and now - req.created > cfg.bootstrap_timeout
        ):
            self._fail(req, FailureReason.BOOTSTRAP_TIMEOUT)
            return
        for bid in list(req.batches):
            s = self._check_batch(bid)
            if s < 0:
                self._fail(req, FailureReason.TRANSFER_ERROR)
                return
            if s > 0:
                req.batches.remove(bid)
                self._batch_results.pop(bid, None)
        if req.dst_pages is None or req.num_pages < 0:
            return
        info = self._peer_info(req.peer, store)
        if info is None:
            return
        while req.chunks:
            chunk = req.chunks.pop(0)
            dst = req.dst_pages[req.sent_pages : req.sent_pages + chunk.size]
            if dst.size != chunk.size:
                self._fail(req, FailureReason.TRANSFER_ERROR)
                return
            self._submit_pages(req, chunk, dst, info)
            req.sent_pages += chunk.size
            if self.status[req.index] == F:
                return
        if req.sent_pages >= req.num_pages and req.meta_stage == 0:
            # the row's fields travel with the last pages; only the room waits for all
            self._submit_meta(req, info, room_field=False)
            req.meta_stage = 1
        if req.sent_pages >= req.num_pages and not req.batches:
            if req.meta_stage == 1:
                self._submit_meta(req, info, room_field=True)
                req.meta_stage = 2
            elif req.meta_stage == 2:
                req.meta_stage = 3
                self._send(req.peer, {"kind": "done", "room": req.room}, store)
                self._set(req, S)

    def _fail(self, req: _Req, reason: FailureReason) -> None:
        """Fail locally; the peer hears of it once every write in flight has landed."""
        self._set(req, F, reason)
        if req.notify is None:
            req.notify = {"kind": "failed", "room": req.room, "reason": int(reason)}

    def _drain(self, req: _Req, store: Any) -> None:
        for bid in list(req.batches):
            if self._check_batch(bid) != 0:
                req.batches.remove(bid)
                self._batch_results.pop(bid, None)
        if req.batches:
            return
        if req.notify is not None and req.peer not in self._peer_dead:
            self._send(req.peer, req.notify, store)
        req.notify = None
        req.drained = True
        if req.cleared:
            req.cleared = False
            self._release(req)

    def _submit(
        self, req: _Req, info: dict[str, Any], srcs: list[int], dsts: list[int], lens: list[int]
    ) -> None:
        if not srcs:
            return
        bid = int(self.engine.batch_transfer_async_write(info["endpoint"], srcs, dsts, lens))
        if bid == 0:  # the engine's way of saying the peer is unreachable
            self._set(req, F, FailureReason.PEER_DEAD)
            req.notify = {
                "kind": "failed",
                "room": req.room,
                "reason": int(FailureReason.PEER_DEAD),
            }
            return
        req.batches.append(bid)

    def _submit_pages(
        self, req: _Req, src: NDArray[np.int64], dst: NDArray[np.int64], info: dict[str, Any]
    ) -> None:
        s0, d0, ln = _runs(src, dst)
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        for base, peer_base, item in zip(
            self.kv_args.kv_data_ptrs, info["kv_ptrs"], self.kv_args.kv_item_lens
        ):
            srcs.extend((base + s0 * item).tolist())
            dsts.extend((peer_base + d0 * item).tolist())
            lens.extend((ln * item).tolist())
        self._submit(req, info, srcs, dsts, lens)

    def _submit_meta(self, req: _Req, info: dict[str, Any], room_field: bool) -> None:
        if req.local_slot < 0 or req.dst_slot < 0:
            return  # no row to write: decode's metadata gate will hold the request
        fields = list(zip(self.kv_args.aux_data_ptrs, info["aux_ptrs"], self.kv_args.aux_item_lens))
        # the last aux buffer is the room column: written alone, after everything else landed
        chosen = fields[-1:] if room_field else fields[:-1]
        self._submit(
            req,
            info,
            [b + req.local_slot * it for b, _, it in chosen],
            [p + req.dst_slot * it for _, p, it in chosen],
            [it for _, _, it in chosen],
        )

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        with contextlib.suppress(Exception):
            self.store.queue_push(
                self._mailbox_key, json.dumps({"kind": "_stop", "room": 0}).encode()
            )
        self._thread.join(timeout=2)
        self._listener.join(timeout=2)


class _Handle(StatusHandle):
    def __init__(self, manager: MooncakeManager, room: int, peer: int, initial: int) -> None:
        self.manager = manager
        self._req = manager._take(room, peer, initial)
        super().__init__(manager, room, self._req.index)
        self._cleared = False

    def abort(self) -> None:
        self.fail(FailureReason.ABORTED)

    def fail(self, reason: FailureReason) -> None:
        """The scheduler gave up on this request (agreed Failed, or a client abort):
        stop, and make the peer stop writing; see :attr:`drained`."""
        m, req = self.manager, self._req
        if m.status[self.index] == S or (req.notify is not None) or req.drained:
            return
        if m.config.role == "prefill":
            m._fail(req, reason)  # the loop tells decode once in-flight writes drain
            return
        m._set(req, F, reason)
        # if the message cannot go out, the peer's heartbeat or timeout catches up
        with contextlib.suppress(Exception):
            m._send(
                req.peer,
                {"kind": "abort", "room": self.bootstrap_room, "reason": int(reason)},
                m.store,
            )

    @property
    def drained(self) -> bool:
        """No write for this request can land any more: its pages and metadata
        row may be reused. Until then, keep them quarantined."""
        req, m = self._req, self.manager
        if req.drained or req.peer in m._peer_dead:
            return True
        if m.status[self.index] == S and m.config.role == "prefill":
            return True
        # last resort, so that a lost peer cannot pin memory forever
        return bool(time.monotonic() - req.failed_at > m.config.drain_timeout)

    def clear(self) -> None:
        if not self._cleared:
            self._cleared = True
            self.manager._release(self._req)


class MooncakeSender(_Handle):
    def __init__(self, manager: MooncakeManager, room: int, peer: int) -> None:
        super().__init__(manager, room, peer, B)

    def init(self, num_pages: int, metadata_slot: int | None = None) -> None:
        self._req.local_slot = -1 if metadata_slot is None else metadata_slot
        self._req.num_pages = num_pages
        if num_pages > 0:
            self.manager._set(self._req, T)
        self.manager._wake.set()

    def send(self, page_indices: ArrayLike, state_indices: Any = None) -> None:
        pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
        if pages.size:
            self._req.chunks.append(pages)
            self.manager._wake.set()


class MooncakeReceiver(_Handle):
    def __init__(self, manager: MooncakeManager, room: int, peer: int) -> None:
        super().__init__(manager, room, peer, B)

    def init(self, prefill_dp_rank: int | None = None) -> None:
        self._req.want_register = True  # registers once the prefill endpoint is known
        self.manager._wake.set()

    def send_metadata(
        self,
        page_indices: ArrayLike,
        metadata_slot: int,
        state_indices: Any = None,
        decode_prefix_len: int = 0,
    ) -> None:
        pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
        m = self.manager
        self._req.meta_sent_at = time.monotonic()
        m._send(
            self._req.peer,
            {
                "kind": "pages",
                "room": self.bootstrap_room,
                "pages": pages.tolist(),
                "slot": int(metadata_slot),
            },
            m.store,
        )


def kv_args_for(
    tensors: Sequence[Any], aux: tuple[list[int], list[int], list[int]], engine_rank: int
) -> KVArgs:
    """KVArgs from a list of KV tensors shaped (num_pages, ...) and metadata ``buf_infos()``."""
    return KVArgs(
        engine_rank=engine_rank,
        kv_data_ptrs=[t.data_ptr() for t in tensors],
        kv_data_lens=[t.nbytes for t in tensors],
        kv_item_lens=[t[0].nbytes for t in tensors],
        aux_data_ptrs=aux[0],
        aux_data_lens=aux[1],
        aux_item_lens=aux[2],
    )


MANAGER = MooncakeManager
SENDER = MooncakeSender
RECEIVER = MooncakeReceiver
BOOTSTRAP = None
