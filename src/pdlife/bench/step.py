"""``pdlife bench``: the step against the all-reduce floor and the per-request
pattern, measured side by side in one run on 2 gloo ranks on 127.0.0.1.

For each N live requests (metadata and staging gates on) every repetition
times, back to back and in the same order on both ranks:

- ``floor``: a bare gloo MIN all-reduce of N uint8 values;
- ``hooks_floor``: the hooks ``ours`` asks (staging advance, batch poll,
  staging pending, metadata landed) over the same N rows, then the bare
  all-reduce: a bound under any step that asks them;
- ``ours``: :meth:`Stepper.step` -- batch poll, verdicts, staging and metadata
  gates, packed reduce, apply, result;
- ``pattern``: what engines do today -- a Python list of ``poll()`` calls, a
  per-request metadata check reading one tensor element each,
  ``torch.tensor``, all-reduce, ``tolist``;
- ``transitions`` (fewer repetitions): one ``transitions`` machine per
  request, the agreed status applied by a trigger per request;
- ``fused3``: three tables of N/3 requests (a decode scheduler's handshake,
  prealloc and transfer queues) stepped as one :class:`StepGroup`, one
  reduce; ``separate3``: the same three tables stepped one by one;
  ``hooks3_floor``: the hooks ``fused3`` asks (its three queues' four each,
  over the same rows), then the bare all-reduce: a bound under ``fused3``;
- ``churn``: N requests of which 1% (at least 4) change status every step (half reach
  Success, half fail: some on rank 0, the others on rank 1, which takes the
  origin fetch); between steps, untimed, the finished ones leave and as many
  new ones arrive; ``churn_one``: the same with every failure on rank 0 (the
  header names the origin: no second reduce);
- ``field``: the code a step replaces, SGLang's own ``poll_and_all_reduce``
  (``sglang.srt.disaggregation.utils``) on a field-style queue of per-request
  pollers (half waiting for input, half transferring), ungated, when SGLang is
  importable here (else skipped, and said so in one line); ``ours_field``: a
  :class:`Stepper` on the ungated queue's rooms and statuses, one batch poll;
  ``field_gated``: the same function with its metadata gate on a decode
  transfer queue, and ``ours_gated``: our step with its metadata gate on the
  same decode requests and the same metadata buffers; ``field_staged``:
  SGLang's ``poll_and_all_reduce_with_staging`` on ``ours``' own queue (its
  staging and metadata gates, the same rows). Each pair's statuses are checked
  to agree once, untimed (:mod:`pdlife.bench.field_cases`);
- ``compat`` / ``compat_gated``: the drop-in, :func:`field.step.consensus.poll_and_all_reduce`,
  on the same queues with the same arguments (its table kept across calls);
- ``overlap_visible``: ``start(worker=True)`` + ``finish`` with a 5 ms sleep
  between them standing in for the forward pass: the time the caller is
  blocked (the hooks, verdicts, gates and the launch run on the step's own
  thread during the sleep); ``overlap_inline``: the same with ``start`` doing
  that work on the caller's thread.

Ratios are of medians taken in the same run (``ratios``), and of lower
quartiles (``ratios_p25``): on a VM whose idle vCPUs halt, a collective's
latency is bimodal (a wake-up can take milliseconds) and a median can land
in either mode from one run to the next. A repetition's time is the
smaller of the two ranks' times: the ranks leave the barrier a little apart,
and the one that leaves first waits for the other inside the variant's
collective, so its time holds that skew (tens of microseconds to
milliseconds on a loaded machine) while the rank that left last waited for
nobody. Rank 0's own medians are kept in the JSON as ``rank0_median_us``.
Table mutation (add and remove 10,000 requests) and memory per live request
are measured on rank 0.

``churn_spans`` (the churn step feeding live spans) and ``churn_twin`` (the
churn step again, on a queue of its own) are timed back to back with
``churn``, in an order that turns, and their ratios to it are also given as
the median of the repetitions' own ratios (``paired``): ``churn_twin``'s is
what that measurement scatters by itself. After the two ranks, the
parent process times the churn step against a step where nothing changes,
and with spans against without, with a group of one
(:mod:`pdlife.bench.one_process`, ``one_process`` in the JSON).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdlife.args import positive_int
from pdlife.bench.cases import (
    ObjPoller,
    bench_layout,
    churn_case,
    gated_queue,
    hooks_of,
    three_queues,
)
from pdlife.bench.field_cases import (
    check_agreement,
    field_calls,
    field_queue,
    field_stepper,
    gated_stepper,
    staged_view,
)
from pdlife.bench.one_process import one_process
from pdlife.bench.report import PAIRED, format_table, summarise
from pdlife.bench.table_cost import table_costs
from pdlife.spans.live import LiveSpans

__all__ = ["add_parser", "run_bench"]

SIZES = (64, 1024, 4096, 16384)
#: the one-process part's repetitions, per repetition of the two-rank part
ONE_PROCESS_REPS = 10


def _bench_size(rank: int, n: int, reps: int, t_reps: int) -> dict[str, Any]:
    import torch.distributed as dist

    from field.step.consensus import poll_and_all_reduce as compat_poll
    from lifecycle import KVPoll, TorchCollective
    from lifecycle.rules.reference import RequestMachine

    coll = TorchCollective()
    layout = bench_layout()
    stepper, backend, meta, rooms = gated_queue(rank, n, layout)
    # the pattern's per-request objects
    pollers = [ObjPoller() for _ in range(n)]
    slots = list(range(n))
    room_list = rooms.tolist()
    meta_rooms = meta.tensors["bootstrap_room"]
    staging_left = backend.scatter_left
    group = None
    floor_buf = torch.zeros(n, dtype=torch.uint8)

    def floor() -> None:
        dist.all_reduce(floor_buf, op=dist.ReduceOp.MIN, group=group)

    def ours() -> None:
        stepper.step(coll)

    def ours_holds() -> None:
        # the same step recording its gates' holds, as a trace (and so the
        # spans built from it) asks: what observing the gates costs the step
        stepper.record_holds = True
        stepper.step(coll)
        stepper.record_holds = False

    hooks = hooks_of(backend, meta, rooms)

    def hooks_floor() -> None:
        # the hooks ``ours`` calls, over the same rows, then the bare reduce:
        # what any step that asks them costs before doing anything of its own
        hooks()
        floor()

    def pattern() -> None:
        polls = [int(p.poll()) for p in pollers]
        for i in range(n):
            if polls[i] == 4 and (
                staging_left[i] > 0 or int(meta_rooms[slots[i], 0].item()) != room_list[i]
            ):
                polls[i] = 3
        t = torch.tensor(polls, dtype=torch.uint8)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        t.tolist()

    fused3, separate3, hooks3 = three_queues(rank, n, layout, coll)

    def hooks3_floor() -> None:
        # the three fused queues' hooks, then the bare reduce: fused3's own bound
        hooks3()
        floor()

    churn = churn_case(rank, n, coll)
    churn_twin = churn_case(rank, n, coll)  # the same again: the pairs' own scatter
    churn_one = churn_case(rank, n, coll, split=False)
    # the same churn with live spans at the default volume (rank 0 the lead: it
    # keeps every request's spans); the step hands over its changed rows, and
    # the spans are taken untimed, as an exporter's thread takes them
    # (pdlife.spans.otel.LiveExport)
    live = LiveSpans("decode", rank, "bench", lead=rank == 0)
    churn_spans_step = churn_case(rank, n, coll, spans=live)

    def churn_spans() -> float:
        took: float = churn_spans_step()
        live.take()
        return took

    def overlapped(worker: bool) -> Any:
        def visible() -> float:
            t0 = time.perf_counter()
            stepper.start(coll, worker=worker)
            t1 = time.perf_counter()
            time.sleep(0.005)  # the forward pass
            t2 = time.perf_counter()
            stepper.finish()
            return (t1 - t0) + (time.perf_counter() - t2)

        return visible

    fc = field_calls()
    f_ungated, f_gated, f_reqs, f_meta = field_queue(n)
    f_stepper = field_stepper(rank, n)
    g_stepper = gated_stepper(rank, f_gated, f_reqs, f_meta)
    s_pollers, s_reqs, s_left, s_meta = staged_view(backend, meta, rooms)

    def field() -> list[int]:
        return fc.poll(f_ungated, group)  # type: ignore[no-any-return]

    def field_gated() -> list[int]:
        return fc.poll(f_gated, group, decode_reqs=f_reqs, metadata_buffers=f_meta)  # type: ignore[no-any-return]

    def field_staged() -> list[int]:
        return fc.staged(s_reqs, s_left, group, metadata_buffers=s_meta, pollers=s_pollers)  # type: ignore[no-any-return]

    def compat() -> None:
        compat_poll(f_ungated, group)

    def ours_field() -> None:
        f_stepper.step(coll)

    def ours_gated() -> None:
        g_stepper.step(coll)

    def compat_gated() -> list[int]:
        return compat_poll(f_gated, group, decode_reqs=f_reqs, metadata_buffers=f_meta)

    variants = {
        "floor": floor,
        "ours": ours,
        "ours_holds": ours_holds,
        "ours_field": ours_field,
        "ours_gated": ours_gated,
        "hooks_floor": hooks_floor,
        "pattern": pattern,
        "fused3": fused3,
        "separate3": separate3,
        "hooks3_floor": hooks3_floor,
        "churn": churn,
        "churn_one": churn_one,
        "churn_spans": churn_spans,
        "churn_twin": churn_twin,
        "overlap_visible": overlapped(True),
        "overlap_inline": overlapped(False),
        "compat": compat,
        "compat_gated": compat_gated,
    }
    if fc.poll is not None:
        variants["field"] = field
        variants["field_gated"] = field_gated
        variants["field_staged"] = field_staged
    for f in variants.values():  # warm-up (also sizes the steps' capacities)
        for _ in range(3):
            f()
    # the pairs compared must do the same work: once, untimed, on both ranks alike
    if fc.poll is not None:
        check_agreement(
            [
                ("ours_field", lambda: f_stepper.step(coll), "field", field),
                ("ours_gated", lambda: g_stepper.step(coll), "field_gated", field_gated),
                ("ours", lambda: stepper.step(coll), "field_staged", field_staged),
            ],
            {
                "field_gated": lambda: fc.poll(f_gated, group),
                "field_staged": lambda: fc.poll(s_pollers, group),
            },
        )
    else:  # without the field, our drop-in stands in for its gated call
        check_agreement(
            [("ours_gated", lambda: g_stepper.step(coll), "compat_gated", compat_gated)], {}
        )
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants.items())
    # a new order every repetition, the same on both ranks (their collectives
    # pair up): what ran before decides how cold the caches are and whether
    # the vCPU sat idle, and a rotation would put each variant after the same
    # one every time (one of them after overlap_inline's 5 ms sleep)
    shuffle = np.random.default_rng(n)

    def timed(name: str, f: Any) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        visible = f()
        elapsed = time.perf_counter() - t0
        times[name].append(visible if isinstance(visible, float) else elapsed)

    partners = {p for members in PAIRED.values() for p in members}
    for rep in range(reps):
        for i in shuffle.permutation(len(order)).tolist():
            name, f = order[i]
            if name in partners:
                continue  # timed beside its base
            if name not in PAIRED:
                timed(name, f)
                continue
            # timed back to back, in an order that turns: the machine's state
            # (a halted vCPU, cold caches) is alike for all of them
            members = [name, *PAIRED[name]]
            turn = rep % len(members)
            for member in members[turn:] + members[:turn]:
                timed(member, variants[member])
    # one transitions machine per request, one trigger per request per step
    t0 = time.perf_counter()
    machines = [RequestMachine(int(r), rank, initial=KVPoll.Bootstrapping) for r in room_list]
    create = (time.perf_counter() - t0) / n
    agreed_seq = [KVPoll.WaitingForInput, KVPoll.Transferring]
    tr_times = []
    for k in range(t_reps):
        if k == 2:  # reset (not timed) so every timed step moves every machine
            for m in machines:
                m.state = KVPoll.Bootstrapping
        target = agreed_seq[k % 2]
        dist.barrier()
        t0 = time.perf_counter()
        polls = [int(p.poll()) for p in pollers]
        tt = torch.tensor(polls, dtype=torch.uint8)
        dist.all_reduce(tt, op=dist.ReduceOp.MIN, group=group)
        for m in machines:
            m.advance(target)
        tr_times.append(time.perf_counter() - t0)
        if k % 2 == 1:
            for m in machines:
                m.state = KVPoll.Bootstrapping
    for m in machines:
        m.close()
    times["transitions"] = tr_times
    return {"times": times, "create_machine_us": create * 1e6}


def _bench_rank(
    rank: int, world: int, sizes: tuple[int, ...], reps: int, t_reps: int
) -> dict[str, Any]:
    out: dict[str, Any] = {"sizes": {}}
    for n in sizes:
        out["sizes"][str(n)] = _bench_size(rank, n, reps, t_reps)
    if rank == 0:
        out["table"] = table_costs()
    return out


def run_bench(sizes: tuple[int, ...], reps: int, t_reps: int) -> dict[str, Any]:
    from lifecycle.testing.spawn import run_ranks

    results = run_ranks(_bench_rank, 2, sizes, reps, t_reps, timeout=1800, pg_timeout=300)
    res: dict[str, Any] = {
        "sizes": {n: summarise([r["sizes"][n] for r in results]) for n in results[0]["sizes"]},
        "table": results[0]["table"],
        "one_process": one_process(sizes, ONE_PROCESS_REPS * reps),
    }
    why = field_calls().why
    if why:
        res["field_skipped"] = why
    import os
    import platform

    res["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "ranks": 2,
        "transport": "gloo over 127.0.0.1",
        "reps": reps,
        "transitions_reps": t_reps,
    }
    return res


def _sizes(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers, e.g. 64,1024"
        ) from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be at least 1, got {text!r}")
    return out


def _run(args: argparse.Namespace) -> int:
    res = run_bench(args.sizes, args.reps, args.transitions_reps)
    print(format_table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench", help="step cost vs. the all-reduce floor and the per-request pattern"
    )
    p.add_argument("--sizes", type=_sizes, default=SIZES, help="comma-separated request counts")
    p.add_argument("--reps", type=positive_int, default=200)
    p.add_argument("--transitions-reps", type=positive_int, default=6)
    p.add_argument("--json", help="write medians, p90s and ratios here")
    p.set_defaults(func=_run)
