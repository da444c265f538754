"""Which ranks' spans leave the process, and the ids they carry (no I/O).

Volume (:data:`VOLUMES`) is decided per request, side and attempt from the
spans themselves, so every rank decides alike: the *lead* is the lowest rank
of the side that saw the request (with prefill DP, the lowest of its group);
``involved`` (the default) keeps the lead's spans and those of every rank that
held a gate on it, originated its failure or was named a holder in a stuck
report. Sampling keeps a share of the rooms, decided by the room alone.

Ids are derived, not drawn: a room's trace id from the run and the room (every
attempt, both sides, one trace, with no propagation between the sides); a
span's id from the run, room, side, rank, attempt and its place. So a span can
be named before it exists: decode's request span links to prefill's (the lead
rank's) of the same room and attempt.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Mapping

import attrs

from lifecycle.errors import InvalidArgument
from pdlife.spans.model import SpanData

__all__ = ["VOLUMES", "Identified", "Selection", "select", "span_id", "trace_id"]

#: the volume a run's spans are exported at
VOLUMES: Mapping[str, str] = {
    "every": "every rank's spans",
    "lead": "the spans of the lowest rank of each side that saw the request",
    "involved": "the lead's, and those of the ranks that held a gate on the request, "
    "originated its failure or were named its holders",
}


def _sample_ok(_: object, a: attrs.Attribute[float], v: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
        raise InvalidArgument(a.name, v, "a share of the rooms in 0..1")


def _volume_ok(_: object, a: attrs.Attribute[str], v: str) -> None:
    if v not in VOLUMES:
        raise InvalidArgument(a.name, v, f"one of {', '.join(VOLUMES)}")


@attrs.frozen
class Selection:
    volume: str = attrs.field(default="involved", validator=_volume_ok)
    #: the share of rooms traced (the room alone decides: every rank alike)
    sample: float = attrs.field(default=1.0, validator=_sample_ok)


@attrs.frozen
class Identified:
    """A span with its ids: ``links`` are (trace id, span id) of other spans."""

    span: SpanData
    trace_id: int
    span_id: int
    parent_id: int | None
    links: tuple[tuple[int, int], ...] = ()


def _digest(size: int, *parts: object) -> int:
    h = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=size)
    return int.from_bytes(h.digest(), "big") or 1  # 0 is the invalid id


def trace_id(run: str, room: int) -> int:
    """The trace of every span of ``room`` in ``run`` (128 bits)."""
    return _digest(16, "trace", run, room)


def span_id(run: str, room: int, side: str, rank: int, attempt: int, index: int = 0) -> int:
    """A span's id (64 bits): the request span's is ``index`` 0."""
    return _digest(8, "span", run, room, side, rank, attempt, index)


def sampled(room: int, share: float) -> bool:
    """Whether ``room`` is traced at ``share`` (the same answer on every rank)."""
    if share >= 1.0:
        return True
    return _digest(8, "sample", room) < share * 2**64


def select(
    spans: Iterable[SpanData], run: str, selection: Selection | None = None
) -> list[Identified]:
    """The spans ``selection`` keeps, with their ids and links."""
    sel = selection or Selection()
    spans = [s for s in spans if sampled(s.room, sel.sample)]
    seen: dict[tuple[int, str, int], set[int]] = defaultdict(set)
    involved: dict[tuple[int, str, int], set[int]] = defaultdict(set)
    for s in spans:
        if s.kind == "request":
            seen[(s.room, s.side, s.attempt)].add(s.rank)
            if s.involved:
                involved[(s.room, s.side, s.attempt)].add(s.rank)
    lead = {k: min(v) for k, v in seen.items()}

    def kept(s: SpanData) -> bool:
        k = (s.room, s.side, s.attempt)
        if sel.volume == "every" or s.rank == lead[k]:
            return True
        return sel.volume == "involved" and s.rank in involved[k]

    out = []
    for s in spans:
        if (s.room, s.side, s.attempt) not in lead or not kept(s):
            continue
        tid = trace_id(run, s.room)
        sid = span_id(run, s.room, s.side, s.rank, s.attempt, s.index)
        parent = None
        links: tuple[tuple[int, int], ...] = ()
        if s.kind != "request":
            parent = span_id(run, s.room, s.side, s.rank, s.attempt)
        elif s.side == "decode" and (s.room, "prefill", s.attempt) in lead:
            p = lead[(s.room, "prefill", s.attempt)]
            links = ((tid, span_id(run, s.room, "prefill", p, s.attempt)),)
        out.append(Identified(s, tid, sid, parent, links))
    return out
