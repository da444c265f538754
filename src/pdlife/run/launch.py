"""Starting ``pdlife simulate``'s ranks: forked from the launcher, which has
imported the simulator (torch and all) already, instead of each rank, or a
fork server, importing it anew. That import is most of what a short run costs
(about 2 s of CPU on a small machine).

Forking is safe only from a process that runs no Python thread besides its
main one and has loaded no transfer engine: the native threads torch and
numpy's BLAS start as they import (as many as the machine has cores, less
one) have fork handlers of their own, but an engine's threads (Mooncake
starts five as it imports) would be missing in the child, with whatever they
held. So the launcher never loads an engine: the backend probe runs in a
forked child (:func:`apart`), and the store, whose server is a thread, starts
after the ranks are forked; each rank is handed its port through a pipe. Where the launcher does run other threads (an in-process
caller), the ranks start from a fork server as before.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

from pdlife.args import UsageError

__all__ = ["ENGINES", "apart", "forkable", "start_ranks"]

logger = logging.getLogger(__name__)

#: the transfer engines' modules: one loaded here, and ranks start from a fork
#: server instead (slower, as safe)
ENGINES = ("mooncake", "nixl_cu12", "nixl")
#: how long a forked probe or a rank waiting for the store's port may take
WAIT_S = 120.0

T = TypeVar("T")


def forkable() -> bool:
    """Whether this process may fork ranks (see the module's docstring)."""
    if sys.platform != "linux":  # fork as the default start of every rank: Linux only
        return False
    return threading.active_count() == 1 and not any(m in sys.modules for m in ENGINES)


def _probe(fn: Callable[..., Any], args: tuple[Any, ...], send: Connection) -> None:
    try:
        send.send(("ok", fn(*args)))
    except UsageError as e:
        send.send(("usage", e.what, str(e).removeprefix(f"{e.what}: ")))
    except Exception as e:  # (fn's own errors are usage errors; anything else is said)
        send.send(("other", type(e).__name__, " ".join(str(e).split())))


def apart(fn: Callable[..., T], *args: Any, what: str) -> T:
    """``fn(*args)`` run in a forked child when this process may fork ranks,
    so that whatever it loads (an engine's library and threads) stays there;
    in this process otherwise. A :class:`UsageError` it raises is raised
    here; a child that dies or hangs is a :class:`UsageError` on ``what``."""
    if not forkable():
        return fn(*args)
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_probe, args=(fn, args, send), daemon=True)
    child.start()
    send.close()
    try:
        answer = recv.recv() if recv.poll(WAIT_S) else None
    except EOFError:  # it died before answering
        answer = None
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join()
        recv.close()
    if answer is None:
        raise UsageError(what, f"checking it killed the checking process ({child.exitcode})")
    if answer[0] == "usage":
        raise UsageError(answer[1], answer[2])
    if answer[0] == "other":
        raise UsageError(what, f"checking it raised {answer[1]}: {answer[2]}")
    result: T = answer[1]
    return result


def _ranked(
    target: Callable[..., None],
    rank: int,
    recv: Connection,
    args: tuple[Any, ...],
    others: list[Connection],
) -> None:
    """A rank: wait for the store's port, then run ``target(rank, port, *args)``.
    ``others``: the pipe ends a forked rank inherited besides its own read end
    (closed first, so that a launcher gone before it said is an end of file
    here, not a wait of ``WAIT_S``)."""
    for end in others:
        end.close()
    try:
        port = int(recv.recv()) if recv.poll(WAIT_S) else None
    except EOFError:
        port = None
    if port is None:
        os._exit(5)  # the launcher never said: it is gone
    recv.close()
    target(rank, port, *args)


def start_ranks(
    world: int,
    target: Callable[..., None],
    args: tuple[Any, ...],
    store: Callable[[], Any],
    preload: list[str],
) -> tuple[list[BaseProcess], Any]:
    """Start ``world`` processes running ``target(rank, port, *args)``, then the
    store they meet at (``store()``, whose ``.port`` each is told): (the
    processes, the store). Forked from here when :func:`forkable`, else from a
    fork server that imported ``preload``."""
    fork = forkable()
    if fork:
        ctx: Any = mp.get_context("fork")
    else:
        from multiprocessing import forkserver

        logger.debug("this process runs threads of its own: ranks start from a fork server")
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(preload)
        forkserver.ensure_running()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    ends = [end for pipe in pipes for end in pipe]
    procs: list[BaseProcess] = [
        ctx.Process(
            target=_ranked,
            args=(target, r, recv, args, [e for e in ends if e is not recv] if fork else []),
        )
        for r, (recv, _) in enumerate(pipes)
    ]
    try:
        for p in procs:
            p.start()
        server = store()  # its server thread starts only now, after every fork
    except BaseException:
        for p in procs:
            if p.pid is not None:
                p.kill()
                p.join()
        for end in ends:
            end.close()
        raise
    for recv, send in pipes:
        send.send(server.port)
        send.close()
        recv.close()
    return procs, server
