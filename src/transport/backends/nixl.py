"""A real NIXL backend: KV pages and metadata rows written through UCX.

One NIXL agent per rank from the ``nixl-cu12`` wheel (import name
``nixl_cu12``; it bundles UCX), with the :class:`~buffers.KVArgs` memory
registered as DRAM. Peers find each other's agent metadata in the endpoint
record the connector publishes; everything else (mailboxes, heartbeats,
ordering, quarantine, timeouts) is the shared
:class:`~transport.connector.hub.Connector`.

Writes are NIXL ``WRITE`` transfers; their completion is the transfer state
(``DONE``/``PROC``/``ERR``). The room-field write carries the room as its
notification, so decode learns of completion from the notification or from
the mailbox's "done", whichever comes first.

Failures: a transfer that cannot be created or posted (the remote agent is
gone or disconnected) fails the request as peer dead; a transfer in error
state is a transfer error; a notification (and "done") that never comes is
decode's waiting timeout; a peer whose heartbeat stops is peer dead.

Progress: UCX on loopback moves a large write by rendezvous, which needs the
*target* to progress its worker. With the agent's progress thread on
(``enable_prog_thread``, the default) a rank progresses without calling into
NIXL; without it a write stalls until the target calls NIXL. The wrapper
starts that thread polling with no pause, which costs a third of a core per
idle process here, so the agent is built with ``progress_delay_us`` (100 µs
by default): about 2% of a core idle.

Posting: on loopback UCX writes host memory by ``cma`` zero-copy, one
``process_vm_writev`` per descriptor, and without worker threads all of them
run inside ``transfer`` on the caller's thread. The agent is built with
``nixl_threads`` UCX worker threads (4 by default, as the agent's
``num_threads``), which take a transfer's descriptors in parallel and let
``transfer`` return at once: 2048 scattered 32 KiB pages moved about twice
as fast in alternating runs (docs/performance.md); a few large runs gain
nothing. Idle, the threads cost nothing measurable.
"""

from __future__ import annotations

import base64
import os
import threading
import uuid
from typing import Any

import numpy as np
from numpy.typing import NDArray

from transport.connector.config import ConnectorConfig
from transport.connector.handles import ConnectorReceiver, ConnectorSender
from transport.connector.hub import Connector
from transport.engine_logs import engine_logs
from transport.errors import BackendUnavailable, require_module
from transport.layout import kv_args_for

__all__ = ["NixlConfig", "NixlManager", "NixlSender", "NixlReceiver", "kv_args_for", "probe"]

NixlConfig = ConnectorConfig
NixlSender = ConnectorSender
NixlReceiver = ConnectorReceiver
_BUILD = threading.Lock()  # the progress-delay override below is process-wide while it lasts


def probe() -> None:
    """Raise BackendUnavailable unless the NIXL agent imports here."""
    # the wheel's UCX InfiniBand modules pull a libnl whose unload crashes every
    # process at exit (SIGSEGV after Python finished); loopback never uses them
    os.environ.setdefault("UCX_MODULES", "^ib,rdmacm")
    engine_logs()  # NIXL's and UCX's own INFO and WARNING lines: only if the user chose
    require_module(
        "nixl",
        "nixl_cu12._api",
        "nixl_agent",
        "Install it with `pip install 'pd-lifecycle[nixl]'` after torch (see constraints.txt)",
    )


def make_agent(name: str, progress_delay_us: int, threads: int = 0) -> Any:
    """A NIXL agent with the UCX backend, a progress thread pausing
    ``progress_delay_us`` and ``threads`` UCX worker threads (0: none)."""
    probe()
    from nixl_cu12 import _api

    bind: Any = getattr(_api, "nixlBind")  # noqa: B009 (not re-exported)
    real = bind.nixlAgent

    def build(agent_name: str, cfg: Any) -> Any:
        cfg.pthrDelay = progress_delay_us  # the wrapper hard-codes 0: a spinning thread
        return real(agent_name, cfg)

    with _BUILD:
        bind.nixlAgent = build
        try:
            cfg = _api.nixl_agent_config(enable_prog_thread=True, num_threads=threads)
            return _api.nixl_agent(name, cfg)
        finally:
            bind.nixlAgent = real


def _descs(addrs: NDArray[np.int64], lens: NDArray[np.int64]) -> NDArray[np.uint64]:
    return np.stack((addrs, lens, np.zeros_like(addrs)), axis=1).astype(np.uint64)


def _room_epoch(note: bytes | str) -> tuple[int, int, tuple[int, int] | None] | None:
    """A completion notification's (room, epoch, span): b"room:epoch" for an
    attempt's last write (span None), b"room:epoch:first:end" for its pages
    [first, end) (None: not ours)."""
    text = note.decode(errors="replace") if isinstance(note, bytes) else str(note)
    words = text.split(":")
    if len(words) not in (2, 4) or not all(w.isdigit() for w in words):
        return None
    n = [int(w) for w in words]
    return (n[0], n[1], None) if len(n) == 2 else (n[0], n[1], (n[2], n[3]))


class NixlManager(Connector):
    """One per rank. Create senders (prefill) or receivers (decode) from it."""

    NOTIFIES = True

    def _start_engine(self) -> dict[str, Any]:
        c = self.config
        self.agent = make_agent(
            f"{c.namespace}-{c.role}{self.rank}-{uuid.uuid4().hex[:8]}",
            c.progress_delay_us,
            c.nixl_threads,
        )
        addrs, lens = np.array(self.regions(), dtype=np.int64).reshape(-1, 2).T
        try:
            self._reg = self.agent.register_memory(_descs(addrs, lens), "DRAM")
        except Exception as e:
            raise BackendUnavailable(
                "nixl", f"registering the KV/metadata buffers failed ({e})", "check KVArgs"
            ) from None
        self._remotes: dict[int, str] = {}
        self._peer_of: dict[str, int] = {}  # remote agent name -> peer rank
        return {"agent": base64.b64encode(self.agent.get_agent_metadata()).decode()}

    def _connect(self, peer: int, info: dict[str, Any]) -> None:
        name = self.agent.add_remote_agent(base64.b64decode(info["agent"]))
        self._remotes[peer] = name
        self._peer_of[name.decode() if isinstance(name, bytes) else str(name)] = peer
        info["_peer"] = peer

    def _write(self, info: dict[str, Any], *w_notif: Any) -> Any:
        src, dst, lens, notif = w_notif
        try:
            handle = self.agent.initialize_xfer(
                "WRITE",
                self.agent.get_xfer_descs(_descs(src, lens), "DRAM"),
                self.agent.get_xfer_descs(_descs(dst, lens), "DRAM"),
                self._remotes[info["_peer"]],
                notif,
            )
            self.agent.transfer(handle, notif)  # "ERR" here shows in the state as well
        except Exception:
            return None  # the remote agent is gone or disconnected
        return handle

    def _check(self, handle: Any) -> int:
        state = self.agent.check_xfer_state(handle)
        return {"DONE": 1, "PROC": 0}.get(state, -1)

    def _forget(self, handle: Any) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:
            return  # NIXL could not cancel a failed transfer: it owns the handle now

    def _notified(self) -> list[tuple[int, int, int, tuple[int, int] | None]]:
        if self.config.role != "decode":
            return []
        try:
            notes = self.agent.get_new_notifs()
        except Exception:
            return []  # a peer went away: its requests end by heartbeat, not by this
        out = []
        for name, msgs in notes.items():
            peer = self._peer_of.get(name.decode() if isinstance(name, bytes) else str(name))
            if peer is not None:  # the room landed last: every write of that peer did
                out += [(n[0], n[1], peer, n[2]) for m in msgs if (n := _room_epoch(m)) is not None]
        return out

    def _stop_engine(self) -> None:
        for name in self._remotes.values():
            try:
                self.agent.remove_remote_agent(name)
            except Exception:
                continue  # already disconnected
        try:
            self.agent.deregister_memory(self._reg)
        except Exception:
            return


MANAGER = NixlManager
SENDER = NixlSender
RECEIVER = NixlReceiver
BOOTSTRAP = None
