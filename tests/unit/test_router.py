"""The simulator's router for retried attempts (pdlife.sim.peer.Router) and the
fake backend's word between the sides (PeerWord), each attempt by its epoch."""

from types import SimpleNamespace

from lifecycle.reasons import FailureReason
from pdlife.sim.peer import PeerWord, Router
from support.store_stub import Store


def test_prefill_takes_the_attempts_decode_handed_over_in_order_once_agreed():
    store = Store()
    decode, prefill = Router(store, "decode", on=True), Router(store, "prefill", on=True)
    assert decode.closed and not prefill.closed  # prefill serves retries until decode is done
    assert prefill.words(leads=True) == (0, 0)
    decode.dispatch(11, 1, 0, 5)
    decode.dispatch(12, 2, 1, 3)
    assert prefill.take() == []  # seen, not agreed yet
    assert prefill.words(leads=False) == (0, 0)  # only the side's first rank speaks
    prefill.agree(*prefill.words(leads=True))
    assert prefill.take() == [(11, 1, 0, 5), (12, 2, 1, 3)] and prefill.take() == []
    decode.close()
    prefill.agree(*prefill.words(leads=True))
    assert prefill.closed


def test_a_router_that_is_off_says_nothing_and_never_holds_prefill():
    r = Router(Store(), "prefill", on=False)
    assert r.closed and r.words(leads=True) == (0, 0)


def _word(store, rank, silent=False, side="decode"):
    cfg = SimpleNamespace(prefill_ranks=2, world=4, prefill=2)
    where = SimpleNamespace(side=side, tp_rank=0)
    return PeerWord(cfg, rank, where, store, silent=silent)


class Handle:
    def __init__(self, epoch):
        self.epoch, self.failed = epoch, None

    def fail(self, reason):
        self.failed = reason


def test_a_notice_is_applied_only_to_the_attempt_it_names():
    store = Store()
    word = _word(store, 2)
    late, live, ahead = Handle(1), Handle(1), Handle(2)
    for room, epoch in ((1, 0), (2, 1), (3, 2)):  # older, the live one, a later attempt
        store.queue_push(
            "fakepeer/2", f"{room} {int(FailureReason.TRANSFER_ERROR)} {epoch}".encode()
        )
    word.hear({1: late, 2: live, 3: Handle(1)})
    assert late.failed is None  # about attempt 0: never applied to attempt 1
    assert live.failed == FailureReason.TRANSFER_ERROR
    word.on_admit(3, ahead)  # attempt 2 of room 3 starts: its notice applies now
    assert ahead.failed == FailureReason.TRANSFER_ERROR


def test_notices_of_two_attempts_not_admitted_yet_are_each_kept():
    # decode failed attempts 1 and 2 of room 5 before prefill admitted attempt 1:
    # the later notice must not hide the earlier one (attempt 1 would stay live
    # on prefill for ever, waiting for a decode that gave up on it)
    store = Store()
    word = _word(store, 0, side="prefill")
    for epoch, reason in ((1, FailureReason.INJECTED_FAULT), (2, FailureReason.TRANSFER_ERROR)):
        store.queue_push("fakepeer/0", f"5 {int(reason)} {epoch}".encode())
    word.hear({5: Handle(0)})  # attempt 0 live: both notices are about later ones
    first, second = Handle(1), Handle(2)
    word.on_admit(5, first)
    assert first.failed == FailureReason.INJECTED_FAULT
    word.on_admit(5, second)
    assert second.failed == FailureReason.TRANSFER_ERROR
    assert word.early == {}
    # a notice of an attempt before the one admitted is dropped, not applied
    store.queue_push("fakepeer/0", f"6 {int(FailureReason.ABORTED)} 1".encode())
    word.hear({})
    third = Handle(2)
    word.on_admit(6, third)
    assert third.failed is None and word.early == {}
