"""A seeded run's spans (pdlife.spans; the run of tests/support/seeded_plan.py):
a staging gate held on prefill rank 1, a transfer error on prefill rank 0. Under an in-memory exporter the spans agree
with the trace; over OTLP/HTTP a collector on 127.0.0.1 receives them as the
wire format says (ExportTraceServiceRequest, decoded here, not mocked)."""

import http.server
import json
import os
import threading
from collections import defaultdict
from typing import ClassVar

import pytest
import zygote

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode

from lifecycle.status import KVPoll
from pdlife.spans import spans_of_records
from pdlife.spans.otel import export_run
from pdlife.spans.select import Selection, select
from pdlife.trace import read_trace
from support.seeded_plan import ARGS, FAILED, HELD, HOLDER, PEER, PLAN, rooms

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]


class Kept(InMemorySpanExporter):
    """Keeps its spans past the shutdown that ends an export."""

    def shutdown(self):
        pass


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    d = tmp_path_factory.mktemp("spans")
    (d / "plan.json").write_text(json.dumps(PLAN))
    args = [*ARGS, "--plan", str(d / "plan.json")]
    proc = zygote.run("simulate", "--backend", "fake", "--quiet", "--no-timeline", "--out",
                      str(d / "run"), *args)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    s = json.loads((d / "run" / "summary.json").read_text())
    assert s["faults_fired"] == 2
    return d / "run", rooms()


def _spans(run, volume):
    ex = Kept()
    n = export_run(run, ex, Selection(volume))
    spans = ex.get_finished_spans()
    assert n == len(spans) > 0
    return spans


def _room(s):
    return int(s.attributes["pdlife.room"]) if "pdlife.room" in s.attributes else None


def test_the_spans_say_what_the_trace_says(seeded):
    run, rooms = seeded
    spans = _spans(run, "every")
    by_id = {s.context.span_id: s for s in spans}
    requests = [s for s in spans if s.name == "pdlife.request"]
    assert {_room(s) for s in requests} == set(rooms)
    # the status spans, in order, are the trace's moves of each rank's request
    moves = defaultdict(list)
    for rec in read_trace(run):
        if rec["t"] == "tr" and rec["queue"] != "drain":
            moves[(rec["rank"], rec["room"])].append((KVPoll(rec["from"]).name, rec["trigger"]))
    children = defaultdict(list)
    for s in sorted(spans, key=lambda s: s.start_time):
        if s.parent is not None and s.name != "pdlife.status.Draining":
            req = by_id[s.parent.span_id]
            key = (req.attributes["pdlife.rank"], _room(req))
            children[key].append((s.name.rsplit(".", 1)[1], s.attributes["pdlife.ended_by"]))
    assert children == moves
    # one trace per room, every span of it in that trace
    trace_of = {}
    for s in spans:
        room = _room(s) if s.parent is None else _room(by_id[s.parent.span_id])
        assert trace_of.setdefault(room, s.context.trace_id) == s.context.trace_id
    assert len(set(trace_of.values())) == len(rooms)


def test_the_gate_and_the_failure_are_where_they_happened(seeded):
    run, rooms = seeded
    spans = _spans(run, "every")
    requests = [s for s in spans if s.name == "pdlife.request"]
    holds = [
        (s.attributes["pdlife.rank"], _room(s), dict(e.attributes))
        for s in requests
        for e in s.events
        if e.name == "pdlife.gate.hold"
    ]
    assert holds == [(HOLDER, rooms[HELD], {"pdlife.gate": "staging", "pdlife.rank": HOLDER})]
    failed = [s for s in requests if _room(s) == rooms[FAILED]]
    assert {s.attributes["pdlife.side"] for s in failed} == {"prefill", "decode"}
    for s in failed:  # the agreed reason and origin, on every rank of a side alike
        assert s.status.status_code is StatusCode.ERROR
        assert s.attributes["error.type"] == "transfer_error"
    origins = {(s.attributes["pdlife.side"], s.attributes["pdlife.origin_rank"]) for s in failed}
    assert ("prefill", PEER) in origins and len(origins) == 2  # one per side
    fired = {
        s.attributes["pdlife.rank"] for s in failed for e in s.events if e.name == "pdlife.failure"
    }
    assert fired == {o for _, o in origins}  # on its origin rank only
    assert all(
        s.status.status_code is StatusCode.UNSET for s in requests if _room(s) != rooms[FAILED]
    )


def test_decode_links_to_prefill_and_the_default_volume_keeps_who_matters(seeded):
    run, rooms = seeded
    spans = _spans(run, "involved")
    ids = {s.context.span_id: s for s in spans}
    requests = [s for s in spans if s.name == "pdlife.request"]
    kept = defaultdict(set)
    for s in requests:
        kept[(_room(s), s.attributes["pdlife.side"])].add(s.attributes["pdlife.rank"])
        if s.attributes["pdlife.side"] == "decode":
            (link,) = s.links
            target = ids[link.context.span_id]  # prefill's lead's span, exported too
            assert (target.name, target.attributes["pdlife.side"]) == ("pdlife.request", "prefill")
            assert (_room(target), target.context.trace_id) == (_room(s), s.context.trace_id)
    for room in rooms:  # each side's lead, always
        assert min(kept[(room, "prefill")]) == 0 and min(kept[(room, "decode")]) == 2
    assert kept[(rooms[HELD], "prefill")] == {0, HOLDER}  # it held a gate
    assert PEER in kept[(rooms[FAILED], "prefill")]  # its transfer broke
    quiet = [r for r in rooms if r not in (rooms[HELD], rooms[FAILED])]
    assert all(kept[(r, "prefill")] == {0} and kept[(r, "decode")] == {2} for r in quiet)


class _Collector(http.server.BaseHTTPRequestHandler):
    bodies: ClassVar[list] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).bodies.append((self.path, self.headers["Content-Type"], body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def collector():
    """An OTLP/HTTP collector on 127.0.0.1, on a port the OS picks as it binds."""
    _Collector.bodies = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", _Collector.bodies
    server.shutdown()
    server.server_close()


def _received(bodies):
    spans = []
    for path, ctype, body in bodies:
        assert (path, ctype) == ("/v1/traces", "application/x-protobuf")
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        for rs in req.resource_spans:
            res = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                assert ss.scope.name == "pdlife.spans"
                spans += [(res, s) for s in ss.spans]
    return spans


def _env(**more):
    env = dict(os.environ, **more)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def test_trace_export_sends_the_wire_format_to_a_collector(seeded, collector):
    run, rooms = seeded
    url, bodies = collector
    proc = zygote.run("trace", "export", "--otlp", str(run), "--endpoint", url, env=_env())
    assert proc.returncode == 0, proc.stderr
    got = _received(bodies)
    n = int(proc.stdout.split("trace export: ")[1].split()[0])
    assert len(got) == n == len(_spans(run, "involved"))
    names = {s.name for _, s in got}
    assert {"pdlife.request", "pdlife.status.Transferring"} <= names
    fail = [
        (res, s)
        for res, s in got
        if s.name == "pdlife.request"
        and any(
            a.key == "error.type" and a.value.string_value == "transfer_error" for a in s.attributes
        )
    ]
    assert fail and all(s.status.code == 2 for _, s in fail)  # STATUS_CODE_ERROR
    assert {res["service.instance.id"] for res, _ in fail} >= {f"prefill rank {PEER}"}
    decode = [
        s
        for res, s in got
        if s.name == "pdlife.request" and res["service.instance.id"].startswith("decode")
    ]
    ids = {s.span_id for _, s in got}
    assert all(len(s.links) == 1 and s.links[0].span_id in ids for s in decode)
    assert all(len(s.trace_id) == 16 and len(s.span_id) == 8 for _, s in got)


def test_simulate_sends_its_spans_after_the_run(tmp_path, collector):
    url, bodies = collector
    out = tmp_path / "run"
    proc = zygote.run(
        "simulate", "--backend", "fake", "--quiet", "--no-timeline", "--out", str(out),
        "--requests", "8", "--otlp-traces-endpoint", url, env=_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = _received(bodies)
    assert f"{len(got)} spans sent to {url}" in proc.stdout
    rooms = {
        a.value.string_value
        for _, s in got
        if s.name == "pdlife.request"
        for a in s.attributes
        if a.key == "pdlife.room"
    }
    assert len(rooms) == 8


def test_a_collector_that_is_not_there_is_one_line(seeded, tmp_path):
    run, _ = seeded
    import socket

    with socket.socket() as s:  # a port bound and not listening: refused at once
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1/traces"
        env = _env(OTEL_EXPORTER_OTLP_TRACES_TIMEOUT="2")  # the exporter's retries: 2 s
        proc = zygote.run(
            "trace", "export", "--otlp", str(run), "--endpoint", url, env=env, timeout=60
        )
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "did not take the spans" in line and "Traceback" not in proc.stderr


def test_trace_spans_prints_a_rooms_tree(seeded):
    run, rooms = seeded
    proc = zygote.run("trace", "spans", str(run), "--room", str(rooms[HELD]), timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"room {rooms[HELD]} (trace ")
    assert sum(f"gate.hold: gate staging, rank {HOLDER}" in x for x in lines) == 1
    assert any(f"prefill rank {HOLDER} attempt 1: Success" in x for x in lines)
    assert any("decode rank 2 attempt 1: Success" in x and "linked to prefill" in x for x in lines)
    proc = zygote.run("trace", "spans", str(run), "--room", str(rooms[FAILED]), timeout=60)
    assert (
        f"prefill rank {PEER} attempt 1: Failed (transfer_error, origin rank {PEER})" in proc.stdout
    )
    assert zygote.run("trace", "spans", str(run), "--room", "77", timeout=60).returncode == 1


def _shapes(spans):
    """(rank, room, attempt) -> (outcome, error, events, queues, status spans in order)."""
    out = {}
    for s in sorted(spans, key=lambda s: s["index"]):
        k = (s["rank"], s["room"], s["attempt"])
        req, kids = out.get(k, (None, []))
        if s["kind"] == "request":
            events = tuple(e for e in s["events"] if e != "pdlife.leg")  # (live: no legs)
            a = s["attributes"]
            req = (a["pdlife.outcome"], s["error"], events, a["pdlife.queues"])
        else:
            kids = [*kids, s["name"]]
        out[k] = (req, kids)
    return out


def _as_records(items):
    return [
        {"kind": i.span.kind, "index": i.span.index, "rank": i.span.rank, "room": i.span.room,
         "attempt": i.span.attempt, "name": i.span.name, "error": i.span.error,
         "events": [e.name for e in i.span.events], "attributes": dict(i.span.attributes)}
        for i in items
    ]  # fmt: skip


@pytest.mark.parametrize("backend", ["fake", "mooncake"])
def test_live_spans_of_a_run_are_its_traces_spans(tmp_path, backend):
    """``pdlife simulate --live-spans``: each rank's steps fed to live spans as
    a host engine feeds them. With retries, failures, aborts, the seeded gate
    hold and transfer error, two queues a side and decode's drain, every
    attempt's spans say what the trace's say: outcome, reason, events, queues
    and status spans in order."""
    if backend != "fake":
        from engines import require

        backend = require(backend)
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    out = tmp_path / "run"
    proc = zygote.run("simulate", "--backend", backend, "--quiet", "--no-timeline", "--out",
                      str(out), "--requests", "60", "--fail-prob", "0.1", "--abort-prob",
                      "0.05", "--recovery", "retry", "--live-spans", "--plan",
                      str(tmp_path / "plan.json"), timeout=180)  # fmt: skip
    s = json.loads((out / "summary.json").read_text())
    assert s["retries"] > 0 and sum(s["failed"].values()) > 0, s
    live = [
        x
        for p in sorted((out / "ranks").glob("rank*.spans.json"))
        for x in json.loads(p.read_text())
    ]
    built = _as_records(select(spans_of_records(read_trace(out)), "run", Selection("every")))
    assert len(live) == len(built) > 0, proc.stderr[-2000:]
    assert _shapes(live) == _shapes(built)
    retried = [x for x in live if x["kind"] == "request" and x["attempt"] > 1]
    assert retried and all("pdlife.recovery" in x["events"] for x in retried)
