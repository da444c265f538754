"""The connector's control plane over one ``torch.distributed.TCPStore``:
endpoint records (rendezvous), one message queue per rank, and heartbeats.
No server of our own: the store the process group already has serves it.

Keys, under the configured namespace: ``{role}/{rank}/endpoint`` (JSON record
of what a peer needs to write here), ``{role}/{rank}/hb`` (a value that
changes with every heartbeat: an observer counts how long it has watched it
unchanged, on its own clock, so hosts' clocks need not agree), the queue
``q/{role}/{rank}``, and ``prefill/group{dp}`` (a prefill DP group's TP size
and head count, which decode reads before it knows whom to register a request
with). A rank is its global id: DP group x TP
size + TP rank.
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

__all__ = ["Mailbox", "SAME", "NEW", "STALE"]

#: what :meth:`Mailbox.incarnation_of` says of a message's sender
SAME, NEW, STALE = "same", "new", "stale"

logger = logging.getLogger(__name__)


def _store(host: str, port: int, timeout: timedelta) -> Any:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(host, port, is_master=False, timeout=timeout)


class Mailbox:
    """One rank's end. A store client is not thread-safe: every method takes the
    client of the calling thread (``self.store`` for the scheduler's, :meth:`client`
    for another thread's)."""

    def __init__(
        self, host: str, port: int, namespace: str, role: str, rank: int, wake: threading.Event
    ) -> None:
        self._addr, self._ns, self._rank, self._wake = (host, port), namespace, rank, wake
        self._peer_role = "decode" if role == "prefill" else "prefill"
        self._me = f"{namespace}/{role}/{rank}"
        self._key = f"{namespace}/q/{role}/{rank}"
        self.store = self.client()
        #: what peers sent, as JSON read it (the connector parses and checks each)
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._peers: dict[int, dict[str, Any]] = {}
        #: peer -> when to try connecting again (its record is up, its engine was not)
        self._retry_at: dict[int, float] = {}
        #: peer -> connects that failed in a row (a live peer never reached is an error)
        self._failed: dict[int, int] = {}
        self._groups: dict[int, dict[str, Any]] = {}
        #: peer -> (its heartbeat value, seconds this rank has watched it unchanged)
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._looked: float | None = None  # when silent() last looked (monotonic)
        self._beats = 0
        self._beater: threading.Thread | None = None
        self._stop = threading.Event()
        self._listener = threading.Thread(target=self._listen, name="pd-mailbox", daemon=True)
        #: this process's incarnation of its rank: in its endpoint record and in
        #: every message, so that a restarted peer's old self is told apart
        self.incarnation = secrets.randbits(62)
        #: peers whose record was replaced by a new incarnation's: connect anew
        self._renewed: set[int] = set()
        #: and whose requests with the old incarnation are still to be failed
        self.restarted: set[int] = set()

    def client(self, timeout: timedelta = timedelta(seconds=30)) -> Any:
        return _store(*self._addr, timeout)

    def publish(self, record: dict[str, Any]) -> None:
        """Publish this rank's endpoint record, then start taking messages."""
        self.store.set(f"{self._me}/endpoint", json.dumps({**record, "inc": self.incarnation}))
        self._listener.start()

    def send(self, peer: int, msg: dict[str, Any], store: Any) -> None:
        msg.setdefault("from", self._rank)
        msg.setdefault("inc", self.incarnation)
        store.queue_push(f"{self._ns}/q/{self._peer_role}/{peer}", json.dumps(msg).encode())

    def _listen(self) -> None:
        """Block on this rank's queue (no polling RPCs) and wake the loop."""
        # a long timeout: close() wakes this pop with a message of our own
        store = self.client(timedelta(days=1))
        while not self._stop.is_set():
            try:
                body = store.queue_pop(self._key, block=True)
            except Exception:
                return  # the store is gone: so is the group
            try:
                msg = json.loads(body)
            except ValueError:  # not JSON: the connector counts it as malformed
                msg = body
            if isinstance(msg, dict) and msg.get("kind") == "_stop":
                return
            self.inbox.put(msg)
            self._wake.set()

    def received(self) -> list[Any]:
        out: list[Any] = []
        while not self.inbox.empty():
            out.append(self.inbox.get_nowait())
        return out

    def peer(self, peer: int, store: Any) -> tuple[dict[str, Any] | None, bool]:
        """(the peer's endpoint record or None if not published yet, whether it is new)."""
        info = self._peers.get(peer)
        if info is not None:
            if peer in self._renewed:
                self._renewed.discard(peer)
                return info, True
            return info, False
        info = self._record(peer, store)
        if info is None:
            return None, False
        self._peers[peer] = info
        return info, True

    def connected(
        self,
        peer: int,
        store: Any,
        connect: Callable[[int, dict[str, Any]], None],
        retry_s: float,
        give_up: int = 0,
    ) -> dict[str, Any] | None:
        """The peer's endpoint record once ``connect`` took it (once per record);
        None while it is not published, or while the peer it names cannot be
        reached. A peer that published and then died fails the connect: that is
        no fault of any request, so none is failed for it here. The connect is
        tried again after ``retry_s``; if the peer stays silent, its heartbeat
        says it is dead. A peer still failing its ``give_up``-th connect in a row
        (0: never) has been failing for ``(give_up - 1) * retry_s``: a peer that
        beats yet cannot be reached (a route, a bad record), whose connect error
        is raised then, naming it, rather than leaving its requests to time out."""
        if peer not in self._peers and self._retry_at.get(peer, 0.0) > time.monotonic():
            return None
        info, new = self.peer(peer, store)
        if new and info is not None:
            try:
                connect(peer, info)
            except Exception as e:
                self._peers.pop(peer, None)  # read and connected anew on a later try
                self._retry_at[peer] = time.monotonic() + retry_s
                failed = self._failed[peer] = self._failed.get(peer, 0) + 1
                log = logger.info if failed == 1 else logger.debug
                log("rank %d: connecting to peer %d failed (%s); trying again", self._rank, peer, e)
                if give_up and failed >= give_up:
                    self._failed.pop(peer, None)
                    raise ConnectionError(
                        f"rank {self._rank}: peer {peer} published its endpoint but {failed} "
                        f"connects in a row failed over {(failed - 1) * retry_s:g} s (last: {e}); "
                        "check the peer's advertised address and the route to it"
                    ) from e
                return None
            self._retry_at.pop(peer, None)
            self._failed.pop(peer, None)
        return info

    def _record(self, peer: int, store: Any) -> dict[str, Any] | None:
        """The peer's endpoint record as the store holds it now (None: not published)."""
        key = f"{self._ns}/{self._peer_role}/{peer}/endpoint"
        if not store.check([key]):
            return None
        record: dict[str, Any] = json.loads(store.get(key))
        return record

    def take_restarted(self) -> set[int]:
        """The peers seen restarted since the last call (each thread may add to
        them: taken one by one, none is lost)."""
        out = set()
        while self.restarted:
            out.add(self.restarted.pop())
        return out

    def incarnation_of(self, peer: int, inc: Any, store: Any) -> str:
        """Whether a message from ``peer`` carrying incarnation ``inc`` comes from
        the incarnation this rank knows (SAME), from a newer one that replaced
        it in the store (NEW: its record is taken, and the next :meth:`peer`
        says it is new), or from one the store no longer names (STALE: an old
        self of a restarted peer, resumed; refuse it). A message with no
        incarnation (an engine's own notification) cannot be told apart: SAME."""
        if inc is None:
            return SAME
        info = self._peers.get(peer)
        if info is not None and info.get("inc") == inc:
            return SAME
        try:
            record = self._record(peer, store)
        except Exception:  # the store is going: nothing to tell it by
            return SAME
        if record is None:
            return SAME if info is None else STALE
        if record.get("inc") != inc:
            return STALE
        if info is None:
            return SAME  # (looked up, and connected to, when first needed)
        self._renew(peer, record)
        return NEW

    def incarnation_known(self, peer: int) -> Any:
        """The incarnation of ``peer`` this rank holds the record of (None: none)."""
        info = self._peers.get(peer)
        return None if info is None else info.get("inc")

    def _renew(self, peer: int, record: dict[str, Any]) -> None:
        self._peers[peer] = record
        self._renewed.add(peer)
        self.restarted.add(peer)

    def _beat_inc(self, peer: int, value: bytes, store: Any) -> None:
        """A heartbeat names its incarnation: one other than the record this rank
        holds means the peer restarted; its new record is taken once published."""
        info = self._peers.get(peer)
        parts = value.split()
        if info is None or len(parts) < 3 or str(info.get("inc")) == parts[2].decode():
            return
        try:
            record = self._record(peer, store)
        except Exception:  # the store is going: the next beat tells again
            return
        if record is not None and str(record.get("inc")) == parts[2].decode():
            self._renew(peer, record)

    def publish_group(self, dp: int, record: dict[str, Any]) -> None:
        self.store.set(f"{self._ns}/prefill/group{dp}", json.dumps(record))

    def group(self, dp: int, store: Any) -> dict[str, Any] | None:
        """Prefill DP group ``dp``'s record, or None if no rank of it is up yet."""
        got = self._groups.get(dp)
        if got is None:
            key = f"{self._ns}/prefill/group{dp}"
            if not store.check([key]):
                return None
            got = self._groups[dp] = json.loads(store.get(key))
        return got

    def beat(self, store: Any) -> None:
        self._beats += 1
        store.set(f"{self._me}/hb", f"{self._beats} {time.time()!r} {self.incarnation}")

    def start_beating(self, interval: float) -> None:
        """Beat every ``interval`` seconds on a thread of its own, so that an engine
        call that blocks the connector's loop (a slow or paused peer) does not
        make this rank look dead to every other peer. A stopped process (killed,
        or paused as a whole) stops beating; a failed beat is tried again."""

        def run() -> None:
            store = None
            while not self._stop.is_set():
                try:
                    store = store or self.client()
                    self.beat(store)
                except Exception:  # a store hiccup: a new connection next time
                    store = None
                    logger.debug("heartbeat of %s not written", self._me, exc_info=True)
                self._stop.wait(interval)

        self._beater = threading.Thread(target=run, name="pd-heartbeat", daemon=True)
        self._beater.start()

    def silent(self, peers: Iterable[int], limit: float, store: Any) -> set[int]:
        """The peers whose heartbeat this rank has watched unchanged for more than
        ``limit`` seconds (a peer not up yet is not silent: the bootstrap timeout
        covers one that never comes).

        Time is counted on this rank's monotonic clock, between its own looks,
        and a gap between two looks counts at most ``limit / 2``: a pause of this
        rank's own (a long GC, a starved host) is not taken for the peer's
        silence, and no two hosts' clocks are compared."""
        out = set()
        now = time.monotonic()
        step = 0.0 if self._looked is None else min(now - self._looked, limit / 2)
        self._looked = now
        for p in peers:
            key = f"{self._ns}/{self._peer_role}/{p}/hb"
            if not store.check([key]):
                continue
            value = bytes(store.get(key))
            seen = self._seen.get(p)
            if seen is None or seen[0] != value:
                self._seen[p] = (value, 0.0)
                self._beat_inc(p, value, store)
                continue
            watched = seen[1] + step
            self._seen[p] = (value, watched)
            if watched > limit:
                out.add(p)
        return out

    def heard(self, peer: int) -> None:
        """A message from ``peer`` arrived: it lives, whatever its heartbeat says."""
        seen = self._seen.get(peer)
        if seen is not None:
            self._seen[peer] = (seen[0], 0.0)

    def close(self) -> None:
        self._stop.set()
        if self._beater is not None:
            self._beater.join(timeout=2)
        try:
            self.store.queue_push(self._key, json.dumps({"kind": "_stop"}).encode())
        except Exception:
            return  # the store is gone: the listener's pop has failed already
        self._listener.join(timeout=2)
