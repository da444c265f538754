"""The shared connector's protocol over real topologies, on the simulated
network (transport.testing.simnet) with real buffers and real byte copies:
prefill and decode TP sizes that differ (direct head-sliced writes and
staging), MLA, state components, a cached prefix and prefill DP groups. Every
page decode holds is compared, head by head, with what the prefill rank
holding that head wrote."""

import numpy as np
import pytest
import torch

from lifecycle import FailureReason, KVPoll
from support.simcases import (
    HB,
    PS,
    SPLIT_UNITS,
    UNIT,
    WHOLE,
    Rank,
    deliver,
    finish,
    handshaken,
    hello,
    pattern,
    refused_for_layout,
    run_request,
    run_split_state,
    settle,
    split_row,
    whole_row,
)
from transport.connector.core.graph import Phase
from transport.testing.simnet import SimNet
from transport.topology import Topology, TopologyError


@pytest.fixture
def net():
    return SimNet(seed=0)


@pytest.fixture
def cluster(net):
    def build(pt, dt, heads=4, mla=False, dp=1, state=False, heads_major=False, **decode_cfg):
        topo = Topology(pt, dt, heads, mla)
        hm = heads_major
        pre = [
            Rank("prefill", pt, r, topo, net.add, dp=g, state=state, heads_major=hm)
            for g in range(dp)
            for r in range(pt)
        ]
        dec = [
            Rank("decode", dt, r, topo, net.add, state=state, heads_major=hm, **decode_cfg)
            for r in range(dt)
        ]
        return pre, dec

    return build


@pytest.mark.parametrize("heads_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize(("pt", "dt"), [(2, 1), (1, 2), (2, 4), (4, 2), (2, 2)])
def test_head_sliced_writes_land_every_head(net, cluster, pt, dt, heads_major):
    pre, dec = cluster(pt, dt, heads=4, heads_major=heads_major)
    senders, receivers, dst = run_request(net, pre, dec, room=77)
    finish(net, senders, receivers, dec)
    for d in dec:
        d.check(77, dst)
        assert d.meta.room_of(2) == 77 and d.meta.read(2).first_token == 77
    assert not any(r.require_staging for r in receivers)
    if (pt, dt) == (2, 1):  # 5 pages of 2 tokens in 2 layers, decode's pages reversed
        kv = 5 * 2 * (1 if heads_major else PS)  # a run per page (head-major) or per token
        row = len(pre[0].meta.buf_infos()[0])  # the primary's metadata fields and room
        assert [p.m.core.stats["writes"] for p in pre] == [kv + row, kv]


@pytest.mark.parametrize("pre_hm", [False, True], ids=["token-to-head", "head-to-token"])
def test_pages_laid_out_unlike_the_peers_are_refused_on_either_side(net, pre_hm):
    p = Rank("prefill", 1, 0, Topology(1, 1, 2), net.add, heads_major=pre_hm)
    d = Rank("decode", 1, 0, Topology(1, 1, 2), net.add, heads_major=not pre_hm)
    refused_for_layout(net, p.m, d.m, 4, "(KVArgs.heads_major)")
    assert "decode rank 0 refused it: prefill's KV pages are" in str(p.m.core.last_error)


def test_prefill_refuses_a_register_from_pages_laid_out_otherwise(net):
    p = Rank("prefill", 1, 0, Topology(1, 1, 2), net.add, heads_major=True)
    s = p.m.sender(5)
    register = {"kind": "register", "room": 5, "from": 0, "decode_tp": 1, "dp": 0}
    register.update(kv_heads=2, mla=False, slice=[0, 0, 2], state=[], state_leg=True)
    deliver(net, p.m, register)  # from a decode rank of token-major pages
    assert s.poll() == KVPoll.Failed
    assert "prefill's KV pages are head-major, decode's token-major" in str(p.m.core.last_error)
    assert p.m.core.stats["bytes_written"] == 0


@pytest.mark.parametrize(("pt", "dt"), [(1, 2), (2, 4), (1, 4)])
def test_prefill_is_ready_only_once_every_decode_legs_page_list_is_in(net, cluster, pt, dt):
    # a prefill rank with several decode legs reports WaitingForInput (its scheduler
    # takes a metadata row) only once each of them said where to write
    pre, dec = cluster(pt, dt, heads=4)
    room, n = 83, 3
    senders, receivers = hello(net, pre, dec, room)
    dst = np.arange(10, 10 + n)
    last = dt - 1  # every decode rank but the last says where to write
    for r in receivers[:last]:
        r.send_metadata(dst, 2)

    def legs(p):
        return p.m.core.live(room).legs

    settle(
        net,
        lambda: all(leg.told for p in pre for q, leg in legs(p).items() if q != last),
        "every other page list in",
    )
    waiting = [p.tp_rank for p in pre if last in legs(p)]  # a leg has not said yet
    assert waiting
    for p, s in zip(pre, senders):
        want = KVPoll.Bootstrapping if p.tp_rank in waiting else KVPoll.WaitingForInput
        assert s.poll() == want, p.tp_rank
    if pt == 1:  # its other legs' lists are in, yet it is not ready
        assert len(legs(pre[0])) == dt
    receivers[last].send_metadata(dst, 2)
    settle(net, lambda: all(s.poll() == KVPoll.WaitingForInput for s in senders), "every list in")
    src = np.arange(3, 3 + n)
    for p, s in zip(pre, senders):
        p.fill(room, src)
        p.meta.write(1, room, {"output_ids": [room % 1000]})
        s.init(n, 1)
        s.send(src)
    finish(net, senders, receivers, dec)
    for d in dec:
        d.check(room, dst)


def test_staging_lands_contiguous_then_the_gate_holds_until_scattered(net, cluster):
    pre, dec = cluster(2, 4, heads=4, staging=True, staging_pages=8, scatter_pages=2)
    senders, receivers, dst = run_request(net, pre, dec, room=91, n=5)
    assert all(r.require_staging for r in receivers)
    # every sender done: the connector says Success, the scatter is still to come
    settle(net, lambda: all(r.poll() == KVPoll.Success for r in receivers), "transfer done")
    idx = np.array([r.index for r in receivers])
    assert dec[0].m.core.pending(np.array([91], np.uint64), idx[:1]).all()
    assert dec[0].kv[0].sum() == 0  # nothing placed yet
    for _ in range(2):  # 2 pages a step: 5 pages need 3 steps
        dec[0].m.core.advance(np.array([91], np.uint64), idx[:1], net.now)
    assert dec[0].m.core.pending(np.array([91], np.uint64), idx[:1]).all()
    finish(net, senders, receivers, dec, staged=True)
    for d in dec:
        d.check(91, dst)


def test_mla_one_sender_per_decode_rank_idle_prefill_ranks_still_succeed(net, cluster):
    pre, dec = cluster(2, 1, mla=True, heads=1)
    senders, receivers, dst = run_request(net, pre, dec, room=5)
    finish(net, senders, receivers, dec)
    dec[0].check(5, dst)
    assert pre[1].m.core.stats["bytes_written"] == 0  # the idle rank wrote nothing
    assert pre[0].m.core.stats["bytes_written"] > 0


def test_state_rows_travel_with_the_pages(net, cluster):
    pre, dec = cluster(2, 1, heads=2, state=True)
    senders, receivers, dst = run_request(net, pre, dec, room=33)
    finish(net, senders, receivers, dec)
    dec[0].check(33, dst)
    assert np.array_equal(dec[0].state[5].numpy(), pattern(33, 9, [0], range(3)).reshape(-1))
    assert dec[0].state[:5].sum() == 0


def test_a_cached_prefix_is_not_sent(net, cluster):
    pre, dec = cluster(1, 1, heads=2)
    senders, receivers, dst = run_request(net, pre, dec, room=44, n=6, prefix=2)
    finish(net, senders, receivers, dec)
    dec[0].check(44, dst, first_page=2)
    page = PS * 2 * HB  # a page of one layer: 2 tokens x 2 heads
    assert pre[0].m.core.stats["bytes_written"] == 4 * page * 2 + sum(
        pre[0].m.kv_args.aux_item_lens
    )


def test_a_prefill_that_knows_the_prefix_hands_over_only_the_pages_after_it(net, cluster):
    pre, dec = cluster(2, 1, heads=2)  # two prefill ranks: each sends its head
    room, n, prefix = 45, 6, 2
    senders = [p.m.sender(room) for p in pre]
    (r,) = [d.m.receiver(room) for d in dec]
    r.init()
    settle(net, lambda: r.poll() == KVPoll.WaitingForInput, "handshake")
    assert all(s.decode_prefix_pages is None for s in senders)  # not told yet
    src = np.arange(3, 3 + n)
    for p in pre:
        p.fill(room, src)
        p.meta.write(1, room, {"output_ids": [room]})
    dst = np.arange(10, 10 + n - prefix)
    r.send_metadata(dst, 2, decode_prefix_len=prefix * PS)
    settle(net, lambda: all(s.decode_prefix_pages == prefix for s in senders), "told")
    for s in senders:
        s.init(n - prefix, 1, first_page=prefix)
        s.send(src[prefix:4])
        with pytest.raises(ValueError, match="first_page=2 given after pages"):
            s.init(n - prefix, 1, first_page=prefix)
        s.send(src[4:])
    finish(net, senders, [r], dec)
    dec[0].check(room, dst, first_page=prefix)
    page = PS * 1 * HB  # one head of one page on one layer, per prefill rank
    row = sum(pre[0].m.kv_args.aux_item_lens)  # written once, by the primary rank
    written = sum(p.m.core.stats["bytes_written"] for p in pre)
    assert written == (n - prefix) * page * 2 * len(pre) + row


def test_a_decode_rank_with_a_shorter_prefix_than_prefill_skipped_fails_it(net, cluster):
    pre, dec = cluster(1, 1, heads=2)
    s, r = pre[0].m.sender(46), dec[0].m.receiver(46)
    r.init()
    settle(net, lambda: r.poll() == KVPoll.WaitingForInput, "handshake")
    r.send_metadata(np.arange(10, 14), 2, decode_prefix_len=1 * PS)
    settle(net, lambda: s.decode_prefix_pages == 1, "told")
    s.init(3, 1, first_page=2)  # prefill believes decode holds 2 pages: page 1 is missing
    s.send(np.arange(5, 8))
    settle(net, lambda: s.poll() == KVPoll.Failed, "refused")
    assert s.failure_reason() == FailureReason.TRANSFER_ERROR
    assert "decode rank 0 holds a prefix of 1 pages, but send() is handed the request's " in str(
        pre[0].m.core.last_error
    )
    settle(net, lambda: r.poll() == KVPoll.Failed, "decode told")


def test_prefill_dp_groups_pair_only_with_the_named_group(net, cluster):
    pre, dec = cluster(2, 1, heads=2, dp=2)
    senders, receivers, dst = run_request(net, pre, dec, room=66, dp=1)
    finish(net, senders, receivers, dec)
    dec[0].check(66, dst)
    assert all(p.m.core.stats["bytes_written"] == 0 for p in pre if p.dp == 0)


def test_an_abort_on_one_decode_rank_fails_and_drains_every_leg(net, cluster):
    pre, dec = cluster(2, 4, heads=4)
    senders = [p.m.sender(12) for p in pre]
    receivers = [d.m.receiver(12) for d in dec]
    for r in receivers:
        r.init()
    settle(net, lambda: handshaken(*senders), "handshake")
    for r in receivers:
        r.send_metadata(np.arange(3), 0)
    settle(net, lambda: all(s.poll() == KVPoll.WaitingForInput for s in senders), "page lists in")
    receivers[1].abort()  # decode rank 1's heads come from prefill rank 0 alone
    settle(net, lambda: senders[0].poll() == KVPoll.Failed, "prefill rank 0 hears")
    # prefill rank 0 tells its other leg, decode rank 0, once its writes drained
    settle(net, lambda: receivers[0].poll() == KVPoll.Failed, "decode rank 0 hears")
    assert receivers[0].failure_reason() == FailureReason.ABORTED
    assert senders[1].poll() == KVPoll.WaitingForInput  # its own scheduler's consensus tells it
    senders[1].fail(FailureReason.ABORTED)
    for r in receivers[2:]:
        r.fail(FailureReason.ABORTED)
    settle(net, lambda: all(r.drained for r in receivers), "every decode rank drained")
    settle(net, lambda: all(s.drained for s in senders), "every prefill rank drained")


def test_decode_refuses_a_prefill_group_serving_another_model(net):
    p = Rank("prefill", 1, 0, Topology(1, 1, 2), net.add)
    d = Rank("decode", 1, 0, Topology(1, 1, 4), net.add)
    s = p.m.sender(3)
    r = d.m.receiver(3)
    r.init()
    settle(net, lambda: r.poll() == KVPoll.Failed, "refused")
    assert isinstance(d.m.core.last_error, TopologyError)
    assert "2 KV heads" in str(d.m.core.last_error) and "room=3" in str(d.m.core.last_error)
    # prefill hears why at once (not at its bootstrap timeout, 300 s)
    settle(net, lambda: s.poll() == KVPoll.Failed, "prefill told", limit=1.0)
    assert s.failure_reason() == FailureReason.TRANSFER_ERROR
    assert "room=3 on prefill rank 0: decode rank 0 refused it: 2 KV heads" in str(
        p.m.core.last_error
    )


def test_bad_arguments_are_refused_before_anything_moves(net, cluster):
    pre, dec = cluster(1, 1, heads=2)
    s, r = pre[0].m.sender(8), dec[0].m.receiver(8)
    with pytest.raises(ValueError, match="prefill_dp_rank"):
        r.init(prefill_dp_rank=-1)
    r.init()
    settle(net, lambda: r.poll() == KVPoll.WaitingForInput, "handshake")
    with pytest.raises(ValueError, match="room=8: decode_prefix_len 3"):
        r.send_metadata([1, 2], 0, decode_prefix_len=3)
    with pytest.raises(ValueError, match="no state component"):
        r.send_metadata([1, 2], 0, state_indices=[np.array([1])])
    with pytest.raises(ValueError, match="no state component"):
        s.send([1], state_indices=[1])
    assert r.poll() == KVPoll.WaitingForInput  # nothing was sent
    with pytest.raises(TopologyError, match="holds 1 of 2 KV heads, but its KVArgs say 2"):
        Rank("decode", 2, 0, Topology(1, 1, 2), net.add, kv_heads=2)


def test_a_page_list_that_overtakes_its_register_is_held_not_lost(net, cluster):
    # decode's scheduler and its loop send on two store connections: "pages"
    # can reach prefill before "register"
    pre, _ = cluster(1, 1, heads=2)
    m = pre[0].m
    s = m.sender(21)
    pages = {"kind": "pages", "room": 21, "from": 0, "pages": [4], "slot": 1, "skip": 0}
    pages.update(dst_heads=2, dst_ptrs=None, state=None)
    register = {"kind": "register", "room": 21, "from": 0, "decode_tp": 1, "dp": 0}
    register.update(kv_heads=2, mla=False, slice=[0, 0, 2], state=[], state_leg=True)
    deliver(net, m, pages)
    assert m.core.phase[s.index] == Phase.Bootstrap and m.core.last_error is None
    deliver(net, m, register)
    assert m.core.phase[s.index] == Phase.Metadata  # handshake, then the held page list
    assert m.core.live(21).legs[0].dst_pages.tolist() == [4]


@pytest.mark.parametrize("when", ["before the handshake", "after the handshake"])
def test_a_decode_abort_before_the_page_list_reaches_every_prefill_rank(net, cluster, when):
    pre, dec = cluster(2, 1, heads=2)
    senders = [p.m.sender(31) for p in pre]
    r = dec[0].m.receiver(31)
    if when == "after the handshake":
        r.init()
        settle(net, lambda: handshaken(*senders), "handshake")
    else:  # named its group, not registered yet: the legs are planned to tell them
        r._req.want_register = True
        r._req.dp = 0
    r.abort()
    assert r.drained  # no page list was sent: nothing can land
    settle(net, lambda: all(s.poll() == KVPoll.Failed for s in senders), "every prefill rank hears")
    assert {s.failure_reason() for s in senders} == {FailureReason.ABORTED}
    settle(net, lambda: all(s.drained for s in senders), "prefill drained")


@pytest.mark.parametrize(("pt", "dt"), [(2, 1), (1, 2), (2, 2)])
def test_a_decode_failure_before_prefill_is_up_reaches_it_once_it_is(net, pt, dt):
    """Decode fails a request before its prefill group's record is up (its
    ranks still starting): nothing could land, so decode releases it at once,
    and its prefill ranks hear why once they are up -- instead of holding the
    request in Bootstrapping for a register that never comes."""
    topo = Topology(pt, dt, 4, False)
    made = [Rank("decode", dt, r, topo, net.add) for r in range(dt)]
    receivers = [d.m.receiver(51) for d in made]
    for r in receivers:
        r.init()
        r.fail(FailureReason.INJECTED_FAULT)
    assert all(r.drained for r in receivers)  # no page list was sent
    for r in receivers:
        r.clear()
    net.run(lambda: False, 0.2)  # the decode ranks run on alone for a while
    pre = [Rank("prefill", pt, r, topo, net.add) for r in range(pt)]
    made += pre
    senders = [p.m.sender(51) for p in pre]
    settle(net, lambda: all(s.poll() == KVPoll.Failed for s in senders), "prefill hears")
    assert {s.failure_reason() for s in senders} == {FailureReason.INJECTED_FAULT}
    settle(net, lambda: all(s.drained for s in senders), "prefill drained")
    # every decode rank told its word (prefill may have heard one first)
    settle(net, lambda: not any(d.m.core.side.owed for d in made[:dt]), "every owed word told")


def test_a_late_register_hears_why_prefill_failed_even_once_cleared(net, cluster):
    pre, dec = cluster(2, 1, heads=2)
    senders = [p.m.sender(41) for p in pre]
    for s in senders:  # prefill agreed Failed before decode registered; released at once
        s.fail(FailureReason.INJECTED_FAULT)
    settle(net, lambda: all(s.drained for s in senders), "prefill drained")
    for s in senders:
        s.clear()
    settle(net, lambda: all(41 not in p.m.core.reqs for p in pre), "prefill released")
    r = dec[0].m.receiver(41)
    r.init()
    settle(net, lambda: r.poll() == KVPoll.Failed, "decode hears")
    assert r.failure_reason() == FailureReason.INJECTED_FAULT
    settle(net, lambda: r.drained, "decode drained")


@pytest.mark.parametrize(
    ("pt", "dt", "heads", "mla"),
    [
        *[(2, 1, 4, False), (1, 2, 4, False), (2, 4, 4, False), (4, 2, 4, False)],
        *[(2, 2, 4, False), (2, 1, 1, False), (1, 4, 1, False), (4, 2, 1, True), (2, 4, 1, True)],
    ],
)
def test_split_state_is_resharded_whatever_the_kv_layout(net, cluster, pt, dt, heads, mla):
    # every decode rank holds its own share of the split tensor, assembled from
    # every prefill rank whose share overlaps it, and the whole tensor from its
    # primary sender, also where those are not its KV senders (MLA, replicated heads)
    pre, dec = cluster(pt, dt, heads=heads, mla=mla, state="split")
    senders, receivers, dst = run_split_state(net, pre, dec, room=57)
    finish(net, senders, receivers, dec)
    for d in dec:
        d.check(57, dst)
        assert np.array_equal(d.split[0][5].numpy(), split_row(57, dt, d.tp_rank)), d.tp_rank
        assert np.array_equal(d.split[1][5].numpy(), whole_row(57)), d.tp_rank
        assert d.split[0][:5].sum() == 0 and d.split[1][6:].sum() == 0
    due = sum(d.split[0][0].nbytes + WHOLE for d in dec)
    sent = sum(p.m.core.stats["bytes_written"] for p in pre)
    kv = sum(d.kv[0][0].nbytes * 2 * 2 for d in dec)  # 2 layers x 2 pages per decode rank
    meta = sum(pre[0].m.kv_args.aux_item_lens) * dt
    assert sent == kv + meta + due  # each state byte written once, no more


def test_split_state_that_does_not_fit_is_refused_on_either_side(net, cluster):
    # one side cuts its rows into units of another size: refused and named, nothing written
    pre, dec = cluster(2, 1, heads=2, state="split")
    wrong = [[[SPLIT_UNITS * UNIT * 2, WHOLE], [SPLIT_UNITS, 0]]]  # 6-byte units on decode
    bad = dec[0].m
    bad.core.state_geom = wrong
    told = [p.m.sender(61) for p in pre]
    r = bad.receiver(61)
    r.init()
    settle(net, lambda: r.poll() == KVPoll.Failed, "decode refuses")
    assert isinstance(bad.core.last_error, TopologyError)
    assert "room=61" in str(bad.core.last_error)
    assert "a unit must have the same bytes on both" in str(bad.core.last_error)
    settle(net, lambda: all(s.poll() == KVPoll.Failed for s in told), "every prefill rank told")
    assert all("a unit must have the same bytes" in str(p.m.core.last_error) for p in pre)
    # prefill checks the geometry a register carries as well
    m = pre[0].m
    s = m.sender(62)
    register = {"kind": "register", "room": 62, "from": 0, "decode_tp": 1, "dp": 0}
    register.update(kv_heads=2, mla=False, slice=[0, 0, 1], state=wrong, state_leg=True)
    deliver(net, m, register)
    assert s.poll() == KVPoll.Failed
    assert isinstance(m.core.last_error, TopologyError)
    assert "room=62 on prefill rank 0" in str(m.core.last_error)
    assert "prefill cuts 12-byte rows into 4 units, decode 48-byte rows into 8" in str(
        m.core.last_error
    )
    assert all(p.m.core.stats["bytes_written"] == 0 for p in pre)


@pytest.mark.parametrize("state", [True, "split"])
def test_state_rows_of_another_count_than_decode_gave_are_refused(net, cluster, state):
    # prefill hands over 2 state rows, decode gave 1: written as they were, the
    # second whole row ran into decode's next row (another request's), and the
    # split writes paired sources and destinations out of step. Refused, named
    pre, dec = cluster(2, 1, heads=2, state=state)
    room = 71
    senders, receivers = hello(net, pre, dec, room)
    for p, s in zip(pre, senders):
        for t in [p.state] if state is True else p.split:
            t[2:4] = 7
        s.init(1, 1)
    for r in receivers:
        r.send_metadata(np.array([10]), 2, state_indices=[np.array([5])])
    for s in senders:
        s.send(np.array([3]), state_indices=[np.array([2, 3])])
    # a rank writing state rows refuses (the primary; with split state each writes a
    # share, and the first to refuse may abort the other through decode first)
    settle(net, lambda: receivers[0].poll() == KVPoll.Failed, "decode hears")
    settle(net, lambda: senders[0].poll() == KVPoll.Failed, "prefill fails")
    errors = [p for p in pre if p.m.core.last_error is not None]
    assert errors
    for p in errors:
        assert isinstance(p.m.core.last_error, TopologyError)
        why = str(p.m.core.last_error)
        assert f"room={room} on prefill rank {p.tp_rank}" in why
        assert "2 state rows of component 0" in why and "decode rank 0 gave 1" in why
    got = [dec[0].state] if state is True else dec[0].split
    assert all(t.sum() == 0 for t in got), "no state row may be written"


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("state", [True, "split"])
def test_state_rows_named_on_one_side_only_are_refused(net, cluster, state, side):
    # decode gave rows but prefill's send() never did (or the other way round):
    # committed, decode would hold whatever its rows held before. Refused, named
    pre, dec = cluster(2, 1, heads=2, state=state)
    room = 73
    senders, receivers = hello(net, pre, dec, room)
    for s in senders:
        s.init(1, 1)
    rows = [np.array([5])] if side == "decode" else None
    for r in receivers:
        r.send_metadata(np.array([10]), 2, state_indices=rows)
    for s in senders:
        s.send(np.array([3]), state_indices=None if side == "decode" else [np.array([2])])
    settle(net, lambda: receivers[0].poll() == KVPoll.Failed, "decode hears")
    errors = [str(p.m.core.last_error) for p in pre if p.m.core.last_error is not None]
    assert errors
    want = (
        "decode rank 0 gave state rows but send() was handed none"
        if side == "decode"
        else "send() was handed state rows but decode rank 0 gave none"
    )
    assert all(f"room={room}" in e and want in e for e in errors), errors


def test_a_request_of_no_pages_takes_its_state_rows_from_the_send_after_init(net, cluster):
    # init(0) then send([], state_indices): the loop may run between the two
    # calls; "every page handed over" is not yet "every row handed over"
    pre, dec = cluster(1, 1, heads=2, state=True)
    room = 74
    s, r = pre[0].m.sender(room), dec[0].m.receiver(room)
    r.init()
    settle(net, lambda: r.poll() == KVPoll.WaitingForInput and handshaken(s), "handshake")
    pre[0].meta.write(1, room, {"output_ids": [room % 1000]})
    pre[0].state[2] = torch.tensor(pattern(room, 9, [0], range(3)).reshape(-1))
    r.send_metadata(np.array([], dtype=np.int64), 2, state_indices=[np.array([5])])
    settle(net, lambda: pre[0].m.core.live(room).legs[0].told, "pages told")
    s.init(0, 1)
    net.run(lambda: False, 0.2)  # the loop's turn between the scheduler's two calls
    s.send(np.array([], dtype=np.int64), state_indices=[np.array([2])])
    settle(net, lambda: r.poll() in (KVPoll.Success, KVPoll.Failed), "decode concludes")
    assert pre[0].m.core.last_error is None, pre[0].m.core.last_error
    finish(net, [s], [r], dec)
    assert np.array_equal(dec[0].state[5].numpy(), pattern(room, 9, [0], range(3)).reshape(-1))
