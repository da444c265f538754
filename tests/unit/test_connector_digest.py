"""The connector's KV digest (ConnectorConfig.digest) in one process, with the
stub engine that copies at once: every topology's legs digest the same bytes
on both sides; a byte corrupted on decode fails the request there and on
prefill (checksum mismatch); with the digest off the same corruption goes
unseen; a decode that asks a prefill that does not digest fails closed."""

import queue

import numpy as np
import pytest
import test_connector_topologies as topologies
from test_connector_topologies import PS, Rank, finish, run_request, store  # noqa: F401

from lifecycle import FailureReason, KVPoll
from support.stub_engine import CopyConnector, CopyEngine
from support.wait import wait_for
from transport.connector.core.graph import Phase
from transport.errors import ChecksumMismatch
from transport.topology import Topology


@pytest.fixture
def build(store, request):  # noqa: F811
    made = []
    ns = f"d{abs(hash(request.node.name))}"

    def make(pt, dt, heads=4, mla=False, state=False, pre=None, dec=None, **decode_cfg):
        topo = Topology(pt, dt, heads, mla)
        p_cfg = {"digest": True} if pre is None else pre
        d_cfg = {"digest": True, **decode_cfg} if dec is None else {**dec, **decode_cfg}
        ps = [
            Rank("prefill", pt, r, store, topo, state=state, namespace=ns, **p_cfg)
            for r in range(pt)
        ]
        ds = [
            Rank("decode", dt, r, store, topo, state=state, namespace=ns, **d_cfg)
            for r in range(dt)
        ]
        made.extend(ps + ds)
        return ps, ds

    yield make
    for r in made:
        r.m.close(wait=0)


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
    pre, dec = build(pt, dt, **kw)
    senders, receivers, dst = run_request(pre, dec, room=41, n=5, prefix=1)
    finish(senders, receivers, dec, staged=kw.get("staging", False))
    for d in dec:
        d.check(41, dst, first_page=1)
        s = d.m.stats
        assert s["digests_checked"] >= 1 and s["digest_mismatches"] == 0, s
        assert s["digest_bytes"] > 0
    assert sum(p.m.stats["digest_bytes"] for p in pre) == sum(
        d.m.stats["digest_bytes"] for d in dec
    )


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_a_corrupted_byte_fails_both_sides_checksum_mismatch(build, staged):
    kw = {"staging": True, "staging_pages": 8} if staged else {}
    pre, dec = build(2, 1, **kw)
    dec[0].m.corrupt(43, offset=3)
    senders, receivers, _ = run_request(pre, dec, room=43, n=4)
    r = receivers[0]

    def failed():
        if staged:
            dec[0].m.advance(np.array([43], np.uint64), np.array([r.index]))
        return r.poll() == KVPoll.Failed

    wait_for(failed, "decode fails the request")
    assert r.failure_reason() == FailureReason.CHECKSUM_MISMATCH
    wait_for(lambda: all(s.poll() == KVPoll.Failed for s in senders), "prefill hears why")
    assert {s.failure_reason() for s in senders} == {FailureReason.CHECKSUM_MISMATCH}
    st = dec[0].m.stats
    assert (st["corrupted"], st["digest_mismatches"]) == (1, 1)  # the first sender's leg only
    err = dec[0].m.last_error
    assert isinstance(err, ChecksumMismatch) and "room=43" in str(err)
    assert "prefill rank 0" in str(err) and "prefill rank 1" not in str(err)
    wait_for(lambda: r.drained and all(s.drained for s in senders), "both drained")


def test_with_the_digest_off_the_same_corruption_goes_unseen(build):
    """Negative control: the corruption hook works without the digest, and
    nothing notices it."""
    pre, dec = build(2, 1, pre={}, dec={})
    dec[0].m.corrupt(47, offset=3)
    senders, receivers, dst = run_request(pre, dec, room=47, n=4)
    finish(senders, receivers, dec)
    assert dec[0].m.stats["corrupted"] == 1
    assert dec[0].m.stats["digests_checked"] == 0
    with pytest.raises(AssertionError, match="layer 0"):
        dec[0].check(47, dst)  # the byte is wrong, yet the request succeeded


def test_a_decode_that_asks_a_prefill_that_does_not_digest_fails_closed(build):
    pre, dec = build(1, 1, pre={})
    senders, receivers, _ = run_request(pre, dec, room=53, n=2)
    wait_for(lambda: receivers[0].poll() == KVPoll.Failed, "decode fails closed")
    assert receivers[0].failure_reason() == FailureReason.CHECKSUM_MISMATCH
    assert "sent no digest" in str(dec[0].m.last_error)
    wait_for(lambda: senders[0].poll() == KVPoll.Failed, "prefill hears why")
    assert senders[0].failure_reason() == FailureReason.CHECKSUM_MISMATCH


def test_a_prefill_waits_for_the_verdict_before_success(build, monkeypatch):
    """Prefill is Verifying, not Done, until decode said its bytes matched."""
    pre, dec = build(1, 1)
    held = []
    send = dec[0].m.mail.send

    def hold(peer, msg, st):
        (held if msg["kind"] == "verified" else []).append((peer, msg, st))
        if msg["kind"] != "verified":
            send(peer, msg, st)

    monkeypatch.setattr(dec[0].m.mail, "send", hold)
    senders, receivers, _ = run_request(pre, dec, room=59, n=2)
    wait_for(lambda: receivers[0].poll() == KVPoll.Success, "decode matched")
    wait_for(lambda: pre[0].m.phase_of(senders[0]._req) == Phase.Verifying, "prefill verifying")
    assert senders[0].poll() == KVPoll.Transferring
    for peer, msg, st in held:
        send(peer, msg, st)
    wait_for(lambda: senders[0].poll() == KVPoll.Success, "prefill success")
    assert PS == 2  # (the geometry run_request fills)


def test_prefill_connectors_have_nothing_to_corrupt(build):
    pre, _ = build(1, 1)
    with pytest.raises(Exception, match="call corrupt\\(\\) on a decode connector"):
        pre[0].m.corrupt(1)


@pytest.mark.parametrize(("pt", "dt"), [(2, 1), (1, 2), (4, 2)])
def test_split_state_shares_are_digested_alike_on_both_sides(build, pt, dt):
    from test_connector_topologies import _run_split_state

    pre, dec = build(pt, dt, heads=4, state="split")
    senders, receivers, _ = _run_split_state(pre, dec, room=61)
    finish(senders, receivers, dec)
    assert all(d.m.stats["digest_mismatches"] == 0 for d in dec)
    assert all(d.m.stats["digests_checked"] >= 1 for d in dec)


class NotingEngine(CopyEngine):
    """An engine that notes each noted write's landing to decode, as NIXL does
    (one decode rank: every note goes to it)."""

    NOTIFIES = True
    inbox: "queue.SimpleQueue[tuple]"

    def __init__(self, rank, role):
        super().__init__()
        self.rank, self.role = rank, role

    def write(self, info, src, dst, lens, note):
        token = super().write(info, src, dst, lens, note)
        if note:
            n = [int(w) for w in note.decode().split(":")]
            self.inbox.put((n[0], n[1], self.rank, None if len(n) == 2 else (n[2], n[3])))
        return token

    def notified(self):
        out = []
        while self.role == "decode" and not self.inbox.empty():
            out.append(self.inbox.get())
        return out


def noting_connector(kv_args, config):
    return CopyConnector(kv_args, config, NotingEngine(config.rank, config.role))


@pytest.fixture
def noting(monkeypatch):
    """Connectors whose engine notes every write; pieces of 64 bytes, so that
    each page is a noted write of its own and a piece of the digest."""
    from transport.digest import hashing, parts

    monkeypatch.setattr(NotingEngine, "inbox", queue.SimpleQueue(), raising=False)
    monkeypatch.setattr(topologies, "CopyConnector", noting_connector)
    monkeypatch.setattr(hashing, "PIECE", 64)
    monkeypatch.setattr(parts, "PIECE", 64)


@pytest.mark.parametrize(("pt", "kw"), [(1, {}), (2, {}), (2, {"state": True})])
def test_decode_hashes_each_noted_write_as_it_lands(build, noting, pt, kw):
    pre, dec = build(pt, 1, **kw)
    senders, receivers, dst = run_request(pre, dec, room=57, n=6, prefix=1)
    finish(senders, receivers, dec)
    dec[0].check(57, dst, first_page=1)
    st = dec[0].m.stats
    assert st["digests_checked"] == pt and st["digest_mismatches"] == 0, st
    # a note per page after the prefix, from each sender (heard by the loop's next pass)
    wait_for(lambda: st["landed"] == 5 * pt, "every note heard")


def test_a_byte_corrupted_after_its_pages_were_hashed_is_still_caught(build, noting):
    """The corruption lands after the notes had decode hash those pages: the
    pieces hashed before it are hashed again (else it would go unseen)."""
    pre, dec = build(1, 1)
    dec[0].m.corrupt(59, offset=3)
    senders, receivers, _ = run_request(pre, dec, room=59, n=4)
    wait_for(lambda: receivers[0].poll() == KVPoll.Failed, "decode fails the request")
    assert receivers[0].failure_reason() == FailureReason.CHECKSUM_MISMATCH
    st = dec[0].m.stats
    assert (st["corrupted"], st["digest_mismatches"]) == (1, 1)
    wait_for(lambda: st["landed"] == 4, "every note heard")
