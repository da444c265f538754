"""A checker of Chrome/Perfetto trace-event JSON, written from the format's
rules (the trace event format document): what a viewer needs to draw a
trace without dropping or mismatching events."""

from __future__ import annotations

from collections import defaultdict
from typing import Any


def problems(doc: dict[str, Any]) -> list[str]:
    """Every rule ``doc`` breaks (empty: it is well formed)."""
    bad: list[str] = []
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        return ["traceEvents is not a list"]
    named_pids = {
        e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    named_threads = {
        (e["pid"], e["tid"])
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    timed = [(e.get("ts"), i, e) for i, e in enumerate(events) if e.get("ph") != "M"]
    for ts, i, e in timed:
        if not isinstance(ts, (int, float)):
            bad.append(f"event {i} ({e.get('ph')}) has no numeric ts")
        if e.get("pid") not in named_pids:
            bad.append(f"event {i}: process {e.get('pid')} is not named")
        if (
            e.get("ph") in ("b", "e", "X", "i", "s", "f")
            and (e["pid"], e.get("tid")) not in named_threads
        ):
            bad.append(f"event {i}: thread {e.get('tid')} of process {e['pid']} is not named")
    if bad:
        return bad
    timed.sort(key=lambda x: (x[0], x[1]))  # (a viewer orders by ts; ties as written)
    stacks: dict[tuple[Any, ...], list[tuple[str, float]]] = defaultdict(list)
    flows: dict[Any, list[tuple[str, float, int, int]]] = defaultdict(list)
    slices: list[tuple[int, int, float, float]] = []
    for ts, i, e in timed:
        ph = e["ph"]
        if ph in ("b", "e"):
            scope = e.get("id2", {}).get("local", e.get("id"))
            key = (e["pid"], e.get("cat"), scope)
            if ph == "b":
                stacks[key].append((e["name"], ts))
            elif not stacks[key]:
                bad.append(f"event {i}: async end {e['name']!r} of {key} with nothing open")
            else:
                name, began = stacks[key].pop()
                if name != e["name"]:
                    bad.append(f"event {i}: async end {e['name']!r} closes {name!r} of {key}")
                if ts < began:
                    bad.append(f"event {i}: async end before its begin")
        elif ph == "X":
            if not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0:
                bad.append(f"event {i}: a complete slice without a duration")
            slices.append((e["pid"], e["tid"], ts, ts + e.get("dur", 0)))
        elif ph in ("s", "f"):
            flows[e.get("id")].append((ph, ts, e["pid"], e["tid"]))
        elif ph == "C":
            args = e.get("args", {})
            if not all(isinstance(v, (int, float)) for v in args.values()):
                bad.append(f"event {i}: a counter with a value that is not a number")
    bad += [f"async {k}: {[n for n, _ in v]} never closed" for k, v in stacks.items() if v]
    for fid, ends in flows.items():
        kinds = sorted(p for p, _, _, _ in ends)
        if kinds != ["f", "s"]:
            bad.append(f"flow {fid}: {kinds} (one start and one end)")
            continue
        (_, t_start, *_), (_, t_end, *_) = sorted(ends, key=lambda x: x[0] != "s")
        if t_end < t_start:
            bad.append(f"flow {fid}: its end is before its start")
        for _, t, pid, tid in ends:
            if not any(p == pid and q == tid and a <= t <= b for p, q, a, b in slices):
                bad.append(f"flow {fid}: no slice on process {pid} thread {tid} encloses it")
    return bad
