"""A hook that raises or answers nonsense fails only its rows, on every rank,
is reported in StepResult.exceptions, and the group keeps stepping."""

import numpy as np
import pytest
import torch

from buffers import MetadataBuffers, MetadataLayout
from lifecycle import FailureReason, KVPoll, RequestTable, StepConfig, Stepper
from lifecycle.errors import HookError
from lifecycle.testing import ScriptedPoller, SetStaging, StatusBoard, lockstep
from support.status import B, F, S, T, W

HOOK = FailureReason.HOOK_ERROR


def ok(results):
    for r in results:
        assert not isinstance(r, BaseException), r
    return results


def two_ranks(rooms, bad_rank_kw, good_rank_kw=None, statuses=S):
    boards, steppers = [], []
    for r in range(2):
        t = RequestTable()
        t.extend(rooms)
        b = StatusBoard()
        b.set(rooms, statuses)
        boards.append(b)
        kw = bad_rank_kw if r == 1 else (good_rank_kw or {})
        steppers.append(Stepper(t, r, poller=b, **kw))
    return boards, steppers


class Raising:
    name = "raising"

    def __init__(self, answer=None, exc=None):
        self.answer, self.exc, self.calls = answer, exc, 0

    def closed(self, rooms, idx):
        self.calls += 1
        if self.exc is not None:
            raise self.exc
        return self.answer(rooms) if callable(self.answer) else self.answer


def assert_hook_failed(results, failed_rooms, rooms):
    for res in results:
        assert res.failed.tolist() == failed_rooms
        for f in res.failures():
            assert f.reason == HOOK and f.origin == 1
        assert [r for r in rooms if r not in failed_rooms] == [
            int(x) for x in res.rooms[res.statuses != F]
        ]
    assert set(results[1].exceptions) == set(failed_rooms)
    assert all(isinstance(e, HookError) for e in results[1].exceptions.values())
    assert results[0].exceptions == {}


@pytest.mark.parametrize(
    "answer",
    [
        None,  # a gate returning None must not count as open
        lambda rooms: np.zeros(rooms.size, dtype=np.int64),  # not booleans
        lambda rooms: np.zeros(rooms.size + 1, dtype=bool),  # wrong shape
        lambda rooms: "open",
    ],
    ids=["none", "ints", "shape", "str"],
)
def test_gate_answering_nonsense_fails_its_rows_on_every_rank(answer):
    _, steppers = two_ranks([1, 2], {"gates": [Raising(answer)]})
    assert_hook_failed(ok(lockstep(steppers)), [1, 2], [1, 2])


def test_gate_answering_a_list_of_bools_is_read_as_bools():
    gate = Raising(lambda rooms: [False, True])
    _, steppers = two_ranks([1, 2], {"gates": [gate]})
    assert [r.statuses.tolist() for r in ok(lockstep(steppers))] == [[S, T], [S, T]]


def test_gate_raising_on_one_rank_fails_the_rows_at_success_and_keeps_stepping():
    gate = Raising(exc=RuntimeError("gate broke"))
    boards, steppers = two_ranks([1, 2, 3], {"gates": [gate]}, statuses=W)
    for b in boards:
        b.set([2], S)
    res = ok(lockstep(steppers))
    assert_hook_failed(res, [2], [1, 2, 3])
    assert "gate broke" in str(res[1].exceptions[2].__cause__)
    gate.exc = None
    gate.answer = lambda rooms: np.zeros(rooms.size, dtype=bool)
    for b in boards:
        b.set([1, 3], S)
    res = ok(lockstep(steppers))
    assert [r.succeeded.tolist() for r in res] == [[1, 3], [1, 3]]


def test_staging_advance_raising_fails_the_rows_it_was_asked_to_advance():
    class BadStaging(SetStaging):
        def advance(self, rooms, indices):
            raise OSError("scatter device gone")

    _, steppers = two_ranks([4, 5], {"staging": BadStaging()}, {"staging": SetStaging()}, W)
    res = ok(lockstep(steppers))
    assert_hook_failed(res, [4, 5], [4, 5])


def test_staging_pending_answering_ints_fails_rows_at_success():
    class IntStaging(SetStaging):
        def pending(self, rooms, indices):
            return np.zeros(rooms.size, dtype=np.int8)

    _, steppers = two_ranks([4, 5], {"staging": IntStaging()})
    assert_hook_failed(ok(lockstep(steppers)), [4, 5], [4, 5])


@pytest.mark.parametrize(
    "inject",
    [
        lambda ctx: (_ for _ in ()).throw(RuntimeError("plan broke")),
        lambda ctx: None,
        lambda ctx: np.ones(ctx.rooms.size, dtype=np.int64),
        lambda ctx: np.zeros(3, dtype=bool),
    ],
    ids=["raises", "none", "ints", "shape"],
)
def test_fault_hook_misbehaving_fails_its_rows_everywhere(inject):
    class Hook:
        def inject(self, ctx):
            return inject(ctx)

    _, steppers = two_ranks([7, 8], {"faults": Hook()}, statuses=T)
    assert_hook_failed(ok(lockstep(steppers)), [7, 8], [7, 8])


@pytest.mark.parametrize(
    "reasons",
    [
        lambda rooms: (_ for _ in ()).throw(KeyError("no reasons")),
        lambda rooms: np.zeros(rooms.size + 2, dtype=np.int8),
        lambda rooms: np.full(rooms.size, 1.5),
    ],
    ids=["raises", "shape", "float"],
)
def test_failure_reasons_misbehaving_gives_hook_error(reasons):
    class Board(StatusBoard):
        def failure_reasons(self, rooms, indices):
            return reasons(rooms)

    steppers, boards = [], []
    for r in range(2):
        t = RequestTable()
        t.extend([1, 2])
        b = Board() if r == 1 else StatusBoard()
        b.set([1, 2], T)
        boards.append(b)
        steppers.append(Stepper(t, r, poller=b))
    boards[1].set([2], F)
    res = ok(lockstep(steppers))
    for r in res:
        (f,) = r.failures()
        assert (f.room, f.reason, f.origin) == (2, HOOK, 1)
    assert list(res[1].exceptions) == [2]


@pytest.mark.parametrize(
    "answer",
    [
        lambda k: np.full(k, True),  # bool statuses are rejected
        lambda k: np.full(k, 2.7),
        lambda k: np.full(k + 1, 4),
        lambda k: None,
    ],
    ids=["bool", "float", "shape", "none"],
)
def test_batch_poll_answering_nonsense_fails_the_batch_on_every_rank(answer):
    class Bad:
        by_room = True

        def poll_many(self, rooms, indices):
            return answer(rooms.size)

    steppers = []
    for r in range(2):
        t = RequestTable()
        t.extend([1, 2])
        b = Bad() if r == 1 else StatusBoard()
        if r == 0:
            b.set([1, 2], S)
        steppers.append(Stepper(t, r, poller=b))
    res = ok(lockstep(steppers))
    for r in res:
        assert r.statuses.tolist() == [F, F]
        assert {f.reason for f in r.failures()} == {FailureReason.LOCAL_EXCEPTION}
    assert set(res[1].exceptions) == {1, 2}


@pytest.mark.parametrize("value", [2.7, True, "4", None, 2**70, np.float32(2.0)], ids=repr)
def test_per_object_poll_value_that_is_not_an_integer_status_is_invalid(value):
    t = RequestTable()
    p = ScriptedPoller(value)
    t.add(1, handle=p)
    t.add(2, handle=ScriptedPoller(KVPoll.WaitingForInput))
    stp = Stepper(t, 0, config=StepConfig(invalid_status="fail"))
    (res,) = ok(lockstep([stp]))
    assert res.statuses.tolist() == [F, W]
    assert res.failures()[0].reason == FailureReason.INVALID_STATUS


def test_metadata_source_raising_fails_only_the_rows_it_was_asked_about():
    class Broken:
        size = 4

        def landed(self, slots, rooms):
            raise RuntimeError("row read failed")

    steppers = []
    for r in range(2):
        t = RequestTable()
        t.add(1, metadata_slot=0)
        t.add(2, fake=True)
        b = StatusBoard()
        b.set([1, 2], S)
        steppers.append(Stepper(t, r, poller=b, metadata=Broken() if r == 1 else None))
    res = ok(lockstep(steppers))
    for r in res:
        assert r.statuses.tolist() == [F, S]
        assert r.failures()[0].reason == HOOK
    assert list(res[1].exceptions) == [1]


class _NoRow:
    """A metadata source for rows that may have no slot yet."""

    size = 4

    def __init__(self, how):
        self.how = how

    def landed(self, slots, rooms):
        if self.how == "raise":
            raise RuntimeError("row read failed")
        if self.how == "garbage":
            return "yes", None
        return np.zeros(len(slots), dtype=bool), np.zeros(len(slots), dtype=bool)


@pytest.mark.parametrize("how", ["raise", "garbage"])
@pytest.mark.parametrize("slots", [(-1, -1), (0, -1)], ids=["no-row-has-a-slot", "one-has"])
def test_a_broken_metadata_source_fails_every_row_it_decides_with_or_without_a_slot(how, slots):
    """Whatever rows have a slot, a source that raises or answers garbage fails
    every row at Success it decides (HOOK_ERROR) on every rank, and the step
    returns: it neither escapes the step on one rank nor releases a row the
    same source, answering, would hold."""
    steppers = []
    for r in range(2):
        t = RequestTable()
        for room, slot in zip((1, 2), slots):
            t.add(room, metadata_slot=slot)
        t.add(3, fake=True)  # no metadata row to wait for: never the gate's
        b = StatusBoard()
        b.set([1, 2, 3], S)
        steppers.append(Stepper(t, r, poller=b, metadata=_NoRow(how if r == 1 else "hold")))
    res = ok(lockstep(steppers))
    for r in res:
        assert r.statuses.tolist() == [F, F, S]
        assert {f.reason for f in r.failures()} == {HOOK}
    assert sorted(res[1].exceptions) == [1, 2]


def test_a_metadata_source_that_answers_holds_rows_without_a_slot():
    t = RequestTable()
    t.extend([1, 2])
    b = StatusBoard()
    b.set([1, 2], S)
    (res,) = ok(lockstep([Stepper(t, 0, poller=b, metadata=_NoRow("hold"))]))
    assert F not in res.statuses.tolist() and S not in res.statuses.tolist()


def test_metadata_slot_outside_the_pool_fails_that_row_only():
    layout = MetadataLayout(hidden_size=16, hidden_dtype=torch.float32, max_top_logprobs=16)
    meta = MetadataBuffers(4, layout)
    meta.write(1, 11, {"output_ids": [1]})
    t = RequestTable()
    t.add(11, metadata_slot=1)
    t.add(12, metadata_slot=9)  # outside the pool of 4
    b = StatusBoard()
    b.set([11, 12], S)
    (res,) = ok(lockstep([Stepper(t, 0, poller=b, metadata=meta)]))
    assert res.statuses.tolist() == [S, F]
    assert res.failures()[0].reason == HOOK
    assert "outside the pool of 4" in str(res.exceptions[12])


def test_row_without_a_handle_index_never_reads_another_requests_status():
    class ArrayBackend:
        """Keeps statuses in an array and gathers by index (as the real managers do)."""

        def __init__(self):
            self.status = np.array([S, B, B], dtype=np.int8)

        def poll_many(self, rooms, indices):
            return self.status[indices]

    t = RequestTable()
    t.add(1, handle_index=1)
    t.add(2)  # no index: -1 would read status[-1], another request's
    be = ArrayBackend()
    be.status[-1] = S
    (res,) = ok(lockstep([Stepper(t, 0, poller=be)]))
    assert res.statuses.tolist() == [B, F]
    assert res.failures()[0].reason == HOOK
    assert "handle index" in str(res.exceptions[2])
    t.set_handle_index(2, 0)
    t2 = RequestTable()
    t2.add(1, handle_index=1)
    t2.add(2, handle_index=0)
    (res,) = ok(lockstep([Stepper(t2, 0, poller=be)]))
    assert res.statuses.tolist() == [B, S]


def test_per_object_failure_reason_raising_is_a_hook_error():
    class Poller(ScriptedPoller):
        def failure_reason(self):
            raise RuntimeError("no idea")

    t = RequestTable()
    t.add(1, handle=Poller(KVPoll.Failed))
    (res,) = ok(lockstep([Stepper(t, 0)]))
    assert res.failures()[0].reason == HOOK
    assert isinstance(res.exceptions[1], HookError)


def test_a_hook_cannot_write_into_the_step_through_its_arguments():
    class Vandal:
        name = "vandal"

        def closed(self, rooms, idx):
            rooms[:] = 0
            return np.zeros(rooms.size, dtype=bool)

    class VandalFaults:
        def inject(self, ctx):
            ctx.states[:] = F
            return np.zeros(ctx.rooms.size, dtype=bool)

    t = RequestTable()
    t.extend([1, 2])
    b = StatusBoard()
    b.set([1, 2], S)
    (res,) = ok(lockstep([Stepper(t, 0, poller=b, gates=[Vandal()], faults=VandalFaults())]))
    assert res.rooms.tolist() == [1, 2]
    assert res.statuses.tolist() == [F, F]  # the gate's write was refused: a hook error
    assert {f.reason for f in res.failures()} == {HOOK}


def test_an_abort_requested_by_the_fault_hook_is_carried_in_the_same_step():
    """A client abort keyed to a phase fires from inside the fault hook; the
    step that asked must carry it, or a fast request succeeds first."""

    class AbortingFaults:
        def __init__(self, table):
            self.table = table

        def inject(self, ctx):
            self.table.request_abort(2)
            return np.zeros(ctx.rooms.size, dtype=bool)

    t = RequestTable()
    t.extend([1, 2])
    board = StatusBoard()
    board.set([1, 2], S)
    (res,) = ok(lockstep([Stepper(t, 0, poller=board, faults=AbortingFaults(t))]))
    assert res.succeeded.tolist() == [1]
    assert [(f.room, f.reason) for f in res.failures()] == [(2, FailureReason.ABORTED)]
