"""``pdlife trace export``: a finished run's traces in other formats: a
Chrome/Perfetto trace (:mod:`pdlife.perfetto`) or OpenTelemetry spans sent
over OTLP/HTTP (:mod:`pdlife.spans`). ``pdlife trace spans``: the spans of a
run (or of one room) as a tree on the terminal, no collector needed.
``pdlife trace picture``: a Chrome/Perfetto trace drawn as a PNG
(:mod:`pdlife.trace_picture`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["add_parser"]


def _perfetto(args: argparse.Namespace) -> int:
    from pdlife.args import UsageError
    from pdlife.perfetto import export
    from pdlife.trace import TraceError

    try:
        doc = export(Path(args.run))
    except TraceError as e:
        raise UsageError(f"trace export {args.run}", str(e)) from None
    out = Path(args.output or Path(args.run) / "trace.perfetto.json")
    try:
        out.write_text(json.dumps(doc, separators=(",", ":")))
    except OSError as e:
        raise UsageError("--output", f"cannot write {out} ({e.strerror})") from None
    n = len(doc["traceEvents"])
    print(
        f"trace export: {n} events in {out} (open it in ui.perfetto.dev; or pdlife trace picture)"
    )
    return 0


def _otlp(args: argparse.Namespace) -> int:
    from pdlife.spans.cli import send

    n, where = send(Path(args.run), args.endpoint, args.volume, args.sample, "--endpoint")
    print(f"trace export: {n} spans sent to {where}")
    return 0


def _spans(args: argparse.Namespace) -> int:
    from pdlife.args import UsageError
    from pdlife.spans import Selection, select, spans_of_records
    from pdlife.spans.tree import lines
    from pdlife.trace import TraceError, read_trace

    try:
        records = list(read_trace(Path(args.run)))
        items = select(spans_of_records(records), "run", Selection(args.volume))
    except TraceError as e:
        raise UsageError(f"trace spans {args.run}", str(e)) from None
    if args.room is not None:
        items = [i for i in items if i.span.room == args.room]
        if not items:
            print(f"room {args.room}: no span in {args.run} (not a room of this run?)")
            return 1
    for line in lines(items):
        print(line)
    return 0


def _picture(args: argparse.Namespace) -> int:
    from pdlife.args import UsageError

    src = Path(args.trace)
    try:
        doc = json.loads(src.read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
            raise ValueError("no traceEvents list")
    except OSError as e:
        raise UsageError("TRACE", f"cannot read {src} ({e.strerror})") from None
    except (ValueError, RecursionError) as e:
        why = "nested too deep" if isinstance(e, RecursionError) else e
        raise UsageError("TRACE", f"{src} is not a trace-event JSON file ({why})") from None
    try:
        from pdlife.trace_picture import draw
    except ImportError:  # pragma: no cover (matplotlib: the plot extra)
        raise UsageError("trace picture", "needs matplotlib: install the plot extra") from None
    out = Path(args.output or src.with_suffix(".png"))
    if not out.parent.is_dir():
        raise UsageError("--output", f"{out.parent} is not a directory")
    try:
        rooms = draw(doc, out, args.rooms)
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError("TRACE", f"{src}: an event this picture cannot read ({e!r})") from None
    print(f"trace picture: {len(rooms)} room(s) drawn in {out}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from pdlife.args import UsageError

    if args.output and args.otlp:
        raise UsageError("--output", "writes the Perfetto trace; spans go to --endpoint")
    if not args.otlp and (args.endpoint, args.volume, args.sample) != (None, "involved", 1.0):
        raise UsageError("--endpoint/--volume/--sample", "choose the spans: add --otlp")
    return _otlp(args) if args.otlp else _perfetto(args)


def add_parser(sub: Any) -> None:
    from pdlife.args import positive_int, probability
    from pdlife.spans.select import VOLUMES

    t = sub.add_parser("trace", help="a finished run's traces in other formats")
    tsub = t.add_subparsers(dest="trace_command", required=True, parser_class=type(t))
    e = tsub.add_parser(
        "export", help="write a run's traces as a Chrome/Perfetto trace, or send them as spans"
    )
    what = e.add_mutually_exclusive_group(required=True)
    what.add_argument("--perfetto", action="store_true", help="the trace-event JSON")
    what.add_argument(
        "--otlp", action="store_true", help="OpenTelemetry spans over OTLP/HTTP (the otel extra)"
    )
    e.add_argument("run", help="the run's --out directory (pdlife simulate)")
    e.add_argument("-o", "--output", help="where to write it (default RUN/trace.perfetto.json)")
    e.add_argument(
        "--endpoint",
        help="the collector's OTLP/HTTP traces URL (default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "
        "OTEL_EXPORTER_OTLP_ENDPOINT, else http://localhost:4318/v1/traces)",
    )
    e.add_argument(
        "--volume",
        choices=list(VOLUMES),
        default="involved",
        help="whose spans: " + "; ".join(f"{k}: {v}" for k, v in VOLUMES.items()),
    )
    e.add_argument(
        "--sample", type=probability, default=1.0, help="the share of rooms traced (default 1)"
    )
    e.set_defaults(func=_export)
    sp = tsub.add_parser("spans", help="print a run's spans (or one room's) as a tree")
    sp.add_argument("run", help="the run's --out directory (pdlife simulate)")
    sp.add_argument("--room", type=_room, help="only this room's spans")
    sp.add_argument("--volume", choices=list(VOLUMES), default="involved", help="whose spans")
    sp.set_defaults(func=_spans)
    pic = tsub.add_parser("picture", help="draw a Chrome/Perfetto trace (trace export) as a PNG")
    pic.add_argument("trace", help="the trace-event JSON (pdlife trace export --perfetto)")
    pic.add_argument("-o", "--output", help="the PNG (default: beside TRACE, .png)")
    pic.add_argument(
        "--rooms", type=positive_int, default=4, help="how many rooms to draw (default 4)"
    )
    pic.set_defaults(func=_picture)


def _room(text: str) -> int:
    try:
        room = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a room (an integer)") from None
    if not 1 <= room < 2**64:
        raise argparse.ArgumentTypeError(f"room {text} is out of range (1..2**64-1)")
    return room
