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

import attrs
import numpy as np

from lifecycle.errors import FaultPlanError
from lifecycle.reasons import FailureReason
from lifecycle.status import Role
from pdlife import args as a
from pdlife.args import UsageError
from pdlife.plan import MODES, FaultPlan, TargetedFault, load_plan
from pdlife.sim import SimConfig, Workload, run_rank

__all__ = ["add_parser", "simulate", "summarize", "pick_backend", "compare"]


def pick_backend(requested: str) -> tuple[str, str]:
    """(backend, why) -- ``auto`` takes Mooncake when it is installed and works here.

    A backend named explicitly must load here, or this raises :class:`UsageError`.
    """
    if requested != "auto":
        from transport.errors import TransportError
        from transport.registry import get_backend, known_backends

        if requested.lower() not in known_backends():
            raise UsageError(
                f"--backend {requested}",
                f"unknown backend; choose auto or one of {', '.join(known_backends())}",
            )
        try:
            get_backend(requested)
        except TransportError as e:
            raise UsageError(f"--backend {requested}", str(e)) from None
        return requested.lower(), "requested"
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
    try:
        result = run_rank(cfg, rank, Path(out), store, groups, ("127.0.0.1", port))
    except Exception as e:  # one line, not a traceback; the launcher reports the crash
        sys.stderr.write(f"rank {rank}: {type(e).__name__}: {' '.join(str(e).split())}\n")
        os._exit(4)
    if result["error"]:
        sys.stderr.write(result["error"] + "\n")
        os._exit(3)
    dist.destroy_process_group()


def _progress(store: Any, total: int | None, start: float) -> None:
    def get(key: str) -> int:
        try:
            return int(store.get(key).decode()) if store.check([key]) else 0
        except Exception:
            return 0

    done = min(get("progress/prefill"), get("progress/decode"))
    width = 30
    fill = int(width * done / max(total, 1)) if total else 0
    of = f"/{total}" if total else " (soak)"
    sys.stderr.write(
        f"\r[{'#' * fill}{'.' * (width - fill)}] {done}{of} requests  {time.monotonic() - start:5.1f}s"
    )
    sys.stderr.flush()


def simulate(cfg: SimConfig, out: Path, timeout: float, progress: bool = True) -> int:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from lifecycle.testing.spawn import free_port

    out.mkdir(parents=True, exist_ok=True)
    stale = [
        out / "summary.json",
        *(out / "trace").glob("*.jsonl"),
        *(out / "ranks").glob("*.json"),
        *(out / "ranks").glob("*.jsonl"),
    ]
    for old in stale:
        old.unlink(missing_ok=True)
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
    total = None if cfg.soak else cfg.requests
    deadline = start + timeout + (cfg.soak or 0.0)
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if progress:
            _progress(store, total, start)
        time.sleep(0.2)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    if progress:
        _progress(store, total, start)
        sys.stderr.write("\n")
    exits = {r: p.exitcode for r, p in enumerate(procs)}
    summary = summarize(cfg, out, exits, hung, time.monotonic() - start)
    print_table(summary)
    return 0 if summary["ok"] else 1


def _rss_growth(samples: list[list[float]], requests: int) -> float | None:
    """Relative RSS growth from the end of warm-up (a fifth of the requests
    finished) to the last sample; None without two samples past warm-up."""
    warm = [m for _, done, m, *_ in samples if done >= requests / 5]
    if len(warm) < 2 or warm[0] <= 0:
        return None
    return round((warm[-1] - warm[0]) / warm[0], 4)


def _end_to_end(
    rooms: list[int], by_side: dict[str, list[dict[str, Any]]]
) -> dict[str, tuple[str, int]]:
    """Per request: Failed if either side failed it (decode's reason first, as the
    side the client sees), Success only once decode succeeded, else unfinished."""
    final: dict[str, tuple[str, int]] = {}
    firsts = {side: results[0]["outcome"] for side, results in by_side.items() if results}
    for room in map(str, rooms):
        seen = {side: got.get(room) for side, got in firsts.items()}
        failed_on = [
            o for side in ("decode", "prefill") if (o := seen.get(side)) and o[0] == "Failed"
        ]
        dec = seen.get("decode")
        if failed_on:
            final[room] = ("Failed", failed_on[0][1])
        elif dec and dec[0] == "Success":
            # delivered: decode holds the KV and the first token (prefill may have died since)
            final[room] = ("Success", FailureReason.NONE)
    return final


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
    requests = cfg.requests
    if cfg.soak:
        agreed = [r["requests"] for r in ranks.values() if r.get("requests") is not None]
        requests = max(agreed, default=0)
    rooms = Workload(cfg).all_rooms(requests)
    final = _end_to_end(rooms, by_side)
    failed = Counter(
        FailureReason(reason).label for status, reason in final.values() if status == "Failed"
    )
    aborted = failed.pop("aborted", 0)
    latency = np.concatenate(
        [np.asarray(r["latency_us"], dtype=float) for r in ranks.values()] or [np.zeros(1)]
    )
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
    problems = [p for r in ranks.values() for p in r.get("problems", [])]
    unfired = [u for r in ranks.values() for u in r.get("unfired_faults", [])]
    # a kill that never happened: the rank is alive at the end
    for f in cfg.plan.faults:
        if f.kind == "kill_rank" and f.rank not in dead:
            unfired.append(f"kill_rank on rank {f.rank} at step {f.step}")
    if unfired:
        problems.append(
            f"{len(unfired)} targeted fault(s) never fired, e.g. {unfired[0]}: the request "
            "finished (or the run ended) before the fault's step or phase; move it earlier"
        )
    decisions = sorted(
        {tuple(d) for r in ranks.values() for d in r.get("decisions", []) if d[1] == r["rank"]}
        | {
            tuple(d)
            for res in by_side["decode"][:1]
            for d in res.get("decisions", [])
            if d[1] == -1
        }
    )
    rss = {str(r): res.get("rss_mb", []) for r, res in sorted(ranks.items())}
    summary: dict[str, Any] = {
        "requests": requests,
        "succeeded": sum(1 for s, _ in final.values() if s == "Success"),
        "failed": dict(sorted(failed.items())),
        "aborted": aborted,
        "disagreements": disagreements,
        # a rank that stopped on an error cannot have cleaned up: count the others
        "leaked_slots": sum(r["leaked_slots"] for r in ranks.values() if not r["error"]),
        "leaked_kv_pages": sum(r["leaked_kv_pages"] for r in ranks.values() if not r["error"]),
        "drain_failed": sum(r.get("drain_failed", 0) for r in ranks.values()),
        "kv_bytes_verified": sum(r.get("bytes_checked", 0) for r in ranks.values()),
        "stuck": requests - len(final),
        "stuck_reports": sum(r["stuck_reports"] for r in ranks.values()),
        "steps": max((r["steps"] for r in ranks.values()), default=0),
        "step_latency_us": {
            "p50": round(float(np.percentile(latency, 50)), 1),
            "p99": round(float(np.percentile(latency, 99)), 1),
        },
        "backend": cfg.backend,
        "seed": cfg.seed,
        "fault_mode": cfg.mode,
        "ranks": {"prefill": cfg.prefill, "decode": cfg.decode},
        "faults_fired": sum(r["faults_fired"] for r in ranks.values()),
        "fault_decisions": [
            {
                "room": d[0],
                "rank": d[1],  # -1: the client (an abort)
                "phase": d[2],
                "kind": d[3],
                "reason": "aborted" if d[3] == "abort" else "injected fault",
                "wins": d[4],  # the request's winner: the one draw that fires
            }
            for d in decisions
        ],
        "outcomes": {
            room: [status, FailureReason(reason).label] for room, (status, reason) in final.items()
        },
        "unfired_faults": unfired,
        "problems": problems,
        "invariant_violations": violations,
        "dead_ranks": dead,
        "rank_errors": errors,
        "backend_errors": {
            str(r): res["backend_error"] for r, res in ranks.items() if res.get("backend_error")
        },
        "hung_ranks": hung,
        "crashed_ranks": crashed,
        "rss_mb": rss,
        "rss_growth_after_warmup": {r: _rss_growth(v, requests) for r, v in rss.items()},
        "soak_s": cfg.soak,
        "elapsed_s": round(elapsed, 2),
    }
    summary["ok"] = not (
        violations
        or problems
        or disagreements
        or summary["leaked_slots"]
        or summary["leaked_kv_pages"]
        or summary["stuck"]
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
    drawn = False
    for ax, (side, first) in zip(axes, (("prefill", 0), ("decode", cfg.prefill))):
        res = ranks.get(first)
        ax.set_title(f"{side} rank {first}: live requests by agreed status")
        if not res or not res["counts"]:
            continue
        counts = np.asarray(res["counts"])
        steps = np.arange(1, len(counts) + 1) * res.get("counts_stride", 1)
        ax.stackplot(steps, counts[:, 1:5].T, labels=names[1:5], colors=colors[1:5], alpha=0.8)
        ax.plot(steps, counts[:, 5], color="black", lw=1, label="finished (cumulative)")
        for s in res["failure_steps"]:
            ax.axvline(s, color=colors[0], alpha=0.25, lw=0.8)
        ax.set_ylabel("requests")
        drawn = True
    if drawn:
        axes[0].legend(loc="upper right", fontsize=7)
    axes[1].set_xlabel("scheduler step (red lines: failures agreed)")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=90)
    plt.close(fig)


def print_table(s: dict[str, Any]) -> None:
    growth = {r: g for r, g in s.get("rss_growth_after_warmup", {}).items() if g is not None}
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
        ("fault mode", s["fault_mode"]),
        ("faults fired", s["faults_fired"]),
        ("elapsed", f"{s['elapsed_s']} s"),
    ]
    if growth:
        rows.append(
            (
                "RSS growth after warm-up",
                ", ".join(f"rank {r}: {100 * g:+.1f}%" for r, g in sorted(growth.items())),
            )
        )
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    for msg in s["rank_errors"]:
        print(f"  ERROR: {msg}")
    for r in s["hung_ranks"]:
        print(f"  ERROR: rank {r} hung and was killed")
    for r in s["crashed_ranks"]:
        print(f"  ERROR: rank {r} crashed")
    for msg in s["problems"]:
        print(f"  ERROR: {msg}")
    for r, e in s.get("backend_errors", {}).items():
        print(f"  rank {r}'s transfer backend caught: {e}")
    for r in s["dead_ranks"]:
        print(f"  rank {r} was killed by the fault plan")
    for v in s["invariant_violations"][:20]:
        print(f"  VIOLATION: {v}")
    print("  result: " + ("OK" if s["ok"] else "FAILED"))


def _plan(args: argparse.Namespace, world: int, requests: int) -> FaultPlan:
    try:
        plan = load_plan(args.plan) if args.plan else FaultPlan()
        if args.fail_prob:
            plan = attrs.evolve(plan, seed=args.seed, prob=args.fail_prob)
        elif plan.prob == 0.0:
            from lifecycle.faults import from_env

            env = from_env()
            if env is not None:  # the field's per-step knob keeps its per-step meaning
                plan = attrs.evolve(plan, seed=env.seed, prob=env.prob, mode="step")
        if args.kill_rank is not None:
            kill = TargetedFault("kill_rank", args.kill_rank, step=args.kill_step)
            plan = attrs.evolve(plan, faults=(*plan.faults, kill))
        plan.validate_against(world, requests if not args.soak else 2**62)
    except FaultPlanError as e:
        where = "--plan" if args.plan else "fault options"
        if args.kill_rank is not None and e.field.startswith(f"faults[{len(plan.faults) - 1}]"):
            where = "--kill-rank"
        raise UsageError(where, str(e)) from None
    return plan


def _check_ports(base: int, world: int) -> None:
    import socket

    for r in range(world):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", base + r))
            except OSError as e:
                raise UsageError(
                    f"--metrics-port {base}",
                    f"rank {r} would serve on port {base + r}, which is taken ({e.strerror}); "
                    "choose another base port",
                ) from None


def _config(args: argparse.Namespace) -> tuple[SimConfig, str]:
    """Every check of the command line, before anything is started."""
    world = args.prefill + args.decode
    if world > 64:
        raise UsageError("--prefill/--decode", f"{world} ranks on one machine; use at most 64")
    if args.kill_rank is not None and not 0 <= args.kill_rank < world:
        raise UsageError(
            f"--kill-rank {args.kill_rank}", f"not a rank of this run; choose 0..{world - 1}"
        )
    if args.metrics_port is not None and args.metrics_port + world - 1 > 65535:
        raise UsageError(
            f"--metrics-port {args.metrics_port}",
            f"rank r serves on port + r, so it must be at most {65536 - world}",
        )
    if args.metrics_port is not None:
        _check_ports(args.metrics_port, world)
    if args.soak is not None and args.requests_given:
        raise UsageError("--soak", "admits requests for that long; drop --requests")
    plan = _plan(args, world, args.requests)
    backend, why = pick_backend(args.backend)
    if backend in ("mooncake", "nixl") and args.prefill != args.decode:
        raise UsageError(
            "--prefill/--decode",
            f"the {backend} simulation pairs prefill and decode ranks 1:1; give equal counts",
        )
    a.writable_dir(Path(args.out), "--out")
    cfg = SimConfig(
        prefill=args.prefill,
        decode=args.decode,
        requests=args.requests if args.soak is None else 2**31 - 1,
        seed=args.seed,
        abort_prob=args.abort_prob,
        max_steps=args.max_steps,
        backend=backend,
        pg_timeout=args.pg_timeout,
        metrics_port=args.metrics_port,
        plan=plan,
        fault_mode=args.fault_mode,
        soak=args.soak,
    )
    return cfg, why


def _run(args: argparse.Namespace) -> int:
    if args.compare:
        return compare(Path(args.compare[0]), Path(args.compare[1]))
    if args.soak is not None and args.max_steps == _MAX_STEPS:
        args.max_steps = 2**31 - 1  # a soak ends by time
    cfg, why = _config(args)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ
    if not torchrun or os.environ["RANK"] == "0":
        where = "under torchrun (env://)" if torchrun else "on 127.0.0.1"
        print(
            f"pdlife simulate: backend {cfg.backend} ({why}); "
            f"{cfg.prefill}P + {cfg.decode}D ranks {where}; seed {cfg.seed}; "
            f"{cfg.mode}-keyed faults"
        )
    if torchrun:
        return _under_torchrun(cfg, Path(args.out), args.role)
    return simulate(cfg, Path(args.out), timeout=args.timeout, progress=not args.quiet)


def _under_torchrun(cfg: SimConfig, out: Path, role: str | None = None) -> int:
    import torch.distributed as dist

    from pdlife import multinode
    from transport.addressing import advertised_host, store_address

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != cfg.world:
        raise UsageError(
            "--prefill/--decode", f"torchrun started {world} ranks but they add up to {cfg.world}"
        )
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


def _outcomes(path: Path) -> dict[str, Any]:
    f = path / "summary.json" if path.is_dir() else path
    try:
        doc = json.loads(f.read_text())
    except OSError as e:
        raise UsageError(f"--compare {path}", f"cannot read {f} ({e.strerror})") from None
    except ValueError as e:
        raise UsageError(f"--compare {path}", f"{f} is not JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("outcomes"), dict):
        raise UsageError(
            f"--compare {path}", f"{f} has no per-request outcomes; rerun it with this version"
        )
    return doc


def compare(a_dir: Path, b_dir: Path) -> int:
    """Diff two runs' per-request outcomes (room, status, reason); 1 if they differ."""
    a_doc, b_doc = _outcomes(a_dir), _outcomes(b_dir)
    a_out, b_out = a_doc["outcomes"], b_doc["outcomes"]
    rooms = sorted(set(a_out) | set(b_out), key=int)
    diffs = [r for r in rooms if a_out.get(r) != b_out.get(r)]
    label = f"{a_dir} ({a_doc.get('backend')}) vs {b_dir} ({b_doc.get('backend')})"
    if not diffs:
        print(f"compare: {label}: the {len(rooms)} requests end the same (room, status, reason)")
        return 0
    r = diffs[0]

    def show(o: Any) -> str:
        return "unfinished" if o is None else f"{o[0]} ({o[1]})" if o[0] == "Failed" else o[0]

    print(
        f"compare: {label}: {len(diffs)} of {len(rooms)} requests differ; first: room {r}: "
        f"{show(a_out.get(r))} vs {show(b_out.get(r))}"
    )
    return 1


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


_MAX_STEPS = 3000


class _RequestsAction(argparse.Action):
    def __call__(self, parser: Any, ns: argparse.Namespace, values: Any, opt: Any = None) -> None:
        ns.requests = values
        ns.requests_given = True


def add_parser(sub: Any) -> None:
    p = sub.add_parser("simulate", help="run a local PD cluster under a fault plan")
    p.add_argument("--prefill", type=a.positive_int, default=2, help="prefill ranks (TP group)")
    p.add_argument("--decode", type=a.positive_int, default=2, help="decode ranks (TP group)")
    p.add_argument("--requests", type=a.positive_int, default=200, action=_RequestsAction)
    p.add_argument("--seed", type=a.nonneg_int, default=0)
    p.add_argument(
        "--fail-prob",
        type=a.probability,
        default=0.0,
        help="per rank and request (phase mode) or per rank, request and step (step mode)",
    )
    p.add_argument(
        "--abort-prob", type=a.probability, default=0.02, help="client aborts per request"
    )
    p.add_argument(
        "--fault-mode",
        choices=MODES,
        default="phase",
        help="phase: faults and aborts keyed to a request's phase, the same on every run "
        "and backend; step: drawn per step (soak-style noise). A plan's mode wins",
    )
    p.add_argument("--plan", help="fault plan (.json or .toml)")
    p.add_argument("--kill-rank", type=a.nonneg_int, help="kill this rank (a targeted fault)")
    p.add_argument("--kill-step", type=a.positive_int, default=5)
    p.add_argument("--backend", default="auto", help="auto | fake | mooncake | nixl")
    p.add_argument("--max-steps", type=a.positive_int, default=_MAX_STEPS)
    p.add_argument(
        "--soak",
        type=a.seconds,
        metavar="SECONDS",
        help="keep admitting requests this long; samples RSS per rank into summary.json",
    )
    p.add_argument(
        "--timeout", type=a.seconds, default=110.0, help="wall-clock limit (after --soak)"
    )
    p.add_argument("--pg-timeout", type=a.seconds, default=15.0, help="collective timeout per rank")
    p.add_argument("--out", default="pdlife-out")
    p.add_argument(
        "--metrics-port", type=a.port, help="serve Prometheus metrics: rank r on this port + r"
    )
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help="diff two runs' per-request outcomes (run directories or summary.json files)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--role",
        choices=["prefill", "decode"],
        help="under torchrun: the side this node's ranks serve (default: by rank)",
    )
    p.set_defaults(func=_run, requests_given=False)

    r = sub.add_parser("replay", help="recompute a recorded run from its local observations")
    r.add_argument("dir")
    r.set_defaults(func=_replay)
