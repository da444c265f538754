"""``pdlife simulate``'s command line checked and turned into a :class:`SimConfig`:
the backend, the fault plan, the topology flags and the metrics ports, all
before anything is started."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import attrs

from lifecycle.errors import FaultPlanError
from pdlife.args import SimConfigError, UsageError, writable_dir
from pdlife.cluster.config import MAX_WORLD, STATE_SPLIT_GRAIN, SimConfig, longest_ask
from pdlife.cluster.plan_doc import MAX_PAUSE_S, FaultPlan, TargetedFault, load_plan
from pdlife.cluster.topology import topology_problem
from pdlife.run.launch import apart

__all__ = [
    "FLAGS",
    "backend_name",
    "pick_backend",
    "sim_config",
    "staging_note",
    "shape",
    "torchrun",
]


def backend_name(requested: str) -> str:
    """``requested`` checked against the known backends (nothing loaded): its
    lower-case name, or ``auto``."""
    from transport.registry import known_backends

    if requested != "auto" and requested.lower() not in known_backends():
        raise UsageError(
            f"--backend {requested}",
            f"unknown backend; choose auto or one of {', '.join(known_backends())}",
        )
    return requested.lower()


def pick_backend(requested: str) -> tuple[str, str]:
    """(backend, why) -- ``auto`` takes Mooncake when it is installed and works here.

    A backend named explicitly must load here, or this raises :class:`UsageError`.
    """
    if backend_name(requested) != "auto":
        from transport.errors import TransportError
        from transport.registry import get_backend

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


def _plan(args: argparse.Namespace, world: int, requests: int) -> FaultPlan:
    try:
        plan = load_plan(args.plan) if args.plan else FaultPlan()
    except FaultPlanError as e:  # an unreadable or malformed file
        raise UsageError("--plan", str(e)) from None
    flags: dict[str, str] = {}  # a fault a flag added (its field prefix) -> the flag
    try:
        if args.fail_prob:
            plan = attrs.evolve(plan, seed=args.seed, prob=args.fail_prob)
        elif plan.prob == 0.0:
            from lifecycle.faults import from_env

            env = from_env()
            if env is not None:  # the field's per-step knob keeps its per-step meaning
                plan = attrs.evolve(plan, seed=env.seed, prob=env.prob, mode="step")
        if args.kill_rank is not None:
            kill = TargetedFault("kill_rank", args.kill_rank, step=args.kill_step)
            flags[f"faults[{len(plan.faults)}]"] = "--kill-rank"
            plan = attrs.evolve(plan, faults=(*plan.faults, kill))
        if args.pause_rank is not None:
            pause = TargetedFault(
                "pause_rank", args.pause_rank, step=args.pause_step, seconds=args.pause_seconds
            )
            flags[f"faults[{len(plan.faults)}]"] = "--pause-rank"
            plan = attrs.evolve(plan, faults=(*plan.faults, pause))
        plan.validate_against(world, requests if not args.soak else 2**62)
    except FaultPlanError as e:
        where = "--plan" if args.plan else "fault options"
        for prefix, flag in flags.items():
            if e.field == prefix or e.field.startswith(prefix + "."):
                where = flag
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
    longest = longest_ask(args.max_pages_per_request, args.prefix_pages)
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
    if args.state_split and not args.state:
        raise UsageError("--state-split", "splits the state rows by TP; add --state")
    if args.state_split and (STATE_SPLIT_GRAIN % p or STATE_SPLIT_GRAIN % d):
        raise UsageError(
            "--state-split",
            f"the simulated state rows are split in blocks of at least {STATE_SPLIT_GRAIN} "
            f"units; TP sizes {p} and {d} must both divide it",
        )
    return {
        "prefill_dp": args.prefill_dp,
        "mla": args.mla,
        "kv_heads": heads,
        "page_size": args.page_size,
        "state": args.state,
        "state_split": args.state_split,
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


def torchrun() -> bool:
    """Started by torchrun (its env:// variables are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def _check_pauses(args: argparse.Namespace, plan: FaultPlan) -> None:
    """A pause must end before the run's clocks call the rank dead or hung."""
    where = "--pause-rank" if args.pause_rank is not None else "--plan"
    prefill_ranks = args.prefill * args.prefill_dp
    for f in plan.faults:
        if f.kind != "pause_rank":
            continue
        group = args.prefill if f.rank < prefill_ranks else args.decode
        if group > 1 and f.seconds >= args.pg_timeout:
            raise UsageError(
                where,
                f"rank {f.rank} pauses {f.seconds:g} s, not less than --pg-timeout "
                f"{args.pg_timeout:g}: its TP group would call it dead; raise --pg-timeout "
                "or pause for less (to kill a rank, use --kill-rank)",
            )
        if f.seconds >= args.timeout:
            raise UsageError(
                where,
                f"rank {f.rank} pauses {f.seconds:g} s, not less than --timeout "
                f"{args.timeout:g}: the run would be stopped as hung",
            )


#: the command line's name of each SimConfig field a flag sets
FLAGS = {
    "prefill": "--prefill-tp",
    "decode": "--decode-tp",
    "prefill_dp": "--prefill-dp",
    "mla": "--mla",
    "kv_heads": "--kv-heads",
    "page_size": "--page-size",
    "state": "--state",
    "state_split": "--state-split",
    "staging": "--staging",
    "staging_pages": "--staging-pages",
    "prefix_pages": "--prefix-pages",
    "max_pages": "--max-pages-per-request",
    "requests": "--requests",
    "seed": "--seed",
    "abort_prob": "--abort-prob",
    "max_steps": "--max-steps",
    "backend": "--backend",
    "pg_timeout": "--pg-timeout",
    "waiting_timeout_s": "--waiting-timeout",
    "timeline": "--timeline",
    "live_spans": "--live-spans",
    "metrics_port": "--metrics-port",
    "plan": "--plan",
    "fault_mode": "--fault-mode",
    "soak": "--soak",
    "recovery": "--recovery",
    "max_attempts": "--max-attempts",
    "corrupt_prob": "--corrupt-prob",
    "digest": "--digest",
}


def _outage_as_pause(args: argparse.Namespace, prefill_ranks: int) -> None:
    """--peer-outage R:S:T is prefill rank R's process stopping at step S for T s."""
    if getattr(args, "peer_outage", None) is None:
        return
    rank, step, secs = args.peer_outage
    flag = f"--peer-outage {rank}:{step}:{secs:g}"
    if args.pause_rank is not None:
        raise UsageError(flag, "is a pause of a prefill rank: drop --pause-rank (or this flag)")
    if rank >= prefill_ranks:
        raise UsageError(flag, f"names a prefill rank's outage; choose 0..{prefill_ranks - 1}")
    args.pause_rank, args.pause_step, args.pause_seconds = rank, step, secs


def _flags_alone(args: argparse.Namespace) -> int:
    """The checks of the flags that need nothing but the flags; the run's world."""
    world = int(args.prefill * args.prefill_dp + args.decode)
    _outage_as_pause(args, int(args.prefill * args.prefill_dp))
    if world > MAX_WORLD:
        raise UsageError(
            "--prefill-tp/--prefill-dp/--decode-tp",
            f"{world} ranks on one machine; use at most {MAX_WORLD}",
        )
    for rank, flag in ((args.kill_rank, "--kill-rank"), (args.pause_rank, "--pause-rank")):
        if rank is not None and not 0 <= rank < world:
            raise UsageError(f"{flag} {rank}", f"not a rank of this run; choose 0..{world - 1}")
    if args.kill_rank is None and args.kill_step is not None:
        raise UsageError("--kill-step", "say which rank is killed: --kill-rank R")
    if args.pause_rank is None and (args.pause_step, args.pause_seconds) != (None, None):
        raise UsageError("--pause-step/--pause-seconds", "say which rank pauses: --pause-rank R")
    args.kill_step = 5 if args.kill_step is None else args.kill_step
    args.pause_step = 5 if args.pause_step is None else args.pause_step
    args.pause_seconds = 3.0 if args.pause_seconds is None else args.pause_seconds
    for rank, flag, step in (
        (args.kill_rank, "--kill-step", args.kill_step),
        (args.pause_rank, "--pause-step", args.pause_step),
    ):
        if rank is not None and step > args.max_steps:
            raise UsageError(
                f"{flag} {step}",
                f"after the run's last step (--max-steps {args.max_steps}): it would never "
                "happen; choose an earlier step or raise --max-steps",
            )
    if args.pause_seconds > MAX_PAUSE_S:
        raise UsageError(
            f"--pause-seconds {args.pause_seconds:g}",
            f"at most {MAX_PAUSE_S:g} s; a longer stall is a dead rank (--kill-rank)",
        )
    if args.metrics_port and args.metrics_port + world - 1 > 65535:
        raise UsageError(
            f"--metrics-port {args.metrics_port}",
            f"rank r serves on port + r, so it must be at most {65536 - world}",
        )
    if args.soak is not None and args.requests_given:
        raise UsageError("--soak", "admits requests for that long; drop --requests")
    if args.role is not None and not torchrun():
        raise UsageError(
            f"--role {args.role}",
            "says which side a node's ranks serve under torchrun; without torchrun "
            "the ranks are placed by rank number: drop --role",
        )
    return world


def _steps_of(plan: FaultPlan, max_steps: int) -> None:
    """A plan's targeted fault at a step after the last one would never fire."""
    for i, f in enumerate(plan.faults):
        if f.step is not None and f.step > max_steps:
            raise UsageError(
                "--plan",
                f"faults[{i}].step {f.step} is after the run's last step (--max-steps "
                f"{max_steps}): it would never fire",
            )


def _real_only(args: argparse.Namespace, backend: str) -> None:
    """A flag that sets a real transport's wall-clock deadline means nothing to
    the fake backend, which counts steps."""
    if backend == "fake" and args.waiting_timeout is not None:
        raise UsageError(
            f"--waiting-timeout {args.waiting_timeout:g}",
            "is a real transport's deadline in seconds; the fake backend counts steps "
            "(200): drop it or choose --backend mooncake or nixl",
        )


def _build(args: argparse.Namespace, plan: FaultPlan, backend: str) -> SimConfig:
    """The SimConfig of the flags; a field it refuses is named by its flag."""
    try:
        return SimConfig(
            prefill=args.prefill,
            decode=args.decode,
            requests=args.requests if args.soak is None else 2**31 - 1,
            seed=args.seed,
            abort_prob=args.abort_prob,
            max_steps=args.max_steps,
            backend=backend,
            pg_timeout=args.pg_timeout,
            **({} if args.waiting_timeout is None else {"waiting_timeout_s": args.waiting_timeout}),
            metrics_port=args.metrics_port,
            timeline=args.timeline,
            live_spans=args.live_spans,
            plan=plan,
            fault_mode=args.fault_mode,
            soak=args.soak,
            recovery=args.recovery,
            max_attempts=args.max_attempts,
            corrupt_prob=args.corrupt_prob,
            digest=args.digest,
            **_topology(args),
        )
    except SimConfigError as e:
        flag = FLAGS.get(e.field, e.field)
        raise UsageError(f"{flag} {e.value}", f"expected {e.allowed}") from None


def sim_config(args: argparse.Namespace) -> tuple[SimConfig, str]:
    """Every check of the command line, before anything is started: first all
    the flags' own (nothing touched), then the probes of this machine: the
    metrics ports are free, the output directory is writable, the backend
    loads."""
    world = _flags_alone(args)
    requested = backend_name(args.backend)
    _real_only(args, requested)
    plan = _plan(args, world, args.requests)
    _steps_of(plan, args.max_steps)
    _check_pauses(args, plan)
    # "auto" may take Mooncake, which stages: the largest memory it could need
    cfg = _build(args, plan, "mooncake" if requested == "auto" else requested)
    if args.metrics_port:  # (0: each rank binds a port the OS picks)
        _check_ports(args.metrics_port, world)
    writable_dir(Path(args.out), "--out")
    # last: loading an engine's library may open its own sockets; in a child,
    # so that its threads never run in a launcher that forks ranks
    backend, why = apart(pick_backend, args.backend, what=f"--backend {args.backend}")
    _real_only(args, backend)
    return attrs.evolve(cfg, backend=backend), why


def shape(cfg: SimConfig) -> str:
    """``2P + 2D ranks``, or e.g. ``2x2P (DP 2) + 4D ranks, MLA, staging``."""
    dp = f"{cfg.prefill_dp}x{cfg.prefill}P (DP {cfg.prefill_dp})" if cfg.prefill_dp > 1 else ""
    text = f"{dp or f'{cfg.prefill}P'} + {cfg.decode}D ranks"
    extras = [
        "MLA" if cfg.mla else f"{cfg.total_heads} KV heads",
        f"page size {cfg.page_size}" if cfg.page_size > 1 else "",
        ("state split by TP" if cfg.state_split else "state") if cfg.state else "",
        "staging" if cfg.staging else "",
        f"cached prefix {cfg.prefix_pages} pages" if cfg.prefix_pages else "",
    ]
    return ", ".join([text, *(e for e in extras if e)])
