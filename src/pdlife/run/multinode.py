"""``pdlife simulate`` as one node of a multi-node torchrun job.

Three things differ from one host:

- placement: with ``--role`` every rank says which side it serves and the
  sides are built from what the ranks say, so prefill lands on the host that
  was started as prefill whatever order the c10d rendezvous gave the nodes.
  A rank keeps the *logical* rank of one host (prefill ``0..P-1``, decode
  ``P..P+D-1``) for traces, fault plans and summaries;
- results: the hosts share no file system, so every rank sends its result
  and trace through the job's store and rank 0 writes them where one host
  would have (``ranks/``, ``trace/``), so summary and replay are unchanged;
- deaths: the sides share no collective, so a host that dies is seen by
  rank 0 as ranks whose heartbeat stops and whose result never comes. Rank 0
  waits until every rank has reported or the missing ones' heartbeats have
  been still for the collective timeout, then names them.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "JOIN_TIMEOUT_S",
    "Placement",
    "StoreWatch",
    "add_errors",
    "collect",
    "place",
    "publish",
    "store_lost",
]

# how long the world group waits for every node's ranks to join: nodes start
# at different times (image pulls, imports on a loaded host)
JOIN_TIMEOUT_S = 120.0


@attrs.frozen
class Placement:
    logical: int  # this rank's rank on one host: prefill 0..P-1, decode P..P+D-1
    prefill: tuple[int, ...]  # global ranks of the prefill group, in logical order
    decode: tuple[int, ...]
    hosts: tuple[str, ...]  # by logical rank: the address each rank advertises


def place(rank: int, world: int, prefill: int, role: str | None, host: str, dist: Any) -> Placement:
    """Agree on which global rank serves which side (one all-gather on the world)."""
    mine = role if role is not None else ("prefill" if rank < prefill else "decode")
    said: list[Any] = [None] * world
    dist.all_gather_object(said, (mine, host))
    if len({r is None for r, _ in said}) > 1:
        raise ValueError("give --role on every node or on none")
    p = tuple(g for g, (r, _) in enumerate(said) if r == "prefill")
    d = tuple(g for g, (r, _) in enumerate(said) if r == "decode")
    if len(p) != prefill:
        raise ValueError(
            f"{len(p)} ranks said --role prefill but the prefill side has {prefill} "
            "(--prefill x --prefill-dp); start that many prefill processes"
        )
    order = p + d
    return Placement(order.index(rank), p, d, tuple(said[g][1] for g in order))


def publish(store: Any, logical: int, out: Path) -> None:
    """Send this rank's result and trace to rank 0 through the store."""
    for kind, path in (
        ("ranks", out / "ranks" / f"rank{logical}.json"),
        ("trace", out / "trace" / f"rank{logical}.jsonl"),
    ):
        store.set(f"out/{kind}/{logical}", path.read_bytes() if path.exists() else b"")
    store.set(f"out/done/{logical}", b"1")


def _beat(store: Any, rank: int) -> int:
    try:
        return int(store.get(f"hb/{rank}").decode()) if store.check([f"hb/{rank}"]) else -1
    except Exception:
        return -1


def collect(
    store: Any, world: int, out: Path, patience: float, placement: Placement
) -> tuple[list[int], list[str]]:
    """Rank 0: gather every rank's files into ``out``; (dead ranks, one message each).

    A rank counts as dead once it has not reported and its heartbeat (the
    scheduler step it last started) has not moved for ``patience`` seconds.
    """
    pending = set(range(world))
    last = {r: (_beat(store, r), time.monotonic()) for r in pending}
    dead: list[int] = []
    while pending:
        for r in sorted(pending):
            if store.check([f"out/done/{r}"]):
                for kind, name in (("ranks", f"rank{r}.json"), ("trace", f"rank{r}.jsonl")):
                    data = store.get(f"out/{kind}/{r}")
                    if data:
                        (out / kind).mkdir(parents=True, exist_ok=True)
                        (out / kind / name).write_bytes(data)
                pending.discard(r)
                continue
            beat = _beat(store, r)
            if beat != last[r][0]:
                last[r] = (beat, time.monotonic())
            elif time.monotonic() - last[r][1] > patience:
                dead.append(r)
                pending.discard(r)
        if pending:
            time.sleep(0.2)
    side = {r: "prefill" if r < len(placement.prefill) else "decode" for r in range(world)}
    msgs = [
        f"rank {r} ({side[r]}, on {placement.hosts[r]}) stopped: no result, last heartbeat "
        f"at step {last[r][0]}, still for {patience:g} s; its host or process died"
        for r in sorted(dead)
    ]
    return sorted(dead), msgs


def add_errors(summary: dict[str, Any], out: Path, msgs: list[str]) -> None:
    """Add rank 0's findings about ranks that never reported to its summary."""
    if not msgs:
        return
    summary["rank_errors"] = [*summary["rank_errors"], *msgs]
    summary["ok"] = False
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")


def store_lost(where: Placement, store: tuple[str, int], err: BaseException) -> str:
    """What a survivor says when the job's store stops answering mid-run.

    The store lives with torchrun's node 0, so its loss means that node died;
    the ranks that advertised the store's address are named.
    """
    me = where.logical
    side = "prefill" if me < len(where.prefill) else "decode"
    gone = [r for r, h in enumerate(where.hosts) if h == store[0] and r != me]
    cause = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
    return (
        f"rank {me} ({side}, on {where.hosts[me]}): the job's store at {store[0]}:{store[1]} "
        f"stopped answering ({cause}); the node hosting it died with rank(s) "
        f"{gone or 'unknown'}; exiting"
    )


class StoreWatch:
    """Say at once, in one line, that the job's store (and so node 0) is gone.

    A thread waits on the store for a key nobody sets: the wait fails the moment
    the store's connection drops, before torchrun's agent (which polls it every
    ``--monitor-interval``) stops this rank. :meth:`lost` is also what the main
    thread calls when its own store call fails; the line is said once either
    way. :meth:`done` before the job's normal end, when node 0 may leave first.
    """

    def __init__(self, where: Placement, store: tuple[str, int]) -> None:
        self._where, self._store = where, store
        self._done = threading.Event()
        self._said = threading.Lock()
        self.watching = threading.Event()  # set once its wait is with the store

    def start(self) -> None:
        threading.Thread(target=self._watch, name="pdlife-store-watch", daemon=True).start()

    def _watch(self) -> None:
        from torch.distributed import (  # type: ignore[attr-defined]
            DistNetworkError,
            DistStoreError,
            TCPStore,
        )

        try:
            client = TCPStore(
                self._store[0], self._store[1], is_master=False, timeout=timedelta(hours=1)
            )
            self.watching.set()
            while not self._done.is_set():
                try:
                    client.wait(["pdlife/store-watch/never"])
                except DistNetworkError:
                    raise
                except DistStoreError:  # the wait's own timeout: watch on
                    continue
        except Exception as e:
            if not self._done.is_set():
                self.lost(e)
                os._exit(4)

    def done(self) -> None:
        self._done.set()

    def lost(self, err: BaseException) -> None:
        if self._said.acquire(blocking=False):
            print(store_lost(self._where, self._store, err), file=sys.stderr, flush=True)
