"""``pdlife engine-memory``: the Mooncake engine's own memory per batch, with
none of this package's code in the loop.

Two processes on 127.0.0.1: a target that registers a buffer, and a writer
that submits ``--batches`` writes per request with ``--entries`` entries each
(``batch_transfer_async_write``) and polls each to completion
(``transfer_check_status``), then samples its RSS. Prints the RSS growth per
request after warm-up (a fifth of the requests), so multi-entry batches can be
compared with single-entry ones side by side.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

from pdlife.args import positive_int

__all__ = ["add_parser", "engine_rss_per_request"]

_BUF = 1 << 22


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _target(q: Any, done: Any) -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    buf = np.zeros(_BUF, np.uint8)
    e.register_memory(buf.ctypes.data, buf.nbytes)
    q.put((f"127.0.0.1:{e.get_rpc_port()}", buf.ctypes.data))
    done.wait(600)


def engine_rss_per_request(
    requests: int, entries: int, batches: int, item: int = 256, settle_s: float = 0.0
) -> dict[str, float]:
    """RSS of the writing engine before and after, and bytes per request after warm-up."""
    os.environ.setdefault("GLOG_minloglevel", "2")
    from mooncake.engine import TransferEngine

    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_target, args=(q, done))
    p.start()
    try:
        endpoint, remote = q.get(timeout=60)
        e = TransferEngine()
        e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        buf = np.ones(_BUF, np.uint8)
        e.register_memory(buf.ctypes.data, buf.nbytes)
        base = buf.ctypes.data
        slots = _BUF // 4096
        samples: list[tuple[int, float]] = []
        for i in range(requests):
            bids = []
            for j in range(batches):
                offs = [((i * 97 + j * 13 + k * 7) % slots) * 4096 for k in range(entries)]
                bids.append(
                    e.batch_transfer_async_write(
                        endpoint,
                        [base + o for o in offs],
                        [remote + o for o in offs],
                        [item] * entries,
                    )
                )
            if settle_s:
                time.sleep(settle_s)  # every entry has landed before the first poll
            pending = set(bids)
            while pending:  # as the backend does: poll each batch until it reports
                pending = {b for b in pending if e.transfer_check_status(b) == 0}
            if i % max(requests // 20, 1) == 0:
                samples.append((i, _rss_mib()))
        samples.append((requests, _rss_mib()))
    finally:
        done.set()
        p.join(10)
    warm = [s for s in samples if s[0] >= requests // 5]
    per = (warm[-1][1] - warm[0][1]) * 2**20 / max(warm[-1][0] - warm[0][0], 1)
    return {"rss_start_mib": samples[0][1], "rss_end_mib": samples[-1][1], "bytes_per_request": per}


def _run(args: argparse.Namespace) -> int:
    from transport.backends.mooncake import probe

    probe()
    settle = args.settle_ms / 1000
    for entries, batches in ((args.entries, args.batches), (1, args.entries * args.batches)):
        r = engine_rss_per_request(args.requests, entries, batches, settle_s=settle)
        print(
            f"{args.requests} requests x {batches} batches of {entries} entries"
            f"{f', polled after {args.settle_ms} ms' if settle else ''}: RSS "
            f"{r['rss_start_mib']:.1f} -> {r['rss_end_mib']:.1f} MiB, "
            f"{r['bytes_per_request']:.0f} bytes per request after warm-up"
        )
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "engine-memory",
        help="the Mooncake engine's RSS per request, multi- vs single-entry batches",
    )
    p.add_argument("--requests", type=positive_int, default=6000)
    p.add_argument("--entries", type=positive_int, default=8, help="entries per batch")
    p.add_argument("--batches", type=positive_int, default=5, help="batches per request")
    p.add_argument(
        "--settle-ms", type=float, default=0.0, help="wait this long before the first poll"
    )
    p.set_defaults(func=_run)
