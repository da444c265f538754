"""Heartbeats and a peer that only pauses: a rank judges a peer by when it
last saw its heartbeat change, on its own clock; a silent peer's requests fail
on both sides with reason peer dead and stay quarantined until it says it
stopped (a writer still silent at the drain timeout keeps them fenced); a peer
that beats again serves new requests."""

import contextlib
import ctypes
import json
import time

import pytest
import torch

from buffers import MetadataBuffers, MetadataLayout
from lifecycle import FailureReason, KVPoll
from lifecycle.testing.spawn import store_server
from support.stub_engine import CopyConnector, CopyEngine, handshaken
from support.wait import wait_for
from transport.connector.config import ConnectorConfig
from transport.connector.core import liveness
from transport.connector.core.graph import Phase
from transport.connector.mailbox import SAME, Mailbox
from transport.layout import kv_args_for

# heartbeat_interval x heartbeat_misses: short, yet long enough that a loaded
# machine's scheduling delays are not taken for silence
LIMIT = 0.6


class FakeStore:
    def __init__(self):
        self.kv = {}

    def check(self, keys):
        return all(k in self.kv for k in keys)

    def get(self, key):
        return self.kv[key]


def _mailbox():
    box = object.__new__(Mailbox)  # no store connection: silent() only reads its argument
    box._ns, box._peer_role, box._seen, box._looked = "ns", "decode", {}, None
    box._peers, box._renewed, box.restarted = {}, set(), set()
    return box


def test_silence_is_timed_on_the_observers_clock(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    box, store = _mailbox(), FakeStore()

    def look(after=0.4):  # the loop looks every heartbeat interval
        clock[0] += after
        return box.silent([0], 1.0, store)

    assert look() == set()  # not up yet: the bootstrap timeout's
    # a wall-clock value far in the past (another host's clock) is not silence
    store.kv["ns/decode/0/hb"] = b"1 12.5"
    assert look() == set()
    assert look() == look() == set()  # unchanged for 0.8 s
    assert look() == {0}  # unchanged for 1.2 s of this rank's clock
    store.kv["ns/decode/0/hb"] = b"2 12.9"  # it beats again
    assert look() == set()
    # this rank paused for 5 s meanwhile: the peer beat, so it is not silent
    store.kv["ns/decode/0/hb"] = b"9 17.9"
    assert look(5.0) == set()
    # paused again, and the peer did not beat (this rank may have held it up):
    # the gap counts half the window at most
    assert look(5.0) == look() == set()  # 0.5 s, then 0.9 s
    assert look() == {0}  # 1.3 s
    box.heard(0)  # a message from it: it lives, whatever its heartbeat says
    assert look() == look() == set()
    assert look() == {0}


def test_looks_further_apart_than_half_the_window_still_find_a_dead_peer(monkeypatch):
    # heartbeat_misses 2: the loop looks once per interval, half the window apart
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    box, store = _mailbox(), FakeStore()
    store.kv["ns/decode/0/hb"] = b"1 0.0"
    found = []
    for _ in range(6):
        clock[0] += 0.55
        found.append(box.silent([0], 1.0, store))
    assert found[:3] == [set()] * 3 and found[3] == {0}


class HangEngine(CopyEngine):
    """Its writes never finish (an engine that lost them)."""

    def write(self, info, src, dst, lens, note):
        self.writes.append(lens.tolist())
        return 0

    def check(self, token):
        return 0


def _make_pair(prefill_engine=CopyEngine, drain=(30.0, 30.0), decode_engine=CopyEngine):
    store = store_server()
    port = store.port
    layout = MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
    sides = {"store": store}
    for role, engine, drain_s in (
        ("prefill", prefill_engine, drain[0]),
        ("decode", decode_engine, drain[1]),
    ):
        kv = [torch.zeros((8, 64), dtype=torch.uint8)]
        meta = MetadataBuffers(4, layout)
        cfg = ConnectorConfig(
            role=role,
            tp_rank=0,
            store_port=port,
            idle_interval=0.005,
            heartbeat_interval=LIMIT / 4,
            heartbeat_misses=4,
            drain_timeout=drain_s,
        )
        sides[role] = CopyConnector(kv_args_for(kv, meta.buf_infos(), 0), cfg, engine())
        sides[f"{role} buffers"] = (kv, meta)  # the engine writes into them: keep them alive
    return sides


@pytest.fixture
def pair(request):
    sides = _make_pair(drain=getattr(request, "param", (30.0, 30.0)))
    yield sides
    for role in ("prefill", "decode"):
        sides[role].close(wait=0)


@contextlib.contextmanager
def paused(m):
    """The connector stops as a paused process would: no beat, no step."""
    with m.lock:
        m.mail.beat = lambda store: None
        try:
            yield
        finally:
            del m.mail.beat


def _paired(p, d, room):
    s, r = p.sender(room), d.receiver(room)
    r.init()
    wait_for(lambda: handshaken(s), "prefill handshake")
    s.init(1, None)
    r.send_metadata([1], 0)  # decode's pages are promised: writes may land from now
    wait_for(lambda: p.phase[s.index] == Phase.Metadata, "prefill has the page list")
    return s, r


def _succeeds(p, d, room):
    s, r = _paired(p, d, room)
    s.send([0])
    wait_for(lambda: r.poll() == KVPoll.Success == s.poll(), f"room {room} succeeds")


def test_a_paused_prefill_fails_its_requests_then_serves_again(pair):
    p, d = pair["prefill"], pair["decode"]
    s, r = _paired(p, d, 7)
    with paused(p):  # no beat, no answer
        wait_for(lambda: r.poll() == KVPoll.Failed, "decode finds prefill silent")
        assert r.failure_reason() == FailureReason.PEER_DEAD
        time.sleep(0.3)
        assert not r.drained  # prefill may write once it resumes: quarantined
    # it resumes: it hears decode's abort, stops, says so; decode then releases
    wait_for(lambda: r.drained, "decode drained on prefill's word")
    assert d.phase[r.index] == Phase.Drained
    assert (s.poll(), s.failure_reason()) == (KVPoll.Failed, FailureReason.PEER_DEAD)
    for h in (s, r):
        h.clear()
    _succeeds(p, d, 8)  # it beats again: live for new requests


class HeldEngine(CopyEngine):
    """Its writes stay in the engine (a paused process's queue) until ``let_go``,
    then land: the bytes are copied at that moment."""

    def __init__(self):
        super().__init__()
        self.held = []

    def write(self, info, src, dst, lens, note):
        self.writes.append(lens.tolist())
        token = [src.copy(), dst.copy(), lens.copy(), 0]
        self.held.append(token)
        return token

    def check(self, token):
        return token[3]

    def let_go(self):
        for token in self.held:
            src, dst, lens, _ = token
            for a, b, n in zip(src.tolist(), dst.tolist(), lens.tolist()):
                ctypes.memmove(b, a, n)
            token[3] = 1
        self.held.clear()


@pytest.mark.parametrize("fence", [True, False], ids=["fenced", "negative-control"])
def test_sglang_24527_a_writer_silent_past_the_drain_timeout_stays_fenced(monkeypatch, fence):
    # SGLang #24527 by way of a pause: decode declares prefill dead while a write
    # of room 7 sits in prefill's engine. Past decode's drain timeout (1 s) its
    # pages stay fenced while prefill is silent; prefill resumes, the write
    # lands in those pages (still fenced), prefill hears the abort and says it
    # stopped, and only then are they released. Negative control: with no reason
    # fenced (the rule switched off), decode releases the pages on silence, and
    # the resumed write lands in pages the scheduler could have given to another
    # request
    if not fence:
        monkeypatch.setattr(liveness, "FENCE_REASONS", frozenset())
    sides = _make_pair(HeldEngine, drain=(30.0, 1.0))
    p, d = sides["prefill"], sides["decode"]
    kv_p, kv_d = sides["prefill buffers"][0][0], sides["decode buffers"][0][0]
    try:
        s, r = _paired(p, d, 7)
        kv_p[0] = 0xAB
        s.send([0])
        wait_for(lambda: p.engine.held, "prefill's write sits in its engine")
        with paused(p):
            wait_for(lambda: r.poll() == KVPoll.Failed, "decode finds prefill silent")
            assert r.failure_reason() == FailureReason.PEER_DEAD
            t0 = time.monotonic()
            if fence:
                wait_for(lambda: r.fenced, "fenced at decode's drain timeout")
                assert time.monotonic() - t0 > 0.5  # the drain timeout, not at once
                time.sleep(0.3)
                assert not r.drained and r.fenced
                assert d.fenced() == (1, 1)  # the gauge: one request, one page
            else:
                wait_for(lambda: r.drained, "released on prefill's silence")
            p.engine.let_go()  # the paused process's queued write goes out as it resumes
        assert bytes(kv_d[1].tolist()) == b"\xab" * 64  # it landed in decode's page 1
        if fence:
            # the page held the late write: only now, told prefill stopped, is it free
            wait_for(lambda: r.drained, "released on prefill's word")
            assert d.phase[r.index] == Phase.Drained and d.fenced() == (0, 0)
        else:  # released before the write landed: another request's page by then
            assert d.phase[r.index] == Phase.Drained
        for h in (s, r):
            h.clear()
        kv_p[0] = 0x11
        s2, r2 = _paired(p, d, 8)  # admitted after the resume: it succeeds
        s2.send([0])
        wait_for(lambda: p.engine.held, "the new write is issued")
        p.engine.let_go()
        wait_for(lambda: r2.poll() == KVPoll.Success == s2.poll(), "room 8 succeeds")
        assert bytes(kv_d[1].tolist()) == b"\x11" * 64
    finally:
        for role in ("prefill", "decode"):
            sides[role].close(wait=0)


@pytest.mark.parametrize("pair", [(30.0, 1.0)], indirect=True)
def test_a_prefill_that_never_resumes_keeps_decode_fenced(pair):
    p, d = pair["prefill"], pair["decode"]
    s, r = _paired(p, d, 7)
    with paused(p):
        wait_for(lambda: r.poll() == KVPoll.Failed, "decode finds prefill silent")
        t0 = time.monotonic()
        wait_for(lambda: r.fenced, "fenced on prefill's silence")
        assert time.monotonic() - t0 > 0.5  # at the drain timeout (1 s), not at once
        assert d.phase[r.index] == Phase.Fenced and not r.drained
        time.sleep(1.5)  # longer than the drain timeout again: still fenced
        assert r.fenced and d.fenced() == (1, 1)
        r.clear()  # the scheduler lets go of its handle: the fence holds all the same
        assert d.fenced() == (1, 1)
        d.close(wait=0)  # closing does not wait for a peer that is gone


def test_a_paused_decode_hears_why_once_it_resumes(pair):
    p, d = pair["prefill"], pair["decode"]
    s, r = _paired(p, d, 7)
    with paused(d):
        wait_for(lambda: s.poll() == KVPoll.Failed, "prefill finds decode silent")
        assert s.failure_reason() == FailureReason.PEER_DEAD
    # prefill told it "failed" once no write was in flight: decode ends the same way
    wait_for(lambda: r.poll() == KVPoll.Failed and r.drained, "decode hears of it")
    assert r.failure_reason() == FailureReason.PEER_DEAD
    for h in (s, r):
        h.clear()
    _succeeds(p, d, 8)


def test_writes_given_up_keep_decode_quarantined_until_its_own_drain_timeout():
    # prefill fails the request (decode went silent) while its write is in flight;
    # the engine never finishes it, so at prefill's drain timeout it is given up.
    # It may still land: decode, told so, keeps its pages until its own timeout
    sides = _make_pair(HangEngine, drain=(0.5, 2.0))
    p, d = sides["prefill"], sides["decode"]
    try:
        s, r = _paired(p, d, 7)
        s.send([0])
        wait_for(lambda: p.engine.writes, "prefill's write issued")
        with paused(d):
            wait_for(lambda: s.poll() == KVPoll.Failed, "prefill finds decode silent")
            wait_for(lambda: p.phase_of(s._req) == Phase.Drained, "prefill gives the write up")
            assert s._req.abandoned
        wait_for(lambda: r.poll() == KVPoll.Failed, "decode hears of it")
        assert r.failure_reason() == FailureReason.PEER_DEAD
        t0 = time.monotonic()
        assert not r.drained  # the given-up write may still land
        wait_for(lambda: r.drained, "released at decode's own drain timeout")
        assert time.monotonic() - t0 > 0.8
    finally:
        for role in ("prefill", "decode"):
            sides[role].close(wait=0)


def _restart(m):
    """``m`` comes back as a new incarnation of its rank: a new record in the
    store, heartbeats that name it, messages that carry it (the object is the
    same, which lets the test hold the old incarnation's word)."""
    key = f"{m.mail._me}/endpoint"
    record = json.loads(m.mail.store.get(key))
    old = m.mail.incarnation
    m.mail.incarnation = old + 1
    m.mail.store.set(key, json.dumps({**record, "inc": old + 1}))
    return old


@pytest.mark.parametrize("check", [True, False], ids=["refused", "negative-control"])
def test_vllm_49250_a_restarted_prefill_is_a_new_incarnation(pair, monkeypatch, check):
    # a prefill rank restarts (vLLM #49250 / #45138: state kept across a
    # re-admission). Decode sees the new incarnation in its heartbeat and its
    # record: the request paired with the old one fails (peer dead), a request
    # admitted after it succeeds, and a word in the old incarnation's name
    # (a resumed old self) is refused and counted, never taken for the new
    # owner's. Negative control: with incarnations not told apart, a forged
    # "done" of the old self completes a request whose bytes never came
    if not check:
        monkeypatch.setattr(Mailbox, "incarnation_of", lambda *a: SAME)
    p, d = pair["prefill"], pair["decode"]
    s, r = _paired(p, d, 7)
    old = _restart(p)
    wait_for(lambda: r.poll() == KVPoll.Failed, "decode sees prefill restarted")
    assert r.failure_reason() == FailureReason.PEER_DEAD
    wait_for(lambda: r.drained, "released on the new incarnation's word")
    for h in (s, r):
        h.clear()
    s2, r2 = _paired(p, d, 8)  # admitted after the restart: registered with the new one
    assert r2._req.legs[0].inc == p.mail.incarnation
    # the old self, resumed, says room 8 is done: no byte of it was written
    d.deliver({"kind": "done", "room": 8, "from": 0, "inc": old})
    if check:
        assert d.stats["stale"] == 1 and r2.poll() != KVPoll.Success
        s2.send([0])
        wait_for(lambda: r2.poll() == KVPoll.Success == s2.poll(), "room 8 succeeds")
    else:
        assert r2.poll() == KVPoll.Success and s2.poll() != KVPoll.Success


class UnreachableAtFirst(CopyEngine):
    """Its engine cannot reach a peer for its first ``refusals`` tries (NIXL's
    add_remote_agent raising on a peer whose process just died, or not yet
    listening): the record is published, the peer is not there."""

    refusals = 2

    def __init__(self):
        super().__init__()
        self.tries = 0

    def connect(self, peer, info):
        self.tries += 1
        if self.tries <= self.refusals:
            raise RuntimeError("NIXL_ERR_BACKEND: loadRemoteMD failed")


class NeverReached(UnreachableAtFirst):
    refusals = 10**9


def test_a_peer_unreachable_at_first_fails_nothing_and_is_tried_again():
    # the connect that raised used to fail every live request of the rank as
    # a transfer error, from a peer none of them had reached yet
    sides = _make_pair(decode_engine=UnreachableAtFirst)
    p, d = sides["prefill"], sides["decode"]
    try:
        _succeeds(p, d, 11)
        assert d.engine.tries == UnreachableAtFirst.refusals + 1  # once per try, then once more
        assert d.last_error is None
        _succeeds(p, d, 12)  # connected: not tried again
        assert d.engine.tries == UnreachableAtFirst.refusals + 1
    finally:
        for role in ("prefill", "decode"):
            sides[role].close(wait=0)


def test_a_live_peer_never_reached_is_a_transfer_error_naming_it():
    # it beats, so it is never named dead: without the give-up its requests
    # would wait out the bootstrap timeout with the cause unsaid
    sides = _make_pair(decode_engine=NeverReached)
    p, d = sides["prefill"], sides["decode"]
    try:
        p.sender(31)
        r = d.receiver(31)
        r.init()
        wait_for(lambda: r.poll() == KVPoll.Failed, "decode gives up on prefill")
        assert r.failure_reason() == FailureReason.TRANSFER_ERROR
        give_up = 3 * d.config.heartbeat_misses + 1
        assert d.engine.tries == give_up  # one try a heartbeat interval, no more
        assert isinstance(d.last_error, ConnectionError)
        assert "peer 0" in str(d.last_error) and "NIXL_ERR_BACKEND" in str(d.last_error)
    finally:
        for role in ("prefill", "decode"):
            sides[role].close(wait=0)


def test_the_give_up_counts_failures_in_a_row_only():
    mail = object.__new__(Mailbox)  # only connected()'s own state
    mail._peers, mail._retry_at, mail._failed, mail._renewed, mail._rank = {}, {}, {}, set(), 1
    mail.peer = lambda peer, store: ({"addr": "x"}, True)
    fails = iter([True, True, False, True, True, True])

    def connect(peer, info):
        if next(fails):
            raise OSError("unreachable")

    for _ in range(2):
        assert mail.connected(0, None, connect, 0.0, give_up=3) is None
    assert mail.connected(0, None, connect, 0.0, give_up=3) == {"addr": "x"}  # count reset
    for _ in range(2):
        assert mail.connected(0, None, connect, 0.0, give_up=3) is None
    with pytest.raises(ConnectionError, match=r"peer 0 .* 3 connects in a row"):
        mail.connected(0, None, connect, 0.0, give_up=3)


def test_a_peer_never_reached_and_silent_is_peer_dead_not_a_transfer_error():
    sides = _make_pair(decode_engine=NeverReached)
    p, d = sides["prefill"], sides["decode"]
    try:
        p.sender(21)
        # it published and beat, then went silent (a dead process) before decode's
        # first connect. Decode names it dead after heartbeat_misses intervals of
        # silence and gives a live peer up after 3 * heartbeat_misses + 1 connects
        # one interval apart; both count from decode's first look, on decode's own
        # passes. (Paused after the first connect instead, a test thread that was
        # late to pause it let the give-up win: a CI run saw TRANSFER_ERROR.)
        up = [f"{p.mail._me}/endpoint", f"{p.mail._me}/hb"]
        wait_for(lambda: p.mail.store.check(up), "prefill published and beat")
        with paused(p):
            r = d.receiver(21)
            t0 = time.monotonic()
            r.init()
            wait_for(lambda: r.poll() == KVPoll.Failed, "decode finds prefill silent")
        took = time.monotonic() - t0
        assert r.failure_reason() == FailureReason.PEER_DEAD
        # tried again a heartbeat interval apart, not on every pass of the loop
        assert 1 <= d.engine.tries <= 2 + took / d.config.heartbeat_interval
    finally:
        for role in ("prefill", "decode"):
            sides[role].close(wait=0)
