"""A picture of a Chrome/Perfetto trace (``pdlife trace picture``): what
:mod:`pdlife.perfetto` exports, read back from its trace-event JSON and drawn
in a trace viewer's layout, for a page or a terminal without a browser.

A band per process (a side's rank) and, inside it, a track per thread (a
queue); in a track, a lane per request (its async slice, ``room N``), with
the slices of the statuses it dwelt in drawn in their colours; instants as
markers (a gate's hold, a failure on its origin rank); flows as arrows from
prefill's track where the writes began to decode's where they landed. Only
the rooms picked are drawn (by default the rooms an instant names, then the
first others), so that a page shows a readable few.

Reading the file back, not the run, is the point: what is drawn is what a
viewer is given.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

__all__ = ["COLOURS", "Lane", "draw", "lanes"]

#: a status slice's colour (the names :mod:`pdlife.perfetto` gives them)
COLOURS: Mapping[str, str] = {
    "Bootstrapping": "#9ecae1",
    "WaitingForInput": "#fdd0a2",
    "Transferring": "#a1d99b",
    "Draining": "#d9d9d9",
}


@attrs.define
class Lane:
    """One request's async slice on one track, with its status slices."""

    pid: int
    tid: int
    room: int
    start: float
    end: float
    #: (status name, start, end) in microseconds
    parts: list[tuple[str, float, float]] = attrs.field(factory=list)
    outcome: str = "live"


def _room_of(name: str) -> int | None:
    if not name.startswith("room "):
        return None
    try:
        return int(name[5:])
    except ValueError:
        return None


def lanes(events: Iterable[Mapping[str, Any]]) -> list[Lane]:
    """Every request slice of ``events`` with its nested status slices (async
    begin/end pairs matched per process, thread and id, innermost first)."""
    open_: dict[tuple[int, int, str], list[tuple[str, float]]] = defaultdict(list)
    current: dict[tuple[int, int, str], Lane] = {}
    out: list[Lane] = []
    for e in events:
        if e.get("ph") not in ("b", "e"):
            continue
        key = (int(e["pid"]), int(e["tid"]), str((e.get("id2") or {}).get("local", e.get("id"))))
        name, ts = str(e["name"]), float(e["ts"])
        if e["ph"] == "b":
            room = _room_of(name)
            if room is not None:
                current[key] = Lane(key[0], key[1], room, ts, ts)
            open_[key].append((name, ts))
            continue
        stack = open_.get(key)
        if not stack:
            continue
        began_name, began = stack.pop()
        lane = current.get(key)
        if lane is None:
            continue
        if _room_of(began_name) is not None:
            lane.end = ts
            lane.outcome = str((e.get("args") or {}).get("outcome", lane.outcome))
            out.append(lane)
            del current[key]
        else:
            lane.parts.append((began_name, began, ts))
    return out


def _picked(all_lanes: list[Lane], named: set[int], most: int) -> list[int]:
    rooms = list(dict.fromkeys(lane.room for lane in all_lanes))
    first = [r for r in rooms if r in named]
    return (first + [r for r in rooms if r not in named])[:most]


def draw(doc: Mapping[str, Any], out: Path, most: int = 4) -> list[int]:
    """Draw ``doc`` (trace-event JSON) into the PNG ``out``; the rooms drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = doc["traceEvents"]
    names = {
        (int(e["pid"]), int(e.get("tid", -1))): str(e["args"]["name"])
        for e in events
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name")
    }
    instants = [e for e in events if e.get("ph") == "i"]
    named = {int(e["args"]["room"]) for e in instants if "room" in (e.get("args") or {})}
    found = lanes(events)
    rooms = _picked(found, named, most)
    shown = [lane for lane in found if lane.room in rooms]
    tracks = sorted({(lane.pid, lane.tid) for lane in shown})
    row: dict[tuple[int, int, int], int] = {}
    labels: list[tuple[int, str]] = []
    y = 0
    for pid, tid in tracks:
        labels.append((y, f"{names.get((pid, -1), f'pid {pid}')} / {names.get((pid, tid), tid)}"))
        for room in rooms:
            if any(x.room == room and (x.pid, x.tid) == (pid, tid) for x in shown):
                row[(pid, tid, room)] = y
                y += 1
        y += 1  # a gap between tracks
    fig, ax = plt.subplots(figsize=(14, 0.28 * y + 2.0))
    for lane in shown:
        at = row[(lane.pid, lane.tid, lane.room)]
        edge = "#cb181d" if lane.outcome == "Failed" else "#525252"
        ax.broken_barh([(lane.start / 1e3, max(lane.end - lane.start, 1.0) / 1e3)], (at - 0.42, 0.84),
                       facecolors="none", edgecolors=edge, linewidth=1.2)  # fmt: skip
        for name, s, t in lane.parts:
            ax.broken_barh([(s / 1e3, max(t - s, 1.0) / 1e3)], (at - 0.32, 0.64),
                           facecolors=COLOURS.get(name, "#bcbddc"))  # fmt: skip
        ax.text(lane.start / 1e3, at, f" {lane.room % 100000:05d} ", ha="right", va="center",
                fontsize=7, color="#525252")  # fmt: skip
    for e in instants:
        named_room = (e.get("args") or {}).get("room")
        mark = (
            row.get((int(e["pid"]), int(e["tid"]), int(named_room)))
            if named_room is not None
            else None
        )
        if mark is None:
            continue
        failed = str(e["name"]).startswith("failed")
        ax.plot(float(e["ts"]) / 1e3, mark, marker="X" if failed else "v", markersize=9,
                color="#cb181d" if failed else "#6a51a3", zorder=5)  # fmt: skip
        ax.annotate(str(e["name"]), (float(e["ts"]) / 1e3, mark), xytext=(6, 6),
                    textcoords="offset points", fontsize=7)  # fmt: skip
    starts = {e["id"]: e for e in events if e.get("ph") == "s"}
    for f in (e for e in events if e.get("ph") == "f" and e.get("id") in starts):
        s = starts[f["id"]]
        ys = [r for (p, t, _), r in row.items() if (p, t) == (s["pid"], s["tid"])]
        yf = [r for (p, t, _), r in row.items() if (p, t) == (f["pid"], f["tid"])]
        if ys and yf:
            ax.annotate("", xy=(float(f["ts"]) / 1e3, min(yf) - 0.5),
                        xytext=(float(s["ts"]) / 1e3, max(ys) + 0.5),
                        arrowprops={"arrowstyle": "->", "color": "#9e9ac8", "lw": 0.6})  # fmt: skip
    ax.set_yticks([at for at, _ in labels], [text for _, text in labels], fontsize=8)
    ax.set_ylim(y - 0.5, -1.0)
    ax.set_xlabel("ms since the run's first observation")
    ax.grid(axis="x", color="#f0f0f0")
    legend = [Patch(facecolor=c, label=n) for n, c in COLOURS.items()]
    legend.append(Patch(facecolor="none", edgecolor="#cb181d", label="request ended Failed"))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=5, fontsize=8)
    ax.set_title(f"{len(rooms)} of {len({x.room for x in found})} rooms; markers: a gate's hold "
                 "(v), a failure on its origin rank (X); arrows: prefill's writes to decode",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return rooms
