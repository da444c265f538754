"""Spans from a live stepper (pdlife.spans.live): a host engine's stepper
hands each step's changes over; an attempt's spans are taken once it ended,
with the host's trace when it gave one, and a rank that is not its side's
lead keeps only the requests it was involved in."""

import pytest

from lifecycle import FailureReason, KVPoll, RequestTable, SingleRank, StepConfig, Stepper
from lifecycle.errors import InvalidArgument
from lifecycle.testing import StatusBoard
from pdlife.spans.live import LiveSpans, parse_traceparent
from pdlife.spans.select import Selection, span_id, trace_id

HOST = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        self.now += 1.0
        return self.now


class _Hold:
    """Holds the rooms in ``rooms`` (a user gate)."""

    name = "user"

    def __init__(self):
        self.rooms = set()

    def closed(self, rooms, indices):
        return [int(r) in self.rooms for r in rooms.tolist()]


def _host(rank=0, side="decode", take=True, **kw):
    table, board, gate = RequestTable(rank=rank), StatusBoard(), _Hold()
    stepper = Stepper(table, rank, poller=board, config=StepConfig(), gates=[gate])
    stepper.record_holds = True
    got = []
    spans = LiveSpans(side, rank, "run-1", clock=Clock(), **kw)

    def step():
        res = stepper.step(SingleRank(rank))
        spans.observe("transfer", res, stepper.last_holds())
        if take:
            got.extend(spans.take())  # (an exporter's thread, here after each step)
        table.remove_many(res.succeeded)
        table.remove_many(res.failed)
        return res

    return table, board, gate, spans, step, got


def test_a_request_s_spans_leave_the_step_it_ends_with_its_states_and_gate():
    table, board, gate, spans, step, got = _host(prefill_lead=0)
    table.extend([7, 8])
    step()
    assert got == [] and spans.live == {}  # nothing moved: nothing opened
    board.status[7] = board.status[8] = KVPoll.WaitingForInput
    step()
    board.status[7] = KVPoll.Success
    gate.rooms.add(7)
    step()  # 7 held at Transferring by the gate (its poll says Success)
    assert got == []
    gate.rooms.clear()
    step()  # released: Success
    request, *states = [i for i in got if i.span.room == 7]
    assert request.span.name == "pdlife.request"
    assert request.span.attributes["pdlife.outcome"] == "Success"
    assert [s.span.name for s in states] == [
        "pdlife.status.Bootstrapping",
        "pdlife.status.WaitingForInput",
        "pdlife.status.Transferring",
    ]
    assert [e.name for e in request.span.events] == ["pdlife.gate.hold", "pdlife.gate.release"]
    assert states[1].span.attributes["pdlife.steps"] == 1
    assert "pdlife.steps" not in states[0].span.attributes  # (its first status: not known)
    # ids as a finished run's: the room's derived trace; decode links to prefill's lead
    assert request.trace_id == trace_id("run-1", 7)
    assert request.span_id == span_id("run-1", 7, "decode", 0, 1)
    assert request.links == ((request.trace_id, span_id("run-1", 7, "prefill", 0, 1)),)
    assert all(s.parent_id == request.span_id for s in states)
    assert 8 in spans.live  # still live: nothing of it left


def test_a_failure_carries_its_reason_and_the_host_s_trace_holds_its_retry():
    table, board, gate, spans, step, got = _host()
    spans.parent(9, HOST)
    table.extend([9])
    board.status[9] = KVPoll.Failed
    board.reasons[9] = FailureReason.TRANSFER_ERROR
    step()
    (request, status) = got
    assert request.span.error == "transfer_error"
    assert [e.name for e in request.span.events] == ["pdlife.failure"]
    host_trace, host_span = parse_traceparent(HOST)
    assert (request.trace_id, request.parent_id) == (host_trace, host_span)
    assert status.trace_id == host_trace
    # its retry (the next attempt) is in the host's trace too, and says why
    got.clear()
    table.extend([9])
    board.status[9] = KVPoll.Success
    step()
    request = got[0]
    assert request.trace_id == host_trace and request.span.attempt == 2
    assert [(e.name, dict(e.attributes)) for e in request.span.events] == [
        ("pdlife.recovery", {"pdlife.decision": "retry", "pdlife.after": "transfer_error"})
    ]


def test_a_rank_that_is_not_the_lead_keeps_what_it_was_involved_in():
    table, board, gate, spans, step, got = _host(rank=1, lead=False)
    table.extend([1, 2, 3])
    board.status[1] = board.status[2] = board.status[3] = KVPoll.Success
    gate.rooms.add(2)
    step()
    gate.rooms.clear()
    board.reasons[3] = FailureReason.TRANSFER_ERROR
    board.status[3] = KVPoll.Failed  # (fails on this rank: its origin)
    step()
    kept = {i.span.room for i in got if i.span.kind == "request"}
    assert kept == {2}  # 1: not involved; 3: succeeded before the failure came
    every = _host(rank=1, lead=False, selection=Selection("every"))
    every[0].extend([5])
    every[1].status[5] = KVPoll.Success
    every[4]()
    assert {i.span.room for i in every[5]} == {5}


def test_close_ends_the_open_attempts_as_live():
    table, board, gate, spans, step, got = _host()
    table.extend([4])
    board.status[4] = KVPoll.WaitingForInput
    step()
    (request, *_) = spans.close()
    assert request.span.attributes["pdlife.outcome"] == "live"


@pytest.mark.parametrize(
    "bad",
    [None, 7, "", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331", "01-" + HOST[3:],
     "00-" + "0" * 32 + "-b7ad6b7169203331-01", HOST.upper()],
)  # fmt: skip
def test_a_bad_traceparent_is_refused_by_name(bad):
    spans = _host()[3]
    with pytest.raises(InvalidArgument, match="traceparent"):
        spans.parent(1, bad)
    assert spans._parents == {}


@pytest.mark.parametrize(("kw", "name"), [({"side": "middle"}, "side"), ({"side": None}, "side")])
def test_bad_arguments_are_refused_by_name(kw, name):
    args = {"side": "decode", "rank": 0, "run": "r", **kw}
    with pytest.raises(InvalidArgument, match=name):
        LiveSpans(**args)


def test_the_live_export_hands_the_sdk_s_spans_to_a_processor():
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdlife.spans.otel import LiveExport

    exporter = InMemorySpanExporter()
    table, board, gate, spans, step, got = _host(take=False)
    export = LiveExport(spans, SimpleSpanProcessor(exporter), "run-1", interval=3600)
    table.extend([3, 4])
    board.status[3] = KVPoll.Success
    board.status[4] = KVPoll.WaitingForInput
    step()
    assert exporter.get_finished_spans() == ()  # queued by the step, not yet taken
    assert export.flush() == 2
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == ["pdlife.request", "pdlife.status.Bootstrapping"]
    export.start()
    export.stop()  # room 4, still live, closed and handed over
    assert export.handed == 5  # (4: its request and its two statuses)
    (live,) = [
        s
        for s in exporter.get_finished_spans()
        if s.name == "pdlife.request" and s.attributes["pdlife.room"] == "4"
    ]
    assert live.attributes["pdlife.outcome"] == "live"
    with pytest.raises(InvalidArgument, match="interval"):
        LiveExport(spans, SimpleSpanProcessor(exporter), "run-1", interval=0)


def test_a_step_where_nothing_happened_hands_nothing_over():
    table, board, gate, spans, step, got = _host(take=False)
    table.extend([1, 2])
    step()
    step()
    assert len(spans._queue) == 0
    board.status[1] = KVPoll.WaitingForInput
    step()
    assert len(spans._queue) == 1


def test_a_queue_without_holds_lets_go_of_nothing_another_queue_holds():
    # one LiveSpans fed by two steppers (two queues of a rank): queue b's quiet
    # step must not end queue a's hold
    table, board, gate, spans, step, got = _host()
    other_table, other_board = RequestTable(rank=0), StatusBoard()
    other = Stepper(other_table, 0, poller=other_board, config=StepConfig())
    other.record_holds = True
    table.extend([7])
    board.status[7] = KVPoll.Success
    gate.rooms.add(7)
    step()
    other_table.extend([8])
    other_board.status[8] = KVPoll.WaitingForInput
    spans.observe("handshake", other.step(SingleRank(0)), other.last_holds())
    gate.rooms.clear()
    step()
    (request,) = [i for i in got + spans.take() if i.span.kind == "request" and i.span.room == 7]
    assert [e.name for e in request.span.events] == ["pdlife.gate.hold", "pdlife.gate.release"]
    assert [e.ts for e in request.span.events] == sorted(e.ts for e in request.span.events)
    release = request.span.events[1].ts
    assert release == request.span.end  # let go when it succeeded, not at queue b's step


def test_a_rank_that_is_not_an_integer_is_refused():
    with pytest.raises(InvalidArgument, match="rank"):
        LiveSpans("decode", "0", "r")


def test_what_is_kept_for_rooms_not_opened_is_bounded(monkeypatch):
    from pdlife.spans import live

    monkeypatch.setattr(live, "KEPT", 3)
    table, board, gate, spans, step, got = _host()
    table.extend([1, 2, 3, 4, 5], state=KVPoll.Transferring)  # (added there: no move yet)
    board.status.update({r: KVPoll.Success for r in (1, 2, 3, 4, 5)})
    gate.rooms.update({1, 2, 3, 4, 5})  # held before any of them moved (opened)
    step()
    assert len(spans._early) == 3 and 5 in spans._early  # the oldest forgotten


def test_a_failed_decode_attempt_waits_for_its_drain_when_the_host_has_one():
    table, board, gate, spans, step, got = _host(drains=("drain",))
    drain_table, drain_board = RequestTable(rank=0), StatusBoard()
    drain = Stepper(drain_table, 0, poller=drain_board, config=StepConfig())
    table.extend([9])
    board.status[9] = KVPoll.Failed
    board.reasons[9] = FailureReason.TRANSFER_ERROR
    step()
    assert got == []  # failed, its pages not drained yet: its span is still open
    drain_table.extend([9], state=KVPoll.Transferring)
    drain_board.status[9] = KVPoll.Success  # (its peer stopped writing)
    spans.observe("drain", drain.step(SingleRank(0)), {})
    request, *states = spans.take()
    assert [s.span.name for s in states][-1] == "pdlife.status.Draining"
    assert [e.name for e in request.span.events][-1] == "pdlife.released"
    assert request.span.attributes["pdlife.queues"] == "transfer,drain"
