"""``pdlife bench-transfer``: a lifecycle-driven 64 MiB transfer against the
raw engine (Mooncake or NIXL) on loopback, side by side in one run.

Two processes (prefill, decode) on 127.0.0.1. Each repetition times, in
alternating order:

- ``raw``: one write of the whole buffer through the engine's own calls
  (Mooncake ``batch_transfer_async_write``; NIXL ``initialize_xfer`` +
  ``transfer``), polled to completion -- the engine's loopback throughput;
- ``lifecycle``: one request of the same bytes (pages of ``page_kib``) driven
  end to end by the lifecycle: decode receiver ``init`` + ``send_metadata``,
  prefill sender ``init`` + ``send``, both sides stepping a :class:`Stepper`
  until the agreed Success, metadata row included.

The buffer is ``buffers`` KV buffers (a model's layers) of equal size. With
``shuffle`` decode's destination pages are a fixed permutation of prefill's,
so no two pages are adjacent on both sides: every page of every buffer is a
run of its own, in both the raw write (one descriptor per page, as a
connector that sends per page does) and the lifecycle-driven one.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from pdlife.engine_output import choose, divert

__all__ = ["add_parser", "run_transfer_bench"]


def _side(
    backend: str,
    role: str,
    port: int,
    total_mib: int,
    page_kib: int,
    reps: int,
    q: Any,
    quiet: bool = True,
    buffers: int = 1,
    shuffle: bool = False,
) -> None:
    if quiet:
        divert(None)  # the engine's own lines; --verbose keeps them
    import torch
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from buffers import MetadataBuffers, MetadataLayout
    from lifecycle import RequestTable, SingleRank, Stepper
    from transport.connector.hub import ConnectorConfig
    from transport.layout import kv_args_for
    from transport.registry import get_backend

    page = page_kib * 1024
    pages = total_mib * 1024 * 1024 // page // buffers
    kv = [torch.zeros((pages, page), dtype=torch.uint8) for _ in range(buffers)]
    meta = MetadataBuffers(
        4, MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
    )
    mgr = get_backend(backend).manager(
        kv_args_for(kv, meta.buf_infos(), 0),
        ConnectorConfig(role=role, tp_rank=0, store_port=port, namespace="bench"),
    )
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    peer = "decode" if role == "prefill" else "prefill"
    store.wait([f"bench/{peer}/0/endpoint"])
    info = mgr._peer_info(0, store)  # the record the connector writes with (connected)
    # a pattern both sides can compute: decode checks every byte it received
    pattern = [((torch.arange(t.numel()) + b) % 251).to(torch.uint8).view_as(t) for b, t in enumerate(kv)]  # fmt: skip
    if role == "prefill":
        for t, want in zip(kv, pattern):
            t.copy_(want)
    verified = True
    raw_t: list[float] = []
    life_t: list[float] = []
    hand_t: list[float] = []
    idx = np.arange(pages, dtype=np.int64)
    dst = np.random.default_rng(0).permutation(pages) if shuffle else idx
    raw = _raw_runs(kv, info["kv_ptrs"], dst, page, shuffle)
    for rep in range(reps):
        for what in ("raw", "life") if rep % 2 == 0 else ("life", "raw"):
            if role == "decode" and what == "life":
                for t in kv:
                    t.zero_()  # so only this transfer can put the bytes back
            store.add(f"sync/{rep}/{what}", 1)
            if role == "decode":
                store.wait([f"go/{rep}/{what}"])
            else:
                while int(store.add(f"sync/{rep}/{what}", 0)) < 2:
                    time.sleep(0.0002)
                store.set(f"go/{rep}/{what}", "1")
            room = 1000 + rep * 2 + (what == "life")
            if what == "raw":
                if role == "prefill":
                    t0 = time.perf_counter()
                    token = mgr._write(info, *raw, b"")  # the engine's own write and poll
                    while mgr._check(token) == 0:
                        time.sleep(0.0002)
                    raw_t.append(time.perf_counter() - t0)
                    mgr._forget(token)
                continue
            table = RequestTable()
            if role == "decode":
                r = mgr.receiver(room)
                r.init()
                table.add(room, handle_index=r.index, metadata_slot=1)
                stepper = Stepper(table, 0, poller=mgr, metadata=meta)
                t0 = time.perf_counter()
                sent = False
                while True:
                    res = stepper.step(SingleRank())
                    if not sent and res.statuses[0] == 2:
                        t1 = time.perf_counter()  # handshake done: decode says where to write
                        r.send_metadata(dst, 1)
                        sent = True
                    if res.statuses[0] in (0, 4):
                        break
                    time.sleep(0.0002)
                t2 = time.perf_counter()
                life_t.append(t2 - t1)
                hand_t.append(t1 - t0)
                if res.statuses[0] != 4:
                    raise RuntimeError(
                        f"lifecycle transfer of room {room} failed: {res.failures()}"
                    )
                rows = torch.from_numpy(dst)
                verified &= all(torch.equal(t[rows], want) for t, want in zip(kv, pattern))
                verified &= meta.room_of(1) == room
                r.clear()
                meta.clear_room(1)
            else:
                meta.write(2, room, {"output_ids": [room]})
                h = mgr.sender(room)
                table.add(room, handle_index=h.index)
                stepper = Stepper(table, 0, poller=mgr)
                inited = False
                while True:
                    res = stepper.step(SingleRank())
                    if not inited and res.statuses[0] == 2:
                        h.init(pages, 2)
                        h.send(idx)
                        inited = True
                    if res.statuses[0] in (0, 4):
                        break
                    time.sleep(0.0002)
                h.clear()
    if role == "decode":
        q.put(("decode", life_t, verified))
        q.put(("handshake", hand_t, verified))
    else:
        q.put(("prefill", raw_t, True))
    time.sleep(0.5)
    mgr.close()


def _raw_runs(
    kv: list[Any], dst_ptrs: list[int], dst: Any, page: int, shuffle: bool
) -> tuple[Any, Any, Any]:
    """The raw engine's descriptors for the same bytes: one per buffer when the
    pages line up, one per page of every buffer when they are shuffled."""
    if not shuffle:
        cols = [(t.data_ptr(), d, t.nbytes) for t, d in zip(kv, dst_ptrs)]
        return tuple(np.array(c, dtype=np.int64) for c in zip(*cols))  # type: ignore[return-value]
    n = dst.size
    src = np.concatenate([t.data_ptr() + np.arange(n, dtype=np.int64) * page for t in kv])
    to = np.concatenate([d + dst.astype(np.int64) * page for d in dst_ptrs])
    return src, to, np.full(src.size, page, dtype=np.int64)


def run_transfer_bench(
    total_mib: int = 64,
    page_kib: int = 256,
    reps: int = 6,
    backend: str = "mooncake",
    verbose: bool = False,
    buffers: int = 1,
    shuffle: bool = False,
) -> dict[str, Any]:
    from lifecycle.testing.spawn import store_server

    quiet = choose(verbose)
    store = store_server(3)  # on a port the OS picks as it binds
    port = store.port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(
            target=_side,
            args=(backend, r, port, total_mib, page_kib, reps, q, quiet, buffers, shuffle),
        )
        for r in ("prefill", "decode")
    ]
    for p in procs:
        p.start()
    got = {}
    for _ in range(3):
        name, times, ok = q.get(timeout=600)
        got[name] = (times, ok)
    for p in procs:
        p.join(10)
    _ = store
    if not got["decode"][1]:
        raise RuntimeError("decode did not receive the bytes prefill wrote")
    nbytes = total_mib * 1024 * 1024
    raw = float(np.median(got["prefill"][0]))
    life = float(np.median(got["decode"][0]))
    return {
        "backend": backend,
        "bytes": nbytes,
        "page_kib": page_kib,
        "buffers": buffers,
        "shuffled": shuffle,
        # separate runs per page and buffer (the raw write's descriptors)
        "runs": buffers * (nbytes // buffers // (page_kib * 1024)) if shuffle else buffers,
        "reps": reps,
        "raw_median_s": raw,
        "lifecycle_median_s": life,
        "raw_gbps": nbytes / raw / 1e9,
        "lifecycle_gbps": nbytes / life / 1e9,
        "lifecycle/raw": raw / life,
        "handshake_median_s": float(np.median(got["handshake"][0])),
        "bytes_verified": True,
    }


#: the most repetitions: the launcher waits 600 s for each side's timings
MAX_REPS = 1000


def check_args(args: argparse.Namespace) -> None:
    """Every check of ``bench-transfer``'s flags, before a process is spawned:
    the sizes fit together and this machine, the JSON file can be written, the
    backend loads here."""
    import os

    from pdlife.args import UsageError
    from transport.errors import TransportError
    from transport.registry import get_backend

    each = args.mib * 1024 // args.buffers  # KiB per KV buffer
    if args.buffers > args.mib * 1024 or (args.mib * 1024) % args.buffers:
        raise UsageError(
            f"--buffers {args.buffers}",
            f"the {args.mib} MiB must split into equal buffers: give a count that divides "
            f"{args.mib * 1024} KiB",
        )
    if args.page_kib > each or each % args.page_kib:
        raise UsageError(
            f"--page-kib {args.page_kib}",
            f"each of the {args.buffers} buffer(s) of {each} KiB must be a whole number of "
            f"pages: give a page size that divides {each} KiB",
        )
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
    if 4 * args.mib > phys // 2:
        raise UsageError(
            f"--mib {args.mib}",
            f"the two sides hold 4 x {args.mib} MiB (a buffer and its check pattern each); "
            f"at most {phys // 8} MiB on this machine ({phys} MiB of memory)",
        )
    if args.reps > MAX_REPS:
        raise UsageError(
            f"--reps {args.reps}",
            f"at most {MAX_REPS}: the launcher waits 600 s for each side's timings",
        )
    if args.json is not None:
        out = Path(args.json)
        if out.is_dir() or not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
            raise UsageError(
                f"--json {args.json}",
                "cannot write a file there; give a file path in an existing, writable directory",
            )
    try:
        get_backend(args.backend)
    except TransportError as e:  # it names the missing package and how to install it
        raise UsageError(f"--backend {args.backend}", str(e)) from None


def _run(args: argparse.Namespace) -> int:
    check_args(args)
    res = run_transfer_bench(
        args.mib, args.page_kib, args.reps, args.backend, args.verbose, args.buffers, args.shuffle
    )
    over = {"mooncake": "Mooncake TCP", "nixl": "NIXL UCX"}[args.backend]
    shape = f"{args.buffers} buffer(s) of {args.page_kib} KiB pages" + (
        f", destination pages shuffled ({res['runs']} runs)" if args.shuffle else ""
    )
    print(
        f"{res['bytes'] >> 20} MiB ({shape}) over {over} on 127.0.0.1: "
        f"raw engine {res['raw_gbps']:.2f} GB/s, "
        f"lifecycle-driven {res['lifecycle_gbps']:.2f} GB/s "
        f"({100 * res['lifecycle/raw']:.0f}% of raw; medians of {res['reps']}); "
        f"the handshake before it took {1e3 * res['handshake_median_s']:.1f} ms; "
        "every lifecycle-driven byte and the metadata row verified on decode"
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
    p.add_argument("--page-kib", type=positive_int, default=256)
    p.add_argument("--reps", type=positive_int, default=6)
    p.add_argument("--buffers", type=positive_int, default=1, help="KV buffers (layers)")
    p.add_argument(
        "--shuffle",
        action="store_true",
        help="decode's pages a permutation of prefill's: a run per page (scattered pages)",
    )
    p.add_argument("--json")
    p.add_argument("--verbose", action="store_true", help="the engines' own log lines too")
    p.set_defaults(func=_run)
