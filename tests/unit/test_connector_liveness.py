"""Heartbeats and a peer that only pauses: a rank judges a peer by when it
last saw its heartbeat change, on its own clock; a silent peer's requests fail
on both sides with reason peer dead and stay quarantined until it says it
stopped (a writer still silent at the drain timeout keeps them fenced); a peer
that beats again serves new requests. The protocol runs on the simulated
network (transport.testing.simnet), in virtual time; the mailbox's own
judgement of silence is checked against a store stand-in."""

import time

import pytest
import torch

from buffers import MetadataBuffers, MetadataLayout
from lifecycle import FailureReason, KVPoll
from support.simcases import handshaken, settle, thaw
from transport.connector.config import ConnectorConfig
from transport.connector.core import liveness
from transport.connector.core.graph import Phase
from transport.connector.mailbox import Mailbox
from transport.layout import kv_args_for
from transport.testing.simnet import Faults, SimNet

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


def _make_pair(drain=(30.0, 30.0), faults=None):
    """A prefill and a decode rank on a simulated network whose heartbeats are
    the configured ones: {"net", "prefill", "decode", "<role> buffers"}."""
    net = SimNet(0, faults or Faults(), heartbeat=(LIMIT / 4, 4))
    layout = MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
    sides = {"net": net}
    for role, drain_s in (("prefill", drain[0]), ("decode", drain[1])):
        kv = [torch.zeros((8, 64), dtype=torch.uint8)]
        meta = MetadataBuffers(4, layout)
        cfg = ConnectorConfig(
            role=role,
            tp_rank=0,
            store_port=1,
            heartbeat_interval=LIMIT / 4,
            heartbeat_misses=4,
            drain_timeout=drain_s,
        )
        sides[role] = net.add(kv_args_for(kv, meta.buf_infos(), 0), cfg)
        sides[f"{role} buffers"] = (kv, meta)  # the writes land in them: keep them alive
    return sides


@pytest.fixture
def pair(request):
    return _make_pair(drain=getattr(request, "param", (30.0, 30.0)))


def _paired(net, p, d, room):
    s, r = p.sender(room), d.receiver(room)
    r.init()
    settle(net, lambda: handshaken(s), "prefill handshake")
    s.init(1, None)
    net.fence.assign(d, [1], room, r.epoch)  # decode's scheduler gave the request page 1
    r.send_metadata([1], 0)  # decode's pages are promised: writes may land from now
    settle(net, lambda: p.core.phase[s.index] == Phase.Metadata, "prefill has the page list")
    return s, r


def _cleared(net, d, *handles):
    """The schedulers let go of the handles; decode's page goes back to the pool."""
    for h in handles:
        h.clear()
    net.fence.free(d, [1])


def _succeeds(net, p, d, room):
    s, r = _paired(net, p, d, room)
    s.send([0])
    settle(net, lambda: r.poll() == KVPoll.Success == s.poll(), f"room {room} succeeds")
    _cleared(net, d, s, r)


def _write_of(net, p, room):
    """The write of ``p`` for ``room`` on the wire (None: not issued yet)."""
    return next((f for f in net.flights if f.writer is p and f.effect.room == room), None)


def test_a_paused_prefill_fails_its_requests_then_serves_again(pair):
    net, p, d = pair["net"], pair["prefill"], pair["decode"]
    s, r = _paired(net, p, d, 7)
    net.pause(p, None)  # no beat, no answer
    settle(net, lambda: r.poll() == KVPoll.Failed, "decode finds prefill silent")
    assert r.failure_reason() == FailureReason.PEER_DEAD
    net.run(lambda: False, 0.3)
    assert not r.drained  # prefill may write once it resumes: quarantined
    # it resumes: it hears decode's abort, stops, says so; decode then releases
    thaw(p)
    settle(net, lambda: r.drained, "decode drained on prefill's word")
    assert d.core.phase[r.index] == Phase.Drained
    assert (s.poll(), s.failure_reason()) == (KVPoll.Failed, FailureReason.PEER_DEAD)
    _cleared(net, d, s, r)
    _succeeds(net, p, d, 8)  # it beats again: live for new requests
    assert net.fence.violations == []
    # decode's legs by peer: the one the pause failed, blamed on it; the next, done
    legs = d.core.side.peer_legs
    assert legs.totals == {0: {"asked": 2, "done": 1, "failed": 1}}
    ended = legs.take()
    assert [(e.peer, e.outcome, e.room) for e in ended] == [(0, "peer dead", 7), (0, "done", 8)]
    assert all(e.seconds is not None and e.seconds >= 0 for e in ended) and legs.take() == []
    # prefill's, by decode peer (decode rank 0 is its peer 0): the one decode gave
    # up on is not blamed on decode (peer dead names prefill); the next, done
    legs = p.core.side.peer_legs
    assert legs.totals == {0: {"asked": 2, "done": 1, "failed": 0}}
    assert [(e.peer, e.outcome, e.room) for e in legs.take()] == [(0, "done", 8)]


@pytest.mark.parametrize("fence", [True, False], ids=["fenced", "negative-control"])
def test_sglang_24527_a_writer_silent_past_the_drain_timeout_stays_fenced(monkeypatch, fence):
    # SGLang #24527 by way of a pause: decode declares prefill dead while a write
    # of room 7 is still on its way (a paused process's queue). Past decode's
    # drain timeout (1 s) its pages stay fenced while prefill is silent; the
    # write lands in those pages (still fenced), prefill resumes, hears the
    # abort and says it stopped, and only then are they released. Negative
    # control: with no writer counted silent (the rule switched off), decode releases
    # the pages on silence, and the late write lands in pages the scheduler
    # gave back (the simulated network's fence records it)
    if not fence:
        monkeypatch.setattr(liveness, "silent_writers", lambda dead, req: set())
    # the write lands 3 s after it is issued: past silence (0.6 s) and drain (1 s)
    sides = _make_pair(drain=(30.0, 1.0), faults=Faults(write_delay=(3.0, 3.0)))
    net, p, d = sides["net"], sides["prefill"], sides["decode"]
    kv_p, kv_d = sides["prefill buffers"][0][0], sides["decode buffers"][0][0]
    s, r = _paired(net, p, d, 7)
    kv_p[0] = 0xAB
    s.send([0])
    settle(net, lambda: _write_of(net, p, 7) is not None, "prefill's write is on its way")
    late = _write_of(net, p, 7)
    net.pause(p, None)
    settle(net, lambda: r.poll() == KVPoll.Failed, "decode finds prefill silent")
    assert r.failure_reason() == FailureReason.PEER_DEAD
    t0 = net.now
    if fence:
        settle(net, lambda: r.fenced, "fenced at decode's drain timeout")
        assert net.now - t0 > 0.5  # the drain timeout, not at once
        net.run(lambda: False, 0.3)
        assert not r.drained and r.fenced
        assert d.core.fenced() == (1, 1)  # the gauge: one request, one page
    else:
        settle(net, lambda: r.drained, "released on prefill's silence")
        net.fence.free(d, [1])  # drained: the scheduler takes the page back
    assert not late.done
    settle(net, lambda: late.done, "the paused process's queued write lands")
    assert bytes(kv_d[1].tolist()) == b"\xab" * 64  # it landed in decode's page 1
    thaw(p)  # the paused process resumes
    if fence:
        # the page held the late write: only now, told prefill stopped, is it free
        settle(net, lambda: r.drained, "released on prefill's word")
        assert d.core.phase[r.index] == Phase.Drained and d.core.fenced() == (0, 0)
        assert net.fence.violations == []
        _cleared(net, d, s, r)
    else:  # released before the write landed: another request's page by then
        assert d.core.phase[r.index] == Phase.Drained
        assert [v.rank for v in net.fence.violations] == [0], net.fence.violations
        for h in (s, r):
            h.clear()
        net.fence.violations.clear()
    net.faults = Faults()  # writes land quickly again
    kv_p[0] = 0x11
    s2, r2 = _paired(net, p, d, 8)  # admitted after the resume: it succeeds
    s2.send([0])
    settle(net, lambda: _write_of(net, p, 8) is not None, "the new write is issued")
    settle(net, lambda: r2.poll() == KVPoll.Success == s2.poll(), "room 8 succeeds")
    assert bytes(kv_d[1].tolist()) == b"\x11" * 64
    assert net.fence.violations == []


@pytest.mark.parametrize("pair", [(30.0, 1.0)], indirect=True)
def test_a_prefill_that_never_resumes_keeps_decode_fenced(pair):
    net, p, d = pair["net"], pair["prefill"], pair["decode"]
    s, r = _paired(net, p, d, 7)
    net.pause(p, None)
    settle(net, lambda: r.poll() == KVPoll.Failed, "decode finds prefill silent")
    t0 = net.now
    settle(net, lambda: r.fenced, "fenced on prefill's silence")
    assert net.now - t0 > 0.5  # at the drain timeout (1 s), not at once
    assert d.core.phase[r.index] == Phase.Fenced and not r.drained
    net.run(lambda: False, 1.5)  # longer than the drain timeout again: still fenced
    assert r.fenced and d.core.fenced() == (1, 1)
    r.clear()  # the scheduler lets go of its handle: the fence holds all the same
    assert d.core.fenced() == (1, 1)
    # closing does not wait for a peer that is gone: nothing is owed to a live peer
    assert not d.core.owing()


def test_a_paused_decode_hears_why_once_it_resumes(pair):
    net, p, d = pair["net"], pair["prefill"], pair["decode"]
    s, r = _paired(net, p, d, 7)
    net.pause(d, None)
    settle(net, lambda: s.poll() == KVPoll.Failed, "prefill finds decode silent")
    assert s.failure_reason() == FailureReason.PEER_DEAD
    thaw(d)
    # prefill told it "failed" once no write was in flight: decode ends the same way
    settle(net, lambda: r.poll() == KVPoll.Failed and r.drained, "decode hears of it")
    assert r.failure_reason() == FailureReason.PEER_DEAD
    _cleared(net, d, s, r)
    _succeeds(net, p, d, 8)
    assert net.fence.violations == []


def test_writes_given_up_keep_decode_quarantined_until_its_own_drain_timeout():
    # prefill fails the request (decode went silent) while its write is in flight;
    # the engine never finishes it, so at prefill's drain timeout it is given up.
    # It may still land: decode, told so, keeps its pages until its own timeout
    sides = _make_pair(drain=(0.5, 2.0), faults=Faults(write_lost=1.0))
    net, p, d = sides["net"], sides["prefill"], sides["decode"]
    s, r = _paired(net, p, d, 7)
    s.send([0])
    settle(net, lambda: _write_of(net, p, 7) is not None, "prefill's write issued")
    net.pause(d, None)
    settle(net, lambda: s.poll() == KVPoll.Failed, "prefill finds decode silent")
    settle(net, lambda: p.phase_of(s._req) == Phase.Drained, "prefill gives the write up")
    assert s._req.abandoned
    thaw(d)
    settle(net, lambda: r.poll() == KVPoll.Failed, "decode hears of it")
    assert r.failure_reason() == FailureReason.PEER_DEAD
    t0 = net.now
    assert not r.drained  # the given-up write may still land
    settle(net, lambda: r.drained, "released at decode's own drain timeout")
    assert net.now - t0 > 0.8


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
