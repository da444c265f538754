"""StepGroup: several queues in one reduce; misaligned groups are caught."""

import threading

import numpy as np
import pytest

from lifecycle import (
    CollectiveMismatch,
    KVPoll,
    RequestTable,
    SingleRank,
    StepConfig,
    StepGroup,
    Stepper,
    TableBusy,
)
from lifecycle.drive.collective import CountingCollective
from lifecycle.testing import SimulatedWorld, StatusBoard
from lifecycle.testing.spawn import on_threads
from support.status import F, S


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
    from lifecycle.testing.simulated import _Thread

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


# -- start(worker=True): the local work on the group's own thread --------------


class _GatedBoard(StatusBoard):
    """A poller that answers only once the test lets it (or after 10 s)."""

    def __init__(self):
        super().__init__()
        import threading

        self.go = threading.Event()
        self.threads = []

    def poll_many(self, rooms, indices):
        import threading

        self.threads.append(threading.get_ident())
        self.go.wait(10)
        return super().poll_many(rooms, indices)


def test_a_worker_start_returns_before_the_hooks_run_and_finish_applies_their_answer():
    import threading

    t = RequestTable()
    t.extend([1, 2])
    board = _GatedBoard()
    board.go.set()
    s = Stepper(t, 0, poller=board)
    world = SimulatedWorld(1)
    s.step(world.rank(0))  # sizes the capacity
    board.go.clear()
    board.set([1], S)
    board.set([2], F)
    s.start(world.rank(0), worker=True)  # the poll blocks: start must not wait for it
    assert t.step_no == 1 and t.busy
    with pytest.raises(TableBusy):
        t.add(3)
    board.go.set()
    res = s.finish()
    assert board.threads[-1] != threading.get_ident()  # polled on the worker
    assert res.succeeded.tolist() == [1] and [f.room for f in res.failures()] == [2]
    assert t.step_no == 2 and not t.busy


def test_worker_and_inline_starts_agree_step_for_step_across_ranks():
    """Rank 0 starts on its worker, rank 1 inline: the same buffers, the same results."""
    world = SimulatedWorld(2)
    groups = [_group(r, ["a", "b"], [6, 6]) for r in range(2)]
    script = [({1: S}, {}), ({2: F}, {3: F}), ({4: S, 5: S}, {6: F}), ({}, {})]
    for step, (on0, on1) in enumerate(script):
        for r, moves in enumerate((on0, on1)):
            for room, st in moves.items():
                groups[r].steppers[step % 2].local.poller.set([room], st)
        for g in groups:  # the other ranks see Success where one rank fails
            for room in {**on0, **on1}:
                if room not in g.steppers[step % 2].local.poller.status:
                    g.steppers[step % 2].local.poller.set([room], S)

        def run(r):
            groups[r].start(world.rank(r), worker=r == 0)
            return groups[r].finish()

        out = on_threads([lambda r=r: run(r) for r in range(2)])
        assert not any(isinstance(x, BaseException) for x in out), out
        for a, b in zip(*out):
            assert a.statuses.tolist() == b.statuses.tolist()
            assert a.reasons.tolist() == b.reasons.tolist()
            assert a.origins.tolist() == b.origins.tolist()


def test_what_a_worker_start_raises_comes_out_of_finish_and_frees_the_tables():
    from lifecycle import RankFailure

    class Gone:
        rank, world_size = 0, 2

        def start_all_reduce_min(self, buf):
            raise RankFailure(0, (1,), "connection reset by peer")

        def all_reduce_min(self, buf):
            raise AssertionError("not reached")

        def all_gather(self, buf):
            raise AssertionError("not reached")

    t = RequestTable()
    t.extend([1])
    s = Stepper(t, 0, poller=StatusBoard())
    s.start(Gone(), worker=True)
    with pytest.raises(RankFailure, match="connection reset"):
        s.finish()
    assert not t.busy
    t.add(2)
    with pytest.raises(RuntimeError, match="without start"):
        s.finish()


def test_a_groups_worker_thread_ends_with_the_group():
    import gc
    import threading

    def workers():
        return {th for th in threading.enumerate() if th.name == "pdlife-step"}

    # other tests' groups may still be ending: follow this group's own thread
    before = workers()
    group = _group(0, ["a"], [2])
    world = SimulatedWorld(1)
    group.start(world.rank(0), worker=True)
    group.finish()
    (mine,) = workers() - before
    assert mine.is_alive()
    del group
    gc.collect()
    mine.join(timeout=10)
    assert not mine.is_alive()


class _Launches:
    """One rank whose reduces land at once; records which buffer each launch carried
    (ranks pair collectives by the order they launch them)."""

    rank, world_size = 0, 1

    def __init__(self, names):
        self.names = names  # id of a stepper's buffer -> its queue
        self.order = []
        self.launched = threading.Event()

    def start_all_reduce_min(self, buf):
        self.order.append(self.names.get(id(buf), "?"))
        self.launched.set()
        from lifecycle.drive.collective import start_min

        return start_min(SingleRank(), buf)

    def all_reduce_min(self, buf):
        self.order.append("blocking")

    def all_gather(self, buf):
        return buf.reshape(1, -1).copy()


@pytest.mark.parametrize("second", ["worker", "inline"])
def test_reduces_launch_in_the_order_their_starts_were_called(second):
    """A worker still in its hooks must not let a later start's reduce overtake
    its own on this rank only: the peers would pair queue a with queue b."""
    a, b = RequestTable(), RequestTable()
    a.extend([1, 2])
    b.extend([3, 4, 5])
    board = _GatedBoard()
    sa = Stepper(a, 0, poller=board, queue="a")
    sb = Stepper(b, 0, poller=StatusBoard(), queue="b")
    board.go.set()
    for s in (sa, sb):
        s.step(SingleRank())  # the buffers exist from here on
    coll = _Launches({id(sa._buffer.buf): "a", id(sb._buffer.buf): "b"})
    board.go.clear()
    sa.start(coll, worker=True)  # its poll blocks until go
    if second == "worker":
        sb.start(coll, worker=True)
        coll.launched.wait(0.5)  # a start overtaking a's would launch by now
        board.go.set()
    else:
        threading.Timer(0.5, board.go.set).start()
        sb.start(coll)  # inline: waits for a's launch
    sa.finish()
    sb.finish()
    assert coll.order == ["a", "b"]


def test_a_worker_that_cannot_start_leaves_the_tables_free(monkeypatch):
    import lifecycle.drive.group as group_module

    class NoThread:
        def __init__(self, owner):
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(group_module, "Worker", NoThread)
    t = RequestTable()
    t.add(1)
    s = Stepper(t, 0, poller=StatusBoard())
    with pytest.raises(RuntimeError, match="new thread"):
        s.start(SingleRank(), worker=True)
    assert not t.busy
    t.add(2)
    assert len(s.step(SingleRank()).rooms) == 2


def test_a_pending_reduce_whose_then_raises_is_waited_for_as_one_without_it():
    """``then`` is an optional speed-up: one that raises must not leave the
    reduce launched, the tables busy and the step unfinishable."""

    class Landed:
        def wait(self):
            return None

        def then(self, fn):
            raise TypeError("then() takes no callbacks here")

    class Coll:
        rank, world_size = 0, 1

        def start_all_reduce_min(self, buf):
            return Landed()

        def all_reduce_min(self, buf):
            return None

        def all_gather(self, buf):
            return buf.reshape(1, -1).copy()

    t = RequestTable()
    t.extend([1, 2])
    board = StatusBoard()
    s = Stepper(t, 0, poller=board)
    board.set([1], S)
    for worker in (False, True):
        s.start(Coll(), worker=worker)
        res = s.finish()
        assert not t.busy
    assert res.statuses.tolist() == [S, KVPoll.Bootstrapping]


def test_a_late_callback_of_a_failed_reduce_cannot_answer_for_the_next_step():
    """A torch future runs its callbacks even when the reduce failed, possibly
    after finish() raised. Run late, during the next step (before that
    step's reduce lands), the old callback must not hand that step a result
    built from this rank's unreduced buffer."""
    from lifecycle import RankFailure

    late = []

    class Failed:
        def then(self, fn):
            late.append(fn)

        def wait(self):
            raise RankFailure(0, (), "gloo: connection closed")

    peer_t = RequestTable(rank=1)
    peer_t.extend([1, 2])
    peer_board = StatusBoard()
    peer = Stepper(peer_t, 1, poller=peer_board)

    class Lands:
        def __init__(self, buf):
            self.buf = buf

        def then(self, fn):
            pass

        def wait(self):
            for fn in late:  # the failed step's callback, only now
                fn()
            peer_board.set([1], F)  # the peer fails room 1 in this step
            np.minimum(self.buf, peer.prepare(), out=self.buf)

    class Coll:
        rank, world_size = 0, 2

        def __init__(self, pending):
            self.pending = pending

        def start_all_reduce_min(self, buf):
            return self.pending(buf)

        def all_reduce_min(self, buf):
            raise AssertionError("no second reduce: the peer alone failed rows")

        def all_gather(self, buf):
            raise AssertionError("not reached")

    t = RequestTable()
    t.extend([1, 2])
    s = Stepper(t, 0, poller=StatusBoard())
    s.start(Coll(lambda buf: Failed()))
    with pytest.raises(RankFailure):
        s.finish()
    s.start(Coll(Lands))
    res = s.finish()
    assert [(f.room, f.origin) for f in res.failures()] == [(1, 1)]
