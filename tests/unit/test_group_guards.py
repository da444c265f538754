"""Guards of the step's public surface: bad input, half-applied groups,
rank-local errors that would leave peers waiting, read-only views."""

import numpy as np
import pytest

from lifecycle import (
    CollectiveMismatch,
    FailureReason,
    RequestTable,
    SingleRank,
    StepGroup,
    Stepper,
    TableBusy,
)
from lifecycle.drive.collective import CountingCollective
from lifecycle.errors import HookError, InvalidArgument, InvalidStatus
from lifecycle.testing import SimulatedWorld, StatusBoard, lockstep
from lifecycle.testing.spawn import on_threads
from support.status import B, F, S, T, W


def _stepper(rank, rooms=(1, 2, 3), queue="", **kw):
    t = RequestTable(rank=rank)
    t.extend(rooms)
    return Stepper(t, rank, poller=kw.pop("poller", StatusBoard()), queue=queue, **kw)


# -- StepGroup construction -------------------------------------------------


def test_group_refuses_bad_members_with_a_typed_error():
    a, b = _stepper(0, queue="a"), _stepper(0, queue="b")
    with pytest.raises(InvalidArgument, match="at least one"):
        StepGroup([])
    with pytest.raises(InvalidArgument, match="at least one"):
        StepGroup(s for s in [])
    with pytest.raises(InvalidArgument, match="Stepper"):
        StepGroup([a, "b"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="rank"):
        StepGroup([a, _stepper(1, queue="c")])
    with pytest.raises(InvalidArgument, match="once"):
        StepGroup([a, a])
    # two steppers over one table would apply twice to the same rows
    twin = Stepper(b.table, 0, poller=StatusBoard(), queue="b2")
    with pytest.raises(InvalidArgument, match="table"):
        StepGroup([b, twin])


def test_group_takes_an_iterator_of_steppers():
    g = StepGroup(iter([_stepper(0, queue="a"), _stepper(0, queue="b")]))
    assert len(g.steppers) == 2
    res = g.step(SingleRank())
    assert [r.queue for r in res] == ["a", "b"]


def test_a_table_already_in_flight_refuses_a_second_start_before_any_collective():
    s = _stepper(0)
    s.start(SingleRank())
    coll = CountingCollective(SingleRank())
    other = StepGroup([s])
    with pytest.raises(TableBusy):
        other.start(coll)
    assert coll.reduces == 0
    s.finish()


# -- tags --------------------------------------------------------------------


@pytest.mark.parametrize("tag", [True, 1.0, "3", -1, -(2**70), np.float64(2.0)])
def test_bad_tags_are_refused_before_any_collective(tag):
    coll = CountingCollective(SingleRank())
    g = StepGroup([_stepper(0, queue="a"), _stepper(0, queue="b")])
    with pytest.raises(InvalidArgument, match="tag"):
        g.step(coll, tag=tag)
    assert coll.reduces == 0
    assert not any(s.table.busy for s in g.steppers)
    assert [r.step for r in g.step(coll, tag=2**100)] == [1, 1]  # huge counters still step


def test_lockstep_tags_must_match_the_ranks():
    steppers = [_stepper(r) for r in range(2)]
    with pytest.raises(InvalidArgument, match="tag"):
        lockstep(steppers, [1])
    with pytest.raises(InvalidArgument, match="tag"):
        lockstep(steppers, "12")  # type: ignore[arg-type]
    assert all(s.table.step_no == 0 for s in steppers)
    out = lockstep(steppers, [4, 4])
    assert all(not isinstance(r, BaseException) for r in out)


# -- groups built differently --------------------------------------------------


def test_a_group_against_a_single_queue_raises_instead_of_mixing_sizes():
    """Rank 0 steps queues a and b in one group; rank 1 steps a alone: the
    hello meets rank 1's first step at the same size and both raise."""
    world = SimulatedWorld(2, timeout=5)
    g0 = StepGroup([_stepper(0, queue="a"), _stepper(0, queue="b")])
    s1 = _stepper(1, queue="a")
    res = on_threads([lambda: g0.step(world.rank(0)), lambda: s1.step(world.rank(1))])
    assert all(isinstance(e, CollectiveMismatch) for e in res), res


# -- a group applies all queues or none ----------------------------------------


def test_a_raising_queue_leaves_the_other_queues_of_its_group_unapplied():
    world = SimulatedWorld(2)
    groups = []
    for r in range(2):
        a = _stepper(r, queue="a")
        b = _stepper(r, (7, 8), queue="b")
        a.local.poller.set([1, 2, 3], S)
        b.local.poller.set([8], 9 if r == 1 else S)  # not a KVPoll value
        groups.append(StepGroup([a, b]))
    res = on_threads([lambda r=r: groups[r].step(world.rank(r)) for r in range(2)])
    assert all(isinstance(e, InvalidStatus) for e in res), res
    for g in groups:
        for s in g.steppers:
            assert s.table.step_no == 0
            assert (s.table.states() == B).all()
    # the group still steps once the poller answers sensibly
    for g in groups:
        g.steppers[1].local.poller.set([7, 8], S)
    res = on_threads([lambda r=r: groups[r].step(world.rank(r)) for r in range(2)])
    for r in res:
        assert r[0].succeeded.tolist() == [1, 2, 3]
        assert r[1].succeeded.tolist() == [7, 8]


# -- a clock that fails on one rank ---------------------------------------------


@pytest.mark.parametrize("bad", ["raise", "none", "nan"])
def test_a_failing_clock_fails_its_requests_on_every_rank(bad):
    calls = {"n": 0}

    def clock():
        calls["n"] += 1
        if calls["n"] == 1:
            return 0.0  # the stepper's construction reads it once
        if bad == "raise":
            raise OSError("clock gone")
        return None if bad == "none" else float("nan")

    world = SimulatedWorld(2, timeout=5)
    steppers = [_stepper(0), _stepper(1, clock=clock)]
    res = on_threads([lambda r=r: steppers[r].step(world.rank(r)) for r in range(2)])
    assert all(not isinstance(r, BaseException) for r in res), res
    for r in res:
        assert r.failed.tolist() == [1, 2, 3]
        assert {f.reason for f in r.failures()} == {FailureReason.HOOK_ERROR}
        assert {f.origin for f in r.failures()} == {1}
    assert isinstance(res[1].exceptions[1], HookError)
    assert "clock" in str(res[1].exceptions[1])


# -- what the caller and hooks get is read-only ----------------------------------


def test_result_positions_are_read_only():
    s = _stepper(0)
    s.local.poller.set([2], S)
    coll = SingleRank()
    r1 = s.step(coll)
    r2 = s.step(coll)
    for r in (r1, r2):
        assert not r.active.flags.writeable
        assert not r.rooms.flags.writeable
    assert r2.active.tolist() == [0, 2]


def test_result_columns_are_read_only_snapshots():
    """Steps where nothing moves share their agreed columns; a later move
    never reaches an earlier result, and nobody can write into them."""
    s = _stepper(0)
    coll = SingleRank()
    r1 = s.step(coll)  # nothing moves
    r2 = s.step(coll)
    s.local.poller.set([1], S)
    s.local.poller.set([3], F)
    r3 = s.step(coll)
    assert r1.statuses.tolist() == r2.statuses.tolist() == [B, B, B]
    assert r3.statuses.tolist() == [S, B, F]
    assert r1.origins.tolist() == [-1, -1, -1] and r3.origins.tolist() == [-1, -1, 0]
    for r in (r1, r2, r3):
        for col in (r.statuses, r.reasons, r.origins):
            assert not col.flags.writeable
            with pytest.raises(ValueError, match="read-only"):
                col[0] = 0


class _RecordingMetadata:
    size = 16

    def __init__(self):
        self.writeable = []

    def landed(self, slots, rooms):
        self.writeable.append((slots.flags.writeable, rooms.flags.writeable))
        n = slots.size
        return np.ones(n, dtype=bool), np.zeros(n, dtype=bool)


def test_metadata_source_gets_read_only_rooms():
    t = RequestTable()
    t.extend([1, 2, 3], metadata_slots=[0, -1, 2])  # room 2 has no row: a subset is asked
    md = _RecordingMetadata()
    board = StatusBoard()
    board.set([1, 3], S)
    s = Stepper(t, 0, poller=board, metadata=md)
    s.step(SingleRank())
    assert md.writeable == [(False, False)]


# -- ranks whose agreed states differ ---------------------------------------------


def test_ranks_disagreeing_on_which_rows_are_terminal_raise():
    """Same rooms, same order, but room 1 is agreed Success on rank 0 only:
    without a check, rank 0 packs [room 2] and rank 1 packs [room 1, room 2]
    and the reduce pairs different requests."""
    tables = [RequestTable(rank=r) for r in range(2)]
    tables[0].add(1, state=S)
    tables[0].add(2)
    tables[1].extend([1, 2])
    steppers = [Stepper(tables[r], r, poller=StatusBoard()) for r in range(2)]
    out = lockstep(steppers)
    assert all(isinstance(e, CollectiveMismatch) for e in out), out
    assert all("request list" in e.differs for e in out)


# -- recovering from a mismatch ---------------------------------------------------


def test_a_rank_that_catches_up_after_a_mismatch_steps_again():
    """A lone stepper's buffer is reduced in place: the merged header of a
    mismatch must not be sent again by the rank whose list did not change."""
    world = SimulatedWorld(2, timeout=5)
    steppers = [_stepper(0, (1, 2)), _stepper(1, (1,))]
    res = on_threads([lambda r=r: steppers[r].step(world.rank(r)) for r in range(2)])
    assert all(isinstance(e, CollectiveMismatch) for e in res), res
    steppers[1].table.add(2)  # rank 1 catches up; rank 0's list is unchanged
    res = on_threads([lambda r=r: steppers[r].step(world.rank(r)) for r in range(2)])
    assert all(not isinstance(r, BaseException) for r in res), res
    assert [r.rooms.tolist() for r in res] == [[1, 2], [1, 2]]


def test_a_rank_that_catches_up_after_a_tag_mismatch_steps_again():
    world = SimulatedWorld(2, timeout=5)
    steppers = [_stepper(r) for r in range(2)]
    res = on_threads([lambda r=r: steppers[r].step(world.rank(r), tag=3 + r) for r in range(2)])
    assert all(isinstance(e, CollectiveMismatch) for e in res), res
    # rank 0 retries iteration 3 while rank 1 moves on... then both agree on 4
    res = on_threads([lambda r=r: steppers[r].step(world.rank(r), tag=4) for r in range(2)])
    assert all(not isinstance(r, BaseException) for r in res), res


# -- origin fetch --------------------------------------------------------------------


def test_origin_is_a_rank_whose_word_won_when_ranks_fail_a_row_for_different_reasons():
    """Room 1 fails on every rank, each for another reason: the agreed reason is
    the smallest code and the origin a rank that reported exactly that."""
    steppers = [_stepper(r, (1, 2)) for r in range(3)]
    boards = [s.local.poller for s in steppers]
    boards[0].set([1], F)
    boards[0].reasons[1] = FailureReason.TRANSFER_ERROR
    steppers[1].table.request_abort(1)  # ABORTED: the smallest code
    boards[2].set([1], F)
    boards[2].reasons[1] = FailureReason.PEER_DEAD
    boards[0].set([2], F)  # room 2: UNKNOWN on rank 0, an abort on rank 2
    steppers[2].table.request_abort(2)
    out = lockstep(steppers)
    for r in out:
        assert not isinstance(r, BaseException), r
        got = {(f.room, f.reason, f.origin) for f in r.failures()}
        assert got == {(1, FailureReason.ABORTED, 1), (2, FailureReason.ABORTED, 2)}


@pytest.mark.parametrize(
    ("failing", "reduces", "ranks"),
    [
        ({2: [1, 3]}, 1, (0, 1, 2)),  # one rank fails rows: the header names it
        ({0: [1], 2: [3]}, 1, (0, 1, 2)),  # two ranks: their failure slots name them
        ({0: [1], 1: [1]}, 1, (0, 1, 2)),  # two ranks fail the same row: the lower one
        # rank 0's three failures overflow its region (two entries at capacity 64)
        ({0: [1, 2, 3], 2: [3]}, 2, (0, 1, 2)),
        # ranks 1 and 9 write the same region (rank % 8): the step fetches
        ({0: [1], 1: [2]}, 2, (1, 9, 2)),
        ({0: [1], 1: [2]}, 1, (1, 10, 2)),
    ],
)
def test_the_origin_fetch_runs_only_when_the_failure_slots_cannot_say(failing, reduces, ranks):
    world = SimulatedWorld(3, timeout=20)
    steppers = [_stepper(ranks[r], (1, 2, 3)) for r in range(3)]
    colls = [CountingCollective(world.rank(r)) for r in range(3)]
    for r, rooms in failing.items():
        steppers[r].local.poller.set(rooms, F)
    out = on_threads([lambda r=r: steppers[r].step(colls[r]) for r in range(3)])
    assert all(not isinstance(x, BaseException) for x in out), out
    # the origin of each failure is the smallest rank that reported it
    want = {
        room: min(ranks[r] for r, rooms in failing.items() if room in rooms)
        for room in (1, 2, 3)
        if any(room in rooms for rooms in failing.values())
    }
    for res in out:
        assert {f.room: f.origin for f in res.failures()} == want
    assert [c.reduces for c in colls] == [reduces] * 3


def test_ranks_disagreeing_on_an_agreed_status_raise_on_every_rank():
    """Room 1 entered at Transferring on rank 1 only: every rank observes
    Bootstrapping, so applying the agreed value is a regression on rank 1
    alone, which would raise there while rank 0 moves on."""
    tables = [RequestTable(rank=r) for r in range(2)]
    tables[0].extend([1, 2])
    tables[1].add(1, state=T)
    tables[1].add(2)
    steppers = [Stepper(tables[r], r, poller=StatusBoard()) for r in range(2)]
    out = lockstep(steppers)
    assert all(isinstance(e, CollectiveMismatch) for e in out), out
    assert "agreed status" in str(out[0])


def test_the_fingerprint_follows_status_changes_between_rebuilds():
    """Statuses move without the frame being rebuilt (no row became terminal):
    ranks stay in agreement step after step, and a later divergence is seen."""
    steppers = [_stepper(r, (1, 2, 3)) for r in range(2)]
    for s in steppers:
        s.local.poller.set([1], W)
    assert all(not isinstance(r, BaseException) for r in lockstep(steppers))
    for s in steppers:
        s.local.poller.set([1, 2], T)
    assert all(not isinstance(r, BaseException) for r in lockstep(steppers))
    assert [s.table.states().tolist() for s in steppers] == [[T, T, B]] * 2
    # a fresh stepper hashes rank 0's list from scratch; rank 1's was updated
    # step by step: they must still agree
    steppers[0] = Stepper(steppers[0].table, 0, poller=steppers[0].local.poller)
    assert all(not isinstance(r, BaseException) for r in lockstep(steppers))
    # rank 1 replaces room 3 by a Waiting one: same rooms, another status
    steppers[1].table.remove(3)
    steppers[1].table.add(3, state=W)
    steppers[0].table.remove(3)
    steppers[0].table.add(3)
    out = lockstep(steppers)
    assert all(isinstance(e, CollectiveMismatch) for e in out), out


@pytest.mark.parametrize("queue", [None, 1, b"a", ["a"]])
def test_stepper_queue_must_be_a_name(queue):
    t = RequestTable()
    with pytest.raises(InvalidArgument, match="queue"):
        Stepper(t, 0, queue=queue)  # type: ignore[arg-type]
    assert t.rank == 0 and len(t) == 0


def test_start_twice_and_finish_without_start_change_nothing():
    s = _stepper(0)
    s.local.poller.set([1], S)
    coll = CountingCollective(SingleRank())
    with pytest.raises(RuntimeError, match="without start"):
        s.finish()
    s.start(coll)
    with pytest.raises(RuntimeError, match="twice"):
        s.start(coll)
    assert coll.reduces == 1
    assert s.finish().succeeded.tolist() == [1]
    assert not s.table.busy


_IN_FLIGHT_CALLS = {
    "prepare": lambda s, coll, buf: s.prepare(),
    "resize": lambda s, coll, buf: s.resize(buf),
    "origins": lambda s, coll, buf: s.origins(buf),
    "apply": lambda s, coll, buf: s.apply(buf),
    "settle": lambda s, coll, buf: s.settle(buf, None),
    "repack": lambda s, coll, buf: s.repack(),
    "step": lambda s, coll, buf: s.step(coll),
    "diagnose": lambda s, coll, buf: s.diagnose(coll),
}


@pytest.mark.parametrize("worker", [False, True], ids=["inline", "worker"])
@pytest.mark.parametrize("call", list(_IN_FLIGHT_CALLS))
def test_the_hand_driven_step_refuses_between_start_and_finish(call, worker):
    """Between start() and finish() every method that could read or change the
    step in flight refuses before any collective or hook, on the rank that
    called it; the step then lands alike on every rank."""
    world = SimulatedWorld(2, timeout=5)
    steppers = []
    for r in range(2):
        s = _stepper(r, rooms=(1, 2))
        s.local.poller.set([1], S)
        s.local.poller.set([2], T if r == 0 else W)
        steppers.append(s)
    errors: list[BaseException] = []

    def rank(r):
        s = steppers[r]
        s.start(world.rank(r), worker=worker)
        if r == 1:
            buf = np.zeros(64, dtype=np.uint8)
            if not worker:  # (a worker may not have polled yet)
                s.local.poller.set([2], F)  # what a second prepare would see
            try:
                _IN_FLIGHT_CALLS[call](s, world.rank(r), buf)
            except (TableBusy, RuntimeError) as e:
                errors.append(e)
        return s.finish()

    res = on_threads([lambda r=r: rank(r) for r in range(2)])
    assert not any(isinstance(x, BaseException) for x in res), res
    assert len(errors) == 1 and "finish()" in str(errors[0])
    assert [x.statuses.tolist() for x in res] == [[S, W]] * 2
    assert not steppers[1].in_flight and not steppers[1].table.busy
    # and the stepper is the caller's again
    assert steppers[1].table.step_no == steppers[0].table.step_no == 1
