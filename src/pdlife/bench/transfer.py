"""``pdlife bench-transfer``: a lifecycle-driven transfer against the raw
engine (Mooncake or NIXL) on loopback, side by side in one run.

One process per TP rank, prefill and decode, on 127.0.0.1 (one of each by
default). Each repetition times, back to back and each first in turn (so a
repetition is a pair, and ``lifecycle/raw`` is the median of the pairs'
own ratios, reported with its quartiles and extremes):

- ``raw`` (``raw-1:1``): every prefill rank writes its share of the bytes
  through the engine's own calls (Mooncake ``batch_transfer_async_write``;
  NIXL ``initialize_xfer`` + ``transfer``), polled to completion, laid out as
  whole pages on both sides -- the engine's loopback throughput for the same
  bytes between the same ranks;
- ``lifecycle``: one request of the same bytes driven end to end by the
  lifecycle: each decode rank's receiver ``init`` + ``send_metadata``, each
  prefill rank's sender ``init`` + ``send``, every rank stepping a
  :class:`Stepper` until the agreed Success, metadata row included.

The default case is today's 1:1 one: pages of ``page_kib`` whole bytes. Given
differing TP sizes (``--prefill-tp``, ``--decode-tp``) or a head geometry
(``--page-tokens``, ``--head-dim``, ``--kv-heads``), pages hold tokens x heads
and every prefill rank writes its heads of each page into the decode ranks
that hold them (head slices, see :mod:`transport.topology`), while ``raw-1:1``
moves the same bytes between the same ranks as whole pages
(:mod:`pdlife.bench.transfer_shape`). Each decode rank checks every byte of
its pages against the model's after each request, outside the timed window.

The KV is ``buffers`` buffers (a model's layers) of equal size. With
``shuffle`` decode's destination pages are a fixed permutation of prefill's,
so no two pages are adjacent on both sides: every page of every buffer is a
run of its own, in both the raw write (one descriptor per page, as a
connector that sends per page does) and the lifecycle-driven one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from pdlife.bench.report import pair_ratios
from pdlife.bench.transfer_args import check_args, heads_flags
from pdlife.bench.transfer_rank import rank_main
from pdlife.bench.transfer_shape import Shape, shape_of
from pdlife.engine_output import choose

__all__ = ["add_parser", "run_transfer_bench"]


#: how the summary line names each --layout
_LAYOUT_TEXT = {"token": "token-major", "head": "head-major", "group": "cut in head groups"}


def _span(per_rank: list[list[tuple[float, float]]]) -> list[float]:
    """Per repetition: from the first rank's start to the last rank's end."""
    return [max(e for _, e in rep) - min(s for s, _ in rep) for rep in zip(*per_rank)]


def run_transfer_bench(
    total_mib: int = 64,
    page_kib: int | None = 256,
    reps: int = 6,
    backend: str = "mooncake",
    verbose: bool = False,
    buffers: int = 1,
    shuffle: bool = False,
    step_us: int = 200,
    digest: bool = False,
    timeline: bool = False,
    **heads: Any,
) -> dict[str, Any]:
    """One run of every part, side by side (``step_us``: each rank's pause between
    steps; ``heads``: :func:`shape_of`'s TP sizes, head geometry, layout, staging;
    ``timeline``: every rank's connector timeline kept, as ``timeline_tracks``,
    and each lifecycle-driven request's hops, as ``hops_ms``)."""
    from lifecycle.testing.spawn import rank_context, store_server

    shape = shape_of(total_mib, page_kib, buffers, shuffle, **heads)
    quiet = choose(verbose)
    ranks = [("prefill", r) for r in range(shape.prefill_tp)]
    ranks += [("decode", r) for r in range(shape.decode_tp)]
    store = store_server(len(ranks) + 1)  # on a port the OS picks as it binds
    ctx = rank_context()
    q = ctx.Queue()
    procs = [
        ctx.Process(
            target=rank_main,
            args=(
                backend,
                role,
                r,
                shape,
                reps,
                store.port,
                q,
                quiet,
                step_us * 1e-6,
                digest,
                timeline,
            ),
        )
        for role, r in ranks
    ]
    for p in procs:
        p.start()
    got: dict[tuple[str, int], tuple[Any, Any, Any]] = {}
    try:
        for _ in ranks:
            role, r, times, ok, stats = q.get(timeout=600)
            if times is None:
                raise RuntimeError(f"{role} rank {r} failed: {ok}")
            got[(role, r)] = (times, ok, stats)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    if not all(got[("decode", d)][1] for d in range(shape.decode_tp)):
        raise RuntimeError("decode did not receive the bytes prefill wrote")
    pre = [got[("prefill", p)] for p in range(shape.prefill_tp)]
    dec = [got[("decode", d)] for d in range(shape.decode_tp)]
    nbytes = shape.moved_bytes()
    raw_each = _span([t["raw"] for t, _, _ in pre])
    sliced_each = _span([t["sliced"] for t, _, _ in pre])
    life_each = _span([t["life"] for t, _, _ in dec])
    pairs = pair_ratios(raw_each, life_each)
    raw, sliced, life = (float(np.median(x)) for x in (raw_each, sliced_each, life_each))
    hand = float(np.median(_span([t["handshake"] for t, _, _ in dec])))
    page_bytes = shape.page_bytes(shape.kv_heads)
    return {
        "backend": backend,
        "bytes": nbytes,
        "page_kib": page_bytes / 1024,
        "buffers": buffers,
        "shuffled": shuffle,
        "prefill_tp": shape.prefill_tp,
        "decode_tp": shape.decode_tp,
        "page_tokens": shape.page_tokens,
        "kv_heads": shape.kv_heads,
        "head_bytes": shape.head_bytes,
        "layout": shape.layout,
        "staging": shape.staging,
        # separate runs of the raw 1:1 write (per pair of ranks, page and buffer)
        "runs": _raw_count(shape),
        # entries the connector wrote per request, over every prefill rank (KV
        # runs, the metadata row's fields and its room)
        "lifecycle_runs": sum(s["writes"] for _, _, s in pre) // reps,
        "reps": reps,
        "step_us": step_us,
        "raw_median_s": raw,
        "lifecycle_median_s": life,
        "raw_gbps": nbytes / raw / 1e9,
        "lifecycle_gbps": nbytes / life / 1e9,
        # the median of the repetitions' own ratios (each a raw and a lifecycle
        # run back to back), with its spread
        "lifecycle/raw": pairs["median"],
        "lifecycle/raw_pairs": pairs,
        # the ratio of the two medians (the figure before pairs were reported)
        "lifecycle/raw_of_medians": raw / life,
        # the same numbers by the name the head-sliced case gives its baseline
        "raw-1:1_gbps": nbytes / raw / 1e9,
        "lifecycle/raw-1:1": pairs["median"],
        # the engine's own write of the connector's runs for the request: the
        # layout's cost to the engine, apart from the protocol's
        "raw_sliced_median_s": sliced,
        "raw_sliced_gbps": nbytes / sliced / 1e9,
        "raw-sliced/raw-1:1": raw / sliced,
        "lifecycle/raw-sliced": sliced / life,
        "handshake_median_s": hand,
        "bytes_verified": True,
        **(_digest_numbers(pre, dec, pairs["median"]) if digest else {"digest": False}),
        **(_timeline(got) if timeline else {}),
    }


#: a lifecycle-driven request's marks (the track, the label, its first or last
#: record), each of which can only follow the one before it, and the name of the
#: gap each ends; prefill rank 0 and decode rank 0 (the other ranks are in the trace)
HOPS = (
    (("decode 0", "page list", "first"), ""),
    (("prefill 0", "recv pages", "first"), "page list reaches prefill's connector"),
    (("prefill 0", "pages in", "first"), "prefill's step sees it"),
    (("prefill 0", "write", "first"), "init, send and the first write handed to the engine"),
    (("prefill 0", "write", "last"), "until the last write (metadata, room, note) is handed over"),
    (("decode 0", "success", "first"), "until decode's agreed Success"),
)


def _timeline(got: dict[tuple[str, int], tuple[Any, Any, Any]]) -> dict[str, Any]:
    """Every rank's timeline records, and the median of each hop over the
    lifecycle-driven requests that have every mark."""
    from transport.connector.timeline import hops

    tracks = {f"{role} {r}": stats.pop("timeline") for (role, r), (_, _, stats) in got.items()}
    per = [g for g in hops(tracks, [m for m, _ in HOPS]).values() if None not in g]
    names = [name for _, name in HOPS[1:]]
    medians = np.median(np.asarray(per, dtype=np.float64), axis=0) * 1e3 if per else ()
    return {
        "timeline_tracks": tracks,
        "hops_requests": len(per),
        "hops_ms": {name: float(ms) for name, ms in zip(names, medians, strict=False)},
    }


def _digest_cpu(side: str, stats: list[dict[str, Any]]) -> dict[str, Any]:
    """``side``'s hashing CPU time per request (summed over its ranks; the
    median over requests) against a bare hash pass over the same byte count."""
    per_request = np.sum([s["digest_cpu_s"] for s in stats], axis=0)
    cpu = float(np.median(per_request))
    bare = float(sum(s["bare_hash_cpu_s"] for s in stats))
    return {
        f"{side}_digest_cpu_s": cpu,
        f"{side}_digest_bytes": int(sum(s["digest_bytes_per_request"] for s in stats)),
        f"{side}_bare_hash_cpu_s": bare,
        f"{side}_digest_cpu/bare": cpu / bare if bare else float("nan"),
    }


def _digest_numbers(pre: list[Any], dec: list[Any], ratio: float) -> dict[str, Any]:
    """The lifecycle-driven request ran with the KV digest: its ratio to raw, the
    hash's speed here, and what decode checked (every leg of every repetition)."""
    from transport.digest import ALGORITHM, measure

    stats = [s for _, _, s in dec]
    return {
        "digest": True,
        # per side, the median over requests of its ranks' hashing CPU time (all
        # threads), against one bare pass of the hash over as many contiguous bytes
        **_digest_cpu("prefill", [s for _, _, s in pre]),
        **_digest_cpu("decode", stats),
        "lifecycle+digest/raw": ratio,
        "hash": ALGORITHM,
        "hash_gbps_2mib": measure(2 << 20),
        "hash_gbps_64mib": measure(64 << 20),
        "digests_checked": sum(s["digests_checked"] for s in stats),
        "digest_mismatches": sum(s["digest_mismatches"] for s in stats),
    }


def _raw_count(shape: Shape) -> int:
    pairs = sum(len(shape.topology.targets(p)) for p in range(shape.prefill_tp))
    return pairs * shape.buffers * (shape.pages if shape.shuffle else 1)


def _run(args: argparse.Namespace) -> int:
    shape = check_args(args)
    res = run_transfer_bench(
        args.mib,
        args.page_kib,
        args.reps,
        args.backend,
        args.verbose,
        args.buffers,
        args.shuffle,
        args.step_us,
        args.digest,
        args.timeline is not None,
        **heads_flags(args),
    )
    over = {"mooncake": "Mooncake TCP", "nixl": "NIXL UCX"}[args.backend]
    if shape.kv_heads > 1 or shape.page_tokens > 1:
        shape_text = (
            f"{args.buffers} buffer(s) of {shape.page_tokens}-token pages of "
            f"{shape.kv_heads} heads x {shape.head_bytes} bytes, {_LAYOUT_TEXT[res['layout']]}"
            f"{', staged on decode' if shape.staging else ''}; "
            f"prefill TP {shape.prefill_tp} -> decode TP {shape.decode_tp}"
        )
        raw_name = "raw engine 1:1 (whole pages)"
    else:
        shape_text = f"{args.buffers} buffer(s) of {res['page_kib']:.0f} KiB pages"
        raw_name = "raw engine"
    if args.shuffle:
        shape_text += ", destination pages shuffled"
    print(
        f"{res['bytes'] >> 20} MiB ({shape_text}) over {over} on 127.0.0.1: "
        f"{raw_name} {res['raw_gbps']:.2f} GB/s ({res['runs']} runs), "
        f"lifecycle-driven {res['lifecycle_gbps']:.2f} GB/s ({res['lifecycle_runs']} runs) "
        f"({100 * res['lifecycle/raw']:.0f}% of raw: the median of {res['reps']} pairs' ratios, "
        f"quartiles {100 * res['lifecycle/raw_pairs']['q1']:.0f}-"
        f"{100 * res['lifecycle/raw_pairs']['q3']:.0f}%, "
        f"extremes {100 * res['lifecycle/raw_pairs']['min']:.0f}-"
        f"{100 * res['lifecycle/raw_pairs']['max']:.0f}%); "
        f"the raw engine moved the connector's runs at {res['raw_sliced_gbps']:.2f} GB/s "
        f"({100 * res['raw-sliced/raw-1:1']:.0f}% of raw); "
        f"the handshake before it took {1e3 * res['handshake_median_s']:.1f} ms; "
        "every lifecycle-driven byte and the metadata row verified on decode"
    )
    if args.digest:
        print(
            f"with the KV digest ({res['hash']}: {res['hash_gbps_2mib']:.1f} GB/s on 2 MiB, "
            f"{res['hash_gbps_64mib']:.1f} GB/s on 64 MiB here): lifecycle+digest/raw "
            f"{100 * res['lifecycle+digest/raw']:.0f}%; {res['digests_checked']} leg digests "
            f"checked on decode, {res['digest_mismatches']} differed; the digest's CPU time "
            f"per request: prefill {1e3 * res['prefill_digest_cpu_s']:.1f} ms "
            f"({res['prefill_digest_cpu/bare']:.2f}x a bare pass over its "
            f"{res['prefill_digest_bytes'] >> 20} MiB), decode "
            f"{1e3 * res['decode_digest_cpu_s']:.1f} ms "
            f"({res['decode_digest_cpu/bare']:.2f}x)"
        )
    if args.timeline:
        from transport.connector.timeline import chrome_trace

        trace = chrome_trace(res.pop("timeline_tracks"))
        Path(args.timeline).write_text(json.dumps(trace) + "\n")
        hops = "; ".join(f"{name} {ms:.2f} ms" for name, ms in res["hops_ms"].items())
        print(
            f"where a lifecycle-driven request's time went (prefill rank 0 and decode rank 0; "
            f"medians over {res['hops_requests']} requests, from decode's page list): {hops}; "
            f"every rank's connector events in {args.timeline} (a Chrome trace: Perfetto opens it)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


def add_parser(sub: Any) -> None:
    from pdlife.args import positive_int

    p = sub.add_parser(
        "bench-transfer", help="lifecycle-driven transfer vs. the raw engine (Mooncake, NIXL)"
    )
    p.add_argument("--backend", choices=["mooncake", "nixl"], default="mooncake")
    p.add_argument("--mib", type=positive_int, default=64)
    p.add_argument(
        "--page-kib", type=positive_int, default=None, help="whole pages (1:1 case; default 256)"
    )
    p.add_argument(
        "--reps",
        type=positive_int,
        default=10,
        help="repetitions, each a raw and a lifecycle-driven run back to back (pairs)",
    )
    p.add_argument("--buffers", type=positive_int, default=1, help="KV buffers (layers)")
    p.add_argument(
        "--shuffle",
        action="store_true",
        help="decode's pages a permutation of prefill's: a run per page (scattered pages)",
    )
    p.add_argument("--prefill-tp", type=positive_int, default=1, help="prefill TP ranks")
    p.add_argument("--decode-tp", type=positive_int, default=1, help="decode TP ranks")
    p.add_argument("--page-tokens", type=positive_int, help="tokens per page (default 16)")
    p.add_argument(
        "--head-dim", type=positive_int, help="values of one head, 2 bytes each (default 128)"
    )
    p.add_argument("--kv-heads", type=positive_int, help="the model's KV heads (default 8)")
    p.add_argument(
        "--layout",
        choices=["token", "head", "group"],
        default="token",
        help="a page's heads per token (token-major), its tokens per head (head-major), "
        "or every rank's buffers cut in one region per head group (KVArgs.head_group: "
        "the largest group that both TP sizes hold whole)",
    )
    p.add_argument(
        "--staging",
        action="store_true",
        help="decode lands head slices in a staging region, then scatters them (token-major)",
    )
    p.add_argument(
        "--step-us",
        type=positive_int,
        default=200,
        help="each rank's pause between steps of the lifecycle-driven request",
    )
    p.add_argument(
        "--digest",
        action="store_true",
        help="the lifecycle-driven request with the KV digest on (ConnectorConfig.digest)",
    )
    p.add_argument("--json")
    p.add_argument(
        "--timeline",
        metavar="FILE",
        help="write every rank's connector events and the bench's marks as a Chrome trace "
        "(Perfetto opens it), and print where each lifecycle-driven request's time went "
        "(prefill rank 0 and decode rank 0)",
    )
    p.add_argument("--verbose", action="store_true", help="the engines' own log lines too")
    p.set_defaults(func=_run)
