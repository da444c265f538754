"""``pdlife replay DIR``: recompute a recorded run from its ranks' local
observations and say where it first differs (no torch, no process group)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pdlife.args import UsageError

__all__ = ["add_parser"]


def _replay(args: argparse.Namespace) -> int:
    from pdlife.trace import TraceError, replay

    try:
        report = replay(Path(args.dir))
    except TraceError as e:
        raise UsageError(f"replay {args.dir}", str(e)) from None
    if report.ok:
        print(f"replay: {report.steps_checked} collective steps recomputed; no difference")
        return 0
    d = report.first_difference or {}
    print(
        f"replay: first difference at step {d['step']} ({d['side']} {d['queue']} queue): {d['detail']}"
    )
    return 1


def add_parser(sub: Any) -> None:
    r = sub.add_parser("replay", help="recompute a recorded run from its local observations")
    r.add_argument("dir")
    r.set_defaults(func=_replay)
