"""pdlife trace export --perfetto: a run's traces as trace-event JSON that a
checker written from the format accepts, and the checker catches the
breakages a viewer would trip on."""

import copy

import pytest

from lifecycle.reasons import FailureReason
from pdlife.perfetto import events_of
from support.trace_events import problems

NONE, INJ = int(FailureReason.NONE), int(FailureReason.INJECTED_FAULT)


def obs(rank, side, queue, step, ts, rooms, agreed, held=None):
    rec = {"t": "obs", "rank": rank, "side": side, "queue": queue, "step": step, "ts": ts}
    rec.update(rooms=rooms, local=agreed, reason=[NONE] * len(rooms), agreed=agreed)
    if held:
        rec["held"] = held
    return rec


def tr(rank, side, queue, step, room, old, new, reason=NONE, origin=-1):
    return {
        "t": "tr", "rank": rank, "side": side, "queue": queue, "step": step, "room": room,
        "from": old, "to": new, "trigger": "x", "reason": reason, "origin": origin,
    }  # fmt: skip


def run_records():
    """Room 7 goes through prefill rank 0 and decode rank 1 to Success (a gate
    holds it on decode once); room 8 fails on decode rank 1; room 9 is still
    live at the end."""
    return [
        {"t": "clock", "rank": 0, "mono": 10.0, "wall": 0.0},
        obs(0, "prefill", "bootstrap", 1, 9.9, [7], [2]),
        tr(0, "prefill", "bootstrap", 1, 7, 1, 2),
        obs(0, "prefill", "inflight", 1, 10.0, [7, 9], [3, 2]),
        tr(0, "prefill", "inflight", 1, 7, 2, 3),
        obs(0, "prefill", "inflight", 2, 10.5, [7, 9], [4, 2]),
        tr(0, "prefill", "inflight", 2, 7, 3, 4),
        obs(1, "decode", "transfer", 1, 10.1, [7, 8], [3, 3], held={"metadata": [7]}),
        tr(1, "decode", "transfer", 1, 7, 2, 3),
        obs(1, "decode", "transfer", 2, 10.6, [7, 8], [4, 0]),
        tr(1, "decode", "transfer", 2, 7, 3, 4),
        tr(1, "decode", "transfer", 2, 8, 3, 0, INJ, 1),
        {"t": "event", "rank": 1, "kind": "stuck", "step": 2, "room": 8, "holders": [1]},
    ]


def doc():
    return {"traceEvents": events_of(run_records())}


def test_a_run_exports_to_events_the_checker_accepts():
    d = doc()
    assert problems(d) == []
    ev = d["traceEvents"]
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"prefill rank 0", "decode rank 1"}
    # room 7 on decode: its slice, its statuses nested in it, and the gate's hold
    mine = [e for e in ev if e["ph"] in "be" and e["pid"] == 1 and e["id2"]["local"] == hex(7)]
    assert [(e["ph"], e["name"]) for e in mine] == [
        ("b", "room 7"), ("b", "WaitingForInput"), ("e", "WaitingForInput"),
        ("b", "Transferring"), ("e", "Transferring"), ("e", "room 7"),
    ]  # fmt: skip
    instants = {(e["pid"], e["name"]) for e in ev if e["ph"] == "i"}
    assert instants == {(1, "held by metadata gate"), (1, "failed: injected_fault"), (1, "stuck")}
    flows = sorted((e["ph"], e["pid"]) for e in ev if e["ph"] in "sf")
    assert flows == [("f", 1), ("s", 0)]  # prefill's writes begin -> decode's landing
    live = [e for e in ev if e["ph"] == "e" and e["name"] == "room 9"]
    assert live and live[0]["args"]["outcome"] == "live"  # closed where its trace ends
    assert min(e["ts"] for e in ev if "ts" in e) == 0  # microseconds from the first observation


@pytest.mark.parametrize(
    "breakage",
    ["drop an async end", "swap a nested end", "drop a flow end", "unname a process", "no ts"],
)
def test_the_checker_catches_what_a_viewer_trips_on(breakage):
    d = copy.deepcopy(doc())
    ev = d["traceEvents"]
    if breakage == "drop an async end":
        ev.remove(next(e for e in ev if e["ph"] == "e"))
    elif breakage == "swap a nested end":
        e = next(e for e in ev if e["ph"] == "e" and e["name"] == "WaitingForInput")
        e["name"] = "room 7"
    elif breakage == "drop a flow end":
        ev.remove(next(e for e in ev if e["ph"] == "f"))
    elif breakage == "unname a process":
        ev.remove(next(e for e in ev if e["ph"] == "M" and e["name"] == "process_name"))
    else:
        del next(e for e in ev if e["ph"] == "b")["ts"]
    assert problems(d)


def test_a_trace_without_a_time_base_is_refused_by_name():
    from pdlife.trace import TraceError

    old = [{k: v for k, v in r.items() if k != "ts"} for r in run_records()]
    with pytest.raises(TraceError, match="no time base"):
        events_of(old)
