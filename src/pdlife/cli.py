"""The ``pdlife`` command line.

Exit status: 0 success, 1 a run that failed (or outcomes that differ),
2 a bad argument or input file. Every error is one line on stderr naming the
argument or file and what to do; set ``PDLIFE_DEBUG=1`` for a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from lifecycle.status import Role

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _diagram(args: argparse.Namespace) -> int:
    from lifecycle.rules.diagram import render

    if args.protocol:
        from transport.connector.core.graph import diagram
        from transport.connector.core.legs import leg_diagrams

        sys.stdout.write(diagram(args.format) + leg_diagrams(args.format))
        return 0
    role = Role.SENDER if args.role == "sender" else Role.RECEIVER
    sys.stdout.write(render(role, args.format))
    return 0


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given the command line, with only the command it names
    (and what that command's module adds), so that e.g. ``pdlife replay``
    never loads the simulator. Every command for ``--help`` or none named."""
    p = _Parser(
        prog="pdlife", description="KV-cache transfer lifecycle tooling for PD disaggregation"
    )
    sub: Any = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    d = sub.add_parser("diagram", help="print the request state diagram")
    d.add_argument("--role", choices=["sender", "receiver"], default="sender")
    d.add_argument("--format", choices=["mermaid", "dot"], default="mermaid")
    d.add_argument(
        "--protocol",
        action="store_true",
        help="the connector's per-request protocol and its legs instead",
    )
    d.set_defaults(func=_diagram)

    from pdlife import COMMANDS, register_commands

    named = [a for a in argv or () if not a.startswith("-")][:1]
    known = named and (named[0] in COMMANDS or named[0] in sub.choices)  # (diagram: here)
    register_commands(sub, named if known else None)
    return p


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # a bad flag (one line written, 2) or --help (0)
        return e.code if isinstance(e.code, int) else 2
    from lifecycle.errors import FaultPlanError
    from pdlife.args import UsageError
    from transport.errors import TransportError

    try:
        rc: int = args.func(args)
    except (UsageError, FaultPlanError, TransportError) as e:
        if os.environ.get("PDLIFE_DEBUG"):
            raise
        sys.stderr.write(f"pdlife {args.command}: error: {_one_line(e)}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"pdlife {args.command}: interrupted\n")
        return 130
    except Exception as e:  # a defect or the environment: still one line
        if os.environ.get("PDLIFE_DEBUG"):
            raise
        sys.stderr.write(
            f"pdlife {args.command}: failed: {type(e).__name__}: {_one_line(e)} "
            "(set PDLIFE_DEBUG=1 for the traceback)\n"
        )
        return 1
    return rc


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
