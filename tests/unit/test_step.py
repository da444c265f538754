"""The step in a single-threaded simulated world (lockstep)."""

import numpy as np
import pytest

from buffers import MetadataBuffers
from lifecycle import (
    CollectiveMismatch,
    FailureReason,
    KVPoll,
    RequestTable,
    SingleRank,
    StepConfig,
    Stepper,
)
from lifecycle.errors import IllegalTransition, InvalidStatus
from lifecycle.testing import ListFaults, ScriptedPoller, SetGate, SetStaging, StatusBoard, lockstep
from support.clock import Clock
from support.status import B, F, S, T, W

R = FailureReason


def world(n_ranks, rooms, **kw):
    boards = [StatusBoard() for _ in range(n_ranks)]
    tables = [RequestTable() for _ in range(n_ranks)]
    steppers = []
    for r in range(n_ranks):
        tables[r].extend(rooms)
        extra = {k: (v[r] if isinstance(v, list) else v) for k, v in kw.items()}
        steppers.append(Stepper(tables[r], r, poller=boards[r], **extra))
    return boards, tables, steppers


def ok(results):
    for res in results:
        assert not isinstance(res, BaseException), res
    return results


def test_agreed_is_min_and_identical_on_every_rank():
    boards, _, steppers = world(3, [1, 2, 3])
    boards[0].set([1, 2, 3], S)
    boards[1].set([1, 2, 3], S)
    boards[2].set([1], S)
    boards[2].set([2], W)
    boards[2].set([3], T)
    res = ok(lockstep(steppers))
    for r in res:
        assert r.statuses.tolist() == [S, W, T]
        assert r.succeeded.tolist() == [1]
        assert r.origins.tolist() == [-1, -1, -1]  # only failures carry an origin


def test_failure_reason_and_origin_travel_to_every_rank():
    boards, _, steppers = world(4, [7, 8])
    for b in boards:
        b.set([7, 8], T)
    boards[3].set([7], F)
    boards[3].reasons[7] = R.PEER_DEAD
    boards[1].set([7], F)  # no reason: UNKNOWN, lower priority than PEER_DEAD
    res = ok(lockstep(steppers))
    for r in res:
        (f,) = r.failures()
        assert (f.room, f.reason, f.origin) == (7, R.PEER_DEAD, 3)
        assert r.statuses.tolist() == [F, T]


def test_terminal_states_latch_and_are_not_polled():
    boards, tables, steppers = world(2, [1])
    for b in boards:
        b.set([1], S)
    ok(lockstep(steppers))
    boards[0].set([1], F)  # a late Failed must not bring it back
    res = ok(lockstep(steppers))
    assert res[0].statuses.tolist() == [S]
    assert res[0].succeeded.size == 0
    assert tables[0].info(1).state == S


def test_verdict_order_first_wins():
    clock = Clock()
    faults = ListFaults()
    boards, tables, steppers = world(
        1, [1, 2, 3], faults=faults, clock=clock, config=StepConfig(bootstrap_timeout=5)
    )
    clock.t = 10.0
    faults.rooms = {1}
    tables[0].request_abort(1)
    tables[0].request_abort(2)
    (res,) = ok(lockstep(steppers))
    reasons = {f.room: f.reason for f in res.failures()}
    # the reason code is the priority, on one rank as across ranks: abort first
    assert reasons == {1: R.ABORTED, 2: R.ABORTED, 3: R.BOOTSTRAP_TIMEOUT}


def test_waiting_timeout_from_metadata_sent():
    clock = Clock()
    boards, tables, steppers = world(2, [1, 2], clock=clock, config=StepConfig(waiting_timeout=3))
    for b in boards:
        b.set([1, 2], W)
    ok(lockstep(steppers))
    tables[1].mark_metadata_sent(1, now=0.0)
    clock.t = 2.9
    assert ok(lockstep(steppers))[0].failed.size == 0
    clock.t = 3.0
    for r in ok(lockstep(steppers)):
        assert [(f.room, f.reason, f.origin) for f in r.failures()] == [(1, R.WAITING_TIMEOUT, 1)]


def test_local_abort_spreads():
    boards, tables, steppers = world(3, [5, 6])
    tables[2].request_abort(6)
    for r in ok(lockstep(steppers)):
        assert [(f.room, f.reason, f.origin) for f in r.failures()] == [(6, R.ABORTED, 2)]


def test_batch_poll_exception_fails_that_ranks_requests_not_the_group():
    boards, _, steppers = world(2, [1, 2])
    boards[1].raising = RuntimeError("engine lost")
    res = ok(lockstep(steppers))
    assert {f.reason for f in res[0].failures()} == {R.LOCAL_EXCEPTION}
    assert set(res[1].exceptions) == {1, 2}
    assert res[0].exceptions == {}


def test_per_object_poll_exception_is_contained_and_polls_once():
    tables = [RequestTable() for _ in range(2)]
    pollers = [[ScriptedPoller(S) for _ in range(3)] for _ in range(2)]
    for t, ps in zip(tables, pollers):
        t.extend([1, 2, 3], handles=ps)
    pollers[0][1].error = ValueError("boom")
    steppers = [Stepper(t, r) for r, t in enumerate(tables)]
    res = ok(lockstep(steppers))
    assert res[1].statuses.tolist() == [S, F, S]
    assert res[1].failures()[0].reason == R.LOCAL_EXCEPTION
    assert isinstance(res[0].exceptions[2], ValueError)
    assert [p.polls for p in pollers[0]] == [1, 1, 1]


@pytest.mark.parametrize("n", [40, 3000])
def test_a_long_list_is_checked_like_a_short_one(n):
    """A long list's poll is checked for failures and invalid values by other
    means than a short one's (two reductions, no byte scan): same outcome."""
    rooms = list(range(1, n + 1))
    boards, _, steppers = world(2, rooms, config=StepConfig(invalid_status="fail"))
    for b in boards:
        b.set(rooms, T)
    for r in ok(lockstep(steppers)):
        assert r.statuses.tolist() == [T] * n and not r.failures()
    for b in boards:
        b.set([rooms[5]], S)
    boards[0].set([rooms[3]], F)
    boards[1].set([rooms[-1]], 7)
    for r in ok(lockstep(steppers)):
        got = {(f.room, f.reason, f.origin) for f in r.failures()}
        assert got == {(rooms[3], R.UNKNOWN, 0), (rooms[-1], R.INVALID_STATUS, 1)}
        assert r.succeeded.tolist() == [rooms[5]]


def test_invalid_status_fail_mode():
    boards, _, steppers = world(2, [1, 2], config=StepConfig(invalid_status="fail"))
    boards[0].set([2], 9)
    for r in ok(lockstep(steppers)):
        assert [(f.room, f.reason, f.origin) for f in r.failures()] == [(2, R.INVALID_STATUS, 0)]


def test_invalid_status_raise_mode_raises_on_every_rank_and_changes_nothing():
    boards, tables, steppers = world(2, [1, 2])
    boards[0].set([2], -3)
    res = lockstep(steppers)
    for r in res:
        assert isinstance(r, InvalidStatus)
        assert r.room == 2
        assert r.rank == 0
    assert "-3" in str(res[0])
    assert tables[1].states().tolist() == [B, B]


def test_gates_only_demote_success_and_never_hide_failed():
    staging, gate = SetStaging(), SetGate()
    boards, _, steppers = world(2, [1, 2, 3], staging=[staging, SetStaging()], gates=[[gate], []])
    for b in boards:
        b.set([1, 2], S)
        b.set([3], F)
    staging.pending_rooms = {1, 3}
    gate.closed_rooms = {2, 3}
    res = ok(lockstep(steppers))
    assert res[1].statuses.tolist() == [T, T, F]
    assert staging.advanced == [[1, 2, 3]]
    staging.pending_rooms = set()
    gate.closed_rooms = set()
    assert ok(lockstep(steppers))[0].succeeded.tolist() == [1, 2]


def test_metadata_gate_holds_until_room_lands_and_catches_corruption():
    meta = MetadataBuffers(4)
    tables = [RequestTable() for _ in range(2)]
    boards = [StatusBoard() for _ in range(2)]
    for t in tables:
        t.add(11, metadata_slot=0)
        t.add(12, metadata_slot=1)
        t.add(0, fake=True)
    steppers = [
        Stepper(tables[0], 0, poller=boards[0], metadata=meta),
        Stepper(tables[1], 1, poller=boards[1]),
    ]
    for b in boards:
        b.set([11, 12, 0], S)
    meta.write(1, 999, {"output_ids": [5]})  # another request's row in slot 1
    res = ok(lockstep(steppers))
    assert res[1].statuses.tolist() == [T, F, S]  # fake-path room 0 is exempt
    assert res[1].failures()[0].reason == R.METADATA_CORRUPT
    meta.write(0, 11, {"output_ids": [7]})
    assert ok(lockstep(steppers))[1].succeeded.tolist() == [11]


def test_reordered_list_raises_mismatch_everywhere():
    boards, tables, steppers = world(3, [1, 2, 3])
    tables[2].remove(1)
    tables[2].add(1)
    res = lockstep(steppers)
    assert all(isinstance(r, CollectiveMismatch) for r in res)
    assert res[2].local_len == 3
    assert "diverged" in str(res[0])


def test_empty_lists_still_step():
    _, _, steppers = world(2, [])
    res = ok(lockstep(steppers))
    assert res[0].rooms.size == 0
    assert res[0].step == 1


def test_capacity_grows_collectively_and_shrinks():
    n = 1000
    boards, tables, steppers = world(2, range(1, n + 1))
    for b in boards:
        b.set(range(1, n + 1), W)
    res = ok(lockstep(steppers))
    assert res[0].statuses.tolist() == [W] * n
    assert steppers[0].capacity >= n
    assert steppers[0].capacity == steppers[1].capacity
    for t in tables:
        t.remove_many(range(1, n + 1))
    ok(lockstep(steppers))
    assert steppers[0].capacity == steppers[1].capacity == 64


def test_regression_is_illegal_and_changes_nothing():
    boards, tables, steppers = world(1, [1])
    boards[0].set([1], T)
    ok(lockstep(steppers))
    boards[0].set([1], W)
    (err,) = lockstep(steppers)
    assert isinstance(err, IllegalTransition)
    assert (err.src, err.dst) == (T, W)
    assert tables[0].info(1).state == T


def test_stuck_requests_are_diagnosed_with_their_holders():
    import threading

    from lifecycle.testing import SimulatedWorld

    sim = SimulatedWorld(3, timeout=10)
    boards, tables, steppers = world(3, [1, 2], config=StepConfig(stuck_after=2))
    for b in boards:
        b.set([1, 2], W)
    boards[1].set([2], B)
    out = [[] for _ in range(3)]

    def run(r):
        for _ in range(3):
            out[r].append(steppers[r].step(sim.rank(r)))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    # room 2 has sat at Bootstrapping since it was added (step 0): reported at step 2;
    # room 1 reached WaitingForInput at step 1: reported at step 3
    assert [[s.room for s in res.stuck] for res in out[0]] == [[], [2], [1]]
    (s2,) = out[0][1].stuck
    assert s2.holders == (1,)
    assert s2.status == B
    assert dict(s2.local) == {0: W, 1: B, 2: W}
    (s1,) = out[2][2].stuck
    assert s1.holders == (0, 1, 2)


def test_step_config_validation():
    with pytest.raises(ValueError, match="bootstrap_timeout"):
        StepConfig(bootstrap_timeout=0)
    with pytest.raises(ValueError, match="invalid_status"):
        StepConfig(invalid_status="ignore")  # type: ignore[arg-type]


def test_entered_step_and_time_recorded():
    clock = Clock()
    boards, tables, steppers = world(1, [1], clock=clock)
    clock.t = 4.5
    boards[0].set([1], W)
    ok(lockstep(steppers))
    info = tables[0].info(1)
    assert (info.entered_step, info.entered_time) == (1, 4.5)
    np.testing.assert_array_equal(tables[0].states(), [W])


def test_latched_success_is_not_gated_or_metadata_checked_again():
    meta = MetadataBuffers(2)
    gate = SetGate()
    table, board = RequestTable(), StatusBoard()
    table.add(5, metadata_slot=0)
    stepper = Stepper(table, 0, poller=board, metadata=meta, gates=[gate])
    board.set([5], S)
    meta.write(0, 5, {"output_ids": [1]})
    assert ok(lockstep([stepper]))[0].succeeded.tolist() == [5]
    gate.closed_rooms.add(5)
    meta.clear_room(0)  # the slot is freed and zeroed while the request is still listed
    (res,) = ok(lockstep([stepper]))
    assert res.statuses.tolist() == [S]


def test_partial_batch_poll_error_fails_only_those_requests():
    from lifecycle.errors import PartialPollError

    class Partial:
        by_room = True  # answers without handle indices

        def poll_many(self, rooms, indices):
            raise PartialPollError(np.full(rooms.size, S), {1: KeyError("gone")})

    table = RequestTable()
    table.extend([1, 2, 3])
    (res,) = ok(lockstep([Stepper(table, 0, poller=Partial())]))
    assert res.statuses.tolist() == [S, F, S]
    assert res.failures()[0].reason == R.LOCAL_EXCEPTION
    assert isinstance(res.exceptions[2], KeyError)


def test_the_metadata_gate_reads_only_the_rows_at_local_success_when_they_are_few():
    """A read is a cache line per row: in a queue mostly still transferring,
    only the rows at Success are read, and the answer is the same."""

    class Recording:
        size = 64

        def __init__(self):
            self.asked = []
            self.rows = {}  # slot -> room written

        def landed(self, slots, rooms):
            self.asked.append(np.asarray(slots).tolist())
            got = np.array([self.rows.get(int(s), 0) for s in slots], dtype=np.uint64)
            ok = got == np.asarray(rooms)
            return ok, ~ok & (got != 0)

    rooms = list(range(11, 51))  # 40 rows in slots 0..39
    t = RequestTable()
    t.extend(rooms, state=KVPoll.Transferring, metadata_slots=list(range(40)))
    board = StatusBoard()
    board.set(rooms, KVPoll.Transferring)
    meta = Recording()
    s = Stepper(t, 0, poller=board, metadata=meta)
    s.step(SingleRank())
    assert meta.asked == []  # nobody at Success: nothing read
    board.set([12, 14], KVPoll.Success)
    meta.rows = {1: 12, 3: 99}  # 12 landed; 14's row holds another room
    res = s.step(SingleRank())
    assert meta.asked[-1] == [1, 3]
    assert res.succeeded.tolist() == [12]
    assert [(f.room, f.reason) for f in res.failures()] == [(14, FailureReason.METADATA_CORRUPT)]
    # most rows at Success: every row is read in one pass, with the same answers
    board.set(rooms[2:], KVPoll.Success)
    meta.rows = {i: room for i, room in enumerate(rooms) if i % 2}
    res = s.step(SingleRank())
    assert len(meta.asked[-1]) == 38  # the 38 rows still live
    assert sorted(res.succeeded.tolist()) == [r for i, r in enumerate(rooms) if i % 2 and i > 3]


def test_the_gate_that_held_each_request_is_recorded_when_asked():
    meta = MetadataBuffers(4)
    staging, gate = SetStaging(), SetGate("mine")
    table, board = RequestTable(), StatusBoard()
    table.extend([1, 2, 3, 4])
    for slot, room in enumerate([1, 2, 3, 4]):
        table.set_metadata_slot(room, slot)
    stepper = Stepper(table, 0, poller=board, metadata=meta, staging=staging, gates=[gate])
    board.set([1, 2, 3, 4], S)
    staging.pending_rooms = {1}
    gate.closed_rooms = {1, 3}  # room 1 is the staging gate's: it is asked first
    for slot, room in ((0, 1), (2, 3), (3, 4)):
        meta.write(slot, room, {"output_ids": [7]})  # room 2's row has not landed
    res = ok(lockstep([stepper]))[0]
    assert res.statuses.tolist() == [T, T, T, S]
    assert stepper.last_holds() == {}  # not asked: nothing recorded
    stepper.record_holds = True
    assert stepper.record_holds
    ok(lockstep([stepper]))  # the same holds, recorded
    held = {g: rooms.tolist() for g, rooms in stepper.last_holds().items()}
    assert held == {"staging": [1], "metadata": [2], "user": [3]}
    # nothing held: nothing recorded, not the last step's holds
    staging.pending_rooms, gate.closed_rooms = set(), set()
    meta.write(1, 2, {"output_ids": [7]})
    ok(lockstep([stepper]))
    assert stepper.last_holds() == {}
