"""Lockstep guards in the header (config, queue, iteration tag, capacity) and
the table/step defects: bootstrap clocks, moving a request between queues."""

from pathlib import Path

import numpy as np
import pytest

from lifecycle import (
    CollectiveMismatch,
    FailureReason,
    KVPoll,
    RequestTable,
    SingleRank,
    StepConfig,
    Stepper,
)
from lifecycle.errors import DuplicateRequest, InvalidArgument, UnknownRequest
from lifecycle.testing import StatusBoard, lockstep
from lifecycle.testing.lockstep import reduce_min
from support.clock import Clock
from support.status import B, F, S, T


def steppers_for(configs=None, queues=None, rooms=(1, 2, 3)):
    n = len(configs or queues)
    out = []
    for r in range(n):
        t = RequestTable()
        t.extend(rooms)
        out.append(
            Stepper(
                t,
                r,
                poller=StatusBoard(),
                config=configs[r] if configs else None,
                queue=queues[r] if queues else "",
            )
        )
    return out


def all_mismatch(results, what):
    for r in results:
        assert isinstance(r, CollectiveMismatch), r
        assert what in r.differs
        assert what in str(r)
    return results


@pytest.mark.parametrize(
    "other",
    [
        StepConfig(bootstrap_timeout=5.0),
        StepConfig(invalid_status="fail"),
        StepConfig(stuck_after=3),  # on one rank only: would wait in a gather alone
        StepConfig(waiting_timeout=1.0),
    ],
    ids=repr,
)
def test_a_config_that_differs_raises_on_every_rank_naming_it(other):
    steppers = steppers_for([StepConfig(), other, StepConfig()])
    res = all_mismatch(lockstep(steppers), "step configuration")
    assert res[0].differs == ("step configuration",)
    assert all(int(s.table.state[0]) == B for s in steppers)  # nothing applied


def test_differing_initial_capacity_is_agreed_not_a_mismatch():
    configs = [StepConfig(initial_capacity=c) for c in (1, 300, 64, 2**20)]
    steppers = steppers_for(configs, rooms=range(1, 101))
    for _ in range(3):  # lockstep's reduce refuses buffers of different sizes
        assert not any(isinstance(r, Exception) for r in lockstep(steppers))
    assert len({s.capacity for s in steppers}) == 1
    assert steppers[0].capacity >= 2**20


def test_first_reduce_has_the_same_size_whatever_the_config():
    a, b = steppers_for([StepConfig(initial_capacity=1), StepConfig(initial_capacity=5000)])
    assert a.prepare().size == b.prepare().size


def test_a_queue_that_differs_raises_on_every_rank():
    res = all_mismatch(lockstep(steppers_for(queues=["bootstrap", "inflight"])), "queue")
    assert "'bootstrap'" in str(res[0]) and "'inflight'" in str(res[1])


def test_a_rank_on_another_iteration_raises_on_every_rank():
    steppers = steppers_for(queues=["q", "q"])
    bufs = [s.prepare(tag=7) for s in steppers]
    red = reduce_min(bufs)
    assert [s.apply(red.copy()).step for s in steppers] == [1, 1]
    # rank 1 retried a step after an error and is one iteration behind
    bufs = [steppers[0].prepare(tag=8), steppers[1].prepare(tag=7)]
    red = reduce_min(bufs)
    for s in steppers:
        with pytest.raises(CollectiveMismatch, match="another iteration") as e:
            s.apply(red.copy())
        assert e.value.differs == ("tag",)
    # a tag on one rank and none on the other differs too
    bufs = [steppers[0].prepare(tag=9), steppers[1].prepare()]
    red = reduce_min(bufs)
    with pytest.raises(CollectiveMismatch):
        steppers[0].apply(red.copy())


def test_step_takes_a_tag_and_refuses_a_bad_one():
    t = RequestTable()
    t.add(1)
    s = Stepper(t, 0, poller=StatusBoard())
    assert s.step(SingleRank(), tag=10**30).step == 1
    with pytest.raises(InvalidArgument):
        s.step(SingleRank(), tag=1.5)


# -- defects ---------------------------------------------------------------------------


def test_rows_added_before_the_stepper_start_their_clock_when_it_is_built():
    t = RequestTable()
    t.extend([1, 2, 3])  # the README's order: table, rows, then the stepper
    clock = Clock(10_000.0)
    stp = Stepper(
        t, 0, poller=StatusBoard(), config=StepConfig(bootstrap_timeout=300.0), clock=clock
    )
    res = stp.step(SingleRank())
    assert res.failed.tolist() == []
    clock.t += 300.0
    res = stp.step(SingleRank())
    assert res.failed.tolist() == [1, 2, 3]
    assert {f.reason for f in res.failures()} == {FailureReason.BOOTSTRAP_TIMEOUT}


def test_move_carries_abort_flag_clocks_and_columns():
    clock = Clock(100.0)
    boot, fly = RequestTable(), RequestTable()
    sb = Stepper(boot, 0, poller=StatusBoard(KVPoll.WaitingForInput), clock=clock)
    sf = Stepper(fly, 0, poller=StatusBoard(KVPoll.WaitingForInput), clock=clock)
    boot.add(5, handle_index=3, metadata_slot=2)
    sb.step(SingleRank())
    sf.step(SingleRank())
    boot.mark_metadata_sent(5, 101.0)
    boot.request_abort(5)
    before = boot.info(5)
    slot = boot.move(5, fly, handle_index=4)
    assert 5 not in boot and 5 in fly and fly.slot_of(5) == slot
    after = fly.info(5)
    assert after.state == before.state == KVPoll.WaitingForInput
    assert (after.entered_time, after.metadata_slot) == (before.entered_time, 2)
    assert fly.handle_index[slot] == 4
    assert fly.metadata_sent_at[slot] == 101.0
    assert fly.abort_count == 1 and boot.abort_count == 0
    res = sf.step(SingleRank())
    assert [(f.room, f.reason) for f in res.failures()] == [(5, FailureReason.ABORTED)]


def test_a_reason_a_move_carries_in_is_what_the_next_steps_report():
    """A failed request moved on at another status keeps its reason and
    origin; the queue it joined reports them (its other rows report none),
    also once it has left again."""
    src, dst = RequestTable(), RequestTable()
    board = StatusBoard(KVPoll.Transferring)
    s_src = Stepper(src, 0, poller=board)
    s_dst = Stepper(dst, 0, poller=board)
    src.extend([1, 2])
    dst.extend([7, 8])
    board.set([2], F)
    s_src.step(SingleRank())
    assert src.info(2).reason != FailureReason.NONE
    src.move(2, dst, state=KVPoll.Transferring)
    board.set([2], T)
    res = s_dst.step(SingleRank())
    assert res.rooms.tolist() == [7, 8, 2]
    assert res.reasons.tolist() == [FailureReason.NONE] * 2 + [int(dst.info(2).reason)]
    assert res.origins.tolist() == [-1, -1, 0]
    dst.remove(2)
    dst.add(9)
    res = s_dst.step(SingleRank())
    assert res.reasons.tolist() == [FailureReason.NONE] * 3
    assert res.origins.tolist() == [-1] * 3 and dst.carried == 0


def test_move_keeps_the_deadline_running():
    clock = Clock(0.0)
    a, b = RequestTable(), RequestTable()
    cfg = StepConfig(bootstrap_timeout=10.0)
    sa = Stepper(a, 0, poller=StatusBoard(), config=cfg, clock=clock)
    sb = Stepper(b, 0, poller=StatusBoard(), config=cfg, clock=clock)
    a.add(1)
    sa.step(SingleRank())
    clock.t = 6.0
    a.move(1, b)
    assert sb.step(SingleRank()).failed.tolist() == []
    clock.t = 10.0
    assert sb.step(SingleRank()).failed.tolist() == [1]


def test_a_refused_move_changes_neither_table():
    a, b = RequestTable(), RequestTable()
    a.extend([1, 2])
    b.add(2)
    for room, target, kw, err in [
        (2, b, {}, DuplicateRequest),
        (9, b, {}, UnknownRequest),
        (1, a, {}, InvalidArgument),
        (1, b, {"state": 7}, InvalidArgument),
        (1, b, {"handle_index": -4}, InvalidArgument),
    ]:
        with pytest.raises(err):
            a.move(room, target, **kw)
    assert a.rooms().tolist() == [1, 2] and b.rooms().tolist() == [2]


def test_docs_do_not_say_declared_edges_raise():
    from lifecycle.rules.graph import EDGES

    declared = {(int(s), int(e.dest)) for e in EDGES for s in e.sources}
    assert (B, T) in declared and (B, S) in declared
    doc = (Path(__file__).parents[2] / "docs" / "scheduler-integration.md").read_text()
    assert "Transferring or Success in the bootstrap queue" not in doc
    assert "declares Bootstrapping -> Transferring" in doc


def test_capacity_hint_never_reaches_the_reduce_with_different_sizes():
    rng = np.random.default_rng(0)
    configs = [StepConfig(initial_capacity=int(c)) for c in rng.integers(1, 5000, 3)]
    steppers = steppers_for(configs, rooms=())
    next_room = 1
    for k in (0, 70, 500, 0, 3):
        for s in steppers:
            s.table.extend(range(next_room, next_room + k))
        next_room += k
        bufs = [s.prepare() for s in steppers]
        assert len({b.size for b in bufs}) == 1
        red = reduce_min(bufs)
        if any([s.resize(red) for s in steppers]):
            red = reduce_min([s.repack() for s in steppers])
        for s in steppers:
            s.apply(red.copy())


# -- the hand-driven step's buffers ----------------------------------------------------


def _snapshot(s):
    t = s.table
    return (t.step_no, t.rooms().tolist(), t.state[: len(t)].tolist(), s.capacity)


@pytest.mark.parametrize("method", ["resize", "unchanged", "origins", "apply", "settle"])
def test_a_reduced_buffer_of_another_size_is_refused_naming_both_and_changes_nothing(method):
    """A buffer shorter than the step's raised a raw struct.error (header short),
    and one a byte short was applied as if whole; now either is a typed error
    naming the expected and the given size, and the step goes on unchanged."""
    from lifecycle.errors import LifecycleError, ReducedBufferMismatch

    (s,) = steppers_for(queues=["q"])
    s.local.poller.set([1], S)
    buf = s.prepare()
    size = buf.size
    before = _snapshot(s)
    call = {
        "resize": lambda b: s.resize(b),
        "unchanged": lambda b: s.unchanged(b),
        "origins": lambda b: s.origins(b),
        "apply": lambda b: s.apply(b),
        "settle": lambda b: s.settle(b, None),
    }[method]
    for bad in (buf[:4].copy(), buf[: size - 1].copy(), np.concatenate([buf, buf]), buf.tolist()):
        with pytest.raises(ReducedBufferMismatch) as e:
            call(bad)
        assert isinstance(e.value, (LifecycleError, ValueError))
        msg = str(e.value)
        assert f"{method}()" in msg and "rank 0" in msg and "'q'" in msg
        assert f"{size} bytes" in msg  # what it expected
        if isinstance(bad, np.ndarray):
            assert f"{bad.size} bytes" in msg  # and what it got
        else:
            assert "a list" in msg
        assert "Nothing was changed" in msg
        assert _snapshot(s) == before
    res = s.apply(buf)  # the step's own buffer still applies
    assert res.step == 1 and res.succeeded.tolist() == [1]


def test_origins_of_another_size_are_refused_and_change_nothing():
    """Ranks 0 and 8 share a failure-slot region, so their failures' origins
    are fetched: apply refuses origins that are not what origins() returned."""
    from lifecycle.errors import ReducedBufferMismatch

    steppers = steppers_for(queues=["q"] * 9)
    for r in (0, 8):
        steppers[r].local.poller.set([1 if r == 0 else 2], F)
    red = reduce_min([s.prepare() for s in steppers])
    fetches = [s.origins(red.copy()) for s in steppers]
    assert fetches[0] is not None
    origins = reduce_min(fetches)
    s = steppers[0]
    before = _snapshot(s)
    for bad in (origins[:1].copy(), origins.astype(np.int64), list(origins)):
        with pytest.raises(
            ReducedBufferMismatch, match=rf"apply\(\) got .* as origins.*{origins.size} entries"
        ):
            s.apply(red.copy(), bad)
        assert _snapshot(s) == before
    res = [x.apply(red.copy(), origins) for x in steppers]
    assert [(f.room, f.origin) for f in res[0].failures()] == [(1, 0), (2, 8)]
