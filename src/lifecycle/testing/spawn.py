"""Run a function on W real gloo ranks on 127.0.0.1, with a hard timeout.

Each rank is a spawned process that joins a gloo group (TCP rendezvous on a
free loopback port) and calls ``fn(rank, world_size, *args)``. The return
values come back in rank order; an exception in a rank is re-raised in the
parent with the rank's traceback; a rank still running at ``timeout`` is
killed and :class:`RanksTimedOut` names it, so a hung collective fails a test
instead of blocking CI.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = [
    "rank_context",
    "run_ranks",
    "on_threads",
    "RanksTimedOut",
    "RankError",
    "free_port",
    "store_server",
]


class RanksTimedOut(RuntimeError):
    def __init__(self, ranks: list[int], timeout: float) -> None:
        self.ranks = ranks
        super().__init__(f"rank(s) {ranks} still running after {timeout} s; killed")


class RankError(RuntimeError):
    def __init__(self, rank: int, exc_repr: str, tb: str) -> None:
        self.rank = rank
        self.exc_repr = exc_repr
        super().__init__(f"rank {rank} raised {exc_repr}\n{tb}")


def free_port() -> int:
    """A port that was free a moment ago. Another process may take it before
    it is bound again: for a store, use :func:`store_server`, which lets the
    OS choose the port as it binds."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def store_server(workers: int = 1, timeout: float = 60.0) -> Any:
    """A ``TCPStore`` server on 127.0.0.1, on a port the OS chose as it bound
    it (``.port``): no window in which another process can take the port."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(
        "127.0.0.1",
        0,
        workers,
        is_master=True,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    pg_timeout: float,
    args: tuple[Any, ...],
    out: Any,
) -> None:
    import torch.distributed as dist
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=pg_timeout),
        )
        try:
            result = fn(rank, world, *args)
            try:
                payload = pickle.dumps(("ok", result))
            except Exception as e:  # an unpicklable result is a test bug; say so
                payload = pickle.dumps(("err", repr(e), traceback.format_exc()))
            out.put((rank, payload))
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    except BaseException as e:
        out.put((rank, pickle.dumps(("err", repr(e), traceback.format_exc()))))


def rank_context() -> Any:
    """The multiprocessing context rank processes start from: a fork server
    that imported torch.distributed and lifecycle once (nothing runs there, and
    it loads no transfer engine), instead of a fresh interpreter importing them
    anew for each rank (about 2 s of CPU on a small machine).

    A rank started from it inherits the fork server's environment, which is
    the caller's as it was when the server first started (the first call in
    the process), not as it is now: set what the ranks read before then, or
    pass it to them as an argument."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch.distributed", "lifecycle"])
    return ctx


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    pg_timeout: float = 20.0,
    allow_errors: bool = False,
) -> list[Any]:
    """Run ``fn`` on ``world_size`` gloo ranks; returns results in rank order.

    With ``allow_errors`` a rank's exception is returned in its place as a
    :class:`RankError` instead of raised.
    """
    ctx = rank_context()
    out = ctx.Queue()
    server = store_server(world_size)  # the ranks' rendezvous, held until they end
    port = server.port
    procs = [
        ctx.Process(
            target=_entry, args=(fn, r, world_size, port, pg_timeout, args, out), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RanksTimedOut(sorted(set(range(world_size)) - set(results)), timeout)
            try:
                rank, payload = out.get(timeout=min(left, 0.5))
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in results and not p.is_alive() and p.exitcode not in (0, None):
                        results[r] = RankError(r, f"exit code {p.exitcode}", "(process died)")
                continue
            msg = pickle.loads(payload)
            results[rank] = msg[1] if msg[0] == "ok" else RankError(rank, msg[1], msg[2])
    finally:
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
    ordered = [results[r] for r in range(world_size)]
    if not allow_errors:
        for res in ordered:
            if isinstance(res, RankError):
                raise res
    return ordered


def on_threads(fns: list[Callable[[], Any]], timeout: float = 30.0) -> list[Any]:
    """Call each of ``fns`` on a thread of its own (ranks of a simulated world);
    each one's result, or the exception it raised, in order."""
    from concurrent.futures import ThreadPoolExecutor

    out: list[Any] = []
    with ThreadPoolExecutor(len(fns)) as pool:
        for fut in [pool.submit(f) for f in fns]:
            try:
                out.append(fut.result(timeout=timeout))
            except Exception as e:
                out.append(e)
    return out
