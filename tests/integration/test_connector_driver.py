"""The connector's driver (transport.connector.hub.Connector) with its thread,
its TCPStore mailbox and an engine: an object that merely has the Engine
protocol's methods drives a request end to end, each call from the thread the
contract names; a non-engine is refused before any thread starts; the engine
skeleton of docs/backends.md drives a request; no loaded subclass of the
connector (the backends', the stub's) overrides one of its own members."""

import ctypes
import re
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

import transport.backends.mooncake
import transport.backends.nixl
from buffers import MetadataBuffers, MetadataLayout
from lifecycle import KVPoll
from lifecycle.testing.spawn import store_server
from support.engine_contract import Partial, _subclasses, overrides
from support.stub_engine import CopyEngine, handshaken
from support.wait import wait_for
from transport.connector.config import ConnectorConfig
from transport.connector.hub import Connector
from transport.engine import Engine
from transport.errors import NotAnEngine
from transport.layout import kv_args_for

ROOT = Path(__file__).resolve().parents[2]
_BACKENDS = (transport.backends.mooncake, transport.backends.nixl)  # imported for their subclasses


def test_no_loaded_subclass_overrides_a_connector_method():
    # the backends and the stub's CopyConnector are imported: all their subclasses
    loaded = [c for c in _subclasses(Connector) if c.__module__ != __name__]
    names = {c.__name__ for c in loaded}
    assert {"MooncakeManager", "NixlManager", "CopyConnector"} <= names
    assert [o for c in loaded for o in overrides(c)] == []


class RecordingEngine(CopyEngine):
    """A CopyEngine that records each call as (method, thread name)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def _saw(self, what):
        self.calls.append((what, threading.current_thread().name))

    def start(self, regions, host):
        self._saw("start")
        self.regions = list(regions)
        return {"recorded": True}

    def connect(self, peer, info):
        self._saw("connect")
        assert info["recorded"] is True  # the peer's start() record, published
        info["_mine"] = peer

    def write(self, info, src, dst, lens, note):
        self._saw("write")
        assert "_mine" in info  # the dict connect() was given
        return super().write(info, src, dst, lens, note)

    def check(self, token):
        self._saw("check")
        return super().check(token)

    def forget(self, token):
        self._saw("forget")

    def notified(self):
        self._saw("notified")
        return []

    def stop(self):
        self._saw("stop")


class Bare:
    """Only the protocol's members: no base class at all."""

    NOTIFIES = False

    def __init__(self):
        self.inner = RecordingEngine()

    def start(self, regions, host):
        return self.inner.start(regions, host)

    def connect(self, peer, info):
        self.inner.connect(peer, info)

    def write(self, info, src, dst, lens, note):
        return self.inner.write(info, src, dst, lens, note)

    def check(self, token):
        return self.inner.check(token)

    def forget(self, token):
        self.inner.forget(token)

    def notified(self):
        return self.inner.notified()

    def stop(self):
        self.inner.stop()


def _pair(port, engines):
    layout = MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
    out = {}
    for role, engine in engines.items():
        kv = [torch.zeros((8, 64), dtype=torch.uint8)]
        meta = MetadataBuffers(4, layout)
        cfg = ConnectorConfig(role=role, tp_rank=0, store_port=port, idle_interval=0.005)
        out[role] = (Connector(kv_args_for(kv, meta.buf_infos(), 0), cfg, engine), kv, meta)
    return out


def test_an_object_with_the_protocol_drives_a_request_from_the_contracted_threads():
    store = store_server()
    pe, de = Bare(), RecordingEngine()
    assert isinstance(pe, Engine) and isinstance(de, Engine)
    sides = _pair(store.port, {"prefill": pe, "decode": de})
    (p, pkv, pmeta), (d, dkv, dmeta) = sides["prefill"], sides["decode"]
    try:
        assert p.engine is pe and p.core.notifies is False
        sent, send = [], d.mail.send

        def spy(peer, msg, store):
            sent.append((msg["kind"], threading.current_thread().name))
            send(peer, msg, store)

        d.mail.send = spy
        pkv[0].copy_(torch.arange(pkv[0].numel()).view_as(pkv[0]) % 251)
        pmeta.write(1, 41, {"output_ids": [3]})
        s, r = p.sender(41), d.receiver(41)
        r.init()
        wait_for(lambda: handshaken(s), "prefill handshake")
        r.send_metadata([4, 5], 2)
        wait_for(lambda: s.poll() == KVPoll.WaitingForInput, "prefill has the page list")
        s.init(2, 1)
        s.send([0, 1])
        wait_for(lambda: r.poll() == KVPoll.Success == s.poll(), "the request succeeds")
        assert torch.equal(dkv[0][4:6], pkv[0][0:2])
        assert dmeta.room_of(2) == 41
    finally:
        for m, _, _ in sides.values():
            m.close(wait=0)
    me = threading.current_thread().name
    calls = pe.inner.calls
    assert calls[0] == ("start", me) and calls[-1] == ("stop", me)
    assert [c for c in calls if c[0] in ("start", "stop")] == [("start", me), ("stop", me)]
    middle = calls[1:-1]
    assert {t for _, t in middle} == {"pd-prefill"}  # the loop thread, and only it
    kinds = [k for k, _ in middle]
    assert kinds.index("connect") < kinds.index("write")
    assert kinds.count("connect") == 1  # once per peer record
    # every write was checked until it landed, then let go
    assert kinds.count("write") == kinds.count("forget") == len(pe.inner.writes) >= 2
    assert pe.inner.regions[0] == (pkv[0].data_ptr(), pkv[0].numel())  # KV first
    assert {t for k, t in de.calls if k not in ("start", "stop")} == {"pd-decode"}
    assert "write" not in [k for k, _ in de.calls]  # nothing is written from decode
    # decode's page list leaves from the scheduler's own call (no wake of the thread
    # between them); what the core decides on its pass leaves from the thread
    assert ("pages", me) in sent and ("register", "pd-decode") in sent, sent


def test_a_connector_refuses_a_non_engine_before_it_starts_anything():
    store = store_server()
    layout = MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
    kv = [torch.zeros((8, 64), dtype=torch.uint8)]
    cfg = ConnectorConfig(role="prefill", tp_rank=0, store_port=store.port)
    before = threading.active_count()
    with pytest.raises(NotAnEngine, match="lacks connect"):
        Connector(kv_args_for(kv, MetadataBuffers(4, layout).buf_infos(), 0), cfg, Partial())
    assert threading.active_count() == before  # no loop, no heartbeat started


class _FakeLib:
    """A stand-in for the binding docs/backends.md's skeleton imports: writes
    are copied at once."""

    class Engine:
        def __init__(self, host):
            self.host, self.closed = host, False

        def register(self, addrs, lens):
            return len(addrs) == len(lens) > 0

        def address(self):
            return f"{self.host}:1"

        def open(self, address):
            return ("session", address)

        def post_write(self, session, src, dst, lens):
            assert session[0] == "session"
            for s, d, n in zip(src, dst, lens):
                ctypes.memmove(d, s, n)
            return object()  # compared by identity

        def status(self, token):
            return "done"

        def release(self, token):
            pass

        def close(self):
            self.closed = True


def test_the_documented_skeleton_drives_a_request(monkeypatch):
    text = (ROOT / "docs" / "backends.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "class MyEngine" in b)
    monkeypatch.setitem(sys.modules, "mylib", types.SimpleNamespace(Engine=_FakeLib.Engine))
    ns = {"__name__": "docs_backends_skeleton"}
    exec(compile(code, "docs/backends.md", "exec"), ns)
    manager = ns["MyManager"]
    assert overrides(manager) == []
    store = store_server()
    layout = MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
    sides = {}
    for role in ("prefill", "decode"):
        kv = [torch.zeros((8, 64), dtype=torch.uint8)]
        meta = MetadataBuffers(4, layout)
        cfg = ConnectorConfig(role=role, tp_rank=0, store_port=store.port, idle_interval=0.005)
        sides[role] = (manager(kv_args_for(kv, meta.buf_infos(), 0), cfg), kv, meta)
    (p, pkv, pmeta), (d, dkv, dmeta) = sides["prefill"], sides["decode"]
    try:
        pkv[0].fill_(7)
        pmeta.write(0, 43, {"output_ids": [1]})
        s, r = p.sender(43), d.receiver(43)
        r.init()
        wait_for(lambda: handshaken(s), "prefill handshake")
        r.send_metadata([3], 1)
        wait_for(lambda: s.poll() == KVPoll.WaitingForInput, "prefill has the page list")
        s.init(1, 0)
        s.send([0])
        wait_for(lambda: r.poll() == KVPoll.Success == s.poll(), "the request succeeds")
        assert bool((dkv[0][3] == 7).all()) and dmeta.room_of(1) == 43
    finally:
        for m, _, _ in sides.values():
            m.close(wait=0)
    assert p.engine.lib.closed and d.engine.lib.closed


def test_a_rank_has_beaten_once_before_any_record_of_it_is_found(monkeypatch):
    """A rank killed before its heartbeat thread's first beat must still be
    seen to stop beating (else a peer that found its records waits out the
    bootstrap timeout): the first beat is written before the records."""
    from transport.connector.mailbox import Mailbox

    monkeypatch.setattr(Mailbox, "start_beating", lambda self, interval: None)  # never beats
    store = store_server()
    sides = _pair(store.port, {"prefill": CopyEngine(), "decode": CopyEngine()})
    try:
        for role, (m, _, _) in sides.items():
            assert m.store.check([f"{m.config.namespace}/{role}/0/hb"]), role
    finally:
        for m, _, _ in sides.values():
            m.close(wait=0)
