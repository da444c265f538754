"""The connector's KV digest (ConnectorConfig.digest) on the simulated network
(real buffers, real byte copies, virtual time): every topology's legs digest the
same bytes on both sides; a byte corrupted on decode fails the request there and
on prefill (checksum mismatch); with the digest off the same corruption goes
unseen; a decode that asks a prefill that does not digest fails closed."""

from functools import partial

import pytest

from lifecycle import FailureReason, KVPoll
from support.simcases import PS, Rank, finish, run_request, run_split_state, settle
from transport.connector.core.graph import Phase
from transport.errors import ChecksumMismatch
from transport.testing.simnet import SimNet
from transport.topology import Topology


@pytest.fixture
def build():
    def make(pt, dt, heads=4, mla=False, state=False, pre=None, dec=None, notifies=False, **kw):
        """(net, prefill ranks, decode ranks); ``notifies``: the engines note each
        noted write's landing to decode, as NIXL does."""
        net = SimNet(pt * 10 + dt)
        host = partial(net.add, notifies=notifies)
        topo = Topology(pt, dt, heads, mla)
        p_cfg = {"digest": True} if pre is None else pre
        d_cfg = {"digest": True, **kw} if dec is None else {**dec, **kw}
        ps = [Rank("prefill", pt, r, topo, host, state=state, **p_cfg) for r in range(pt)]
        ds = [Rank("decode", dt, r, topo, host, state=state, **d_cfg) for r in range(dt)]
        return net, ps, ds

    return make


CASES = [
    pytest.param(1, 1, {}, id="1-1"),
    pytest.param(2, 1, {}, id="2-1-sliced"),
    pytest.param(1, 2, {}, id="1-2-sliced"),
    pytest.param(4, 2, {"staging": True, "staging_pages": 8}, id="4-2-staged"),
    pytest.param(2, 4, {"mla": True, "heads": 1}, id="2-4-mla"),
    pytest.param(2, 2, {"state": True}, id="2-2-state"),
]


@pytest.mark.parametrize(("pt", "dt", "kw"), CASES)
def test_every_leg_digests_the_same_bytes_on_both_sides(build, pt, dt, kw):
    net, pre, dec = build(pt, dt, **kw)
    senders, receivers, dst = run_request(net, pre, dec, room=41, n=5, prefix=1)
    finish(net, senders, receivers, dec, staged=kw.get("staging", False))
    for d in dec:
        d.check(41, dst, first_page=1)
        s = d.stats
        assert s["digests_checked"] >= 1 and s["digest_mismatches"] == 0, s
        assert s["digest_bytes"] > 0
    assert sum(p.stats["digest_bytes"] for p in pre) == sum(d.stats["digest_bytes"] for d in dec)


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_a_corrupted_byte_fails_both_sides_checksum_mismatch(build, staged):
    kw = {"staging": True, "staging_pages": 8} if staged else {}
    net, pre, dec = build(2, 1, **kw)
    dec[0].m.core.corrupt(43, offset=3)
    senders, receivers, _ = run_request(net, pre, dec, room=43, n=4)
    r = receivers[0]

    def failed():
        if staged:
            dec[0].advance(43, r.index, net.now)
        return r.poll() == KVPoll.Failed

    settle(net, failed, "decode fails the request")
    assert r.failure_reason() == FailureReason.CHECKSUM_MISMATCH
    settle(net, lambda: all(s.poll() == KVPoll.Failed for s in senders), "prefill hears why")
    assert {s.failure_reason() for s in senders} == {FailureReason.CHECKSUM_MISMATCH}
    st = dec[0].stats
    assert (st["corrupted"], st["digest_mismatches"]) == (1, 1)  # the first sender's leg only
    err = dec[0].m.core.last_error
    assert isinstance(err, ChecksumMismatch) and "room=43" in str(err)
    assert "prefill rank 0" in str(err) and "prefill rank 1" not in str(err)
    # by peer: the mismatch is blamed on the leg whose bytes differ, not its twin's
    legs = dec[0].m.core.side.peer_legs
    assert legs.totals == {
        0: {"asked": 1, "done": 1, "failed": 1},
        1: {"asked": 1, "done": 1, "failed": 0},
    }
    failed = [(e.peer, e.outcome) for e in legs.take() if e.outcome != "done"]
    assert failed == [(0, "checksum mismatch")]
    settle(net, lambda: r.drained and all(s.drained for s in senders), "both drained")
    # prefill's legs by decode peer: each prefill rank's one leg, to decode rank 0,
    # done, then failed by the decode rank that said the bytes differed
    for p in pre:
        legs = p.m.core.side.peer_legs
        assert legs.totals == {0: {"asked": 1, "done": 1, "failed": 1}}
        assert [(e.peer, e.outcome, e.room) for e in legs.take()] == [
            (0, "done", 43),
            (0, "checksum mismatch", 43),
        ]


def test_with_the_digest_off_the_same_corruption_goes_unseen(build):
    """Negative control: the corruption hook works without the digest, and
    nothing notices it."""
    net, pre, dec = build(2, 1, pre={}, dec={})
    dec[0].m.core.corrupt(47, offset=3)
    senders, receivers, dst = run_request(net, pre, dec, room=47, n=4)
    finish(net, senders, receivers, dec)
    assert dec[0].stats["corrupted"] == 1
    assert dec[0].stats["digests_checked"] == 0
    with pytest.raises(AssertionError, match="layer 0"):
        dec[0].check(47, dst)  # the byte is wrong, yet the request succeeded


def test_a_decode_that_asks_a_prefill_that_does_not_digest_fails_closed(build):
    net, pre, dec = build(1, 1, pre={})
    senders, receivers, _ = run_request(net, pre, dec, room=53, n=2)
    settle(net, lambda: receivers[0].poll() == KVPoll.Failed, "decode fails closed")
    assert receivers[0].failure_reason() == FailureReason.CHECKSUM_MISMATCH
    assert "sent no digest" in str(dec[0].m.core.last_error)
    settle(net, lambda: senders[0].poll() == KVPoll.Failed, "prefill hears why")
    assert senders[0].failure_reason() == FailureReason.CHECKSUM_MISMATCH


def test_a_prefill_waits_for_the_verdict_before_success(build):
    """Prefill is Verifying, not Done, until decode said its bytes matched."""
    from support.simcases import hold_sends

    net, pre, dec = build(1, 1)
    release = hold_sends(net, dec[0].m, "verified")
    senders, receivers, _ = run_request(net, pre, dec, room=59, n=2)
    settle(net, lambda: receivers[0].poll() == KVPoll.Success, "decode matched")
    settle(net, lambda: pre[0].m.phase_of(senders[0]._req) == Phase.Verifying, "prefill verifying")
    net.run(lambda: False, 1.0)  # a virtual second more: the verdict is all it waits for
    assert senders[0].poll() == KVPoll.Transferring
    assert release() >= 1
    settle(net, lambda: senders[0].poll() == KVPoll.Success, "prefill success")
    assert PS == 2  # (the geometry run_request fills)


def test_prefill_connectors_have_nothing_to_corrupt(build):
    _, pre, _ = build(1, 1)
    with pytest.raises(Exception, match="call corrupt\\(\\) on a decode connector"):
        pre[0].m.core.corrupt(1)


@pytest.mark.parametrize(("pt", "dt"), [(2, 1), (1, 2), (4, 2)])
def test_split_state_shares_are_digested_alike_on_both_sides(build, pt, dt):
    net, pre, dec = build(pt, dt, heads=4, state="split")
    senders, receivers, _ = run_split_state(net, pre, dec, room=61)
    finish(net, senders, receivers, dec)
    assert all(d.stats["digest_mismatches"] == 0 for d in dec)
    assert all(d.stats["digests_checked"] >= 1 for d in dec)


@pytest.fixture
def pieces(monkeypatch):
    """Pieces of 64 bytes, so that each page is a noted write of its own and a
    piece of the digest."""
    from transport.digest import hashing, parts

    monkeypatch.setattr(hashing, "PIECE", 64)
    monkeypatch.setattr(parts, "PIECE", 64)


@pytest.mark.parametrize(("pt", "kw"), [(1, {}), (2, {}), (2, {"state": True})])
def test_decode_hashes_each_noted_write_as_it_lands(build, pieces, pt, kw):
    net, pre, dec = build(pt, 1, notifies=True, **kw)
    senders, receivers, dst = run_request(net, pre, dec, room=57, n=6, prefix=1)
    finish(net, senders, receivers, dec)
    dec[0].check(57, dst, first_page=1)
    st = dec[0].stats
    assert st["digests_checked"] == pt and st["digest_mismatches"] == 0, st
    # a note per page after the prefix, from each sender (heard on a later pass)
    settle(net, lambda: st["landed"] == 5 * pt, "every note heard")


def test_a_byte_corrupted_after_its_pages_were_hashed_is_still_caught(build, pieces):
    """The corruption lands after the notes had decode hash those pages: the
    pieces hashed before it are hashed again (else it would go unseen)."""
    net, pre, dec = build(1, 1, notifies=True)
    dec[0].m.core.corrupt(59, offset=3)
    senders, receivers, _ = run_request(net, pre, dec, room=59, n=4)
    settle(net, lambda: receivers[0].poll() == KVPoll.Failed, "decode fails the request")
    assert receivers[0].failure_reason() == FailureReason.CHECKSUM_MISMATCH
    st = dec[0].stats
    assert (st["corrupted"], st["digest_mismatches"]) == (1, 1)
    settle(net, lambda: st["landed"] == 4, "every note heard")
