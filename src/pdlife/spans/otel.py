"""The selected spans as OpenTelemetry spans, handed to an exporter (the
``otel`` extra: opentelemetry-api, -sdk and -exporter-otlp-proto-http).

Each span is built whole from its recorded times (an SDK ``ReadableSpan``),
so its ids are the derived ones of :mod:`pdlife.spans.select` and its times
are the ranks' own. Each rank is a resource of its own (``service.name``
``pdlife``, ``service.instance.id`` its side and rank, ``pdlife.run``).
A failed request's span has status ERROR, ``error.type`` its agreed reason.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdlife.spans.build import spans_of_records
from pdlife.spans.live import LiveSpans
from pdlife.spans.model import SpanData
from pdlife.spans.select import Identified, Selection, select

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = [
    "MissingExtra",
    "export_run",
    "LiveExport",
    "otlp_exporter",
    "readable_spans",
    "run_id",
]

logger = logging.getLogger(__name__)

#: seconds the OTLP exporter waits for its collector
OTLP_TIMEOUT_S = 10.0


class MissingExtra(ImportError):
    """OpenTelemetry is not installed."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what} needs OpenTelemetry: install the otel extra (pip install 'pd-lifecycle[otel]')"
        )


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def readable_spans(items: Sequence[Identified], run: str) -> list[ReadableSpan]:
    """The SDK's spans of ``items`` (ids, times, events, links and status as recorded)."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
    except ImportError:
        raise MissingExtra("exporting spans") from None
    from lifecycle import __version__

    scope = InstrumentationScope("pdlife.spans", __version__)
    sampled = TraceFlags(TraceFlags.SAMPLED)
    resources: dict[tuple[str, int], Resource] = {}
    out = []
    for it in items:
        s: SpanData = it.span
        res = resources.get((s.side, s.rank))
        if res is None:
            res = resources[(s.side, s.rank)] = Resource.create(
                {
                    "service.name": "pdlife",
                    "service.instance.id": f"{s.side} rank {s.rank}",
                    "pdlife.run": run,
                }
            )
        ctx = SpanContext(it.trace_id, it.span_id, is_remote=False, trace_flags=sampled)
        parent = (
            None
            if it.parent_id is None
            else SpanContext(it.trace_id, it.parent_id, is_remote=False, trace_flags=sampled)
        )
        links = [
            Link(SpanContext(t, p, is_remote=True, trace_flags=sampled), {"pdlife.link": "prefill"})
            for t, p in it.links
        ]
        events = [Event(e.name, dict(e.attributes), _ns(e.ts)) for e in s.events]
        status = Status(StatusCode.ERROR, s.error) if s.error else Status(StatusCode.UNSET)
        out.append(
            ReadableSpan(
                s.name,
                context=ctx,
                parent=parent,
                resource=res,
                attributes=dict(s.attributes),
                events=events,
                links=links,
                kind=SpanKind.INTERNAL,
                status=status,
                start_time=_ns(s.start),
                end_time=_ns(max(s.end, s.start)),
                instrumentation_scope=scope,
            )
        )
    return out


class LiveExport:
    """A :class:`~pdlife.spans.live.LiveSpans`' spans handed to ``processor``
    (the SDK's; a ``BatchSpanProcessor`` exports them on its own thread) from a
    thread of its own, every ``interval`` seconds: the step only queues what
    changed. :meth:`flush` hands over what is there now; :meth:`stop` closes
    the open attempts and hands them over too."""

    def __init__(
        self, spans: LiveSpans, processor: SpanProcessor, run: str, interval: float = 0.5
    ) -> None:
        import threading

        readable_spans([], run)  # (raises MissingExtra at once without the extra)
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0:
            from lifecycle.errors import InvalidArgument

            raise InvalidArgument("interval", interval, "seconds, more than 0")
        self.spans, self.processor, self.run, self.interval = spans, processor, run, interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pdlife-spans", daemon=True)
        self.handed = 0

    def start(self) -> LiveExport:
        self._thread.start()
        return self

    def _hand(self, items: list[Identified]) -> None:
        for span in readable_spans(items, self.run):
            self.processor.on_end(span)
        self.handed += len(items)

    def flush(self) -> int:
        """Hand over the spans of the attempts ended so far; how many."""
        with self._lock:
            items = self.spans.take()
            self._hand(items)
        return len(items)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except Exception:  # a span that cannot be made must not stop the rest
                logger.exception("live spans: handing spans to the processor failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            self._hand(self.spans.close())


def run_id(records: Iterable[dict[str, Any]]) -> str:
    """A run's id: the one its ranks agreed and wrote in their clock records
    (the one the metrics' exemplars derive trace ids from), else, for a trace
    from before that, the wall time its first rank started at."""
    clocks = [r for r in records if r.get("t") == "clock"]
    agreed = {str(r["run"]) for r in clocks if "run" in r}
    if len(agreed) == 1:
        return agreed.pop()
    walls = [float(r["wall"]) for r in clocks]
    return f"{min(walls):.6f}" if walls else "0"


def otlp_exporter(endpoint: str | None) -> SpanExporter:
    """The OTLP/HTTP (protobuf) exporter to ``endpoint`` (None: the standard
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise MissingExtra("--otlp") from None
    # the standard variables set the timeout where they are given
    given = {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"} & set(os.environ)
    timeout = None if given else OTLP_TIMEOUT_S
    exporter: SpanExporter = OTLPSpanExporter(endpoint=endpoint, timeout=timeout)
    return exporter


def export_run(directory: Path, exporter: SpanExporter, selection: Selection | None = None) -> int:
    """Export the spans of the finished run in ``directory``; how many. Raises
    :class:`ConnectionError` if the exporter reports a failure."""
    from opentelemetry.sdk.trace.export import SpanExportResult

    from pdlife.trace import read_trace

    records = list(read_trace(directory))
    run = run_id(records)
    spans = readable_spans(select(spans_of_records(records), run, selection), run)
    # the exporter's own retries and warnings stay in its logger, quiet unless asked
    quiet = logging.getLogger("opentelemetry")
    level = quiet.level
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        quiet.setLevel(logging.CRITICAL)
    try:
        for start in range(0, len(spans), 512):
            if exporter.export(spans[start : start + 512]) is not SpanExportResult.SUCCESS:
                raise ConnectionError(
                    f"the exporter refused {len(spans[start : start + 512])} spans"
                )
    finally:
        quiet.setLevel(level)
        exporter.shutdown()
    return len(spans)
