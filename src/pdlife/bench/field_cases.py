"""``pdlife bench``'s field cases: SGLang's own consensus calls beside our step,
each pair over one set of requests that both sides read.

- ungated: ``field`` is SGLang's ``poll_and_all_reduce(pollers, group)`` on a
  queue of per-request pollers (half waiting for input, half transferring);
  ``ours_field`` is a :class:`~lifecycle.Stepper` on the same rooms and
  statuses, one batch poll, no gate.
- gated: ``field_gated`` is the same function with its metadata gate,
  ``poll_and_all_reduce(pollers, group, decode_reqs, metadata_buffers)``, on
  a decode transfer queue: a third transferring (their metadata rows landed),
  two thirds reporting Success with the row not landed (held at Transferring
  by the gate). ``ours_gated`` is our step with its metadata gate on the same
  requests: the rooms of ``decode_reqs[i].req.bootstrap_room``, the slots of
  ``decode_reqs[i].metadata_buffer_index`` and the very same
  :class:`field.data.metadata.MetadataBuffers` object (a core
  :class:`buffers.MetadataBuffers` too, which is what our gate reads).
- staged: ``field_staged`` is SGLang's staging-aware gated call,
  ``poll_and_all_reduce_with_staging(decode_reqs, handler, group,
  metadata_buffers, pollers)`` (what its decode transfer queue calls when
  staging is on), on ``ours``' own queue: the same rooms and statuses, the
  same metadata rows (their ``bootstrap_room`` tensor itself, which is all
  that call reads of them) and the same scatter counts (copied to a Python
  list its handler reads, per request). So ``field_staged/ours`` is ``ours``
  itself, staging and metadata gates both, against the call that asks the same.

Each pair must agree: :func:`check_agreement` runs each side once, outside the
timed loop, and raises if the agreed statuses differ or if the gate held
nothing (a gated pair whose gate does no work would compare nothing).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from pdlife.bench.cases import ArrayBackend, ChurnBackend

__all__ = [
    "FieldCalls",
    "RoomPoller",
    "check_agreement",
    "field_calls",
    "field_queue",
    "field_stepper",
    "gated_stepper",
    "staged_view",
]

#: a host that is not the field's fake one: its gate reads every Success's row
HOST = "10.0.0.1"


class FieldCalls:
    """SGLang's two consensus calls, or None each and why they are not here."""

    def __init__(self, poll: Any, staged: Any, why: str) -> None:
        self.poll = poll
        self.staged = staged
        self.why = why


def field_calls() -> FieldCalls:
    """SGLang's ``poll_and_all_reduce`` and ``poll_and_all_reduce_with_staging``."""
    try:
        from sglang.srt.disaggregation.utils import (  # type: ignore[import-not-found]
            poll_and_all_reduce,
            poll_and_all_reduce_with_staging,
        )
    except Exception as e:  # not installed, or its import set is incomplete
        return FieldCalls(None, None, f"{type(e).__name__}: {' '.join(str(e).split())[:160]}")
    return FieldCalls(poll_and_all_reduce, poll_and_all_reduce_with_staging, "")


class RoomPoller:
    """A field-style per-request poller (a sender or receiver) with its room."""

    __slots__ = ("bootstrap_room", "require_staging", "status")

    def __init__(self, room: int, status: int, require_staging: bool = False) -> None:
        self.bootstrap_room = room
        self.status = status
        self.require_staging = require_staging

    def poll(self) -> int:
        return self.status


def _decode_reqs(rooms: list[int], receivers: list[RoomPoller]) -> list[Any]:
    """Decode requests as the field's calls read them: ``req`` (room, host),
    ``metadata_buffer_index`` (row i for request i) and ``kv_receiver``."""
    return [
        types.SimpleNamespace(
            req=types.SimpleNamespace(bootstrap_room=room, bootstrap_host=HOST),
            metadata_buffer_index=i,
            kv_receiver=receivers[i],
        )
        for i, room in enumerate(rooms)
    ]


def field_queue(n: int) -> tuple[list[Any], list[Any], list[Any], Any]:
    """The field's queues: (ungated pollers, gated pollers, decode requests,
    metadata buffers). Ungated: half waiting for input, half transferring.
    Gated: a third transferring, their rows landed; two thirds reporting
    Success with the row not landed (held at Transferring by the gate). No
    request finishes, so the lists stay the same from call to call."""
    from field.data.metadata import MetadataBuffers

    rooms = list(range(9001, 9001 + n))
    ungated = [RoomPoller(r, 2 + i % 2) for i, r in enumerate(rooms)]
    gated = [RoomPoller(r, 3 if i % 3 == 0 else 4) for i, r in enumerate(rooms)]
    meta = MetadataBuffers(n, 16, torch.float32)  # every row's room is 0: not landed
    meta.bootstrap_room[0::3, 0] = torch.tensor(rooms[0::3], dtype=meta.bootstrap_room.dtype)
    return ungated, gated, _decode_reqs(rooms, gated), meta


def field_stepper(rank: int, n: int) -> Any:
    """Our step on the field's ungated queue (:func:`field_queue`): the same
    rooms and statuses (half waiting for input, half transferring) answered by
    one batch poll, no gates. After its first step nothing moves."""
    from lifecycle import KVPoll, RequestTable, Stepper

    backend = ChurnBackend(n)
    backend.status[:n] = 2 + np.arange(n) % 2
    table = RequestTable(rank=rank, capacity=n)
    table.extend(
        np.arange(9001, 9001 + n, dtype=np.uint64),
        state=KVPoll.WaitingForInput,
        handle_indices=np.arange(n),
    )
    return Stepper(table, rank, poller=backend)


def gated_stepper(rank: int, pollers: list[Any], reqs: list[Any], meta: Any) -> Any:
    """Our step with its metadata gate on the field's gated queue: the rooms
    and metadata slots its decode requests name, the statuses its pollers
    report (one batch poll over them), the same metadata buffers."""
    from lifecycle import KVPoll, RequestTable, Stepper

    n = len(reqs)
    backend = ChurnBackend(n)
    backend.status[:n] = [p.status for p in pollers]
    table = RequestTable(rank=rank, capacity=n)
    table.extend(
        np.array([d.req.bootstrap_room for d in reqs], dtype=np.uint64),
        state=KVPoll.Transferring,
        metadata_slots=np.array([d.metadata_buffer_index for d in reqs], dtype=np.int64),
        handle_indices=np.arange(n),
    )
    return Stepper(table, rank, poller=backend, metadata=meta)


class ScatterLeft:
    """A staging handler as the field's staged call asks it, per request:
    scatter steps left, kept in a Python list by metadata row."""

    def __init__(self, left: list[int]) -> None:
        self.left = left

    def is_done(self, decode_req: Any) -> bool:
        row: int = decode_req.metadata_buffer_index
        return self.left[row] <= 0

    def advance_scatter(self, decode_req: Any) -> None:
        self.left[decode_req.metadata_buffer_index] -= 1

    def is_failed(self, decode_req: Any) -> bool:
        return False


def staged_view(
    backend: ArrayBackend, meta: Any, rooms: NDArray[np.uint64]
) -> tuple[list[Any], list[Any], ScatterLeft, Any]:
    """``ours``' queue (:func:`pdlife.bench.cases.gated_queue`) as the field's
    staged call reads it: (pollers, decode requests, staging handler, metadata
    buffers). Request i polls ``backend.status[i]``, requires staging, scatters
    as ``backend.scatter_left[i]`` says and reads metadata row i: the same
    ``bootstrap_room`` tensor our gate reads."""
    room_list = [int(r) for r in rooms.tolist()]
    status = backend.status.tolist()
    pollers = [RoomPoller(r, int(status[i]), True) for i, r in enumerate(room_list)]
    view = types.SimpleNamespace(bootstrap_room=meta.tensors["bootstrap_room"])
    left = ScatterLeft([int(x) for x in backend.scatter_left.tolist()])
    return pollers, _decode_reqs(room_list, pollers), left, view


def check_agreement(
    pairs: list[tuple[str, Callable[[], Any], str, Callable[[], list[int]]]],
    ungated: dict[str, Callable[[], list[int]]],
) -> None:
    """Each (ours, its step, field, its call) once: the statuses agreed must be
    the same, request by request; and the field's call without its gate
    (``ungated[field]``) must answer otherwise, or the gate held nothing. Raises
    RuntimeError naming the pair and how many requests differ."""
    for ours_name, step, field_name, call in pairs:
        got = step().statuses.tolist()
        want = call()
        if got != want:
            bad = sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))
            raise RuntimeError(
                f"{ours_name} and {field_name} disagree on {bad} of {len(want)} requests "
                f"(ours {np.bincount(got, minlength=5).tolist()}, "
                f"field {np.bincount(want, minlength=5).tolist()} by status): "
                "they are not doing the same work"
            )
        bare = ungated.get(field_name)
        if bare is not None and bare() == want:
            raise RuntimeError(
                f"{field_name}'s gate held no request: the gated pair compares nothing"
            )
