"""``pdlife simulate``: a local PD cluster under a fault plan, checked live.

The launcher hosts a ``TCPStore`` (rendezvous, heartbeats, progress), spawns
one process per rank (gloo on 127.0.0.1), waits with a deadline, then merges
the ranks' results into ``summary.json``, a summary table, a timeline PNG and
the mermaid diagram. Under ``torchrun`` the same command runs as one rank of
an env:// group and rank 0 merges.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs

from lifecycle.errors import FaultPlanError
from pdlife import args as a
from pdlife.args import UsageError
from pdlife.compare import compare
from pdlife.plan import MODES, FaultPlan, TargetedFault, load_plan
from pdlife.sim import SimConfig, run_rank
from pdlife.sim_topology import topology_problem
from pdlife.summary import print_table, summarize

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
    # every rank creates every group, in the same order: one per prefill DP group
    prefill = [
        dist.new_group(list(range(g * cfg.prefill, (g + 1) * cfg.prefill)))
        for g in range(cfg.prefill_dp)
    ]
    groups = {
        "prefill": prefill[min(rank // cfg.prefill, cfg.prefill_dp - 1)],
        "decode": dist.new_group(list(range(cfg.prefill_ranks, cfg.world))),
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


def _topology(args: argparse.Namespace) -> dict[str, Any]:
    """The topology flags, checked together; SimConfig's fields for them."""
    p, d = args.prefill, args.decode
    if args.mla and args.kv_heads not in (None, 1):
        raise UsageError(
            f"--kv-heads {args.kv_heads}", "an MLA model has one latent KV head; drop --kv-heads"
        )
    heads = 1 if args.mla else (args.kv_heads or 2 * max(p, d))
    problem = topology_problem(p, d, heads, args.mla)
    if problem is not None:
        raise UsageError(f"--kv-heads {heads}", problem)
    if args.staging_pages and not args.staging:
        raise UsageError("--staging-pages", "sizes the staging buffer; add --staging")
    # the most pages one request asks prefill for: all of a short one, the rest of a long one
    longest = max(args.max_pages_per_request - args.prefix_pages, args.prefix_pages)
    if args.staging_pages and args.staging_pages < longest:
        raise UsageError(
            f"--staging-pages {args.staging_pages}",
            f"a request may ask for {longest} pages, which would not fit its staging "
            f"region; give at least {longest}",
        )
    if args.prefix_pages >= args.max_pages_per_request:
        raise UsageError(
            f"--prefix-pages {args.prefix_pages}",
            f"requests have at most {args.max_pages_per_request} pages, so none would have "
            "more than the prefix; choose fewer",
        )
    if args.prefill_dp > 1 and args.soak is not None:
        raise UsageError(
            "--prefill-dp", "a soak runs one prefill group; drop --soak or --prefill-dp"
        )
    if args.prefill_dp > 1 and _torchrun():
        raise UsageError(
            "--prefill-dp", "under torchrun one prefill group is supported; run it on one host"
        )
    return {
        "prefill_dp": args.prefill_dp,
        "mla": args.mla,
        "kv_heads": heads,
        "page_size": args.page_size,
        "state": args.state,
        "staging": args.staging,
        "staging_pages": args.staging_pages or 0,
        "prefix_pages": args.prefix_pages,
        "max_pages": args.max_pages_per_request,
    }


def staging_note(cfg: SimConfig) -> str | None:
    """Why --staging changes nothing in this topology, or None."""
    if cfg.staging and (cfg.mla or cfg.prefill == cfg.decode):
        why = "MLA" if cfg.mla else "equal prefill and decode TP sizes"
        return f"note: --staging has nothing to scatter with {why} (pages land whole)"
    return None


def _torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def _config(args: argparse.Namespace) -> tuple[SimConfig, str]:
    """Every check of the command line, before anything is started."""
    world = args.prefill * args.prefill_dp + args.decode
    if world > 64:
        raise UsageError(
            "--prefill-tp/--prefill-dp/--decode-tp", f"{world} ranks on one machine; use at most 64"
        )
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
    topology = _topology(args)
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
        **topology,
    )
    return cfg, why


def _run(args: argparse.Namespace) -> int:
    if args.compare:
        return compare(Path(args.compare[0]), Path(args.compare[1]))
    if args.soak is not None and args.max_steps == _MAX_STEPS:
        args.max_steps = 2**31 - 1  # a soak ends by time
    cfg, why = _config(args)
    torchrun = _torchrun()
    if not torchrun or os.environ["RANK"] == "0":
        where = "under torchrun (env://)" if torchrun else "on 127.0.0.1"
        print(
            f"pdlife simulate: backend {cfg.backend} ({why}); "
            f"{_shape(cfg)} {where}; seed {cfg.seed}; {cfg.mode}-keyed faults"
        )
        note = staging_note(cfg)
        if note:
            print(note)
    if torchrun:
        return _under_torchrun(cfg, Path(args.out), args.role)
    return simulate(cfg, Path(args.out), timeout=args.timeout, progress=not args.quiet)


def _shape(cfg: SimConfig) -> str:
    """``2P + 2D ranks``, or e.g. ``2x2P (DP 2) + 4D ranks, MLA, staging``."""
    dp = f"{cfg.prefill_dp}x{cfg.prefill}P (DP {cfg.prefill_dp})" if cfg.prefill_dp > 1 else ""
    text = f"{dp or f'{cfg.prefill}P'} + {cfg.decode}D ranks"
    extras = [
        "MLA" if cfg.mla else f"{cfg.total_heads} KV heads",
        f"page size {cfg.page_size}" if cfg.page_size > 1 else "",
        "state" if cfg.state else "",
        "staging" if cfg.staging else "",
        f"cached prefix {cfg.prefix_pages} pages" if cfg.prefix_pages else "",
    ]
    return ", ".join([text, *(e for e in extras if e)])


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
    p.add_argument(
        "--prefill-tp",
        "--prefill",
        dest="prefill",
        type=a.positive_int,
        default=2,
        help="prefill TP size: ranks per prefill DP group",
    )
    p.add_argument(
        "--decode-tp",
        "--decode",
        dest="decode",
        type=a.positive_int,
        default=2,
        help="decode TP size (ranks)",
    )
    p.add_argument(
        "--prefill-dp",
        type=a.positive_int,
        default=1,
        help="prefill DP groups, each its own TP group; request i goes to group i %% N",
    )
    p.add_argument("--mla", action="store_true", help="MLA: one latent KV head on every rank")
    p.add_argument(
        "--kv-heads",
        type=a.positive_int,
        help="the model's KV heads, split over each side's TP ranks (default 2 x the larger TP)",
    )
    p.add_argument("--page-size", type=a.positive_int, default=1, help="tokens per KV page")
    p.add_argument(
        "--state",
        action="store_true",
        help="a hybrid model: a mamba-like state row per request moves with its pages",
    )
    p.add_argument(
        "--staging",
        action="store_true",
        help="decode lands head-sliced KV in a staging buffer, then scatters it",
    )
    p.add_argument(
        "--staging-pages",
        type=a.positive_int,
        help="pages per staging region (default: the largest request)",
    )
    p.add_argument(
        "--prefix-pages",
        type=a.nonneg_int,
        default=0,
        metavar="K",
        help="decode already holds the first K pages of every longer request (a cached prefix)",
    )
    p.add_argument(
        "--max-pages-per-request",
        type=a.positive_int,
        default=32,
        help="requests have 1..this many pages",
    )
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
