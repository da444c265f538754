"""One deadline policy for every layer: the step, the connector and the fake
backend fail a request with the same reason at the same moment."""

import attrs
import numpy as np
import pytest

from lifecycle import FailureReason, KVPoll, RequestTable, SingleRank, StepConfig, Stepper
from lifecycle.rules.deadlines import DEADLINES, check_deadlines, overdue
from lifecycle.rules.graph import VERDICTS
from lifecycle.testing import StatusBoard
from support.clock import Clock
from transport.backends.fake import FakeConfig, FakeManager


def test_a_deadline_has_passed_from_its_limit_on_and_a_clock_not_started_never():
    since = np.array([0.0, 1.0, np.nan])
    assert overdue(5.0, since, 5.0).tolist() == [True, False, False]
    assert overdue(6.0, since, 5.0).tolist() == [True, True, False]


def _step_fails_at(limit: float, after: float) -> int:
    clock = Clock(100.0)
    table, board = RequestTable(), StatusBoard()
    stepper = Stepper(
        table, 0, poller=board, clock=clock, config=StepConfig(bootstrap_timeout=limit)
    )
    table.add(1)
    board.set([1], KVPoll.Bootstrapping)
    stepper.step(SingleRank())
    clock.t += after
    res = stepper.step(SingleRank())
    return int(res.statuses[0]), int(res.reasons[0])


def _fake_fails_at(limit: float, after: float) -> int:
    clock = Clock(100.0)
    m = FakeManager(config=FakeConfig(bootstrap_timeout=limit, clock=clock))
    r = m.receiver(1)  # Bootstrapping until init()
    rooms, idx = np.array([1], np.uint64), np.array([r.index])
    clock.t += after
    return int(m.poll_many(rooms, idx)[0]), int(m.failure_reasons(rooms, idx)[0])


@pytest.mark.parametrize("layer", [_step_fails_at, _fake_fails_at])
def test_every_layer_fails_at_the_same_moment_with_the_same_reason(layer):
    assert layer(5.0, 4.0)[0] != KVPoll.Failed  # not yet
    status, reason = layer(5.0, 5.0)  # exactly the limit: passed, in every layer
    assert status == KVPoll.Failed
    assert reason == FailureReason.BOOTSTRAP_TIMEOUT == DEADLINES[0].reason


def test_the_table_check_names_a_deadline_whose_verdict_carries_another_reason():
    check_deadlines(DEADLINES, VERDICTS)
    wrong = (attrs.evolve(DEADLINES[0], reason=FailureReason.WAITING_TIMEOUT), DEADLINES[1])
    with pytest.raises(AssertionError, match="deadline bootstrap"):
        check_deadlines(wrong, VERDICTS)


def _step_waiting(status: KVPoll, after: float) -> tuple[int, int]:
    clock = Clock()
    table, board = RequestTable(), StatusBoard()
    stepper = Stepper(table, 0, poller=board, clock=clock, config=StepConfig(waiting_timeout=5.0))
    table.add(1)
    board.set([1], status)
    stepper.step(SingleRank())
    table.mark_metadata_sent(1, now=clock.t)
    clock.t += after
    res = stepper.step(SingleRank())
    return int(res.statuses[0]), int(res.reasons[0])


def _fake_waiting(after: float) -> tuple[int, int]:
    clock = Clock()
    m = FakeManager(config=FakeConfig(waiting_timeout=5.0, clock=clock))
    r = m.receiver(1)
    r.init()  # WaitingForInput: its waiting clock starts
    rooms, idx = np.array([1], np.uint64), np.array([r.index])
    clock.t += after
    return int(m.poll_many(rooms, idx)[0]), int(m.failure_reasons(rooms, idx)[0])


@pytest.mark.parametrize(
    "layer", [lambda after: _step_waiting(KVPoll.WaitingForInput, after), _fake_waiting]
)
def test_every_layer_fails_a_waiting_request_at_the_same_moment(layer):
    assert layer(4.0)[0] == KVPoll.WaitingForInput  # not yet
    assert layer(5.0) == (KVPoll.Failed, FailureReason.WAITING_TIMEOUT)


@pytest.mark.parametrize(
    "status", [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring]
)
def test_the_step_runs_the_waiting_clock_only_in_the_statuses_its_row_names(status):
    (waiting,) = [d for d in DEADLINES if d.reason is FailureReason.WAITING_TIMEOUT]
    status_after, reason = _step_waiting(status, 60.0)
    if status in waiting.statuses:
        assert (status_after, reason) == (KVPoll.Failed, FailureReason.WAITING_TIMEOUT)
    else:
        assert (status_after, reason) == (status, FailureReason.NONE)


def test_a_fake_sender_given_its_pages_waits_no_more():
    # Transferring is a status the waiting deadline runs in, but a fake sender's
    # waiting clock stops once it has its pages (it waited for them, not for data)
    clock = Clock()
    m = FakeManager(config=FakeConfig(waiting_timeout=5.0, clock=clock))
    given, idle = m.sender(1), m.sender(2)
    given.init(4)
    rooms, idx = np.array([1, 2], np.uint64), np.array([given.index, idle.index])
    clock.t += 60.0
    assert m.poll_many(rooms, idx).tolist() == [KVPoll.Transferring, KVPoll.Failed]
    assert m.failure_reasons(rooms, idx)[1] == FailureReason.WAITING_TIMEOUT
