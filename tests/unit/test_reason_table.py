"""One row per failure reason: the table covers every reason, every table
derived from it says what the rows say, and the import-time checks name the
reason and the field of a row (or a derived table) that breaks a rule."""

import attrs
import numpy as np
import pytest

from lifecycle import FailureReason, KVPoll
from lifecycle.core.sources import SOURCES
from lifecycle.rules import peers, recovery
from lifecycle.rules.deadlines import DEADLINES, late
from lifecycle.rules.graph import VERDICTS
from lifecycle.rules.reasons import (
    REASONS,
    RULES,
    Clock,
    ReasonTableError,
    Recovery,
    agree,
    check_reasons,
)
from lifecycle.status import B, S, T, W

R = FailureReason
EVERY = [r for r in FailureReason if r is not R.NONE]


def test_the_table_has_one_row_per_reason_in_code_order():
    assert [row.reason for row in REASONS] == EVERY
    assert [row.code for row in REASONS] == sorted(int(r) for r in EVERY)
    assert set(RULES) == set(EVERY)
    check_reasons(REASONS)  # the positive control of the negative ones below


def test_verdicts_are_the_rows_sources():
    assert [(v.reason, v.sources) for v in VERDICTS] == [(r.reason, r.sources) for r in REASONS]
    assert RULES[R.INVALID_STATUS].sources == ("poll_value",)  # never a backend's own code


def test_deadlines_are_the_rows_deadlines_with_their_clock_and_statuses():
    declared = {
        r.reason: (r.deadline.name, r.deadline.clock, r.deadline.statuses)
        for r in REASONS
        if r.deadline is not None
    }
    assert {d.reason: (d.name, d.clock, d.statuses) for d in DEADLINES} == declared
    assert declared == {
        R.BOOTSTRAP_TIMEOUT: ("bootstrap", Clock.BORN, (KVPoll.Bootstrapping,)),
        R.WAITING_TIMEOUT: ("waiting", Clock.WAITED, (W, T)),
    }
    for d in DEADLINES:  # the step reads every deadline, under its setting
        assert d.source in SOURCES and SOURCES[d.source].needs == d.setting
        assert [KVPoll(s) for s in np.flatnonzero(d.runs_in)] == list(d.statuses)


def test_the_default_recovery_is_the_rows_recovery():
    default = recovery.DEFAULT_RECOVERY
    for row in REASONS:
        p = default[row.reason]
        if row.recovery is Recovery.FAIL:
            assert p == recovery.FAIL, row.reason
        else:
            where = "another" if row.recovery is Recovery.RETRY_ANOTHER else "same"
            assert p == recovery.retry(3, where), row.reason
    assert {r.reason for r in REASONS if r.recovery is not Recovery.FAIL} == recovery.RETRYABLE
    assert default[R.PEER_DEAD] == recovery.retry(3, "another")


def test_counted_is_the_rows_flag():
    assert [(c.reason, c.counts, c.why) for c in peers.COUNTED] == [
        (r.reason, r.counts, r.counts_why) for r in REASONS
    ]
    assert {r.reason for r in REASONS if r.counts} == peers.COUNTS


def _with(reason, **changes):
    return tuple(attrs.evolve(r, **changes) if r.reason is reason else r for r in REASONS)


def _deadline(reason, **changes):
    return _with(reason, deadline=attrs.evolve(RULES[reason].deadline, **changes))


@pytest.mark.parametrize(
    ("broken", "where", "says"),
    [
        (_deadline(R.WAITING_TIMEOUT, clock="waited"), "WAITING_TIMEOUT.deadline.clock", "known"),
        (
            _deadline(R.WAITING_TIMEOUT, statuses=(KVPoll.Success,)),
            "WAITING_TIMEOUT.deadline.statuses",
            "live",
        ),
        (
            _deadline(R.BOOTSTRAP_TIMEOUT, statuses=(KVPoll.WaitingForInput,)),
            "BOOTSTRAP_TIMEOUT.deadline.statuses",
            "born clock",
        ),
        (
            _deadline(R.WAITING_TIMEOUT, name="bootstrap"),
            "WAITING_TIMEOUT.deadline.name",
            "new",
        ),
        (_with(R.WAITING_TIMEOUT, sources=("backend",)), "WAITING_TIMEOUT.sources", "missing"),
        (_with(R.ABORTED, recovery=Recovery.RETRY_SAME), "ABORTED.recovery", "must fail"),
        (_with(R.HOOK_ERROR, counts=True), "HOOK_ERROR.counts", "not count"),
        (_with(R.UNKNOWN, recovery="fail"), "UNKNOWN.recovery", "not a Recovery"),
        (_with(R.UNKNOWN, counts=1), "UNKNOWN.counts", "not a bool"),
        (REASONS[:-1], "reason", "no row for HOOK_ERROR"),
        (REASONS + REASONS[-1:], "HOOK_ERROR.reason", "two rows"),
        (REASONS[1:2] + REASONS[:1] + REASONS[2:], "ABORTED.reason", "code order"),
    ],
)
def test_a_broken_table_is_refused_naming_the_reason_and_the_field(broken, where, says):
    with pytest.raises(ReasonTableError, match=rf"{where}: .*{says}") as caught:
        check_reasons(broken)
    assert "lifecycle.rules.reasons" in str(caught.value)


def test_a_derived_table_that_disagrees_is_refused_naming_the_reason_and_the_field():
    counted = {c.reason: c.counts for c in peers.COUNTED}
    agree("COUNTED", counted, "counts")  # the real one agrees
    with pytest.raises(ReasonTableError, match=r"HOOK_ERROR\.counts: COUNTED says True"):
        agree("COUNTED", {**counted, R.HOOK_ERROR: True}, "counts")
    with pytest.raises(ReasonTableError, match=r"PEER_DEAD\.counts: COUNTED has no entry"):
        agree("COUNTED", {r: v for r, v in counted.items() if r != R.PEER_DEAD}, "counts")


def test_a_deadline_is_late_only_in_its_statuses_and_on_its_clock():
    (boot,) = [d for d in DEADLINES if d.name == "bootstrap"]
    (wait,) = [d for d in DEADLINES if d.name == "waiting"]
    status = np.array([B, W, T, B, W, S], dtype=np.int8)
    clocks = {
        Clock.BORN: np.array([0.0, 0.0, 0.0, 9.0, 0.0, 0.0]),
        Clock.WAITED: np.array([0.0, 0.0, 0.0, 0.0, np.nan, 0.0]),
    }
    rows = np.arange(6)
    # born 10 s ago: only the rows still Bootstrapping; waited: WaitingForInput or
    # Transferring; a clock not started never runs out, a finished row never
    assert late(boot, 10.0, 5.0, status, clocks, rows).tolist() == [1, 0, 0, 0, 0, 0]
    assert late(wait, 10.0, 5.0, status, clocks, rows).tolist() == [0, 1, 1, 0, 0, 0]
    # rows index the clock columns; the statuses are per asked row
    assert late(boot, 10.0, 5.0, status[[3, 0]], clocks, np.array([3, 0])).tolist() == [0, 1]
