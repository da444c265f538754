"""Decode's legs by prefill peer (transport.connector.peer_legs): a failure
is blamed on the legs its reason names, never on a client's abort."""

from lifecycle import FailureReason as R
from transport.connector import peer_legs
from transport.connector.peer_legs import BLAME, PeerLegs


def test_a_done_leg_counts_its_time_from_its_page_list():
    legs = PeerLegs()
    legs.asked(7, 0, [0, 1], now=10.0)
    legs.done(7, 0, 1, now=10.25)
    legs.done(7, 0, 1, now=11.0)  # said twice: counted once
    legs.done(7, 1, 0, now=11.0)  # another attempt's word: not this leg's
    (e,) = legs.take()
    assert (e.peer, e.outcome, e.seconds, e.room) == (1, "done", 0.25, 7)
    assert legs.totals == {
        0: {"asked": 1, "done": 0, "failed": 0},
        1: {"asked": 1, "done": 1, "failed": 0},
    }


def test_a_timeout_is_blamed_on_the_legs_still_open():
    legs = PeerLegs()
    legs.asked(7, 0, [0, 1, 2], now=0.0)
    legs.done(7, 0, 2, now=1.0)
    legs.failed(7, 0, R.WAITING_TIMEOUT, now=5.0)
    assert [(e.peer, e.outcome, e.seconds) for e in legs.take()] == [
        (2, "done", 1.0),
        (0, "waiting timeout", 5.0),
        (1, "waiting timeout", 5.0),
    ]


def test_a_dead_peer_is_blamed_alone():
    legs = PeerLegs()
    legs.asked(7, 0, [0, 1], now=0.0)
    legs.failed(7, 0, R.PEER_DEAD, now=2.0, dead={1, 5})
    assert [(e.peer, e.outcome) for e in legs.take()] == [(1, "peer dead")]
    assert legs.totals[0]["failed"] == 0


def test_an_abort_or_a_hook_error_is_nobodys_fault():
    legs = PeerLegs()
    for room, reason in ((7, R.ABORTED), (8, R.HOOK_ERROR)):
        legs.asked(room, 0, [0], now=0.0)
        legs.failed(room, 0, reason, now=1.0)
    assert legs.take() == [] and legs.totals[0]["failed"] == 0
    legs.done(7, 0, 0, now=2.0)  # closed by the failure: nothing left open
    assert legs.take() == []


def test_a_digest_mismatch_is_blamed_on_the_named_legs_even_once_done():
    legs = PeerLegs()
    legs.asked(7, 0, [0, 1], now=0.0)
    legs.done(7, 0, 0, now=1.0)
    legs.done(7, 0, 1, now=1.0)
    legs.take()
    legs.failed(7, 0, R.CHECKSUM_MISMATCH, now=2.0, named=(1,))
    assert [(e.peer, e.outcome, e.seconds) for e in legs.take()] == [(1, "checksum mismatch", None)]


def test_a_released_request_closes_its_legs_uncounted():
    legs = PeerLegs()
    legs.asked(7, 0, [0], now=0.0)
    legs.forget(7, 0)
    legs.failed(7, 0, R.TRANSFER_ERROR, now=1.0)
    assert legs.take() == [] and legs.totals[0] == {"asked": 1, "done": 0, "failed": 0}


def test_an_unread_ledger_keeps_a_bounded_tail(monkeypatch):
    monkeypatch.setattr(peer_legs, "KEPT", 3)
    legs = PeerLegs()
    for room in range(1, 6):
        legs.asked(room, 0, [0], now=0.0)
        legs.done(room, 0, 0, now=1.0)
    assert [e.room for e in legs.take()] == [3, 4, 5]


def test_blame_names_only_reasons_the_peer_table_counts():
    from lifecycle.rules.peers import COUNTS

    assert set(BLAME) <= COUNTS and set(BLAME.values()) <= {"dead", "named", "open"}


def test_a_side_that_blames_no_open_leg_blames_the_named_peer_alone():
    # prefill: a failure its own side agreed on is not its decode peers' doing;
    # a decode peer that said why (its abort) is blamed
    legs = PeerLegs()
    legs.asked(7, 0, [0, 1], now=0.0)
    legs.failed(7, 0, R.TRANSFER_ERROR, now=1.0, open_blamed=False)
    legs.asked(8, 0, [0, 1], now=2.0)
    legs.failed(8, 0, R.WAITING_TIMEOUT, now=3.0, named=(1,), open_blamed=False)
    assert [(e.room, e.peer, e.outcome) for e in legs.take()] == [(8, 1, "waiting timeout")]
    assert legs.totals[0] == {"asked": 2, "done": 0, "failed": 0}
