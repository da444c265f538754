"""The recovery decision is a function of agreed facts only: for every history
of local failures (each rank failing rows for its own reasons, at any step,
across retried attempts) every rank reports the same failures, actions,
retries with the same next epoch, and recomputes; and no room is attempted
more often than its reason's policy allows.

The negative control decides from each rank's *local* reason instead of the
agreed one, as an engine that recovered per worker would: the suite must
find a history where the ranks disagree."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from lifecycle import KVPoll, RequestTable, StepConfig, Stepper
from lifecycle.reasons import FailureReason
from lifecycle.rules.recovery import DEFAULT_RECOVERY, Action, preset, retry
from lifecycle.testing import StatusBoard, lockstep

REASONS = [r for r in FailureReason if r is not FailureReason.NONE]
TABLES = [
    DEFAULT_RECOVERY,
    preset("retry", 2),
    preset("recompute"),
    DEFAULT_RECOVERY.override(unknown=retry(4, "another"), hook_error="recompute"),
]

# per step, per rank: a list of (row pick, reason pick) failures it observes
step_plan = st.lists(
    st.lists(st.tuples(st.integers(0, 7), st.sampled_from(REASONS)), max_size=3),
    min_size=4,
    max_size=4,
)


def run(w, n, table, plan, local_decision=False):
    """Drive ``w`` ranks through ``plan``; returns each rank's log of decisions
    (step, room, reason, origin, epoch, action, next epoch) and attempts per room."""
    boards = [StatusBoard(default=KVPoll.Transferring) for _ in range(w)]
    steppers = []
    for r in range(w):
        t = RequestTable(rank=r)
        t.extend(range(1, n + 1), state=KVPoll.Transferring)
        steppers.append(Stepper(t, r, poller=boards[r], config=StepConfig(recovery=table)))
    logs = [[] for _ in range(w)]
    attempts = {room: 1 for room in range(1, n + 1)}
    for k, per_rank in enumerate(plan):
        for r in range(w):
            boards[r].status.clear()
            boards[r].reasons.clear()
            rooms = steppers[r].table.rooms().tolist()
            for pick, reason in per_rank[r % len(per_rank)] if per_rank else ():
                if rooms:
                    room = rooms[pick % len(rooms)]
                    boards[r].status[room] = KVPoll.Failed
                    boards[r].reasons[room] = reason
        results = lockstep(steppers)
        for r, res in enumerate(results):
            assert not isinstance(res, BaseException), res
            rows, action, nxt = res.decisions()
            if local_decision:  # each rank decides from the reason it saw itself
                mine = [boards[r].reasons.get(int(x), FailureReason.NONE) for x in res.rooms[rows]]
                theirs = np.array([m if m != FailureReason.NONE else c for m, c in
                                   zip(mine, res.reasons[rows].tolist())], dtype=np.int8)  # fmt: skip
                action, nxt = table.decide(theirs, res._epochs(rows))
            for i, row in enumerate(rows.tolist()):
                logs[r].append((k, int(res.rooms[row]), int(res.reasons[row]),
                                int(res.origins[row]), int(res._epochs(rows)[i]),
                                int(action[i]), int(nxt[i])))  # fmt: skip
        # the engine: a retried room starts its next attempt, the rest leave
        # (rank 0's decisions drive every rank's table, as one scheduler's would)
        for _, room, _, _, _, a, e in [x for x in logs[0] if x[0] == k]:
            for s in steppers:
                s.table.remove(room)
                if a == Action.RETRY:
                    s.table.add(room, state=KVPoll.Transferring, epoch=e)
            if a == Action.RETRY:
                attempts[room] += 1
    return logs, attempts


@given(
    w=st.integers(2, 4),
    n=st.integers(1, 6),
    table=st.sampled_from(TABLES),
    plan=st.lists(step_plan, min_size=1, max_size=8),
)
def test_every_rank_decides_the_same_for_every_agreed_history(w, n, table, plan):
    logs, attempts = run(w, n, table, plan)
    assert all(log == logs[0] for log in logs)
    for _, _room, reason, _, epoch, action, nxt in logs[0]:
        policy = table[FailureReason(reason)]
        assert action != Action.RETRY or nxt == epoch + 1 < policy.max_attempts
        assert FailureReason(reason) is not FailureReason.ABORTED or action == Action.FAIL
    for _room, count in attempts.items():
        assert count <= max(p.max_attempts for p in table.policies.values())


def test_negative_control_deciding_from_the_local_reason_diverges():
    # rank 0 sees a transfer error (retried), rank 1 a client abort (failed):
    # the agreed reason is ABORTED on both; a rank deciding locally retries
    plan = [[[(0, FailureReason.TRANSFER_ERROR)], [(0, FailureReason.ABORTED)]]]
    logs, _ = run(2, 1, DEFAULT_RECOVERY, plan, local_decision=True)
    assert logs[0] != logs[1]
    logs, _ = run(2, 1, DEFAULT_RECOVERY, plan)
    assert logs[0] == logs[1] and logs[0][0][5] == Action.FAIL
