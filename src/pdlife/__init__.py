"""Tooling on top of the core (simulator, replay, benchmarks). The core never
imports this package; it may import everything, transports included."""

from __future__ import annotations

from typing import Any

__all__ = ["register_commands"]


def register_commands(sub: Any) -> None:
    """Add the tooling subcommands to the ``pdlife`` parser."""
    from pdlife import bench, bench_transfer, engine_memory, simulate

    simulate.add_parser(sub)
    bench.add_parser(sub)
    bench_transfer.add_parser(sub)
    engine_memory.add_parser(sub)
