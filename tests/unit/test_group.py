"""StepGroup: several queues in one reduce; misaligned groups are caught."""

import pytest

from lifecycle import (
    CollectiveMismatch,
    CountingCollective,
    KVPoll,
    RequestTable,
    SimulatedWorld,
    StepConfig,
    StepGroup,
    Stepper,
    TableBusy,
)
from lifecycle.testing import StatusBoard
from lifecycle.testing.spawn import on_threads

S, F = KVPoll.Success, KVPoll.Failed


def _group(rank, names, sizes, config=None):
    steppers = []
    for name, n in zip(names, sizes):
        t = RequestTable(rank=rank)
        t.extend(range(1, n + 1))
        steppers.append(
            Stepper(t, rank, poller=StatusBoard(), queue=name, config=config or StepConfig())
        )
    return StepGroup(steppers)


def test_one_reduce_per_step_for_several_queues():
    world = SimulatedWorld(2)
    colls = [CountingCollective(world.rank(r)) for r in range(2)]
    groups = [_group(r, ["a", "b", "c"], [3, 5, 7]) for r in range(2)]
    on_threads([lambda r=r: groups[r].step(colls[r]) for r in range(2)])  # hello + step
    before = [c.reduces for c in colls]
    res = on_threads([lambda r=r: groups[r].step(colls[r]) for r in range(2)])
    assert [c.reduces - b for c, b in zip(colls, before)] == [1, 1]
    assert [r.queue for r in res[0]] == ["a", "b", "c"]
    assert [r.rooms.size for r in res[0]] == [3, 5, 7]


def test_each_queue_gets_its_own_failures_with_origin():
    world = SimulatedWorld(3)
    groups = [_group(r, ["a", "b"], [4, 4]) for r in range(3)]
    groups[2].steppers[1].local.poller.set([3], F)
    for g in groups:
        g.steppers[0].local.poller.set([1, 2, 3, 4], S)
    res = on_threads([lambda r=r: groups[r].step(world.rank(r)) for r in range(3)])
    for r in res:
        assert r[0].succeeded.tolist() == [1, 2, 3, 4]
        assert [(f.room, f.origin) for f in r[1].failures()] == [(3, 2)]


def test_misaligned_segments_are_caught_by_the_hello():
    """Negative control: one rank orders its queues differently."""
    world = SimulatedWorld(2)
    groups = [_group(0, ["a", "b"], [3, 3]), _group(1, ["b", "a"], [3, 3])]
    res = on_threads([lambda r=r: groups[r].step(world.rank(r)) for r in range(2)])
    assert all(isinstance(e, CollectiveMismatch) for e in res), res
    assert all(e.differs == ("queue",) for e in res)
    assert "in this order" in str(res[0])


def test_misaligned_segments_are_caught_without_the_hello():
    """Negative control: even past the hello, a swapped segment names its queue."""
    world = SimulatedWorld(2)
    groups = [_group(0, ["a", "b"], [3, 3]), _group(1, ["b", "a"], [3, 3])]
    for g in groups:
        g._hello_done = True  # a broken variant that skips the structure check
    res = on_threads([lambda r=r: groups[r].step(world.rank(r)) for r in range(2)])
    assert all(isinstance(e, CollectiveMismatch) for e in res), res
    assert all("queue" in e.differs for e in res)


def test_differing_configurations_raise_instead_of_aborting():
    world = SimulatedWorld(2)
    s = [
        Stepper(RequestTable(), 0, config=StepConfig(stuck_after=3, initial_capacity=8)),
        Stepper(RequestTable(), 1, config=StepConfig(initial_capacity=4096)),
    ]
    res = on_threads([lambda r=r: s[r].step(world.rank(r)) for r in range(2)])
    assert all(isinstance(e, CollectiveMismatch) for e in res), res
    assert all(e.differs == ("step configuration",) for e in res)


def test_differing_initial_capacities_are_agreed():
    world = SimulatedWorld(2)
    s = [
        Stepper(RequestTable(), 0, config=StepConfig(initial_capacity=8)),
        Stepper(RequestTable(), 1, config=StepConfig(initial_capacity=4096)),
    ]
    for _ in range(2):
        on_threads([lambda r=r: s[r].step(world.rank(r)) for r in range(2)])
    assert s[0].capacity == s[1].capacity >= 4096


def test_iteration_tags_catch_a_rank_one_step_behind():
    world = SimulatedWorld(2)
    s = [Stepper(RequestTable(), r) for r in range(2)]
    res = on_threads([lambda r=r: s[r].step(world.rank(r), tag=5 + r) for r in range(2)])
    assert all(isinstance(e, CollectiveMismatch) for e in res)
    assert all(e.differs == ("tag",) for e in res)


def test_table_cannot_change_while_a_step_is_in_flight():
    t = RequestTable()
    t.add(1)
    s = Stepper(t, 0, poller=StatusBoard())
    world = SimulatedWorld(1)
    s.start(world.rank(0))
    with pytest.raises(TableBusy):
        t.add(2)
    with pytest.raises(TableBusy):
        t.request_abort(1)
    assert len(t) == 1
    s.finish()
    t.add(2)
    assert len(t) == 2


def test_distinct_queue_names_are_required():
    with pytest.raises(ValueError, match="distinct"):
        _group(0, ["a", "a"], [1, 1])


def test_a_started_step_builds_its_common_result_before_finish_and_applies_it_there():
    """While the forward pass runs, the thread that completed the reduce builds
    the result of a step where nothing moved; the table changes only in finish."""
    import time

    t = RequestTable()
    t.extend([1, 2])
    s = Stepper(t, 0, poller=StatusBoard())
    group = StepGroup([s])
    world = SimulatedWorld(1)
    group.step(world.rank(0))  # sizes the capacity
    group.start(world.rank(0))
    deadline = time.monotonic() + 10
    while group._ready is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert group._ready is not None and t.step_no == 1
    (res,) = group.finish()
    assert res is not None and res.step == 2 and t.step_no == 2
    assert res.statuses.tolist() == [KVPoll.Bootstrapping] * 2 and res.changed.size == 0


def test_a_pending_reduce_runs_what_follows_it_once_and_only_if_it_landed():
    from lifecycle.collective import _Thread

    ran = []
    done = _Thread(lambda: None)
    done.wait()
    done.then(lambda: ran.append("late"))  # already landed: at once
    assert ran == ["late"]

    def boom():
        raise RuntimeError("peer gone")

    failed = _Thread(boom)
    failed.then(lambda: ran.append("never"))
    with pytest.raises(RuntimeError, match="peer gone"):
        failed.wait()
    failed.then(lambda: ran.append("never"))
    assert ran == ["late"]
