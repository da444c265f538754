"""``pdlife simulate``: a local PD cluster under a fault plan, checked live.

The launcher hosts a ``TCPStore`` (rendezvous, heartbeats, progress), spawns
one process per rank (gloo on 127.0.0.1), waits with a deadline, then merges
the ranks' results into ``summary.json``, a summary table, a timeline PNG and
the mermaid diagram. Under ``torchrun`` the same command runs as one rank of
an env:// group and rank 0 merges.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from pdlife.args import UsageError
from pdlife.cluster.config import SimConfig
from pdlife.engine_output import choose, divert
from pdlife.run.compare import compare
from pdlife.run.config import shape as _shape
from pdlife.run.config import sim_config as _config
from pdlife.run.config import staging_note
from pdlife.run.config import torchrun as _torchrun
from pdlife.run.flags import MAX_STEPS, add_arguments
from pdlife.run.launch import start_ranks
from pdlife.run.summary import print_table, summarize
from pdlife.sim.rank import run_rank

__all__ = ["add_parser", "simulate"]


def _worker(rank: int, port: int, cfg: SimConfig, out: str, quiet: bool = True) -> None:
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    if quiet:
        divert(_engine_log(Path(out), rank))
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


def _engine_log(out: Path, rank: int) -> Path:
    """Where rank ``rank``'s engine writes its own lines (see pdlife.engine_output)."""
    return out / "ranks" / f"rank{rank}.engine.log"


def simulate(
    cfg: SimConfig, out: Path, timeout: float, progress: bool = True, quiet: bool = True
) -> int:
    from lifecycle.testing.spawn import store_server

    out.mkdir(parents=True, exist_ok=True)
    stale = [
        out / "summary.json",
        *(out / "trace").glob("*.jsonl"),
        *(out / "ranks").glob("*.json"),
        *(out / "ranks").glob("*.jsonl"),
        *(out / "ranks").glob("*.engine.log"),
    ]
    for old in stale:
        old.unlink(missing_ok=True)
    start = time.monotonic()
    # the ranks fork from here (see pdlife.run.launch), then the store starts on
    # a port the OS picks as it binds, and each rank is told it
    procs, store = start_ranks(
        cfg.world,
        _worker,
        (cfg, str(out), quiet),
        lambda: store_server(cfg.world + 1),
        preload=["pdlife.sim.rank", "pdlife.run.simulate"],
    )
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


def _run(args: argparse.Namespace) -> int:
    if args.compare:
        return compare(Path(args.compare[0]), Path(args.compare[1]))
    if args.soak is not None and args.max_steps == MAX_STEPS:
        args.max_steps = 2**31 - 1  # a soak ends by time
    endpoint = args.otlp_traces_endpoint
    if endpoint is not None:  # checked before the run: a run is not wasted on a typo
        from pdlife.spans.cli import check

        check(endpoint, "--otlp-traces-endpoint")
    quiet = choose(args.verbose)  # before any engine loads (a backend probe), here or in a rank
    torchrun = _torchrun()
    cfg, why = _config(args)  # every check, before anything starts
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
        rc = _under_torchrun(cfg, Path(args.out), args.role, quiet)
        if endpoint is None or os.environ["RANK"] != "0":
            return rc
    else:
        rc = simulate(cfg, Path(args.out), args.timeout, progress=not args.quiet, quiet=quiet)
    if endpoint is not None:
        from pdlife.spans.cli import send

        n, where = send(Path(args.out), endpoint, "involved", 1.0, "--otlp-traces-endpoint")
        print(f"pdlife simulate: {n} spans sent to {where}")
    return rc


def _under_torchrun(cfg: SimConfig, out: Path, role: str | None = None, quiet: bool = True) -> int:
    import torch.distributed as dist

    import pdlife.run.multinode as multinode
    from transport.addressing import advertised_host, store_address

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != cfg.world:
        raise UsageError(
            "--prefill/--decode", f"torchrun started {world} ranks but they add up to {cfg.world}"
        )
    if quiet:  # every check passed: this process is a rank, its engine starts below
        divert(_engine_log(out, rank))
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
    host = advertised_host(target=addr[0])
    where = multinode.place(rank, world, cfg.prefill_ranks, role, host, dist)
    step_timeout = timedelta(seconds=cfg.pg_timeout)
    # every rank creates every group, in the same order: one per prefill DP group
    # (logical prefill ranks g*P .. g*P+P-1), then the decode group
    prefill = [
        dist.new_group(
            list(where.prefill[g * cfg.prefill : (g + 1) * cfg.prefill]), timeout=step_timeout
        )
        for g in range(cfg.prefill_dp)
    ]
    groups = {
        "prefill": prefill[min(where.logical // cfg.prefill, cfg.prefill_dp - 1)],
        "decode": dist.new_group(list(where.decode), timeout=step_timeout),
    }
    start = time.monotonic()
    watch = multinode.StoreWatch(where, addr)
    watch.start()
    try:
        result = run_rank(cfg, where.logical, out, store, groups, addr)
        watch.done()  # from here node 0 may end the job (and its store) first
        if result["error"]:
            print(result["error"], file=sys.stderr)
        multinode.publish(store, where.logical, out)
    except dist.DistNetworkError as e:  # the store, and so node 0, is gone
        watch.lost(e)
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


def add_parser(sub: Any) -> None:
    p = sub.add_parser("simulate", help="run a local PD cluster under a fault plan")
    add_arguments(p)
    p.set_defaults(func=_run, requests_given=False)
