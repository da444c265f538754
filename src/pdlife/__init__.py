"""Tooling on top of the core (simulator, replay, benchmarks). The core never
imports this package; it may import everything, transports included."""

from __future__ import annotations

from typing import Any

__all__ = ["register_commands"]


def register_commands(sub: Any) -> None:
    """Add the tooling subcommands to the ``pdlife`` parser."""
    from pdlife.bench import engine_memory
    from pdlife.bench import step as bench
    from pdlife.bench import transfer as bench_transfer
    from pdlife.run import simulate

    simulate.add_parser(sub)
    bench.add_parser(sub)
    bench_transfer.add_parser(sub)
    engine_memory.add_parser(sub)
