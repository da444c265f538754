"""The recovery table: its declared defaults, its checks, the batch decision,
and what a step reports with it (retries with the next epoch, recomputes)."""

import numpy as np
import pytest

from lifecycle import CollectiveMismatch, KVPoll, RequestTable, StepConfig, Stepper
from lifecycle.errors import InvalidArgument
from lifecycle.reasons import FailureReason as R
from lifecycle.rules.recovery import (
    DEFAULT_RECOVERY,
    FAIL,
    FAIL_ALL,
    RECOMPUTE,
    Action,
    Policy,
    RecoveryTable,
    Where,
    preset,
    retry,
)
from lifecycle.testing import StatusBoard, lockstep


def test_the_default_retries_what_a_new_attempt_can_cure_and_fails_the_rest():
    retried = {r for r, p in DEFAULT_RECOVERY.policies.items() if p.action is Action.RETRY}
    assert retried == {
        R.PEER_DEAD,
        R.BOOTSTRAP_TIMEOUT,
        R.WAITING_TIMEOUT,
        R.TRANSFER_ERROR,
        R.CHECKSUM_MISMATCH,
        R.INJECTED_FAULT,
    }
    assert DEFAULT_RECOVERY[R.ABORTED] == FAIL
    assert DEFAULT_RECOVERY[R.METADATA_CORRUPT] == FAIL
    assert DEFAULT_RECOVERY[R.PEER_DEAD].where is Where.ANOTHER
    assert DEFAULT_RECOVERY[R.TRANSFER_ERROR] == retry(3, "same")
    assert all(p == FAIL for p in FAIL_ALL.policies.values())


def test_a_retry_fails_on_its_last_attempt():
    reasons = np.array([R.TRANSFER_ERROR] * 4 + [R.ABORTED], dtype=np.int8)
    epochs = np.array([0, 1, 2, 7, 0], dtype=np.uint16)
    action, nxt = DEFAULT_RECOVERY.decide(reasons, epochs)
    assert action.tolist() == [Action.RETRY, Action.RETRY, Action.FAIL, Action.FAIL, Action.FAIL]
    assert nxt.tolist() == [1, 2, 2, 7, 0]


def test_one_attempt_never_retries():
    t = DEFAULT_RECOVERY.override(transfer_error=retry(1))
    action, _ = t.decide(np.array([R.TRANSFER_ERROR]), np.array([0]))
    assert action.tolist() == [Action.FAIL]


def test_presets():
    assert preset("fail") is FAIL_ALL
    assert preset("retry", 5)[R.PEER_DEAD] == retry(5, "another")
    rc = preset("recompute")
    assert rc[R.TRANSFER_ERROR] == RECOMPUTE and rc[R.ABORTED] == FAIL
    with pytest.raises(InvalidArgument, match="'fail', 'retry' or 'recompute'"):
        preset("sometimes")


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: DEFAULT_RECOVERY.override(aborted=retry(2)), "abort is never retried"),
        (lambda: DEFAULT_RECOVERY.override(aborted="recompute"), "abort is never retried"),
        (lambda: DEFAULT_RECOVERY.override(not_a_reason=FAIL), "a FailureReason name"),
        (lambda: DEFAULT_RECOVERY.override(peer_dead="maybe"), "'fail' or 'recompute'"),
        (lambda: RecoveryTable({R.ABORTED: FAIL}), "one Policy for every FailureReason"),
        (lambda: RecoveryTable({**FAIL_ALL.policies, R.NONE: FAIL}), "extra"),
        (lambda: RecoveryTable({**FAIL_ALL.policies, R.UNKNOWN: "fail"}), "a Policy"),
        (lambda: retry(0), "max_attempts"),
        (lambda: retry(True), "max_attempts"),
        (lambda: retry(3, "elsewhere"), "'same', 'another' or 'hook'"),
        (lambda: Policy(Action.NONE), "Action.FAIL, RETRY or RECOMPUTE"),
        (lambda: StepConfig(recovery="retry"), "a RecoveryTable"),
    ],
)
def test_a_bad_table_is_refused_with_what_to_do(build, match):
    with pytest.raises(InvalidArgument, match=match):
        build()


def test_override_leaves_the_original_alone():
    t = DEFAULT_RECOVERY.override(transfer_error="fail")
    assert t[R.TRANSFER_ERROR] == FAIL
    assert DEFAULT_RECOVERY[R.TRANSFER_ERROR].action is Action.RETRY
    assert t != DEFAULT_RECOVERY and t.fingerprint != DEFAULT_RECOVERY.fingerprint


def _ranks(w, recovery=DEFAULT_RECOVERY, epochs=(0, 0, 0)):
    boards, steppers = [], []
    for r in range(w):
        t = RequestTable(rank=r)
        t.extend([11, 12, 13], state=KVPoll.Transferring, epochs=list(epochs))
        b = StatusBoard(default=KVPoll.Transferring)
        boards.append(b)
        steppers.append(Stepper(t, r, poller=b, config=StepConfig(recovery=recovery)))
    return boards, steppers


def test_a_step_reports_the_retry_with_the_next_epoch_on_every_rank():
    boards, steppers = _ranks(2, epochs=(0, 2, 1))
    # rank 1 fails 11 (transfer error) and 12 (on its last attempt); rank 0 fails 13 (abort)
    boards[1].set([11, 12], KVPoll.Failed)
    boards[1].reasons.update({11: R.TRANSFER_ERROR, 12: R.TRANSFER_ERROR})
    boards[0].set([13], KVPoll.Failed)
    boards[0].reasons[13] = R.ABORTED
    results = lockstep(steppers)
    for res in results:
        (rt,) = res.retries()
        assert (rt.room, rt.epoch, rt.reason, rt.origin, rt.where) == (
            11,
            1,
            R.TRANSFER_ERROR,
            1,
            Where.SAME,
        )
        got = {(f.room, f.epoch, f.action) for f in res.failures()}
        assert got == {(11, 0, Action.RETRY), (12, 2, Action.FAIL), (13, 1, Action.FAIL)}
        assert res.recomputed.size == 0
    assert steppers[0].table.info(12).epoch == 2


def test_recompute_is_reported_apart():
    boards, steppers = _ranks(2, recovery=preset("recompute"))
    boards[0].set([12], KVPoll.Failed)
    boards[0].reasons[12] = R.PEER_DEAD
    for res in lockstep(steppers):
        assert res.recomputed.tolist() == [12] and res.retries() == []


def test_without_recovery_every_failure_fails():
    boards, steppers = _ranks(1, recovery=FAIL_ALL)
    boards[0].set([11], KVPoll.Failed)
    boards[0].reasons[11] = R.TRANSFER_ERROR
    (res,) = lockstep(steppers)
    assert [f.action for f in res.failures()] == [Action.FAIL] and res.retries() == []


def test_ranks_holding_one_room_at_different_attempts_are_caught():
    # the same rooms in the same order; rank 1 holds room 12 one attempt on
    _, steppers = _ranks(2)
    t = RequestTable(rank=1)
    t.extend([11, 12, 13], state=KVPoll.Transferring, epochs=[0, 1, 0])
    steppers[1] = Stepper(t, 1, poller=StatusBoard(default=KVPoll.Transferring),
                          config=StepConfig(recovery=DEFAULT_RECOVERY))  # fmt: skip
    results = lockstep(steppers)
    assert all(isinstance(r, CollectiveMismatch) for r in results), results
    assert "request list" in str(results[0])


def test_ranks_with_different_recovery_tables_are_caught():
    _, steppers = _ranks(2)
    t = steppers[1].table
    steppers[1] = Stepper(
        t, 1, poller=StatusBoard(default=KVPoll.Transferring), config=StepConfig()
    )
    results = lockstep(steppers)
    assert all(isinstance(r, CollectiveMismatch) for r in results), results
    assert "step configuration" in str(results[0])


def test_a_moved_request_keeps_its_epoch():
    a, b = RequestTable(), RequestTable()
    a.add(5, epoch=3)
    a.move(5, b, state=KVPoll.WaitingForInput)
    assert b.info(5).epoch == 3 and "epoch=3" in repr(b.info(5))


def test_a_bad_epoch_is_refused_and_nothing_is_added():
    t = RequestTable()
    for bad in (-1, 1 << 16, 1.5, "2"):
        with pytest.raises(InvalidArgument):
            t.extend([1, 2], epochs=[0, bad])
        assert len(t) == 0


@pytest.mark.parametrize(
    ("reasons", "epochs"),
    [([R.NONE], [0]), ([14], [0]), ([-1], [0]), ([R.PEER_DEAD], [1 << 16]), ([5], [-1]),
     ([5, 5], [0])],
)  # fmt: skip
def test_decide_refuses_what_is_not_an_agreed_failure(reasons, epochs):
    with pytest.raises(InvalidArgument, match="decide"):
        DEFAULT_RECOVERY.decide(np.array(reasons), np.array(epochs))
