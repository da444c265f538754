"""Sending a finished run's spans from the command line (``pdlife trace
export --otlp`` and ``pdlife simulate --otlp-traces-endpoint``): every
failure is one line naming the argument."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DEFAULT_ENDPOINT", "check", "send"]

#: where the OTLP/HTTP exporter sends without an endpoint or variable
DEFAULT_ENDPOINT = "http://localhost:4318/v1/traces"


def _where(endpoint: str | None) -> str:
    if endpoint:
        return endpoint
    env = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if env:
        return env
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return base.rstrip("/") + "/v1/traces" if base else DEFAULT_ENDPOINT


def check(endpoint: str | None, what: str) -> str:
    """Where the spans go, checked: a URL, and OpenTelemetry installed."""
    from pdlife.args import UsageError
    from pdlife.spans.otel import MissingExtra, otlp_exporter

    where = _where(endpoint)
    if not where.startswith(("http://", "https://")) or len(where.split("//", 1)[1]) < 1:
        raise UsageError(f"{what} {where}", "an OTLP/HTTP URL (http://host:4318/v1/traces)")
    try:
        otlp_exporter(where).shutdown()
    except MissingExtra as e:
        raise UsageError(what, str(e)) from None
    return where


def send(
    directory: Path, endpoint: str | None, volume: str, sample: float, what: str
) -> tuple[int, str]:
    """Send the run's spans; (how many, where to). :class:`UsageError` on any failure."""
    from pdlife.args import UsageError
    from pdlife.spans.otel import export_run, otlp_exporter
    from pdlife.spans.select import Selection
    from pdlife.trace import TraceError

    where = check(endpoint, what)
    exporter = otlp_exporter(where)
    try:
        n = export_run(directory, exporter, Selection(volume, sample))
    except TraceError as e:
        raise UsageError(str(directory), str(e)) from None
    except ConnectionError as e:
        raise UsageError(
            f"{what} {where}", f"the collector did not take the spans ({e}); is it running?"
        ) from None
    return n, where
