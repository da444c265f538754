"""The connector's driver (transport.connector.hub) over a TCP store, in one
process with a stub engine that copies at once: what only the driver does.
Its mailbox tells a restarted peer's new incarnation from the old one (and
refuses the old one's word); its engine's connects to a peer that cannot be
reached are retried and given up, a peer that went silent meanwhile named
dead; and messages handed over from the scheduler's thread and the loop's
are handled one at a time, in order. The protocol itself is tested on the
simulated network (tests/unit/test_connector_liveness.py and
tests/unit/test_connector_topologies.py)."""

import contextlib
import json
import time

import pytest
import torch

from buffers import MetadataBuffers, MetadataLayout
from lifecycle import FailureReason, KVPoll
from lifecycle.testing.spawn import store_server
from support.simcases import Rank
from support.stub_engine import CopyConnector, CopyEngine, handshaken
from support.wait import wait_for
from transport.connector.config import ConnectorConfig
from transport.connector.core.graph import Phase
from transport.connector.mailbox import SAME, Mailbox
from transport.layout import kv_args_for
from transport.topology import Topology

# heartbeat_interval x heartbeat_misses: short, yet long enough that a loaded
# machine's scheduling delays are not taken for silence
LIMIT = 0.6


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


@contextlib.contextmanager
def _opened(**kw):
    """A pair of ``_make_pair(**kw)``, closed however the test ends."""
    sides = _make_pair(**kw)
    try:
        yield sides
    finally:
        for role in ("prefill", "decode"):
            sides[role].close(wait=0)


@pytest.fixture
def pair(request):
    with _opened(drain=getattr(request, "param", (30.0, 30.0))) as sides:
        yield sides


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
    with _opened(decode_engine=UnreachableAtFirst) as sides:
        p, d = sides["prefill"], sides["decode"]
        _succeeds(p, d, 11)
        assert d.engine.tries == UnreachableAtFirst.refusals + 1  # once per try, then once more
        assert d.last_error is None
        _succeeds(p, d, 12)  # connected: not tried again
        assert d.engine.tries == UnreachableAtFirst.refusals + 1


def test_a_live_peer_never_reached_is_a_transfer_error_naming_it():
    # it beats, so it is never named dead: without the give-up its requests
    # would wait out the bootstrap timeout with the cause unsaid
    with _opened(decode_engine=NeverReached) as sides:
        p, d = sides["prefill"], sides["decode"]
        p.sender(31)
        r = d.receiver(31)
        r.init()
        wait_for(lambda: r.poll() == KVPoll.Failed, "decode gives up on prefill")
        assert r.failure_reason() == FailureReason.TRANSFER_ERROR
        give_up = 3 * d.config.heartbeat_misses + 1
        assert d.engine.tries == give_up  # one try a heartbeat interval, no more
        assert isinstance(d.last_error, ConnectionError)
        assert "peer 0" in str(d.last_error) and "NIXL_ERR_BACKEND" in str(d.last_error)


def test_a_peer_never_reached_and_silent_is_peer_dead_not_a_transfer_error():
    with _opened(decode_engine=NeverReached) as sides:
        p, d = sides["prefill"], sides["decode"]
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


@pytest.fixture
def cluster(request):
    """A store, and ranks over it with a copy engine (as the protocol tests
    build them on the simulated network)."""
    server = store_server()
    made = []
    ns = f"t{abs(hash(request.node.name))}"

    def build(pt, dt, heads=4):
        topo = Topology(pt, dt, heads, False)
        pre = [
            Rank("prefill", pt, r, topo, CopyConnector, port=server.port, namespace=ns)
            for r in range(pt)
        ]
        dec = [
            Rank("decode", dt, r, topo, CopyConnector, port=server.port, namespace=ns)
            for r in range(dt)
        ]
        made.extend(pre + dec)
        return pre, dec

    yield build
    for r in made:
        r.m.close(wait=0)
    _ = server


def test_messages_that_came_early_go_first_and_one_at_a_time(cluster, monkeypatch):
    """A register that came before prefill's scheduler took the room is handled
    as it takes it (its thread); a page list the loop receives meanwhile waits
    for it. Handled side by side, the page list could be held after the
    register had looked for held ones: lost, the request waiting for ever."""
    import threading

    from transport.connector.core.graph import Phase
    from transport.connector.core.prefill import PrefillSide

    pre, _ = cluster(1, 1, heads=2)
    m = pre[0].m
    pages = {"kind": "pages", "room": 23, "from": 0, "pages": [4], "slot": 1, "skip": 0}
    pages.update(dst_heads=2, dst_ptrs=None, state=None)
    register = {"kind": "register", "room": 23, "from": 0, "decode_tp": 1, "dp": 0}
    register.update(kv_heads=2, mla=False, slice=[0, 0, 2], state=[], state_leg=True)
    log, inside, go = [], threading.Event(), threading.Event()
    real = PrefillSide.on_message

    def slow(side, req, msg):
        log.append(("in", msg.msg.KIND))
        if msg.msg.KIND == "register":
            inside.set()
            go.wait(5)
        real(side, req, msg)
        log.append(("out", msg.msg.KIND))

    monkeypatch.setattr(PrefillSide, "on_message", slow)
    m.deliver(register)  # no request yet: kept for the scheduler
    taker = threading.Thread(target=lambda: m.sender(23))
    taker.start()
    assert inside.wait(5)  # the register is being handled, as the room is taken
    late = threading.Thread(target=m.deliver, args=(pages,))
    late.start()
    late.join(0.3)
    assert late.is_alive()  # the page list waits for the register
    go.set()
    taker.join(5)
    late.join(5)
    assert log == [("in", "register"), ("out", "register"), ("in", "pages"), ("out", "pages")]
    assert m.phase[m.core.live(23).index] == Phase.Metadata
