"""The in-process world pairs collectives as a real group does: by the order
each rank issues them, not by which thread gets there first."""

import threading
import time

import numpy as np
import pytest

from lifecycle.errors import LifecycleError, RankFailure
from lifecycle.testing import SimulatedWorld


def _on_ranks(world, fn):
    out, errs = {}, []

    def run(r):
        try:
            out[r] = fn(world.rank(r), r)
        except BaseException as e:  # reported below
            errs.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    if errs:
        raise errs[0]
    return out


def test_two_reduces_in_flight_pair_in_the_order_each_rank_started_them():
    world = SimulatedWorld(3, timeout=10)

    def rank(coll, r):
        results = []
        for rep in range(50):
            a = np.array([10 * r + 1, rep], dtype=np.int64)
            b = np.array([10 * r + 5, 1000 + rep], dtype=np.int64)
            pa = coll.start_all_reduce_min(a)
            pb = coll.start_all_reduce_min(b)
            pb.wait()  # waited for in the other order: no matter
            pa.wait()
            results.append((a.tolist(), b.tolist()))
        return results

    out = _on_ranks(world, rank)
    for r in range(3):
        assert out[r] == [([1, rep], [5, 1000 + rep]) for rep in range(50)]


def test_blocking_and_started_reduces_share_one_order():
    world = SimulatedWorld(2, timeout=10)

    def rank(coll, r):
        first = np.array([r + 1], dtype=np.int64)
        p = coll.start_all_reduce_min(first)
        second = np.array([r + 7], dtype=np.int64)
        coll.all_reduce_min(second)  # issued after the started one on every rank
        p.wait()
        return first.tolist(), second.tolist()

    assert _on_ranks(world, rank) == {0: ([1], [7]), 1: ([1], [7])}


def test_ranks_that_issue_different_collectives_get_an_error_not_a_mix():
    world = SimulatedWorld(2, timeout=10)

    def rank(coll, r):
        buf = np.zeros(2, dtype=np.int32)
        if r == 0:
            coll.all_reduce_min(buf)
        else:
            coll.all_gather(buf)

    with pytest.raises(LifecycleError, match=r"different collectives \{0: 'min', 1: 'gather'\}"):
        _on_ranks(world, rank)


def test_a_rank_that_never_comes_is_named():
    world = SimulatedWorld(2, timeout=0.2)
    with pytest.raises(RankFailure) as e:
        world.rank(0).all_reduce_min(np.zeros(1, dtype=np.int64))
    assert e.value.dead == (1,)
    with pytest.raises(ValueError, match="rank 2 is not a rank of a world of 2"):
        world.rank(2)


def test_a_collective_one_rank_gave_up_on_fails_for_the_late_rank_and_is_forgotten():
    # rank 0 timed out: rank 1 coming late got a "result" made with rank 0's
    # abandoned buffer, and that result was kept for a read that never came
    world = SimulatedWorld(2, timeout=0.2)
    with pytest.raises(RankFailure):
        world.rank(0).all_reduce_min(np.array([5], dtype=np.int64))
    late = np.array([9], dtype=np.int64)
    with pytest.raises(RankFailure, match=r"rank 0 stopped waiting for rank\(s\) \[1\]") as e:
        world.rank(1).all_reduce_min(late)
    assert e.value.rank == 1 and e.value.dead == (0,) and late.tolist() == [9]
    assert not world._results and not world._reads and not world._posted
    # the next collective still pairs each rank's next one (time enough for a loaded machine)
    world.timeout = 10
    assert _on_ranks(world, lambda c, r: c.all_gather(np.array([r], np.int32)).tolist()) == {
        0: [[0], [1]],
        1: [[0], [1]],
    }


def test_a_rank_waiting_beside_one_that_gave_up_names_the_rank_still_missing():
    # rank 1 joins once rank 0 waits, so rank 0 gives up first: 2 s after it
    # posted, a margin of 2 s for rank 1 to post (milliseconds, even loaded)
    world = SimulatedWorld(3, timeout=2.0)
    errors = {}

    def wait(r):
        if r == 1:
            deadline = time.monotonic() + 2.0
            while not world._posted.get(0) and time.monotonic() < deadline:
                time.sleep(0.001)
        try:
            world.rank(r).all_reduce_min(np.zeros(1, dtype=np.int64))
        except RankFailure as e:
            errors[r] = e

    threads = [threading.Thread(target=wait, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors[0].dead == errors[1].dead == (2,)
