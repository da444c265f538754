"""Tooling on top of the core (simulator, replay, benchmarks). The core never
imports this package; it may import everything, transports included."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

__all__ = ["COMMANDS", "register_commands"]

#: each tooling subcommand -> the module whose ``add_parser(sub)`` adds it. A
#: command line loads only its own command's module: ``pdlife replay`` and
#: ``pdlife diagram`` never import torch (most of a short command's time).
COMMANDS: dict[str, str] = {
    "simulate": "pdlife.run.simulate",
    "replay": "pdlife.run.replay",
    "why": "pdlife.why",
    "trace": "pdlife.trace_export",
    "bench": "pdlife.bench.step",
    "bench-transfer": "pdlife.bench.transfer",
    "engine-memory": "pdlife.bench.engine_memory",
}
assert all(m.startswith("pdlife.") for m in COMMANDS.values()), "a command outside the tooling"


def register_commands(sub: Any, only: Iterable[str] | None = None) -> None:
    """Add the tooling subcommands to the ``pdlife`` parser: those in ``only``
    that are known (all of them if None)."""
    names = list(COMMANDS) if only is None else [n for n in COMMANDS if n in set(only)]
    for module in dict.fromkeys(COMMANDS[n] for n in names):  # each module once, in order
        importlib.import_module(module).add_parser(sub)
