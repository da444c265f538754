"""The ``pdlife`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lifecycle.status import Role

__all__ = ["main"]


def _diagram(args: argparse.Namespace) -> int:
    from lifecycle.diagram import protocol, render

    role = Role.SENDER if args.role == "sender" else Role.RECEIVER
    sys.stdout.write(protocol(args.format) if args.protocol else render(role, args.format))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdlife", description="KV-cache transfer lifecycle tooling for PD disaggregation"
    )
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("diagram", help="print the request state diagram")
    d.add_argument("--role", choices=["sender", "receiver"], default="sender")
    d.add_argument("--format", choices=["mermaid", "dot"], default="mermaid")
    d.add_argument(
        "--protocol", action="store_true", help="the connector's per-request protocol instead"
    )
    d.set_defaults(func=_diagram)

    from lifecycle.tools import register_commands

    register_commands(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
