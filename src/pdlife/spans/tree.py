"""Spans as an indented tree, one line each (``pdlife trace spans``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence

from pdlife.spans.select import Identified

__all__ = ["lines"]


def _attrs(i: Identified) -> str:
    s, a = i.span, i.span.attributes
    if s.kind == "status":
        return f"{a.get('pdlife.steps')} step(s), ended by {a.get('pdlife.ended_by')}"
    out = f"{a.get('pdlife.outcome')}"
    if s.error:
        out += f" ({s.error}, origin rank {a.get('pdlife.origin_rank')})"
    return out + f", queues {a.get('pdlife.queues')}"


def lines(items: Sequence[Identified]) -> Iterator[str]:
    """Each room's requests by side, rank and attempt, their status spans
    below them and their events in time; times in ms from the room's first span."""
    by_room: dict[int, list[Identified]] = defaultdict(list)
    for i in items:
        by_room[i.span.room].append(i)
    for room, spans in sorted(by_room.items(), key=lambda kv: min(i.span.start for i in kv[1])):
        t0 = min(i.span.start for i in spans)
        kids: dict[int, list[Identified]] = defaultdict(list)
        for i in spans:
            if i.parent_id is not None:
                kids[i.parent_id].append(i)
        yield f"room {room} (trace {spans[0].trace_id:032x})"
        roots = sorted((i for i in spans if i.parent_id is None), key=lambda i: i.span.start)
        for r in roots:
            s = r.span
            ms = f"{(s.start - t0) * 1e3:9.1f} ms +{(s.end - s.start) * 1e3:.1f}"
            link = " -> linked to prefill" if r.links else ""
            yield f"  {ms}  {s.side} rank {s.rank} attempt {s.attempt}: {_attrs(r)}{link}"
            for c in sorted(kids[r.span_id], key=lambda i: i.span.index):
                cs = c.span
                cms = f"{(cs.start - t0) * 1e3:9.1f} ms +{(cs.end - cs.start) * 1e3:.1f}"
                yield f"    {cms}  {cs.name.rsplit('.', 1)[1]}: {_attrs(c)}"
            for e in s.events:
                what = ", ".join(
                    f"{k.removeprefix('pdlife.')} {v}" for k, v in e.attributes.items()
                )
                yield f"    {(e.ts - t0) * 1e3:9.1f} ms  ! {e.name.removeprefix('pdlife.')}: {what}"
