"""Origins read from the failure slots equal the origin fetch's, on a reduce
made in place.

gloo reduces a stepper's own buffer in place, so after a step every rank's
buffer holds every failing rank's list; the next step must not carry those
lists into its own reduce. The lockstep driver of the consensus suite
reduces into a new array and never sees this: here each rank's buffer is
overwritten with the reduced one, as gloo does. Every newly failed row's
origin must be what the origin fetch defines: the lowest rank whose word
for the row equals the agreed word. Worlds of up to 10 ranks make ranks 8
apart share a region; lists up to 6 long overflow the small regions.
"""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from lifecycle import KVPoll, RequestTable, Stepper
from lifecycle.reasons import FailureReason
from lifecycle.testing import StatusBoard

REASONS = (FailureReason.PEER_DEAD, FailureReason.TRANSFER_ERROR)


def in_place_step(steppers):
    """One step as a gloo group takes it: every reduce lands in each rank's own buffer."""

    def reduce(bufs):
        red = np.minimum.reduce(bufs)
        for b in bufs:
            b[...] = red

    bufs = [s.prepare() for s in steppers]
    reduce(bufs)
    if any([s.resize(b) for s, b in zip(steppers, bufs)]):
        bufs = [s.repack() for s in steppers]
        reduce(bufs)
    fetches = [s.origins(b) for s, b in zip(steppers, bufs)]
    origins = None
    if fetches[0] is not None:
        origins = np.minimum.reduce(fetches)
    return [s.apply(b, origins) for s, b in zip(steppers, bufs)]


step_plan = st.tuples(
    # rooms admitted before the step: few, so that failures of consecutive
    # steps land on the same positions; now and then many (capacity regrows)
    st.one_of(st.integers(0, 4), st.integers(100, 300)),
    st.lists(  # per rank: (how many rows it fails, a seed for which and why)
        st.tuples(st.sampled_from([0, 0, 0, 1, 1, 2, 6]), st.integers(0, 2**16)),
        min_size=10,
        max_size=10,
    ),
)


@given(w=st.integers(2, 10), plan=st.lists(step_plan, min_size=1, max_size=8))
def test_slot_origins_equal_the_fetch_on_buffers_reduced_in_place(w, plan):
    run_plan(w, plan)


def test_the_check_catches_slots_carried_over_from_the_last_reduce(monkeypatch):
    """Negative control: a buffer whose slots are never refilled carries the
    last reduce's lists into the next one (found by the test above)."""
    import pytest

    from lifecycle.core.buffer import StepBuffer

    pack = StepBuffer.pack

    def never_refilled(self, *args):
        self._clean = True
        return pack(self, *args)

    none = [(0, 0)] * 10
    plan = [
        (0, none),
        (0, none),
        (3, [(0, 0)] * 4 + [(2, 0)] + [(0, 0)] * 5),
        (0, [(0, 0)] * 4 + [(1, 0), (1, 0)] + [(0, 0)] * 4),
    ]
    run_plan(6, plan)
    monkeypatch.setattr(StepBuffer, "pack", never_refilled)
    with pytest.raises(AssertionError):
        run_plan(6, plan)


def run_plan(w, plan):
    tables = [RequestTable(rank=r) for r in range(w)]
    boards = [StatusBoard() for _ in range(w)]
    steppers = [Stepper(tables[r], r, poller=boards[r]) for r in range(w)]
    next_room = 1
    for admit, fails in plan:
        for t in tables:  # failed rows retire, new ones join, on every rank alike
            done = [room for room in t.rooms().tolist() if t.info(room).state == KVPoll.Failed]
            t.remove_many(done)
            t.extend(range(next_room, next_room + admit))
        next_room += admit
        live = tables[0].rooms().tolist()
        for r, (k, seed) in enumerate(fails[:w]):
            pick = np.random.default_rng(seed)
            for room in pick.choice(live, size=min(k, len(live)), replace=False).tolist():
                boards[r].set([room], KVPoll.Failed)
                boards[r].reasons[room] = REASONS[int(pick.integers(len(REASONS)))]
        results = in_place_step(steppers)
        words = [s.local.words() for s in steppers]
        first = results[0]
        for res in results[1:]:
            assert res.origins.tolist() == first.origins.tolist()
        for i in first.changed.tolist():
            if first.statuses[i] != KVPoll.Failed:
                continue
            j = int(np.searchsorted(first.active, i))
            won = min(int(wr[j]) for wr in words)
            want = min(r for r in range(w) if int(words[r][j]) == won)
            assert int(first.origins[i]) == want, (int(first.rooms[i]), first.origins[i], want)
