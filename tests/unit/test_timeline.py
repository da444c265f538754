"""The connector's timeline: what its loop was told and did, by request, and
the hops a request's marks line up into."""

import pytest

from support.trace_events import problems
from transport.connector.core.events import (
    FAILED,
    LANDED,
    Arrived,
    Forget,
    Restarted,
    Send,
    Silence,
    Stale,
    Write,
    Written,
)
from transport.connector.core.messages import Done, Incoming, Pages
from transport.connector.timeline import Timeline, chrome_trace, hops


def _pages(room):
    return Pages(room=room, epoch=0, pages=[1, 2], slot=0, skip=0, dst_heads=1)


def _write(wid, room):
    return Write(wid, room, 0, 1, {}, ([], [], []), b"")


def test_events_and_effects_are_labelled_by_kind_and_room():
    tl = Timeline(clock=lambda: 9.0)
    tl.events([Arrived(Incoming(1, 7, _pages(5)))], 1.0)
    tl.events([Arrived(Incoming(1, None, Done(room=5, epoch=0), notified=True))], 2.0)
    for e in (Send(1, Done(room=6, epoch=0)), _write(40, 6), _write(41, 7)):
        tl.effect(e, 3.0)
    tl.events([Written(40, LANDED), Written(41, FAILED), Written(42, LANDED)], 4.0)
    tl.effect(_write(43, 8), 5.0)
    tl.effect(Forget(43), 5.0)
    tl.events([Silence(frozenset({2, 1})), Silence(frozenset()), Restarted({})], 6.0)
    tl.events([Stale(Incoming(3, 1, _pages(9))), Restarted({3: 2})], 7.0)
    tl.mark("success", 5)
    assert tl.take() == [
        (1.0, "recv pages", 5),
        (2.0, "note done", 5),
        (3.0, "send done", 6),
        (3.0, "write", 6),
        (3.0, "write", 7),
        (4.0, "landed", 6),
        (4.0, "failed", 7),
        (4.0, "landed", -1),  # a write this timeline never saw posted
        (5.0, "write", 8),
        (5.0, "forget", 8),
        (6.0, "silent [1, 2]", -1),  # (a look that found nobody silent is not kept)
        (7.0, "stale pages", 9),
        (7.0, "restarted [3]", -1),
        (9.0, "success", 5),
    ]
    assert tl.take() == []


def test_a_full_timeline_keeps_its_newest_records_and_counts_the_rest():
    tl = Timeline(limit=2)
    for i in range(5):
        tl.mark("m", i, float(i))
    assert tl.records == [(3.0, "m", 3), (4.0, "m", 4)] and tl.dropped == 3
    assert tl.take() == [(3.0, "m", 3), (4.0, "m", 4)] and tl.records == []


def test_marks_that_name_neither_the_first_nor_the_last_record_are_refused():
    with pytest.raises(ValueError, match="'first' nor the 'last'"):
        hops({}, [("decode 0", "page list", "first"), ("decode 0", "success", "median")])


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "10"])
def test_a_limit_that_is_not_a_positive_int_is_refused(limit):
    with pytest.raises(ValueError, match="Timeline limit"):
        Timeline(limit=limit)


def test_hops_are_the_gaps_between_a_rooms_marks_across_tracks():
    tracks = {
        "decode 0": [(1.0, "page list", 3), (9.0, "success", 3), (2.0, "page list", 4)],
        "prefill 0": [
            (1.5, "write", 3),
            (2.5, "write", 3),
            (4.0, "landed", 3),
            (7.0, "landed", 3),
            (1.0, "write", 4),  # before its page list: out of order
        ],
    }
    marks = [
        ("decode 0", "page list", "first"),
        ("prefill 0", "write", "first"),
        ("prefill 0", "landed", "last"),
        ("decode 0", "success", "first"),
    ]
    got = hops(tracks, marks)
    assert got[3] == [0.5, 5.5, 2.0]
    assert got[4] == [None, None, None]  # out of order, then missing marks
    assert set(got) == {3, 4}


def test_chrome_trace_has_a_process_per_track_and_an_instant_per_record():
    trace = chrome_trace({"a": [(2.0, "x", 1)], "b": [(2.5, "y", -1), (3.0, "z", 2)]})
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: "a", 2: "b"}
    assert problems(trace) == []  # well formed for a viewer: processes and threads named
    inst = [(e["pid"], e["name"], e["ts"], e["args"]["room"]) for e in events if e["ph"] == "i"]
    assert inst == [(1, "x", 0.0, 1), (2, "y", 500000.0, -1), (2, "z", 1000000.0, 2)]
    assert chrome_trace({}) == {"traceEvents": [], "displayTimeUnit": "ms"}
