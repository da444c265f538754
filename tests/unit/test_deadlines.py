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
