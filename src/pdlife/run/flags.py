"""The flags of ``pdlife simulate`` (checked together in :mod:`pdlife.run.config`)."""

from __future__ import annotations

import argparse
from typing import Any

from pdlife.args import nonneg_int, port, positive_int, probability, seconds
from pdlife.cluster.plan_doc import MAX_PAUSE_S, MODES

__all__ = ["MAX_STEPS", "RequestsAction", "add_arguments", "outage"]

MAX_STEPS = 3000


class RequestsAction(argparse.Action):
    """Records that --requests was given (a soak refuses it)."""

    def __call__(self, parser: Any, ns: argparse.Namespace, values: Any, opt: Any = None) -> None:
        ns.requests = values
        ns.requests_given = True


def outage(text: str) -> tuple[int, int, float]:
    """``RANK:STEP:SECONDS`` of --peer-outage."""
    parts = text.split(":")
    try:
        if len(parts) != 3:
            raise ValueError
        rank, step, secs = int(parts[0]), int(parts[1]), float(parts[2])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not RANK:STEP:SECONDS, e.g. 0:20:3 (prefill rank 0 stops at step "
            "20 for 3 s)"
        ) from None
    if rank < 0 or step < 1 or not 0 < secs <= MAX_PAUSE_S:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the rank must be >= 0, the step >= 1 and the seconds in "
            f"(0, {MAX_PAUSE_S:g}]"
        )
    return rank, step, secs


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of ``pdlife simulate``."""
    p.add_argument(
        "--prefill-tp",
        "--prefill",
        dest="prefill",
        type=positive_int,
        default=2,
        help="prefill TP size: ranks per prefill DP group",
    )
    p.add_argument(
        "--decode-tp",
        "--decode",
        dest="decode",
        type=positive_int,
        default=2,
        help="decode TP size (ranks)",
    )
    p.add_argument(
        "--prefill-dp",
        type=positive_int,
        default=1,
        help="prefill DP groups, each its own TP group; request i goes to group i %% N",
    )
    p.add_argument("--mla", action="store_true", help="MLA: one latent KV head on every rank")
    p.add_argument(
        "--kv-heads",
        type=positive_int,
        help="the model's KV heads, split over each side's TP ranks (default 2 x the larger TP)",
    )
    p.add_argument("--page-size", type=positive_int, default=1, help="tokens per KV page")
    p.add_argument(
        "--state",
        action="store_true",
        help="a hybrid model: a mamba-like state row per request moves with its pages",
    )
    p.add_argument(
        "--state-split",
        action="store_true",
        help="with --state: TP splits the state rows as it splits a mamba state's heads "
        "(each rank holds its share; decode assembles its share from every prefill rank "
        "holding part of it)",
    )
    p.add_argument(
        "--live-spans",
        action="store_true",
        help="feed each rank's steps to live spans as a host engine would "
        "(pdlife.spans.live); written to OUT/ranks/rankR.spans.json",
    )
    p.add_argument(
        "--staging",
        action="store_true",
        help="decode lands head-sliced KV in a staging buffer, then scatters it",
    )
    p.add_argument(
        "--staging-pages",
        type=positive_int,
        help="pages per staging region (default: the largest request)",
    )
    p.add_argument(
        "--prefix-pages",
        type=nonneg_int,
        default=0,
        metavar="K",
        help="decode already holds the first K pages of every longer request (a cached prefix)",
    )
    p.add_argument(
        "--max-pages-per-request",
        type=positive_int,
        default=32,
        help="requests have 1..this many pages",
    )
    p.add_argument("--requests", type=positive_int, default=200, action=RequestsAction)
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument(
        "--fail-prob",
        type=probability,
        default=0.0,
        help="per rank and request (phase mode) or per rank, request and step (step mode)",
    )
    p.add_argument("--abort-prob", type=probability, default=0.02, help="client aborts per request")
    p.add_argument(
        "--recovery",
        choices=("fail", "retry", "recompute"),
        default="fail",
        help="what a failed request leads to (docs/recovery.md): fail; retry what a new "
        "attempt can cure at the next epoch; recompute it locally on decode",
    )
    p.add_argument(
        "--max-attempts",
        type=positive_int,
        default=3,
        help="with --recovery retry: attempts in all per request",
    )
    p.add_argument(
        "--corrupt-prob",
        type=probability,
        default=0.0,
        help="per request: decode flips one byte of its committed KV before the check "
        "(byte-moving backends); --digest catches it",
    )
    p.add_argument(
        "--digest",
        action="store_true",
        help="the connector checks each leg's KV digest before Success",
    )
    p.add_argument(
        "--fault-mode",
        choices=MODES,
        default="phase",
        help="phase: faults and aborts keyed to a request's phase, the same on every run "
        "and backend; step: drawn per step (soak-style noise). A plan's mode wins",
    )
    p.add_argument("--plan", help="fault plan (.json or .toml)")
    p.add_argument("--kill-rank", type=nonneg_int, help="kill this rank (a targeted fault)")
    p.add_argument("--kill-step", type=positive_int, help="with --kill-rank; default 5")
    p.add_argument(
        "--pause-rank",
        type=nonneg_int,
        help="stop this rank's whole process for --pause-seconds at --pause-step (a "
        "targeted fault: a long GC pause or a starved host; its heartbeats stop too)",
    )
    p.add_argument("--pause-step", type=positive_int, help="default 5")
    p.add_argument(
        "--peer-outage",
        type=outage,
        metavar="RANK:STEP:SECONDS",
        help="a transient outage of prefill rank RANK from step STEP for SECONDS (its "
        "process stops: decode declares it dead, then it comes back); see docs/recovery.md",
    )
    p.add_argument("--pause-seconds", type=seconds, help=f"default 3, at most {MAX_PAUSE_S:g}")
    p.add_argument("--backend", default="auto", help="auto | fake | mooncake | nixl")
    p.add_argument("--max-steps", type=positive_int, default=MAX_STEPS)
    p.add_argument(
        "--soak",
        type=seconds,
        metavar="SECONDS",
        help="keep admitting requests this long; samples RSS per rank into summary.json",
    )
    p.add_argument("--timeout", type=seconds, default=110.0, help="wall-clock limit (after --soak)")
    p.add_argument("--pg-timeout", type=seconds, default=15.0, help="collective timeout per rank")
    p.add_argument(
        "--waiting-timeout",
        type=seconds,
        metavar="SECONDS",
        help="a real transport's decode fails a request (waiting timeout) whose KV has not "
        "all arrived this long after its metadata row was sent; default 10 (the fake "
        "backend counts 200 steps instead)",
    )
    p.add_argument("--out", default="pdlife-out")
    p.add_argument(
        "--metrics-port",
        type=port,
        help="serve Prometheus metrics: rank r on this port + r; 0: each on a free port, "
        "written to OUT/ranks/rankR.metrics_port",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="after the run, send its requests' spans to this OTLP/HTTP collector "
        "(http://host:4318/v1/traces; the otel extra); `pdlife trace export --otlp` "
        "sends a finished run's",
    )
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help="diff two runs' per-request outcomes (run directories or summary.json files)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--timeline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="draw OUT/timeline.png (matplotlib, about half a second)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="the transfer engines' own log lines on the terminal (else in OUT/ranks/*.engine.log)",
    )
    p.add_argument(
        "--role",
        choices=["prefill", "decode"],
        help="under torchrun: the side this node's ranks serve (default: by rank)",
    )
