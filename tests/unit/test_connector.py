"""The connector's core on the simulated network (real buffers, real byte copies,
virtual time): the protocol's phases, the bytes, the room-last ordering, and the
API's illegal moves."""

import functools

import numpy as np
import pytest
import torch

from lifecycle import FailureReason, KVPoll
from support.simcases import deliver, handshaken, pair, post, settle, watch_sends
from transport.connector.core.graph import Phase, ProtocolError
from transport.connector.core.messages import Msg
from transport.connector.handles import clear_drained
from transport.testing.simnet import Faults


@pytest.fixture
def sim():
    """(net, {role: (rank, kv, meta)}): one prefill and one decode rank."""
    return pair(seed=7)


def _past_handshake(sim, room, epoch=0):
    """(net, prefill rank, decode rank, sender, receiver) of ``room``, registered."""
    net, sides = sim
    p, _, _ = sides["prefill"]
    d, _, _ = sides["decode"]
    s, r = p.sender(room, epoch=epoch), d.receiver(room, epoch=epoch)
    r.init()
    settle(net, lambda: handshaken(s), "prefill handshake")
    return net, p, d, s, r


def test_one_request_moves_pages_then_the_row_room_last(sim):
    net, sides = sim
    p, pkv, pmeta = sides["prefill"]
    d, dkv, dmeta = sides["decode"]
    pkv[0].copy_(torch.arange(pkv[0].numel()).view_as(pkv[0]) % 251)
    pmeta.write(1, 77, {"output_ids": [5]})
    s, r = p.sender(77), d.receiver(77)
    with pytest.raises(ProtocolError, match=r"room=77.*Bootstrap"):
        r.send_metadata([0], 2)  # before the handshake: refused, nothing sent
    r.init()
    settle(net, lambda: handshaken(s), "prefill handshake")
    assert r.poll() == KVPoll.WaitingForInput  # decode may allocate now
    # prefill is not ready before decode said where to write: had it taken a
    # metadata row at the handshake, the two sides could hold their rows for
    # different requests and wait for each other for ever
    assert s.poll() == KVPoll.Bootstrapping
    r.send_metadata([5, 6, 7], 2)
    settle(net, lambda: s.poll() == KVPoll.WaitingForInput, "prefill has the page list")
    s.init(3, 1)
    s.send([2, 3, 4])
    settle(net, lambda: r.poll() == KVPoll.Success, "decode success")
    assert s.poll() == KVPoll.Success
    assert torch.equal(dkv[0][5:8], pkv[0][2:5])
    assert dmeta.room_of(2) == 77
    writes = [f.effect.writes[2].tolist() for f in net.flights if f.writer is p]
    assert writes[-1] == [p.kv_args.aux_item_lens[-1]]  # the room column, alone, last
    assert s.drained and r.drained
    assert p.phase_of(s._req) == Phase.Done and d.phase_of(r._req) == Phase.Done


def test_decode_is_ready_for_pages_before_its_register_leaves(sim):
    """Whoever sees prefill registered (the handshake) and then gives decode its
    pages must find decode ready: decode takes the handshake before it sends
    any register, never after (that order once lost a CI run to a race)."""
    net, sides = sim
    d, _, _ = sides["decode"]
    seen = []

    def see(msg):
        if msg.KIND is Msg.register:
            seen.append(Phase(d.phase_of(d.core.live(msg.room))))

    watch_sends(net, d, see)
    _, _, _, _, r = _past_handshake(sim, 5)
    assert seen == [Phase.Handshaken]
    r.send_metadata([1], 0)  # no step in between: never refused


def test_a_failed_write_fails_both_sides_and_quarantines_until_drained(sim):
    net, p, d, s, r = _past_handshake(sim, 9)
    net.faults = Faults(write_fails=1.0)  # the engine reports the request's writes failed
    s.init(1, None)
    s.send([0])
    r.send_metadata([1], 0)
    settle(net, lambda: r.poll() == KVPoll.Failed, "decode hears of the failure")
    assert any(f.fails for f in net.flights)
    assert (s.failure_reason(), r.failure_reason()) == (FailureReason.TRANSFER_ERROR,) * 2
    settle(net, lambda: r.drained, "decode drained")
    s.clear()
    r.clear()
    settle(net, lambda: 9 not in p.core.reqs and 9 not in d.core.reqs, "both released")
    again = d.receiver(9)  # a cleared room may come back as a new request
    assert again.poll() == KVPoll.Bootstrapping


def test_decode_abort_before_metadata_drains_at_once(sim):
    _, sides = sim
    d, _, _ = sides["decode"]
    r = d.receiver(11)
    r.abort()
    assert r.poll() == KVPoll.Failed
    assert r.failure_reason() == FailureReason.ABORTED
    assert r.drained  # no page list was sent: nothing can land


def test_fire_many_moves_a_batch_and_skips_released(sim):
    _, sides = sim
    d, _, _ = sides["decode"]
    hs = [d.receiver(100 + i) for i in range(3)]
    reqs = [h._req for h in hs]
    reqs[2].released = True
    moved = d.core.fire_many(reqs, "abort", FailureReason.PEER_DEAD)
    assert moved.tolist() == [True, True, False]
    assert np.all(d.core.status[[h.index for h in hs[:2]]] == KVPoll.Failed)
    assert d.core.phase[hs[2].index] == Phase.Bootstrap


def test_prefill_bootstrap_deadline_covers_the_wait_for_decode_page_list(sim):
    # prefill is Bootstrapping until decode said where to write: its bootstrap
    # deadline runs until then; decode's ended when it registered
    net, p, d, s, r = _past_handshake(sim, 13)
    born = p.core.born[s.index]
    assert born == d.core.born[r.index]  # (one clock: both deadlines fall due together)
    late = p.config.bootstrap_timeout + 1
    net.jump(born + late - 2 - net.now - net.dt)  # the next step is at born + late - 2
    net.step()
    assert s.poll() == KVPoll.Bootstrapping  # not yet
    assert r.poll() == KVPoll.WaitingForInput
    net.jump(2 - net.dt)
    net.step()  # born + late: one step, so decode cannot have heard from prefill yet
    assert r.poll() == KVPoll.WaitingForInput  # registered: decode's deadline is over
    assert (s.poll(), s.failure_reason()) == (KVPoll.Failed, FailureReason.BOOTSTRAP_TIMEOUT)
    settle(net, lambda: r.poll() == KVPoll.Failed, "decode hears why")
    assert r.failure_reason() == FailureReason.BOOTSTRAP_TIMEOUT
    settle(net, lambda: r.drained and s.drained, "both drained")  # no page list went out


def _move(net, s, r, pkv, dkv, src, dst, slot, pmeta):
    """Drive one request through the protocol by hand: handshake, pages, Success."""
    pmeta.write(slot, s.bootstrap_room, {"output_ids": [slot]})
    r.init()
    settle(net, lambda: handshaken(s), f"room {s.bootstrap_room} handshake")
    r.send_metadata(dst, slot)  # prefill is ready once decode said where to write
    settle(net, lambda: s.poll() == KVPoll.WaitingForInput, f"room {s.bootstrap_room} page list")
    s.init(len(src), slot)
    s.send(src)
    settle(net, lambda: r.poll() == KVPoll.Success, f"room {s.bootstrap_room} on decode")
    assert s.poll() == KVPoll.Success
    assert torch.equal(dkv[0][dst], pkv[0][src])


def _second_request(rank, make, room):
    """What a scheduler does with a second request carrying a live room."""
    from transport import DuplicateRoom, TransportError

    core = rank.core
    live, free = dict(core.reqs), list(core._free)
    with pytest.raises(DuplicateRoom) as e:
        make(room)
    assert isinstance(e.value, TransportError) and isinstance(e.value, ValueError)
    assert (e.value.room, e.value.role, e.value.rank) == (room, rank.config.role, 0)
    assert f"room={room}: {rank.config.role} rank 0 already has a live request" in str(e.value)
    assert core.reqs == live and all(core.reqs[k] is v for k, v in live.items())
    assert core._free == free  # no slot taken


def test_sglang_40125_duplicate_room_is_refused_and_both_sides_survive(sim):
    """SGLang #40125: a client-supplied bootstrap_room used twice crashed both
    schedulers. The connector refuses a second live request with a room, on
    prefill and on decode, with a typed DuplicateRoom (a TransportError, and a
    ValueError as the untyped error was) before anything changes; the first
    request with the room completes and later ones go through."""
    net, sides = sim
    p, pkv, pmeta = sides["prefill"]
    d, dkv, _ = sides["decode"]
    pkv[0].copy_(torch.arange(pkv[0].numel()).view_as(pkv[0]) % 251)
    s, r = p.sender(40125), d.receiver(40125)
    _second_request(p, p.sender, 40125)
    _second_request(d, d.receiver, 40125)
    _move(net, s, r, pkv, dkv, [2, 3], [5, 6], 1, pmeta)
    s.clear()
    r.clear()
    _move(net, p.sender(40126), d.receiver(40126), pkv, dkv, [4], [7], 2, pmeta)


def test_sglang_40125_negative_control_without_the_check_the_first_request_is_lost(
    sim, monkeypatch
):
    """Negative control: with the check taken out (the attempts never say a
    room is taken), the second request takes the room's messages and the
    first, still live, never hears from decode: it waits in Bootstrapping
    (until its bootstrap timeout), which the test above would catch."""
    net, sides = sim
    p, _, _ = sides["prefill"]
    d, _, _ = sides["decode"]

    monkeypatch.setattr(p.core.attempts, "taken", lambda room, epoch: False)
    first = p.sender(40125)
    second = p.sender(40125)  # accepted: no typed error, the room now names the second
    d.receiver(40125).init()
    settle(net, lambda: handshaken(second), "the second's handshake")
    net.run(lambda: False, 0.2)  # (decode's register was handled long since)
    assert not handshaken(first)  # orphaned: decode's register went to the second
    assert first.poll() == KVPoll.Bootstrapping


def test_a_retried_room_hears_only_its_own_attempt(sim):
    """Attempt 0 of room 77 fails; attempt 1 starts. A completion of attempt 0
    that arrives then is refused and counted, never applied to attempt 1 (which
    would report Success over pages nobody wrote); attempt 1 then moves its own
    bytes. The control: the same word naming attempt 1 is applied."""
    net, sides = sim
    p, pkv, pmeta = sides["prefill"]
    d, dkv, dmeta = sides["decode"]
    s0, r0 = p.sender(77), d.receiver(77)
    r0.init()
    settle(net, lambda: handshaken(s0), "attempt 0 handshake")
    r0.fail(FailureReason.TRANSFER_ERROR)
    settle(net, lambda: s0.poll() == KVPoll.Failed and r0.drained, "attempt 0 failed on both sides")
    assert (s0.epoch, r0.epoch) == (0, 0)
    r1 = d.receiver(77, epoch=1)  # the old handle is not cleared yet: both attempts live
    s0.clear(), r0.clear()
    done0 = {"kind": "done", "room": 77, "epoch": 0, "from": 0}
    # (handed over at once: prefill's own late reply to attempt 0 is refused too, any time)
    before = d.core.stats["stale_epoch"]
    deliver(net, d, done0)
    assert d.core.stats["stale_epoch"] == before + 1
    assert r1.poll() == KVPoll.Bootstrapping
    pkv[0].copy_(torch.arange(pkv[0].numel()).view_as(pkv[0]) % 249)
    s1 = p.sender(77, epoch=1)
    _move(net, s1, r1, pkv, dkv, [2, 3], [6, 7], 3, pmeta)  # handshake, pages, Success, bytes


@pytest.mark.parametrize("superseded", [True, False])
def test_a_register_of_an_attempt_prefill_moved_past_is_told_it_failed(
    sim, superseded, monkeypatch
):
    """Prefill gave up attempt 0 of room 79 and cleared it before decode's attempt 0
    registered (decode had not asked yet): attempt 1 is live there. Decode's
    register of attempt 0 is answered "failed" (a reason a new attempt can cure),
    so decode moves on to attempt 1 instead of waiting out its timeout. The
    negative control drops the answer: decode waits."""
    from transport.connector.core import machine

    if not superseded:
        monkeypatch.setattr(machine.ConnectorCore, "_arrived", _arrived_without_answer)
    net, sides = sim
    p, _, _ = sides["prefill"]
    d, _, _ = sides["decode"]
    s0 = p.sender(79)
    s0.fail(FailureReason.BOOTSTRAP_TIMEOUT)
    settle(net, lambda: s0.drained, "attempt 0 drained on prefill")
    s0.clear()
    s1 = p.sender(79, epoch=1)
    r0 = d.receiver(79)
    r0.init()
    told = net.run(lambda: r0.poll() == KVPoll.Failed, 1.0)
    assert told is superseded
    if superseded:
        assert r0.failure_reason() == machine.SUPERSEDED == FailureReason.TRANSFER_ERROR
        assert p.core.stats["stale_epoch"] >= 1
        r0.clear()
        r1 = d.receiver(79, epoch=1)
        r1.init()
        settle(net, lambda: handshaken(s1), "attempt 1 handshake")


def _arrived_without_answer(self, msg):
    """ConnectorCore._arrived as it was: a stale word is dropped unanswered."""
    from transport.attempts import Route
    from transport.connector.core import liveness

    liveness.heard(self, msg.peer)
    route, req, reason = self.attempts.route(msg.room, msg.epoch, msg)
    if route is Route.LATE:
        self.side.late(msg, reason)
    elif route is Route.DELIVER and req is not None:
        self.side.on_message(req, msg)


def test_control_a_completion_naming_the_live_attempt_is_applied(sim):
    net, _, d, _, r = _past_handshake(sim, 78, epoch=2)
    r.send_metadata([5], 2)
    deliver(net, d, {"kind": "done", "room": 78, "epoch": 2, "from": 0})
    assert r.poll() == KVPoll.Success  # why a word of another attempt must never be
    assert d.core.stats["stale_epoch"] == 0


def test_attempts_of_a_room_are_ordered_and_checked(sim):
    from transport import DuplicateRoom
    from transport.errors import InvalidEpoch

    _, sides = sim
    d, _, _ = sides["decode"]
    r = d.receiver(90, epoch=1)
    for epoch in (0, 1):  # the same attempt or an older one: a duplicate
        with pytest.raises(DuplicateRoom):
            d.receiver(90, epoch=epoch)
    for bad in (-1, 1 << 16, 1.5, True, "2"):
        with pytest.raises(InvalidEpoch, match="attempt"):
            d.receiver(91, epoch=bad)
    assert d.core.live(90) is r._req and d.core.live(91) is None
    assert d.receiver(92, epoch=np.uint16(3)).epoch == 3  # an epoch read from a table


def test_a_message_that_does_not_parse_is_counted_and_changes_nothing(sim):
    """Garbage on a rank's queue (not JSON, an unknown word, a field of the wrong
    type) is counted and dropped: the rank lives on and the request moves."""
    net, sides = sim
    p, pkv, pmeta = sides["prefill"]
    d, dkv, dmeta = sides["decode"]
    s, r = p.sender(79), d.receiver(79)
    bad = [b"{not json", b"[1, 2]", b'{"kind": "explode", "room": 79, "from": 0}']
    bad.append(b'{"kind": "failed", "room": 79, "from": 0, "reason": "oops"}')
    bad.append(b'{"kind": "done", "room": 79, "from": 0, "epoch": -1}')
    for body in bad:
        post(d, body)
    settle(net, lambda: d.core.stats["malformed"] == len(bad), "every malformed message counted")
    assert r.poll() == KVPoll.Bootstrapping and d.core.last_error is None
    _move(net, s, r, pkv, dkv, [2], [6], 1, pmeta)  # the rank still serves the request


def test_clear_drained_is_each_handles_drained_then_clear(sim):
    """The batch release asks each connector once and does what each handle's
    ``drained`` then ``clear`` would: drained handles cleared (released, their
    answers frozen), the others untouched; handles of two connectors at once."""
    net, sides = sim
    p, _, _ = sides["prefill"]
    d, _, _ = sides["decode"]
    aborted = [d.receiver(200 + i) for i in range(3)]
    for h in aborted:
        h.abort()  # no page list sent: drained at once
    live = [d.receiver(300 + i) for i in range(2)]
    for h in live:
        h.init()
    sender = p.sender(400)
    sender.abort()
    handles = [aborted[0], live[0], sender, aborted[1], live[1], aborted[2]]
    want = [h.drained for h in handles]
    assert want[:2] == [True, False] and want[3:] == [True, False, True]
    polls = [h.poll() for h in handles]
    assert clear_drained(handles) == want
    for h, gone, answer in zip(handles, want, polls):
        assert h.detached is gone  # a cleared handle answers what it last saw
        assert h._req.released is gone
        assert h.poll() == answer
    assert clear_drained(handles) == want  # a second time: nothing left to clear
    assert clear_drained([]) == []


@pytest.mark.parametrize("count", [3, 40])  # one by one, and the batch's own path
def test_a_batch_release_leaves_the_connector_as_one_handle_at_a_time(count):
    """clear_drained on many handles leaves every column, the free slots, the
    attempts' records and each handle's frozen answer as each handle's own
    ``drained`` then ``clear`` would (a handle given twice is cleared once)."""

    def run(batch):
        _, sides = pair(seed=7)
        d, _, _ = sides["decode"]
        hs = [d.receiver(500 + i, epoch=i % 2) for i in range(count)]
        for i, h in enumerate(hs):
            if i % 3:
                h.fail(FailureReason.PEER_DEAD if i % 3 == 1 else FailureReason.ABORTED)
            else:
                h.init()  # live: not drained
        given = [*hs, hs[1]]
        if batch:
            gone = clear_drained(given)
        else:
            gone = []
            for h in given:
                gone.append(h.drained)
                if gone[-1]:
                    h.clear()
        core = d.core
        att = core.attempts
        return (
            gone,
            [(h.detached, h._req.released, h.poll(), h.failure_reason()) for h in hs],
            list(core._free),
            {k: getattr(core, k).tolist() for k in ("status", "reason", "phase", "scatter_left")},
            (sorted(att.reqs), dict(att.latest), dict(att.cleared), dict(att.older)),
        )

    assert run(True) == run(False)


def _fire_batch_of_one(core, req, trigger, reason):
    return bool(core.fire_many([req], trigger, reason)[0])


def test_firing_one_request_is_firing_a_batch_of_it():
    """ConnectorCore.fire (Python integers) moves a request as fire_many does,
    for every side, trigger, phase and status."""
    from transport.connector.core.graph import ROLES, TRIGGERS

    for role in ROLES:
        _, sides = pair(seed=3)
        rank = sides[role][0]
        core = rank.core
        h = rank.receiver(1) if role == "decode" else rank.sender(1)
        req, i = h._req, h.index
        cols = ("phase", "status", "reason", "failed_at")
        for trigger in TRIGGERS:
            for phase in Phase:
                for status in range(5):
                    outs = []
                    for fn in (core.fire, functools.partial(_fire_batch_of_one, core)):
                        core.phase[i], core.status[i] = phase, status
                        core.reason[i], core.failed_at[i] = 0, -1.0
                        core.now = 5.0
                        moved = fn(req, trigger, FailureReason.PEER_DEAD)
                        outs.append((moved, [float(getattr(core, c)[i]) for c in cols]))
                    assert outs[0] == outs[1], (role, trigger, phase, status)
        req.released = True
        assert core.fire(req, TRIGGERS[0]) is False
        with pytest.raises(ValueError, match="unknown protocol trigger"):
            core.fire(req, "no such trigger")
