"""Spans lose nothing of a run: random runs of both sides (each its own group
of ranks, stepped in lockstep), traced as the simulator traces them, turned
into spans, and the spans turned back into moves of agreed statuses: on every
rank they are the moves `pdlife replay` recomputes from the ranks' local
observations, and the moves the trace recorded.

A run holds arrivals, progress, failures (which one rank alone may answer),
a gate that holds some rooms' Success on one rank, and departures of the
requests agreed ended."""

import json
from collections import defaultdict
from itertools import pairwise

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from lifecycle import KVPoll, RequestTable, StepConfig, Stepper
from lifecycle.testing import StatusBoard
from lifecycle.testing.lockstep import lockstep
from pdlife.spans import Selection, select, spans_of_records
from pdlife.spans.live import LiveSpans
from pdlife.trace import TraceWriter, read_trace, replay

MOVES = ("keep", "keep", "advance", "advance", "fail")
_NAMES = {f"pdlife.status.{s.name}": int(s) for s in KVPoll}


class _HoldOdd:
    """Holds odd rooms' Success on the group's last rank."""

    name = "hold_odd"

    def __init__(self, last):
        self.last = last

    def closed(self, rooms, indices):
        return (rooms % 2 == 1) & self.last


def _side(trace_dir, side, first_rank, width, history, gate):
    tables = [RequestTable(rank=first_rank + r) for r in range(width)]
    boards = [StatusBoard() for _ in range(width)]
    steppers = []
    for r in range(width):
        gates = (_HoldOdd(r == width - 1),) if gate else ()
        s = Stepper(tables[r], first_rank + r, poller=boards[r], config=StepConfig(), gates=gates)
        s.record_holds = True
        steppers.append(s)
    writers = [
        TraceWriter(trace_dir / f"rank{first_rank + r}.jsonl", first_rank + r) for r in range(width)
    ]
    # the same steps, as a host engine's steppers feed spans live
    live_spans: list = []
    lives = [
        LiveSpans(side, first_rank + r, "run", selection=Selection("every")) for r in range(width)
    ]
    next_room = 1 + first_rank * 1000
    for admit, moves in history:
        rooms = list(range(next_room, next_room + admit))
        next_room += admit
        for t in tables:
            t.extend(rooms)
        for r in range(width):
            for j, (room, cur) in enumerate(
                zip(tables[r].rooms().tolist(), tables[r].states().tolist())
            ):
                move = moves[(r * 3 + j) % len(moves)]
                if move == "advance":
                    boards[r].status[room] = min(int(cur) + 1, int(KVPoll.Success))
                elif move == "fail" and (r + j) % 2 == 0:  # one rank alone may fail it
                    boards[r].status[room] = KVPoll.Failed
                else:
                    boards[r].status[room] = int(cur)
        results = lockstep(steppers)
        for r, res in enumerate(results):
            assert not isinstance(res, BaseException), res
            _, local, reason = steppers[r].last_local
            writers[r].step(side, "q", res, local, reason, steppers[r].last_holds())
            lives[r].observe("q", res, steppers[r].last_holds())
            if len(history) % 2:  # taken as they come, or all at the end
                live_spans += lives[r].take()
        for r, res in enumerate(results):
            tables[r].remove_many(np.concatenate([res.succeeded, res.failed]))
    for w in writers:
        w.close()
    for live in lives:
        live_spans += live.close()
    return live_spans


def _moves_of_spans(spans):
    """(rank, room) -> [(from, to)], from each request's status spans in order."""
    children = defaultdict(list)
    outcome = {}
    for i in spans:
        s = i.span
        if s.kind == "request":
            outcome[(s.rank, s.room, s.attempt)] = s.attributes["pdlife.outcome"]
        else:
            children[(s.rank, s.room, s.attempt)].append((s.index, _NAMES[s.name]))
    out = defaultdict(list)
    for key, kids in children.items():
        states = [st for _, st in sorted(kids)]
        end = outcome[key]
        if end in ("Success", "Failed"):
            pairs = list(pairwise([*states, int(KVPoll[end])]))
        else:  # still live where the trace ends: its last span is the status it is in
            pairs = list(pairwise(states))
        if pairs:
            out[key[:2]] += pairs
    return dict(out)


history = st.lists(
    st.tuples(st.integers(0, 5), st.lists(st.sampled_from(MOVES), min_size=1, max_size=6)),
    min_size=1,
    max_size=12,
)


@given(
    prefill=history,
    decode=history,
    widths=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    gate=st.booleans(),
)
def test_spans_give_back_the_moves_replay_recomputes(
    tmp_path_factory, prefill, decode, widths, gate
):
    run = tmp_path_factory.mktemp("run")
    p, d = widths
    live = _side(run / "trace", "prefill", 0, p, prefill, gate)
    live += _side(run / "trace", "decode", p, d, decode, gate)
    (run / "summary.json").write_text(json.dumps({"ranks": {"prefill": p, "decode": d}}))
    report = replay(run)
    assert report.ok, report.first_difference
    spans = select(spans_of_records(read_trace(run)), "run", Selection("every"))
    got = _moves_of_spans(spans)
    recorded = defaultdict(list)
    for rec in read_trace(run):
        if rec["t"] == "tr":
            recorded[(rec["rank"], rec["room"])].append((rec["from"], rec["to"]))
    assert got == dict(recorded)
    # replay's moves, once per side, are every rank's of that side
    replayed = defaultdict(list)
    for side, _, _, room, frm, to in report.moves:
        replayed[(side, room)].append((frm, to))
    side_of = {r: ("prefill" if r < p else "decode") for r in range(p + d)}
    for (rank, room), moves in got.items():
        assert moves == replayed[(side_of[rank], room)]
    assert {(side_of[r], room) for r, room in got} == set(replayed)
    # the live spans say the same: the same moves, the same gate holds and
    # failures where they happened, and each span in its room's trace
    assert _moves_of_spans(live) == got
    assert _events(live) == _events(spans)
    traces = {i.span.room: i.trace_id for i in spans}
    assert all(i.trace_id == traces[i.span.room] for i in live if i.span.room in traces)


def _events(spans):
    """(rank, room, attempt) -> the names of its request's events, in order."""
    return {
        (i.span.rank, i.span.room, i.span.attempt): [e.name for e in i.span.events]
        for i in spans
        if i.span.kind == "request" and i.span.events
    }
