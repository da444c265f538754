"""The benchmark's stand-in backends and its multi-queue and churn cases."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

__all__ = [
    "ArrayBackend",
    "ChurnBackend",
    "ObjPoller",
    "bench_layout",
    "gated_queue",
    "hooks_of",
    "three_queues",
    "churn_case",
]


class ArrayBackend:
    """A backend that keeps statuses, scatter progress in arrays (batch poll)."""

    def __init__(self, n: int) -> None:
        # a third still transferring; the rest report Success, half of those
        # still scattering from staging, half with the metadata row not landed
        self.status = np.full(n, 4, dtype=np.int8)
        self.status[0::3] = 3
        self.scatter_left = np.zeros(n, dtype=np.int32)
        self.scatter_left[1::3] = 1 << 30

    def poll_many(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.int8]:
        out: NDArray[np.int8] = self.status[indices]
        return out

    # staging gate
    def advance(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> None:
        self.scatter_left[indices] -= 1

    def pending(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.bool_]:
        out: NDArray[np.bool_] = self.scatter_left[indices] > 0
        return out


class ObjPoller:
    __slots__ = ("status",)

    def __init__(self) -> None:
        self.status = 4

    def poll(self) -> int:
        return self.status


class ChurnBackend:
    """Statuses in a ring of indices; a few rows change every step."""

    def __init__(self, n: int) -> None:
        self.status = np.full(2 * n, 3, dtype=np.int8)

    def poll_many(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.int8]:
        out: NDArray[np.int8] = self.status[indices]
        return out


def bench_layout() -> Any:
    """The metadata layout of every gated queue the bench steps."""
    from buffers import MetadataLayout

    return MetadataLayout(hidden_size=16, hidden_dtype=torch.float32, max_top_logprobs=16)


def gated_queue(
    rank: int, n: int, layout: Any, queue: str = "", first: int = 1
) -> tuple[Any, ArrayBackend, Any, NDArray[np.uint64]]:
    """A queue of ``n`` requests with staging and metadata gates on: a third
    still transferring, a third held by the staging gate, a third by the
    metadata gate (its row not landed). (stepper, backend, metadata, rooms)."""
    from buffers import MetadataBuffers
    from lifecycle import KVPoll, RequestTable, Stepper

    rooms = np.arange(first, first + n, dtype=np.uint64) * 7919
    meta = MetadataBuffers(n, layout)
    room_col = meta.tensors["bootstrap_room"].view(torch.int64)
    room_col[:, 0] = torch.from_numpy(rooms.view(np.int64))
    room_col[2::3, 0] = 0
    backend = ArrayBackend(n)
    table = RequestTable(rank=rank, capacity=n)
    table.extend(
        rooms, state=KVPoll.Transferring, metadata_slots=np.arange(n), handle_indices=np.arange(n)
    )
    stepper = Stepper(table, rank, poller=backend, staging=backend, metadata=meta, queue=queue)
    return stepper, backend, meta, rooms


def hooks_of(backend: ArrayBackend, meta: Any, rooms: NDArray[np.uint64]) -> Any:
    """Every hook a gated queue's step asks (staging advance, batch poll,
    staging pending, metadata landed), over all its rows, as one call."""
    rows = np.arange(rooms.size, dtype=np.int64)
    slots = rows.copy()
    slots.setflags(write=False)

    def ask() -> None:
        backend.advance(rooms, rows)
        backend.poll_many(rooms, rows)
        backend.pending(rooms, rows)
        meta.landed(slots, rooms)

    return ask


def three_queues(rank: int, n: int, layout: Any, coll: Any) -> tuple[Any, Any, Any]:
    """Two copies of three gated queues of n/3 requests: one fused, one
    separate; and the fused queues' hooks alone (every hook the fused step
    asks, over the same rows, as one call)."""
    from lifecycle import StepGroup

    def build() -> list[Any]:
        k = max(1, n // 3)
        names = ("handshake", "prealloc", "transfer")
        return [gated_queue(rank, k, layout, name, 1 + q * k) for q, name in enumerate(names)]

    fused = build()
    group = StepGroup([q[0] for q in fused])
    alone = [q[0] for q in build()]
    asks = [hooks_of(backend, meta, rooms) for _, backend, meta, rooms in fused]

    def fused3() -> None:
        group.step(coll)

    def separate3() -> None:
        for s in alone:
            s.step(coll)

    def hooks3() -> None:
        for ask in asks:
            ask()

    return fused3, separate3, hooks3


def churn_case(
    rank: int, n: int, coll: Any, split: bool = True, spans: Any = None, moving: bool = True
) -> Any:
    """A queue where 1% of the requests change status every step: half reach
    Success, half fail. ``split``: rank 0 fails some of them and rank 1 the
    others, so the step fetches their origins (a second, small reduce);
    otherwise rank 0 fails them all and the header names it. ``spans``: a
    :class:`~pdlife.spans.live.LiveSpans` the step feeds, its gates' holds
    recorded (timed with the step). ``moving`` False: the same queue where
    nothing changes (the step a churn step is compared with)."""
    from lifecycle import KVPoll, RequestTable, Stepper

    backend = ChurnBackend(n)
    table = RequestTable(rank=rank, capacity=n)
    ring = 2 * n
    state = {"next": n + 1}
    table.extend(
        np.arange(1, n + 1, dtype=np.uint64),
        state=KVPoll.Transferring,
        handle_indices=np.arange(1, n + 1) % ring,
    )
    stepper = Stepper(table, rank, poller=backend)
    stepper.record_holds = spans is not None
    k = max(4, n // 100)  # at least two failures, one per rank when split
    rng = np.random.default_rng(7)  # the same on both ranks: the same rows change

    def churn() -> float:
        if not moving:
            t0 = time.perf_counter()
            stepper.step(coll)
            return time.perf_counter() - t0
        rooms = table.rooms()
        pick = rooms[rng.choice(rooms.size, size=min(k, rooms.size), replace=False)]
        idx = pick.astype(np.int64) % ring
        backend.status[idx[: k // 2]] = KVPoll.Success
        failing = idx[k // 2 :]
        # the rows this rank fails (on the other ranks they report Success)
        mine = failing[rank % 2 :: 2] if split else failing if rank == 0 else failing[:0]
        backend.status[failing] = KVPoll.Success
        backend.status[mine] = KVPoll.Failed
        t0 = time.perf_counter()
        res = stepper.step(coll)
        if spans is not None:
            spans.observe("churn", res, stepper.last_holds())
        elapsed = time.perf_counter() - t0
        done = np.concatenate([res.succeeded, res.failed])
        backend.status[done.astype(np.int64) % ring] = KVPoll.Transferring
        table.remove_many(done)
        new = np.arange(state["next"], state["next"] + done.size, dtype=np.uint64)
        state["next"] += done.size
        table.extend(new, state=KVPoll.Transferring, handle_indices=new.astype(np.int64) % ring)
        return elapsed

    return churn
