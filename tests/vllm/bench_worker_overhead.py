"""The worker side's per-iteration overhead against vLLM's count-based aggregation.

The requirement: at 64 and 1,024 loads in flight, one iteration of the
connector's worker side (``get_finished``: :meth:`WorkerSide.finished` with the
agreement step and its all-reduce) costs at most 1.2 times what vLLM's path
costs, plus one all-reduce. Measured side by side in one run, on 2 TP workers
over real gloo on 127.0.0.1 (a ``TCPStore`` the OS gave a port as it bound it),
interleaved in an order drawn anew each repetition:

- ``ours``: decode's ``WorkerSide.finished()``, ``n`` loads in flight on the
  library's connector (tests/vllm/overhead_subjects.py);
- ``vllm``: each worker's report (its finished loads, polled handle by handle,
  in vLLM's ``KVConnectorOutput`` and ``ModelRunnerOutput``; the slower
  worker's) plus vLLM's ``KVOutputAggregator`` over both outputs; moving the
  outputs to the aggregator is not counted (vLLM moves every worker's output
  whichever connector runs);
- ``allreduce``: one bare gloo all-reduce of the size the step sends, on the
  same group;
- ``floor``: the least any numpy agreement step does for the same loads, its
  all-reduce included (tests/vllm/overhead_floor.py): a lower bound for ours,
  not a step (``floor_ratio`` = floor / the bound; ``floor_local/vllm_share`` =
  the floor less its all-reduce / 1.2 x vLLM's path).

Each iteration's time is the slower worker's (a barrier starts every timed
iteration). ``ratio`` = ours / (1.2 x vllm + allreduce), medians; at most 1 passes.
Run with ``make vllm-bench``, or::

    HF_HUB_OFFLINE=1 .venv-vllm/bin/python tests/vllm/bench_worker_overhead.py \\
        --reps 300 --n 64 1024 --json bench-worker.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time
from typing import Any

import numpy as np

WORLD = 2
KINDS = ("ours", "vllm", "allreduce", "floor")
#: the columns of each row, in the table's order
COLUMNS = (
    "n",
    "ours_us",
    "vllm_us",
    "allreduce_us",
    "bound_us",
    "ratio",
    "passes",
    "ratio_without_handoff",
    "ratio_p25",
    "ratio_per_worker",
    "ours_start_us",
    "vllm_start_us",
    "ratio_with_start",
    "floor_us",
    "floor_ratio",
    "floor_ratio_p25",
    "floor_local_us",
    "floor_local/vllm_share",
    "ours_step_us",
    "ours_reduce_us",
    "ours_handoff_us",
    "ours_release_us",
    "ours_rest_us",
    "vllm_report_us",
    "vllm_aggregate_us",
    "reduce_bytes",
    "reduces_per_step",
    "finished_per_iter_ours",
    "finished_per_iter_vllm",
    "fence_violations",
)


def _rank(
    rank: int, world: int, ns: list[int], reps: int, life: int, warmup: int, profile: str | None
) -> Any:
    """One TP worker's run: per (n, what), this worker's time of each iteration.
    ``profile``: a folder where each worker writes the profile of ours' timed
    calls per n (cProfile, which slows them: the times of such a run are not
    the measurement)."""
    import cProfile
    import gc

    import torch
    import torch.distributed as dist
    from overhead_floor import NumpyFloor
    from overhead_subjects import CountingLoop, OursLoop, SizedCollective

    ours = {n: OursLoop(n, life, rank, SizedCollective()) for n in ns}
    floors = {n: NumpyFloor(ours[n], SizedCollective()) for n in ns}
    counting = {n: CountingLoop(n, life, rank, world) for n in ns}
    buffers: dict[int, torch.Tensor] = {}
    out: dict[str, list[float]] = collections.defaultdict(list)
    profiles: dict[int, cProfile.Profile] = {}

    def run_ours(n: int) -> dict[str, float]:
        loop = ours[n]
        loop.prepare()
        prof = profiles.get(n)
        _settle()
        if prof is not None:
            prof.enable()
        took = loop.iterate()
        if prof is not None:
            prof.disable()
        return {"ours": took, **{f"ours_{k}": v for k, v in loop.last.items()}}

    def run_vllm(n: int) -> dict[str, float]:
        loop = counting[n]
        loop.prepare()
        _settle()
        t = time.perf_counter()
        mine = loop.report()
        took = time.perf_counter() - t
        kv: list[Any] = [None] * world
        dist.all_gather_object(kv, mine.kv_connector_output)  # (not timed: see the module)
        agg, finished = 0.0, 0
        if rank == 0:
            outputs = [mine, *(loop.runner_cls.with_kv_conn_output_only(o) for o in kv[1:])]
            agg, finished = loop.aggregate(outputs)
        return {
            "vllm_report": took,
            "vllm_aggregate": agg,
            "vllm_finished": float(finished),
            "vllm_start": loop.started,
        }

    def run_allreduce(n: int) -> dict[str, float]:
        dtype, size = ours[n].collective.sent
        buf = buffers.get(n)
        if buf is None or buf.numel() != size or str(buf.dtype) != f"torch.{dtype}":
            buf = buffers[n] = torch.zeros(size, dtype=getattr(torch, dtype))
        _settle()
        t = time.perf_counter()
        dist.all_reduce(buf, op=dist.ReduceOp.MIN)
        took = time.perf_counter() - t
        return {"allreduce": took, "reduce_bytes": float(buf.numel() * buf.element_size())}

    def _settle() -> None:
        """Before each timed call: the garbage of the untimed work collected (the
        objects that live on are frozen after the warm-up, so this is quick), then
        the workers start together."""
        gc.collect()
        dist.barrier()

    def run_floor(n: int) -> dict[str, float]:
        # on ours' table and connector as ours' last iteration left them: mostly
        # agreed already, so few moves (the floor's least work; its moves counted)
        floor = floors[n]
        floor.collective.seconds = 0.0
        _settle()
        took = floor.iterate()
        whole, moves, legal = floor.last
        if not (whole and legal):
            raise AssertionError(f"the floor at n={n} found a list or a move ours would refuse")
        return {"floor": took, "floor_reduce": floor.collective.seconds, "floor_moves": moves}

    runs = {"ours": run_ours, "vllm": run_vllm, "allreduce": run_allreduce, "floor": run_floor}
    gc.collect()
    gc.freeze()  # (what lives now, vLLM's modules among it, is never traversed again)
    for _ in range(warmup):  # the steady state, and every path warm
        for n in ns:
            for kind in KINDS:
                runs[kind](n)
    gc.freeze()
    if profile is not None:
        profiles.update((n, cProfile.Profile()) for n in ns)
    for rep in range(reps):
        order = random.Random(rep)  # the same order on every worker
        for n in order.sample(ns, len(ns)):
            for kind in order.sample(KINDS, len(KINDS)):
                for key, value in runs[kind](n).items():
                    out[f"{key}/{n}"].append(value)
    for n, prof in profiles.items():
        prof.dump_stats(os.path.join(str(profile), f"ours-n{n}-rank{rank}.prof"))
    return dict(out)


def _q(xs: Any, q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


def summarize(per_rank: list[dict[str, list[float]]], ns: list[int]) -> list[dict[str, Any]]:
    """One row per ``n`` (times in microseconds): each iteration is the slower
    worker's; medians, with the 25th and 75th percentiles for the spread."""
    rows = []
    for n in ns:

        def col(key: str, how: str = "max", n: int = n) -> Any:
            stacked = np.asarray([r[f"{key}/{n}"] for r in per_rank], dtype=np.float64)
            return stacked.max(axis=0) if how == "max" else stacked[0]

        ours = col("ours") * 1e6
        vllm = (col("vllm_report") + col("vllm_aggregate", "rank0")) * 1e6
        ar = col("allreduce") * 1e6
        step, handoff = col("ours_step") * 1e6, col("ours_handoff") * 1e6
        release = col("ours_release") * 1e6
        row: dict[str, Any] = {"n": n}
        for name, xs in (("ours", ours), ("vllm", vllm), ("allreduce", ar)):
            row[f"{name}_us"] = _q(xs, 50)
            row[f"{name}_p25_us"], row[f"{name}_p75_us"] = _q(xs, 25), _q(xs, 75)
            row[f"{name}_p10_us"], row[f"{name}_p90_us"] = _q(xs, 10), _q(xs, 90)
        row["bound_us"] = 1.2 * row["vllm_us"] + row["allreduce_us"]
        row["ratio"] = row["ours_us"] / row["bound_us"]
        # the spread of the ratio: the quartiles of each side taken against each other
        row["ratio_low"] = row["ours_p25_us"] / (1.2 * row["vllm_p75_us"] + row["allreduce_p75_us"])
        row["ratio_high"] = row["ours_p75_us"] / (
            1.2 * row["vllm_p25_us"] + row["allreduce_p25_us"]
        )
        row["passes"] = bool(row["ratio"] <= 1.0)
        # what the worker side costs beyond the page hand-off, which vLLM's own
        # connectors do in start_load_kv, outside get_finished
        row["ratio_without_handoff"] = _q(ours - handoff, 50) / row["bound_us"]
        # the undisturbed cost: every part at its 25th percentile (this machine's
        # other work lengthens single iterations by milliseconds)
        row["ratio_p25"] = row["ours_p25_us"] / (1.2 * row["vllm_p25_us"] + row["allreduce_p25_us"])
        # each worker on its own (medians of its own times; the worse worker's):
        # a late start of one worker makes the other wait, which the slower
        # worker's time of each iteration counts (this machine, busy, does that)
        agg = col("vllm_aggregate", "rank0")
        row["ratio_per_worker"] = max(
            _q(r[f"ours/{n}"], 50)
            / (1.2 * _q(np.asarray(r[f"vllm_report/{n}"]) + agg, 50) + _q(r[f"allreduce/{n}"], 50))
            for r in per_rank
        )
        # the whole iteration's connector work: start_load_kv (each new load
        # begun, and ours' page lists of the loads found ready) and get_finished
        ours_start, vllm_start = col("ours_start") * 1e6, col("vllm_start") * 1e6
        row["ours_start_us"], row["vllm_start_us"] = _q(ours_start, 50), _q(vllm_start, 50)
        row["ours_start_handoff_us"] = _q(col("ours_start_handoff") * 1e6, 50)
        row["ratio_with_start"] = _q(ours + ours_start, 50) / (
            1.2 * _q(vllm + vllm_start, 50) + row["allreduce_us"]
        )
        floor = col("floor") * 1e6
        row["floor_us"] = _q(floor, 50)
        # its own work: the floor less its all-reduce, against vLLM's share of the bound
        row["floor_local_us"] = _q(floor - col("floor_reduce") * 1e6, 50)
        row["floor_local_p25_us"] = _q(floor - col("floor_reduce") * 1e6, 25)
        row["floor_local/vllm_share"] = row["floor_local_us"] / (1.2 * row["vllm_us"])
        row["floor_moves_per_iter"] = float(np.mean(col("floor_moves", "rank0")))
        row["floor_p25_us"] = _q(floor, 25)
        row["floor_ratio"] = row["floor_us"] / row["bound_us"]
        row["floor_ratio_p25"] = row["floor_p25_us"] / (
            1.2 * row["vllm_p25_us"] + row["allreduce_p25_us"]
        )
        row["ours_step_us"] = _q(step, 50)
        row["ours_reduce_us"] = _q(col("ours_reduce") * 1e6, 50)
        row["ours_handoff_us"] = _q(handoff, 50)
        row["ours_release_us"] = _q(release, 50)
        row["ours_rest_us"] = _q(ours - step - handoff - release, 50)
        row["vllm_report_us"] = _q(col("vllm_report") * 1e6, 50)
        row["vllm_aggregate_us"] = _q(col("vllm_aggregate", "rank0") * 1e6, 50)
        row["reduce_bytes"] = int(col("reduce_bytes", "rank0")[-1])
        row["reduces_per_step"] = float(np.mean(col("ours_reduces", "rank0")))
        row["finished_per_iter_ours"] = float(np.mean(col("ours_finished", "rank0")))
        row["finished_per_iter_vllm"] = float(np.mean(col("vllm_finished", "rank0")))
        row["in_flight_ours"] = float(np.mean(col("ours_in_flight", "rank0")))
        # writes that landed in a page not their load's (the page reuse is sound: 0)
        row["fence_violations"] = int(col("ours_violations", "rank0")[-1])
        row["samples"] = len(ours)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The verdict's table (medians, 25th-75th percentiles), then where each side
    spends its time (medians of each part, so they need not add up)."""
    lines = [
        f"{'n':>5} {'ours us':>18} {'vLLM us':>18} {'allreduce us':>16} "
        f"{'ratio':>17} pass {'w/o handoff':>11} {'p25s':>5} {'per worker':>10}"
        f" | {'start: ours':>11} {'vLLM':>5} {'with start':>10} | {'floor us':>8} {'ratio':>5} {'p25s':>5}"
        f" {'own':>5} {'/vLLM':>5}"
    ]
    for r in rows:

        def span(name: str, r: dict[str, Any] = r) -> str:
            return f"{r[f'{name}_us']:.0f} ({r[f'{name}_p25_us']:.0f}-{r[f'{name}_p75_us']:.0f})"

        lines.append(
            f"{r['n']:>5} {span('ours'):>18} {span('vllm'):>18} {span('allreduce'):>16} "
            f"{r['ratio']:>4.2f} ({r['ratio_low']:.2f}-{r['ratio_high']:.2f}) "
            f"{'yes' if r['passes'] else 'no':>4} {r['ratio_without_handoff']:>11.2f}"
            f" {r['ratio_p25']:>5.2f} {r['ratio_per_worker']:>10.2f}"
            f" | {r['ours_start_us']:>11.0f} {r['vllm_start_us']:>5.0f} {r['ratio_with_start']:>10.2f}"
            f" | {r['floor_us']:>8.0f} {r['floor_ratio']:>5.2f} {r['floor_ratio_p25']:>5.2f}"
            f" {r['floor_local_us']:>5.0f} {r['floor_local/vllm_share']:>5.2f}"
        )
    lines.append(
        f"{'n':>5} {'ours: step':>10} {'(reduce)':>8} {'handoff':>8} {'release':>8} {'rest':>6} | "
        f"{'vLLM: report':>12} {'aggregate':>9} | {'reduce B':>8} {'ends/it':>7} {'(vLLM)':>6}"
    )
    for r in rows:
        lines.append(
            f"{r['n']:>5} {r['ours_step_us']:>10.0f} {r['ours_reduce_us']:>8.0f} "
            f"{r['ours_handoff_us']:>8.0f} "
            f"{r['ours_release_us']:>8.0f} {r['ours_rest_us']:>6.0f} | "
            f"{r['vllm_report_us']:>12.0f} {r['vllm_aggregate_us']:>9.0f} | "
            f"{r['reduce_bytes']:>8} {r['finished_per_iter_ours']:>7.1f} "
            f"{r['finished_per_iter_vllm']:>6.1f}"
        )
    return "\n".join(lines)


def _print_profiles(folder: str, ns: list[int], top: int = 18) -> None:
    import pstats

    for n in ns:
        path = os.path.join(folder, f"ours-n{n}-rank0.prof")
        print(f"\n-- ours at n={n}, rank 0 (cProfile; {path}) --")
        pstats.Stats(path, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=300, help="timed iterations of each path per n")
    p.add_argument("--n", type=int, nargs="+", default=[64, 1024], help="loads in flight")
    p.add_argument("--life", type=int, default=16, help="iterations a load stays in flight")
    p.add_argument("--warmup", type=int, default=40, help="untimed iterations first")
    p.add_argument("--json", metavar="PATH", help="write the rows and the raw samples here")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="profile ours' timed calls (cProfile) into DIR and print the top of rank 0's; "
        "the run's times are then not the measurement",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds before the run is killed")
    p.add_argument(
        "--workers",
        type=int,
        choices=(1, WORLD),
        default=WORLD,
        help=f"TP workers ({WORLD}); 1: a gloo group of one, each side's own work without "
        "a round trip (the step's reduce is skipped, the bare all-reduce is one rank's)",
    )
    args = p.parse_args(argv)
    if args.reps < 1 or args.life < 1 or args.warmup < 0 or min(args.n) < 1:
        p.error("--reps, --life and every --n must be at least 1, --warmup at least 0")

    from lifecycle.testing.spawn import run_ranks

    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:  # (the ranks import overhead_subjects from here)
        sys.path.insert(0, here)
    if args.profile:
        args.profile = os.path.abspath(args.profile)
        os.makedirs(args.profile, exist_ok=True)
    load = os.getloadavg()
    work = (args.reps + args.warmup) * len(args.n)
    timeout = args.timeout or 180.0 + 0.05 * work * max(1, max(args.n) // 64)
    per_rank = run_ranks(
        _rank,
        args.workers,
        args.n,
        args.reps,
        args.life,
        args.warmup,
        args.profile,
        timeout=timeout,
        pg_timeout=120.0,
    )
    rows = summarize(per_rank, args.n)
    print(f"{args.workers} TP workers, gloo on 127.0.0.1; load average before: {load[0]:.2f}")
    print(table(rows))
    if args.profile:
        _print_profiles(args.profile, args.n)
    if args.json:
        doc = {
            "world": args.workers,
            "reps": args.reps,
            "life": args.life,
            "warmup": args.warmup,
            "load_before": list(load),
            "load_after": list(os.getloadavg()),
            "rows": rows,
            "samples": per_rank,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
