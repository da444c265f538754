"""Prometheus metrics from step results (extra ``metrics``).

One :class:`LifecycleMetrics` per process; call :meth:`observe` with every
:class:`~lifecycle.core.step.StepResult`. Exposes, labelled by queue:

- ``pdlife_transitions_total{queue, from, to}``
- ``pdlife_failures_total{queue, reason}``
- ``pdlife_time_in_state_seconds{queue, state}`` (histogram, on leaving a state)
- ``pdlife_stuck_requests{queue}`` (requests reported stuck at the last step)
- ``pdlife_live_requests{queue, state}``
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lifecycle.reasons import FailureReason
from lifecycle.result import StepResult
from lifecycle.status import KVPoll

__all__ = ["LifecycleMetrics", "serve"]


class LifecycleMetrics:
    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        reg = registry if registry is not None else REGISTRY
        self.transitions = Counter(
            "pdlife_transitions", "Agreed status transitions", ["queue", "from", "to"], registry=reg
        )
        self.failures = Counter(
            "pdlife_failures",
            "Requests agreed Failed, by reason",
            ["queue", "reason"],
            registry=reg,
        )
        self.time_in_state = Histogram(
            "pdlife_time_in_state_seconds",
            "Time a request spent in a status before leaving it",
            ["queue", "state"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120, 300),
            registry=reg,
        )
        self.stuck = Gauge(
            "pdlife_stuck_requests", "Requests reported stuck", ["queue"], registry=reg
        )
        self.fenced = Gauge(
            "pdlife_fenced_kv_pages",
            "KV pages kept out of reuse for a writer that stopped beating",
            registry=reg,
        )
        self.live = Gauge(
            "pdlife_live_requests",
            "Live requests by agreed status",
            ["queue", "state"],
            registry=reg,
        )

    def observe(self, queue: str, result: StepResult) -> None:
        if result.changed.size:
            prev = result.previous.tolist()
            new = result.statuses[result.changed].tolist()
            for (a, b), n in zip(
                *np.unique(np.stack([prev, new], axis=1), axis=0, return_counts=True)
            ):
                self.transitions.labels(queue, KVPoll(int(a)).name, KVPoll(int(b)).name).inc(int(n))
            for a, d in zip(prev, result.dwell.tolist()):
                self.time_in_state.labels(queue, KVPoll(int(a)).name).observe(max(d, 0.0))
            for f in result.failures():
                self.failures.labels(queue, FailureReason(f.reason).label).inc()
        self.stuck.labels(queue).set(len(result.stuck))
        for state, n in result.counts.items():
            self.live.labels(queue, state.name).set(n)


def serve(port: int, host: str = "127.0.0.1") -> int:
    """Expose the default registry over HTTP (``/metrics``); the port it bound
    (``port`` 0: one the OS picked)."""
    from prometheus_client import start_http_server

    got = start_http_server(port, addr=host)
    server = got[0] if isinstance(got, tuple) else None
    return int(getattr(server, "server_port", port))
