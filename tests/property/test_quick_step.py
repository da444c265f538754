"""A lone stepper's quick step (batch poller, no staging gate: the poll is
taken once, and a step where only the poll acts packs in a few calls) is the
group's step, byte for byte.

Two ranks over a simulated world run one random history: on the *mixed* run
rank 0 steps with ``Stepper.step`` (which takes the quick step whenever it
can) and rank 1 through ``StepGroup([stepper]).step`` (never quick); on the
*reference* run both go through the group. The histories hold quiet stretches
(nothing moves, so the quick step runs), progress, failures, values outside
KVPoll, a poller that raises, arrivals and departures, and optionally a
gate that holds some rooms' Success and a fault hook that fails some rooms
at some steps (each decides what the quick step may skip). Every step's
result must be the same on both runs and both ranks, and the quick step must
have run.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle import KVPoll, RequestTable, StepConfig, StepGroup, Stepper
from lifecycle.drive.collective import SingleRank
from lifecycle.errors import CollectiveMismatch
from lifecycle.testing import SimulatedWorld, StatusBoard

W = 2
#: what a step does to each row's local answer: keep it, move it on, fail it,
#: answer a value outside KVPoll
MOVES = ("keep", "keep", "keep", "advance", "fail", "invalid")


class _HoldOdd:
    """Holds the Success of odd rooms on rank 0, the rank that steps quick (a local gate)."""

    name = "hold_odd"

    def __init__(self, rank):
        self.rank = rank

    def closed(self, rooms, indices):
        return (rooms % 2 == 1) & (self.rank == 0)


class _FailAt:
    """Fails, on rank 0, the rooms divisible by 3 at the steps given."""

    def __init__(self, steps):
        self.steps = steps

    def inject(self, ctx):
        return (ctx.rooms % 3 == 0) & (ctx.step in self.steps)


def _run(history, quick_on_rank0, gate=False, fault_steps=None, tagged=False):
    tables = [RequestTable(rank=r) for r in range(W)]
    boards = [StatusBoard() for _ in range(W)]
    config = StepConfig(invalid_status="fail")

    def hooks(r):
        faults = _FailAt(fault_steps) if fault_steps is not None and r == 0 else None
        return {"gates": (_HoldOdd(r),) if gate else (), "faults": faults}

    steppers = [
        Stepper(tables[r], r, poller=boards[r], config=config, **hooks(r)) for r in range(W)
    ]
    groups = [StepGroup([s]) for s in steppers]
    world = SimulatedWorld(W, timeout=20)
    quick = [0]
    inner = steppers[0]._reduce_quick

    def counted(*a):
        quick[0] += 1
        return inner(*a)

    steppers[0]._reduce_quick = counted
    out, next_room = [], 1

    def rank_step(r, tag):
        if r == 0 and quick_on_rank0:
            return steppers[r].step(world.rank(r), tag)
        return groups[r].step(world.rank(r), tag)[0]

    with ThreadPoolExecutor(W) as pool:
        for i, (admit, moves, raising) in enumerate(history):
            rooms = list(range(next_room, next_room + admit))
            next_room += admit
            for t in tables:
                t.extend(rooms)
            for r in range(W):
                t = tables[r]
                for j, (room, cur) in enumerate(zip(t.rooms().tolist(), t.states().tolist())):
                    move = moves[(r * 5 + j) % len(moves)]
                    if move == "advance":
                        boards[r].status[room] = min(int(cur) + 1, int(KVPoll.Success))
                    elif move == "fail":
                        boards[r].status[room] = KVPoll.Failed
                    elif move == "invalid":
                        boards[r].status[room] = 9
                    else:  # keep: answer the agreed status
                        boards[r].status[room] = int(cur)
            if raising is not None:  # this rank's poller raises at this step
                boards[raising].raising = RuntimeError("backend gone")
            # an iteration number as the tag: a new header every step
            results = list(pool.map(rank_step, range(W), [i + 1 if tagged else None] * W))
            step = [
                (
                    res.step,
                    res.rooms.tolist(),
                    res.statuses.tolist(),
                    res.reasons.tolist(),
                    res.origins.tolist(),
                    res.changed.tolist(),
                )
                for res in results
            ]
            assert step[0] == step[1]  # both ranks agree, whichever path they took
            out.append(step[0])
            for r in range(W):
                done = np.concatenate([results[r].succeeded, results[r].failed])
                tables[r].remove_many(done)
    return out, quick[0]


history = st.lists(
    st.tuples(
        st.integers(0, 12),
        st.one_of(
            st.just(["keep"]),  # a quiet step: nothing moves
            st.lists(st.sampled_from(MOVES), min_size=1, max_size=7),
        ),
        st.just(None),
    ),
    min_size=2,
    max_size=10,
)


@settings(max_examples=40)
@given(
    history=history,
    quiet_tail=st.integers(2, 4),
    raising_at=st.integers(0, 12),
    gate=st.booleans(),
    fault_steps=st.none() | st.frozensets(st.integers(1, 14), max_size=3),
    tagged=st.booleans(),
)
def test_the_quick_step_is_the_groups_step(
    history, quiet_tail, raising_at, gate, fault_steps, tagged
):
    history = list(history)
    if raising_at < len(history):  # a poller that raises, on one rank, at one step
        admit, moves, _ = history[raising_at]
        history[raising_at] = (admit, moves, raising_at % W)
    history += [(0, ["keep"], None)] * quiet_tail  # always some quiet steps at the end
    mixed, quick = _run(history, True, gate, fault_steps, tagged)
    reference, none = _run(history, False, gate, fault_steps, tagged)
    assert mixed == reference
    assert none == 0
    # quiet steps after a common step over live rows take the quick step
    # (with no fault hook: one makes every step prepare in full)
    tail = mixed[-quiet_tail:-1]
    if fault_steps is None and any(r[2] and all(s in (1, 2, 3) for s in r[2]) for r in tail):
        assert quick > 0
    if fault_steps is not None:
        assert quick == 0


def test_quiet_steps_take_the_quick_step_and_stay_in_step():
    history = [(5, ["keep"], None)] + [(0, ["keep"], None)] * 6
    history += [(0, ["advance"], None), (0, ["keep"], None), (0, ["keep"], 0)]
    mixed, quick = _run(history, quick_on_rank0=True)
    reference, _ = _run(history, quick_on_rank0=False)
    assert mixed == reference
    # the first step prepares in full (and agrees the capacity); every quiet
    # step after a common step is quick, so is the step where rows move
    # (the reduce tells it, and it applies as the group would)
    assert quick >= 6
    assert [s[2] for s in mixed][-3] == [int(KVPoll.WaitingForInput)] * 5


@pytest.mark.parametrize("tagged", [False, True])
@pytest.mark.parametrize("n", [40, 2100])
def test_a_gate_is_asked_in_a_quick_step_too_short_and_long(n, tagged):
    # past observe.LONG rows the statuses are checked and packed by numpy calls
    history = [(n, ["keep"], None)] + [(0, ["keep"], None)] * 3
    for _ in range(3):  # Bootstrapping -> ... -> Success, quiet steps between
        history += [(0, ["advance"], None), (0, ["keep"], None), (0, ["keep"], None)]
    for gate in (False, True):
        mixed, quick = _run(history, True, gate, tagged=tagged)
        reference, _ = _run(history, False, gate, tagged=tagged)
        assert mixed == reference
        assert quick >= 3
        # without the gate every request reached Success and left; with it,
        # rank 0 holds the odd rooms' Success: they stay, agreed Transferring
        final = mixed[-1][2]
        assert final == ([int(KVPoll.Transferring)] * (n // 2) if gate else [])


def test_ranks_whose_tags_differ_raise_together_in_a_quick_step():
    tables = [RequestTable(rank=r) for r in range(W)]
    boards = [StatusBoard() for _ in range(W)]
    steppers = [Stepper(tables[r], r, poller=boards[r]) for r in range(W)]
    world = SimulatedWorld(W, timeout=20)
    for t in tables:
        t.extend([1, 2, 3])
    with ThreadPoolExecutor(W) as pool:
        for it in (1, 2, 3):  # quiet steps: the later ones are quick
            list(pool.map(lambda r, it=it: steppers[r].step(world.rank(r), it), range(W)))

        def skewed(r):
            try:
                steppers[r].step(world.rank(r), 4 + r)  # rank 1 is an iteration ahead
            except CollectiveMismatch as e:
                return e
            return None

        errors = list(pool.map(skewed, range(W)))
    assert all(isinstance(e, CollectiveMismatch) and "tag" in str(e) for e in errors)
    assert [t.step_no for t in tables] == [3, 3]  # the refused step changed nothing


class _Meddler(StatusBoard):
    """A batch poller that, on its second call, does something to the stepper
    or the table during the poll (``act``), and fails room 2 then."""

    def __init__(self, act):
        super().__init__(default=KVPoll.WaitingForInput)
        self.act, self.stepper, self.seen = act, None, []

    def poll_many(self, rooms, indices):
        if self.calls == 1:
            self.status[2] = KVPoll.Failed
            try:
                self.act(self.stepper)
            except Exception as e:  # what the stepper said, kept for the test
                self.seen.append(type(e).__name__)
        return super().poll_many(rooms, indices)


@pytest.mark.parametrize(
    "act",
    [
        lambda s: s.prepare(),  # re-entry: refused, as in a group's step
        lambda s: s.table.remove(1),  # the list changes under the poll
        lambda s: s.table.add(9),
    ],
)
def test_a_poll_that_meddles_sees_and_gets_what_a_group_step_gives(act):
    out = []
    for lone in (True, False):
        table = RequestTable()
        table.extend([1, 2, 3])
        board = _Meddler(act)
        board.stepper = s = Stepper(table, 0, poller=board)
        group = StepGroup([s])
        results = [s.step(SingleRank()) if lone else group.step(SingleRank())[0] for _ in range(3)]
        assert not table.busy and not s.in_flight
        out.append(
            (
                board.seen,
                [dict(zip(r.rooms.tolist(), r.statuses.tolist())) for r in results],
                [r.reasons.tolist() for r in results],
                sorted(table.rooms().tolist()),
            )
        )
    assert out[0] == out[1]
