"""Spans from trace records (pdlife.spans): what each span and event holds,
which ranks' spans are kept, the derived ids and links, and the SDK's spans."""

import pytest

from lifecycle.errors import InvalidArgument
from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll
from pdlife.spans import Selection, SpanBuilder, select, spans_of_records
from pdlife.spans.select import sampled, span_id, trace_id
from pdlife.trace import TraceError

B, W, T, S, F = (int(s) for s in (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success, KVPoll.Failed))  # fmt: skip
WALL = 1_700_000_000.0
R = 77


def clock(rank):
    return {"t": "clock", "rank": rank, "mono": 100.0, "wall": WALL}


def obs(rank, side, queue, step, rooms, agreed, held=None):
    rec = {"t": "obs", "step": step, "ts": 100.0 + step, "rank": rank, "side": side}
    rec |= {"queue": queue, "rooms": rooms, "local": agreed, "reason": [15] * len(rooms)}
    rec["agreed"] = agreed
    if held:
        rec["held"] = held
    return rec


def tr(rank, side, queue, step, room, frm, to, trigger, reason=15, origin=-1):
    return {
        "t": "tr", "step": step, "rank": rank, "side": side, "queue": queue, "room": room,
        "from": frm, "to": to, "trigger": trigger, "reason": reason, "origin": origin,
    }  # fmt: skip


def prefill_success(rank, held_at=None):
    """One request through prefill's two queues; ``held_at``: a step where
    this rank's user gate held it at Transferring."""
    out = [clock(rank)]
    out += [obs(rank, "prefill", "bootstrap", 1, [R], [B])]
    out += [
        obs(rank, "prefill", "bootstrap", 2, [R], [W]),
        tr(rank, "prefill", "bootstrap", 2, R, B, W, "handshake"),
    ]
    out += [
        obs(rank, "prefill", "inflight", 3, [R], [T]),
        tr(rank, "prefill", "inflight", 3, R, W, T, "start"),
    ]
    for step in (4, 5):
        held = {"user": [R]} if step == held_at else None
        out += [obs(rank, "prefill", "inflight", step, [R], [T], held)]
    out += [
        obs(rank, "prefill", "inflight", 6, [R], [S]),
        tr(rank, "prefill", "inflight", 6, R, T, S, "complete"),
    ]
    return out  # fmt: skip


def decode_failed_then_retried(rank, origin):
    """Decode fails the request (origin ``origin``), drains it, retries it."""
    fail = int(FailureReason.CHECKSUM_MISMATCH)
    out = [clock(rank)]
    out += [obs(rank, "decode", "handshake", 1, [R], [B])]
    out += [
        obs(rank, "decode", "transfer", 2, [R], [W]),
        tr(rank, "decode", "transfer", 2, R, B, W, "handshake"),
    ]
    out += [
        obs(rank, "decode", "transfer", 3, [R], [F]),
        tr(rank, "decode", "transfer", 3, R, W, F, "fail", fail, origin),
    ]
    out += [obs(rank, "decode", "drain", 4, [R], [T])]
    out += [obs(rank, "decode", "handshake", 4, [R], [B])]  # the retry, while the first drains
    out += [
        obs(rank, "decode", "drain", 5, [R], [S]),
        tr(rank, "decode", "drain", 5, R, T, S, "complete"),
    ]
    out += [
        obs(rank, "decode", "handshake", 6, [R], [S]),
        tr(rank, "decode", "handshake", 6, R, B, S, "complete"),
    ]
    return out  # fmt: skip


def test_a_request_span_and_one_child_per_status_dwelt_in():
    b = SpanBuilder()
    spans = [s for rec in prefill_success(0) for s in b.feed(rec)] + b.finish()
    req, *children = spans
    assert (req.kind, req.name, req.room, req.side, req.rank, req.attempt) == (
        "request", "pdlife.request", R, "prefill", 0, 1,
    )  # fmt: skip
    assert (req.start, req.end) == (WALL + 1, WALL + 6)  # first observation to the agreed end
    assert req.attributes["pdlife.outcome"] == "Success" and req.error is None
    assert req.attributes["pdlife.queues"] == "bootstrap,inflight"
    assert req.attributes["pdlife.room"] == str(R)  # OTLP's integers are signed 64 bits
    got = [(c.name, c.start - WALL, c.end - WALL, c.attributes["pdlife.steps"]) for c in children]
    assert got == [
        ("pdlife.status.Bootstrapping", 1, 2, 1),
        ("pdlife.status.WaitingForInput", 2, 3, 1),
        ("pdlife.status.Transferring", 3, 6, 3),
    ]
    assert [c.attributes["pdlife.ended_by"] for c in children] == ["handshake", "start", "complete"]
    assert not req.involved and req.events == ()


def test_a_gate_hold_is_an_event_pair_on_the_rank_that_held():
    b = SpanBuilder()
    spans = [s for rec in prefill_success(1, held_at=4) for s in b.feed(rec)] + b.finish()
    req = next(s for s in spans if s.kind == "request")
    assert [(e.name, e.ts - WALL, dict(e.attributes)) for e in req.events] == [
        ("pdlife.gate.hold", 4, {"pdlife.gate": "user", "pdlife.rank": 1}),
        ("pdlife.gate.release", 5, {"pdlife.gate": "user", "pdlife.rank": 1}),
    ]
    assert req.involved


def test_a_failure_drains_then_its_retry_is_the_next_attempt():
    b = SpanBuilder()
    spans = [s for rec in decode_failed_then_retried(2, origin=2) for s in b.feed(rec)]
    spans += b.finish()
    reqs = [s for s in spans if s.kind == "request"]
    first, second = sorted(reqs, key=lambda s: s.attempt)
    assert (first.attempt, second.attempt) == (1, 2)
    assert first.error == "checksum_mismatch" and first.attributes["pdlife.origin_rank"] == 2
    assert first.end == WALL + 5  # its release, not its agreed end
    names = [e.name for e in first.events]
    assert names == ["pdlife.failure", "pdlife.digest.mismatch", "pdlife.released"]
    drain = [s for s in spans if s.name == "pdlife.status.Draining"]
    assert [(d.attempt, d.start - WALL, d.end - WALL) for d in drain] == [(1, 4, 5)]
    assert [(e.name, dict(e.attributes)) for e in second.events] == [
        ("pdlife.recovery", {"pdlife.decision": "retry", "pdlife.after": "checksum_mismatch"})
    ]
    assert second.attributes["pdlife.epoch"] == 1 and second.error is None
    assert b.unattached == 0


def test_a_failure_from_another_rank_has_no_failure_event_here():
    b = SpanBuilder()
    spans = [s for rec in decode_failed_then_retried(3, origin=2) for s in b.feed(rec)]
    first = next(s for s in spans if s.kind == "request" and s.attempt == 1)
    assert first.error == "checksum_mismatch" and first.attributes["pdlife.origin_rank"] == 2
    assert "pdlife.failure" not in [e.name for e in first.events]
    assert not first.involved


def test_a_stuck_report_names_its_holders_on_the_live_request():
    b = SpanBuilder()
    recs = prefill_success(0)[:4]
    recs.append({"t": "event", "rank": 0, "kind": "stuck", "step": 2, "room": R,
                 "status": "WaitingForInput", "holders": [0, 1]})  # fmt: skip
    spans = [s for rec in recs for s in b.feed(rec)] + b.finish()
    req = spans[0]
    assert req.attributes["pdlife.outcome"] == "live"  # the trace ended: closed there
    stuck = [e for e in req.events if e.name == "pdlife.stuck"]
    assert [dict(e.attributes) for e in stuck] == [
        {"pdlife.status": "WaitingForInput", "pdlife.holders": (0, 1)}
    ]
    assert req.involved


def test_a_trace_without_its_time_base_is_refused():
    b = SpanBuilder()
    rec = obs(0, "prefill", "bootstrap", 1, [R], [B])
    del rec["ts"]
    b.feed(clock(0))
    with pytest.raises(TraceError, match="no time base"):
        b.feed(rec)
    with pytest.raises(TraceError, match="no time base"):  # no clock record
        SpanBuilder().feed(obs(0, "prefill", "bootstrap", 2, [R], [B]))


def _run():
    """Prefill ranks 0 (held a gate) and 1, decode ranks 2 and 3 (3 failed it)."""
    return [
        *prefill_success(0),
        *prefill_success(1, held_at=4),
        *decode_failed_then_retried(2, origin=3),
        *decode_failed_then_retried(3, origin=3),
    ]


@pytest.mark.parametrize(
    ("volume", "kept"),
    [
        ("every", {("prefill", 0), ("prefill", 1), ("decode", 2), ("decode", 3)}),
        ("lead", {("prefill", 0), ("decode", 2)}),
        # rank 1 held a gate; decode rank 3 originated the first attempt's failure
        ("involved", {("prefill", 0), ("prefill", 1), ("decode", 2), ("decode", 3)}),
    ],
)
def test_volume_keeps_the_lead_and_the_involved(volume, kept):
    out = select(spans_of_records(_run()), "run", Selection(volume))
    assert {(i.span.side, i.span.rank) for i in out} == kept
    if volume == "involved":  # rank 3 only for the attempt it failed
        assert {i.span.attempt for i in out if i.span.rank == 3} == {1}


def test_ids_are_derived_and_decode_links_to_prefills_lead():
    out = select(spans_of_records(_run()), "run", Selection("every"))
    assert {i.trace_id for i in out} == {trace_id("run", R)}  # one trace per room
    assert len({i.span_id for i in out}) == len(out)
    by_id = {i.span_id: i for i in out}
    for i in out:
        s = i.span
        assert i.span_id == span_id("run", R, s.side, s.rank, s.attempt, s.index)
        if s.kind == "status":
            assert by_id[i.parent_id].span.kind == "request"
            assert (by_id[i.parent_id].span.rank, by_id[i.parent_id].span.attempt) == (
                s.rank,
                s.attempt,
            )
        elif s.side == "decode" and s.attempt == 1:
            ((t, p),) = i.links
            assert (t, by_id[p].span.side, by_id[p].span.rank) == (i.trace_id, "prefill", 0)
        else:  # prefill; decode's second attempt has no prefill attempt 2 in this run
            assert i.parent_id is None and i.links == ()
    assert trace_id("run", R) != trace_id("other run", R) != trace_id("run", R + 1)


def test_sampling_is_decided_by_the_room_alone():
    rooms = range(1, 2001)
    kept = [r for r in rooms if sampled(r, 0.25)]
    assert 400 < len(kept) < 600
    assert kept == [r for r in rooms if sampled(r, 0.25)]
    assert all(sampled(r, 1.0) for r in rooms) and not any(sampled(r, 0.0) for r in rooms)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"volume": "some"}, "volume"),
        ({"sample": 1.5}, "sample"),
        ({"sample": True}, "sample"),
        ({"sample": "all"}, "sample"),
    ],
)
def test_a_bad_selection_names_its_field(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        Selection(**kwargs)


def test_the_sdk_spans_carry_ids_times_status_events_and_links():
    otel = pytest.importorskip("pdlife.spans.otel")
    from opentelemetry.trace import StatusCode

    items = select(spans_of_records(_run()), "run", Selection("every"))
    spans = otel.readable_spans(items, "run")
    assert len(spans) == len(items)
    for i, s in zip(items, spans):
        assert (s.context.trace_id, s.context.span_id) == (i.trace_id, i.span_id)
        assert (s.start_time, s.end_time) == (round(i.span.start * 1e9), round(i.span.end * 1e9))
        assert s.resource.attributes["service.instance.id"] == f"{i.span.side} rank {i.span.rank}"
        if i.span.error:
            assert s.status.status_code is StatusCode.ERROR
            assert s.attributes["error.type"] == i.span.error
        assert [link.context.span_id for link in s.links] == [p for _, p in i.links]
        assert [e.name for e in s.events] == [e.name for e in i.span.events]


def test_a_legs_end_is_an_event_on_its_attempt_live_or_draining():
    b = SpanBuilder()
    recs = decode_failed_then_retried(2, origin=2)
    leg = {"t": "event", "rank": 2, "kind": "leg", "step": 2, "room": R, "peer": 0}
    recs.insert(4, {**leg, "outcome": "waiting timeout", "seconds": 1.5})  # after step 2
    recs.insert(8, {**leg, "outcome": "done", "seconds": None})  # while the first drains
    spans = [s for rec in recs for s in b.feed(rec)] + b.finish()
    first = next(s for s in spans if s.kind == "request" and s.attempt == 1)
    legs = [dict(e.attributes) for e in first.events if e.name == "pdlife.leg"]
    assert legs == [
        {"pdlife.peer": 0, "pdlife.outcome": "waiting timeout", "pdlife.seconds": 1.5},
        {"pdlife.peer": 0, "pdlife.outcome": "done"},  # (no time: none was recorded)
    ]
