"""Fused and overlapped steps agree with queues stepped one by one.

W ranks (threads over a simulated world) each step three queues. The same
random history is run twice: every queue stepped alone with ``Stepper.step``,
and all three as one :class:`StepGroup` through ``start``/``finish``. Every
queue's agreed statuses, reasons and origins must match step for step, on
every rank, including steps that fail requests (origins from the failure
slots, or fetched when a list overflows them) and steps where a queue
outgrows its capacity. In the overlapped run the even ranks may prepare on
the group's worker thread (``start(worker=True)``) while the odd ones
prepare inline.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle import KVPoll, RequestTable, StepGroup, Stepper
from lifecycle.testing import SimulatedWorld, StatusBoard

QUEUES = ("handshake", "prealloc", "transfer")


def _world(w):
    tables = [[RequestTable(rank=r) for _ in QUEUES] for r in range(w)]
    boards = [[StatusBoard() for _ in QUEUES] for r in range(w)]
    steppers = [
        [Stepper(tables[r][q], r, poller=boards[r][q], queue=name) for q, name in enumerate(QUEUES)]
        for r in range(w)
    ]
    return tables, boards, steppers


def _run(history, w, fused, worker=False):
    tables, boards, steppers = _world(w)
    world = SimulatedWorld(w, timeout=20)
    groups = [StepGroup(steppers[r]) for r in range(w)]
    out = []
    next_room = 1

    def rank_step(r):
        if fused:
            groups[r].start(world.rank(r), worker=worker and r % 2 == 0)
            return groups[r].finish()
        return tuple(s.step(world.rank(r)) for s in steppers[r])

    with ThreadPoolExecutor(w) as pool:
        for admits, draws in history:
            for q, k in enumerate(admits):
                rooms = list(range(next_room, next_room + k))
                next_room += k
                for r in range(w):
                    tables[r][q].extend(rooms)
            for r in range(w):
                for q in range(len(QUEUES)):
                    t = tables[r][q]
                    for i, (room, cur) in enumerate(zip(t.rooms().tolist(), t.states().tolist())):
                        d = draws[(r * 7 + q * 3 + i) % len(draws)]
                        # a backend never reports less than the agreed progress, but may fail
                        boards[r][q].status[room] = d if d == KVPoll.Failed else max(d, cur)
            results = list(pool.map(rank_step, range(w)))
            step = []
            for r in range(w):
                step.append(
                    [
                        (
                            res.queue,
                            res.statuses.tolist(),
                            res.reasons.tolist(),
                            res.origins.tolist(),
                        )
                        for res in results[r]
                    ]
                )
            out.append(step)
            for r in range(w):
                for q, res in enumerate(results[r]):
                    tables[r][q].remove_many(np.concatenate([res.succeeded, res.failed]))
    return out


history = st.lists(
    st.tuples(
        st.tuples(*(st.integers(0, 40) for _ in QUEUES)),
        st.lists(st.sampled_from(list(KVPoll)), min_size=1, max_size=9),
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=25)
@given(w=st.integers(2, 3), history=history, worker=st.booleans())
def test_fused_and_overlapped_steps_equal_separate_steps(w, history, worker):
    separate = _run(history, w, fused=False)
    fused = _run(history, w, fused=True, worker=worker)
    assert fused == separate
    for step in fused:
        assert all(rank == step[0] for rank in step)  # every rank agrees
