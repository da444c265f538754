"""OpenTelemetry spans of a run's requests (docs/observability.md).

:mod:`pdlife.spans.build` turns each rank's trace records into spans (no I/O)
made of the values in :mod:`pdlife.spans.model`,
:mod:`pdlife.spans.select` chooses whose spans leave and gives them their
derived ids and links, :mod:`pdlife.spans.otel` hands them to an
OpenTelemetry exporter (the ``otel`` extra), and :mod:`pdlife.spans.cli`
sends a finished run's spans over OTLP/HTTP; :mod:`pdlife.spans.tree` prints them.
"""

from pdlife.spans.build import SpanBuilder, spans_of_records
from pdlife.spans.model import SpanData, SpanEvent
from pdlife.spans.select import VOLUMES, Identified, Selection, select

__all__ = [
    "VOLUMES",
    "Identified",
    "Selection",
    "SpanBuilder",
    "SpanData",
    "SpanEvent",
    "select",
    "spans_of_records",
]
