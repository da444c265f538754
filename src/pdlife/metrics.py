"""Prometheus metrics from step results (extra ``metrics``).

One :class:`LifecycleMetrics` per process; call :meth:`observe` with every
:class:`~lifecycle.core.step.StepResult`. Exposes, labelled by queue:

- ``pdlife_transitions_total{queue, from, to}``
- ``pdlife_failures_total{queue, reason}``
- ``pdlife_time_in_state_seconds{queue, state}`` (histogram, on leaving a state)
- ``pdlife_stuck_requests{queue}`` (requests reported stuck at the last step)
- ``pdlife_live_requests{queue, state}``
- ``pdlife_failures_by_origin_total{queue, reason, origin}``: the agreed
  origin rank of each failure (an exemplar names the room)
- ``pdlife_gate_holds_total{queue, gate, rank}``: requests a gate began to
  hold at Transferring on this rank (its poll said Success)
- ``pdlife_gate_hold_seconds{queue, gate}`` (histogram): how long a gate held
  a request, observed when it lets go (an exemplar names the room)
- ``pdlife_step_seconds{queue}`` (histogram): the step's own time, reduce
  included, as its caller measured it
- ``pdlife_kv_pages{side, state}``: KV pages held by live requests, quarantined
  for a peer still writing, or fenced on a silent writer
- ``pdlife_requests{side, state}``: a side's requests, its queues' live ones
  by agreed status, and its failed ones whose pages wait for the peer to stop
  writing (``quarantined``) or on a writer that stopped beating (``fenced``)
- ``pdlife_peer_legs_total{side, peer, outcome}``: legs that ended, by peer
  rank: ``done``, or the reason a failure was blamed on that peer
- ``pdlife_peer_leg_seconds{side, peer}`` (histogram): a leg's time from its
  page list to its end (an exemplar names the room)

Exemplars appear in the OpenMetrics exposition (``Accept:
application/openmetrics-text``), each naming the room of a failure or hold.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lifecycle.reasons import FailureReason
from lifecycle.result import StepResult
from lifecycle.status import KVPoll

__all__ = ["LifecycleMetrics", "serve"]


class LifecycleMetrics:
    """``run``: the run's id; given, each exemplar also carries the trace id of
    its room's spans (:func:`pdlife.spans.select.trace_id`)."""

    def __init__(self, registry: Any = None, run: str | None = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        self.run = run
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
        self.by_origin = Counter(
            "pdlife_failures_by_origin",
            "Requests agreed Failed, by reason and the rank the failure came from",
            ["queue", "reason", "origin"],
            registry=reg,
        )
        self.holds = Counter(
            "pdlife_gate_holds",
            "Requests a gate began to hold at Transferring on this rank",
            ["queue", "gate", "rank"],
            registry=reg,
        )
        self.hold_time = Histogram(
            "pdlife_gate_hold_seconds",
            "How long a gate held a request at Transferring on this rank",
            ["queue", "gate"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
            registry=reg,
        )
        self.step_time = Histogram(
            "pdlife_step_seconds",
            "A step's time, its reduce included",
            ["queue"],
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 1),
            registry=reg,
        )
        self.kv_pages = Gauge(
            "pdlife_kv_pages",
            "KV pages kept from reuse, by what keeps them",
            ["side", "state"],
            registry=reg,
        )
        self.side_requests = Gauge(
            "pdlife_requests",
            "A side's requests: live ones by agreed status, failed ones whose pages "
            "wait for their peer (quarantined) or on a silent writer (fenced)",
            ["side", "state"],
            registry=reg,
        )
        self.peer_legs = Counter(
            "pdlife_peer_legs",
            "Legs that ended, by peer rank: done, or the failure blamed on it",
            ["side", "peer", "outcome"],
            registry=reg,
        )
        self.peer_leg_time = Histogram(
            "pdlife_peer_leg_seconds",
            "A leg's time from its page list to its end, by peer rank",
            ["side", "peer"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
            registry=reg,
        )
        #: (queue, gate) -> room -> when its hold began
        self._held: dict[tuple[str, str], dict[int, float]] = {}

    def _exemplar(self, room: int) -> dict[str, str]:
        """An exemplar's labels: the room, and its trace id when the run is known."""
        if self.run is None:
            return {"room": str(room)}
        from pdlife.spans.select import trace_id

        return {"room": str(room), "trace_id": f"{trace_id(self.run, room):032x}"}

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
                reason = FailureReason(f.reason).label
                self.failures.labels(queue, reason).inc()
                by = self.by_origin.labels(queue, reason, str(f.origin))
                by.inc(exemplar=self._exemplar(f.room))
        self.stuck.labels(queue).set(len(result.stuck))
        for state, n in result.counts.items():
            self.live.labels(queue, state.name).set(n)

    def observe_holds(
        self,
        queue: str,
        rank: int,
        holds: Mapping[str, NDArray[np.uint64]],
        now: float | None = None,
    ) -> None:
        """A step's gate holds on this rank (``Stepper.last_holds()``): count the
        holds that began, time the ones that ended (a request no gate holds any
        more, or gone)."""
        now = time.monotonic() if now is None else now
        for key in {*self._held, *((queue, g) for g in holds)}:
            if key[0] != queue:
                continue
            was = self._held.get(key, {})
            rooms = holds.get(key[1])
            held = set() if rooms is None else set(np.asarray(rooms).tolist())
            began = held - was.keys()
            if began:
                self.holds.labels(queue, key[1], str(rank)).inc(len(began))
            for room in was.keys() - held:
                since = was.pop(room)
                exemplar = self._exemplar(room)
                self.hold_time.labels(queue, key[1]).observe(now - since, exemplar=exemplar)
            for room in began:
                was[room] = now
            if was:
                self._held[key] = was
            else:
                self._held.pop(key, None)

    def observe_step_time(self, queue: str, seconds: float) -> None:
        self.step_time.labels(queue).observe(seconds)

    def observe_pages(self, side: str, pages: Mapping[str, int]) -> None:
        """KV pages by state (``held``, ``quarantined``, ``fenced``)."""
        for state, n in pages.items():
            self.kv_pages.labels(side, state).set(n)

    def observe_requests(self, side: str, counts: Mapping[str, int]) -> None:
        """A side's requests by state (the agreed statuses' names, ``quarantined``,
        ``fenced``)."""
        for state, n in counts.items():
            self.side_requests.labels(side, state).set(n)

    def observe_peer_legs(self, side: str, ended: Iterable[Any]) -> None:
        """Legs that ended (:class:`transport.connector.peer_legs.LegEnded`)."""
        for e in ended:
            peer = str(e.peer)
            self.peer_legs.labels(side, peer, e.outcome).inc()
            if e.seconds is not None:
                exemplar = self._exemplar(e.room)
                self.peer_leg_time.labels(side, peer).observe(e.seconds, exemplar=exemplar)


def serve(port: int, host: str = "127.0.0.1") -> int:
    """Expose the default registry over HTTP (``/metrics``); the port it bound
    (``port`` 0: one the OS picked)."""
    from prometheus_client import start_http_server

    got = start_http_server(port, addr=host)
    server = got[0] if isinstance(got, tuple) else None
    return int(getattr(server, "server_port", port))
