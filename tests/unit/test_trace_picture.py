"""pdlife trace picture: a trace-event file read back into request lanes (each
with its status slices) and drawn, the rooms an instant names first."""

import pytest

from pdlife.trace_picture import draw, lanes


def _slice(ph, name, ts, lid, pid=0, tid=1, **args):
    e = {"ph": ph, "cat": "request", "name": name, "pid": pid, "tid": tid, "ts": ts}
    e["id2"] = {"local": hex(lid)}
    if args:
        e["args"] = args
    return e


DOC = {
    "traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "prefill rank 0"}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "inflight"}},
        _slice("b", "room 7", 0.0, 7),
        _slice("b", "Bootstrapping", 0.0, 7),
        _slice("b", "room 9", 5.0, 9),
        _slice("b", "Transferring", 5.0, 9),
        _slice("e", "Bootstrapping", 10.0, 7),
        _slice("b", "Transferring", 10.0, 7),
        _slice("e", "Transferring", 30.0, 7),
        _slice("e", "room 7", 30.0, 7, outcome="Success"),
        _slice("e", "Transferring", 40.0, 9),
        _slice("e", "room 9", 40.0, 9, outcome="Failed"),
        {"ph": "i", "s": "t", "name": "failed: transfer_error", "pid": 0, "tid": 1, "ts": 40.0,
         "args": {"room": 9, "origin": 0}},
    ]
}  # fmt: skip


def test_a_request_lane_holds_its_status_slices_and_outcome():
    got = {lane.room: lane for lane in lanes(DOC["traceEvents"])}
    assert sorted(got) == [7, 9]
    assert got[7].parts == [("Bootstrapping", 0.0, 10.0), ("Transferring", 10.0, 30.0)]
    assert (got[7].start, got[7].end, got[7].outcome) == (0.0, 30.0, "Success")
    assert got[9].outcome == "Failed" and got[9].parts == [("Transferring", 5.0, 40.0)]


def test_unmatched_ends_and_other_events_are_passed_over():
    extra = [_slice("e", "Transferring", 1.0, 3), {"ph": "C", "name": "x", "pid": 0, "ts": 1.0}]
    assert [lane.room for lane in lanes(extra + DOC["traceEvents"])] == [7, 9]


def test_the_picture_draws_the_named_rooms_first(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "t.png"
    assert draw(DOC, out, most=1) == [9]  # the failure's room
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert draw(DOC, out, most=4) == [9, 7]
