"""``pdlife simulate``: a local PD cluster under a fault plan, checked live.

The launcher hosts a ``TCPStore`` (rendezvous, heartbeats, progress), spawns
one process per rank (gloo on 127.0.0.1), waits with a deadline, then merges
the ranks' results into ``summary.json``, a summary table, a timeline PNG and
the mermaid diagram. Under ``torchrun`` the same command runs as one rank of
an env:// group and rank 0 merges.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from lifecycle.reasons import FailureReason
from lifecycle.status import Role
from lifecycle.tools.plan import FaultPlan, TargetedFault, load_plan
from lifecycle.tools.sim import SimConfig, run_rank

__all__ = ["add_parser", "simulate", "summarize", "pick_backend"]


def pick_backend(requested: str) -> tuple[str, str]:
    """(backend, why) -- ``auto`` takes Mooncake when it is installed and works here."""
    if requested != "auto":
        return requested, "requested"
    try:
        from transport.registry import get_backend

        get_backend("mooncake")
        return "mooncake", "Mooncake transfer engine found"
    except Exception as e:
        return "fake", f"Mooncake not usable here ({type(e).__name__}: {str(e)[:80]})"


def _worker(cfg: SimConfig, rank: int, out: str, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    store = TCPStore(
        "127.0.0.1", port, cfg.world + 1, is_master=False, timeout=timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo",
        store=PrefixStore("pg", store),
        rank=rank,
        world_size=cfg.world,
        timeout=timedelta(seconds=cfg.pg_timeout),
    )
    groups = {
        "prefill": dist.new_group(list(range(cfg.prefill))),
        "decode": dist.new_group(list(range(cfg.prefill, cfg.world))),
    }
    result = run_rank(cfg, rank, Path(out), store, groups, ("127.0.0.1", port))
    if result["error"]:
        sys.stderr.write(result["error"] + "\n")
        os._exit(3)
    dist.destroy_process_group()


def _progress(store: Any, total: int, start: float) -> None:
    def get(key: str) -> int:
        try:
            return int(store.get(key).decode()) if store.check([key]) else 0
        except Exception:
            return 0

    done = min(get("progress/prefill"), get("progress/decode"))
    width = 30
    fill = int(width * done / max(total, 1))
    sys.stderr.write(
        f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} requests  {time.monotonic() - start:5.1f}s"
    )
    sys.stderr.flush()


def simulate(cfg: SimConfig, out: Path, timeout: float, progress: bool = True) -> int:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from lifecycle.testing.spawn import free_port

    out.mkdir(parents=True, exist_ok=True)
    for old in list((out / "trace").glob("*.jsonl")) + list((out / "ranks").glob("*.json")):
        old.unlink()
    port = free_port()
    store = TCPStore(
        "127.0.0.1",
        port,
        cfg.world + 1,
        is_master=True,
        timeout=timedelta(seconds=60),
        wait_for_workers=False,
    )
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(cfg, r, str(out), port)) for r in range(cfg.world)]
    start = time.monotonic()
    for p in procs:
        p.start()
    deadline = start + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if progress:
            _progress(store, cfg.requests, start)
        time.sleep(0.2)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    if progress:
        _progress(store, cfg.requests, start)
        sys.stderr.write("\n")
    exits = {r: p.exitcode for r, p in enumerate(procs)}
    summary = summarize(cfg, out, exits, hung, time.monotonic() - start)
    print_table(summary)
    return 0 if summary["ok"] else 1


def summarize(
    cfg: SimConfig, out: Path, exits: dict[int, int | None], hung: list[int], elapsed: float
) -> dict[str, Any]:
    ranks: dict[int, dict[str, Any]] = {}
    for r in range(cfg.world):
        path = out / "ranks" / f"rank{r}.json"
        if path.exists():
            ranks[r] = json.loads(path.read_text())
    by_side: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
    for _, res in sorted(ranks.items()):
        by_side[res["side"]].append(res)
    # end to end: Failed if either side failed it (decode's reason first), Success
    # only if both sides succeeded, otherwise unfinished
    from lifecycle.tools.sim import Workload

    final: dict[str, tuple[str, int]] = {}
    for room in map(str, Workload.make(cfg).rooms):
        seen = {
            side: results[0]["outcome"].get(room) for side, results in by_side.items() if results
        }
        failed_on = [
            o for side in ("decode", "prefill") if (o := seen.get(side)) and o[0] == "Failed"
        ]
        dec = seen.get("decode")
        if failed_on:
            final[room] = ("Failed", failed_on[0][1])
        elif dec and dec[0] == "Success":
            # delivered: decode holds the KV and the first token (prefill may have died since)
            final[room] = ("Success", FailureReason.NONE)
    failed = Counter(
        FailureReason(reason).label for status, reason in final.values() if status == "Failed"
    )
    aborted = failed.pop("aborted", 0)
    latency = np.concatenate([np.asarray(r["latency_us"]) for r in ranks.values()] or [np.zeros(1)])
    violations = [v for r in ranks.values() for v in r["violations"]]
    # every rank of a side must report the same outcome for every request
    disagreements = sum(r["disagreements"] for r in ranks.values())
    for side, results in by_side.items():
        for res in results[1:]:
            if res["outcome"] != results[0]["outcome"]:
                disagreements += 1
                violations.append(
                    f"{side} rank {res['rank']} ended with different outcomes than rank {results[0]['rank']}"
                )
    dead = sorted(r for r, code in exits.items() if code == 17)
    errors = [r["error"] for r in ranks.values() if r.get("error")]
    crashed = sorted(r for r, code in exits.items() if code not in (0, 17, 3) and r not in hung)
    summary: dict[str, Any] = {
        "requests": cfg.requests,
        "succeeded": sum(1 for s, _ in final.values() if s == "Success"),
        "failed": dict(sorted(failed.items())),
        "aborted": aborted,
        "disagreements": disagreements,
        # a rank that stopped on an error cannot have cleaned up: count the others
        "leaked_slots": sum(r["leaked_slots"] for r in ranks.values() if not r["error"]),
        "leaked_kv_pages": sum(r["leaked_kv_pages"] for r in ranks.values() if not r["error"]),
        "kv_bytes_verified": sum(r.get("bytes_checked", 0) for r in ranks.values()),
        "stuck": cfg.requests - len(final),
        "stuck_reports": sum(r["stuck_reports"] for r in ranks.values()),
        "steps": max((r["steps"] for r in ranks.values()), default=0),
        "step_latency_us": {
            "p50": round(float(np.percentile(latency, 50)), 1),
            "p99": round(float(np.percentile(latency, 99)), 1),
        },
        "backend": cfg.backend,
        "seed": cfg.seed,
        "ranks": {"prefill": cfg.prefill, "decode": cfg.decode},
        "faults_fired": sum(r["faults_fired"] for r in ranks.values()),
        "invariant_violations": violations,
        "dead_ranks": dead,
        "rank_errors": errors,
        "hung_ranks": hung,
        "crashed_ranks": crashed,
        "elapsed_s": round(elapsed, 2),
    }
    summary["ok"] = not (
        violations
        or disagreements
        or summary["leaked_slots"]
        or summary["leaked_kv_pages"]
        or dead
        or errors
        or hung
        or crashed
        or len(ranks) != cfg.world
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    from lifecycle.diagram import mermaid

    (out / "lifecycle.mmd").write_text(
        mermaid(Role.SENDER) + "\n%% ---- decode ----\n" + mermaid(Role.RECEIVER)
    )
    _timeline(out, ranks, cfg)
    return summary


def _timeline(out: Path, ranks: dict[int, dict[str, Any]], cfg: SimConfig) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        (out / "timeline.txt").write_text("install the 'plot' extra for timeline.png\n")
        return
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    names = ["Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success"]
    colors = ["#d62728", "#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c"]
    for ax, (side, first) in zip(axes, (("prefill", 0), ("decode", cfg.prefill))):
        res = ranks.get(first)
        ax.set_title(f"{side} rank {first}: live requests by agreed status")
        if not res or not res["counts"]:
            continue
        counts = np.asarray(res["counts"])
        steps = np.arange(1, len(counts) + 1)
        ax.stackplot(steps, counts[:, 1:5].T, labels=names[1:5], colors=colors[1:5], alpha=0.8)
        ax.plot(steps, counts[:, 5], color="black", lw=1, label="finished (cumulative)")
        for s in res["failure_steps"]:
            ax.axvline(s, color=colors[0], alpha=0.25, lw=0.8)
        ax.set_ylabel("requests")
    axes[0].legend(loc="upper right", fontsize=7)
    axes[1].set_xlabel("scheduler step (red lines: failures agreed)")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=90)
    plt.close(fig)


def print_table(s: dict[str, Any]) -> None:
    rows = [
        ("backend", s["backend"]),
        ("ranks", f"{s['ranks']['prefill']} prefill + {s['ranks']['decode']} decode"),
        ("requests", s["requests"]),
        ("succeeded", s["succeeded"]),
        ("failed", ", ".join(f"{k}: {v}" for k, v in s["failed"].items()) or "0"),
        ("aborted", s["aborted"]),
        ("disagreements", s["disagreements"]),
        ("leaked slots", s["leaked_slots"]),
        ("stuck", s["stuck"]),
        ("steps", s["steps"]),
        (
            "step latency us p50/p99",
            f"{s['step_latency_us']['p50']} / {s['step_latency_us']['p99']}",
        ),
        ("faults fired (targeted)", s["faults_fired"]),
        ("elapsed", f"{s['elapsed_s']} s"),
    ]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    for msg in s["rank_errors"]:
        print(f"  ERROR: {msg}")
    for r in s["hung_ranks"]:
        print(f"  ERROR: rank {r} hung and was killed")
    for r in s["crashed_ranks"]:
        print(f"  ERROR: rank {r} crashed")
    for r in s["dead_ranks"]:
        print(f"  rank {r} was killed by the fault plan")
    for v in s["invariant_violations"][:20]:
        print(f"  VIOLATION: {v}")
    print("  result: " + ("OK" if s["ok"] else "FAILED"))


def _config(args: argparse.Namespace) -> tuple[SimConfig, str]:
    plan = load_plan(args.plan) if args.plan else FaultPlan()
    if args.fail_prob:
        plan = FaultPlan(seed=args.seed, prob=args.fail_prob, faults=plan.faults)
    elif plan.prob == 0.0:
        from lifecycle.faults import from_env

        env = from_env()
        if env is not None:
            plan = FaultPlan(seed=env.seed, prob=env.prob, faults=plan.faults)
    if args.kill_rank is not None:
        plan = FaultPlan(
            seed=plan.seed,
            prob=plan.prob,
            prob_ranks=plan.prob_ranks,
            faults=(*plan.faults, TargetedFault("kill_rank", args.kill_rank, step=args.kill_step)),
        )
    backend, why = pick_backend(args.backend)
    cfg = SimConfig(
        prefill=args.prefill,
        decode=args.decode,
        requests=args.requests,
        seed=args.seed,
        abort_prob=args.abort_prob,
        max_steps=args.max_steps,
        backend=backend,
        pg_timeout=args.pg_timeout,
        metrics_port=args.metrics_port,
        plan=plan,
    )
    plan.validate_against(cfg.world, cfg.requests)
    return cfg, why


def _run(args: argparse.Namespace) -> int:
    cfg, why = _config(args)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ
    if not torchrun or os.environ["RANK"] == "0":
        where = "under torchrun (env://)" if torchrun else "on 127.0.0.1"
        print(
            f"pdlife simulate: backend {cfg.backend} ({why}); "
            f"{cfg.prefill}P + {cfg.decode}D ranks {where}; seed {cfg.seed}"
        )
    if torchrun:
        return _under_torchrun(cfg, Path(args.out), args.role)
    return simulate(cfg, Path(args.out), timeout=args.timeout, progress=not args.quiet)


def _under_torchrun(cfg: SimConfig, out: Path, role: str | None = None) -> int:
    import torch.distributed as dist

    from lifecycle.tools import multinode
    from transport.addressing import advertised_host, store_address

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != cfg.world:
        print(f"torchrun world size {world} != --prefill + --decode = {cfg.world}", file=sys.stderr)
        return 2
    addr = store_address()
    # joining waits for the slowest node to start; a rank that dies mid-run is
    # caught by the side groups, which keep --pg-timeout
    join = timedelta(seconds=max(cfg.pg_timeout, multinode.JOIN_TIMEOUT_S))
    dist.init_process_group("gloo", init_method="env://", timeout=join)
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        for old in (out / "ranks").glob("*.json"):
            old.unlink()
    # the sides by what each rank says (--role), not by the node order rendezvous chose
    where = multinode.place(rank, world, cfg.prefill, role, advertised_host(target=addr[0]), dist)
    step_timeout = timedelta(seconds=cfg.pg_timeout)
    groups = {
        "prefill": dist.new_group(list(where.prefill), timeout=step_timeout),
        "decode": dist.new_group(list(where.decode), timeout=step_timeout),
    }
    start = time.monotonic()
    try:
        result = run_rank(cfg, where.logical, out, store, groups, addr)
        if result["error"]:
            print(result["error"], file=sys.stderr)
        multinode.publish(store, where.logical, out)
    except dist.DistNetworkError as e:  # the store, and so node 0, is gone
        print(multinode.store_lost(where, addr, e), file=sys.stderr)
        return 4
    if rank != 0:
        dist.destroy_process_group()
        return 3 if result["error"] else 0
    dead, msgs = multinode.collect(store, world, out, cfg.pg_timeout, where)
    exits: dict[int, int | None] = {r: None if r in dead else 0 for r in range(world)}
    summary = summarize(cfg, out, exits, [], time.monotonic() - start)
    multinode.add_errors(summary, out, msgs)
    print_table(summary)
    dist.destroy_process_group()
    return 0 if summary["ok"] else 1


def _replay(args: argparse.Namespace) -> int:
    from lifecycle.tools.trace import replay

    report = replay(Path(args.dir))
    if report.ok:
        print(f"replay: {report.steps_checked} collective steps recomputed; no difference")
        return 0
    d = report.first_difference or {}
    print(
        f"replay: first difference at step {d['step']} ({d['side']} {d['queue']} queue): {d['detail']}"
    )
    return 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser("simulate", help="run a local PD cluster under a fault plan")
    p.add_argument("--prefill", type=int, default=2, help="prefill ranks (TP group)")
    p.add_argument("--decode", type=int, default=2, help="decode ranks (TP group)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fail-prob", type=float, default=0.0, help="per rank, request and step")
    p.add_argument("--abort-prob", type=float, default=0.02, help="client aborts per request")
    p.add_argument("--plan", help="fault plan (.json or .toml)")
    p.add_argument("--kill-rank", type=int, help="kill this rank (a targeted fault)")
    p.add_argument("--kill-step", type=int, default=5)
    p.add_argument("--backend", default="auto", help="auto | fake | mooncake")
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--timeout", type=float, default=110.0, help="wall-clock limit for the run")
    p.add_argument("--pg-timeout", type=float, default=15.0, help="collective timeout per rank")
    p.add_argument("--out", default="pdlife-out")
    p.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics: rank r on this port + r"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--role",
        choices=["prefill", "decode"],
        help="under torchrun: the side this node's ranks serve (default: by rank)",
    )
    p.set_defaults(func=_run)

    r = sub.add_parser("replay", help="recompute a recorded run from its local observations")
    r.add_argument("dir")
    r.set_defaults(func=_replay)
