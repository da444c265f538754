"""The field's consensus helpers, by their own names and call shapes, run by the step.

An engine that calls ``poll_and_all_reduce(pollers, gloo_group, decode_reqs,
metadata_buffers, server_args)`` today imports it from here instead and keeps
the same arguments and the same answer: one agreed status per poller, a list
of ints. Underneath, every call is one :class:`~lifecycle.step.Stepper` step,
so it also gets, with no other change:

- a failure's agreed reason and origin rank (:func:`last_failures`);
- a fingerprint of the ordered request list in the same all-reduce, so ranks
  whose lists diverged raise :class:`~lifecycle.errors.CollectiveMismatch` on
  every rank instead of hanging or mixing requests up (rooms are read from
  ``decode_req.req.bootstrap_room`` or the poller's ``bootstrap_room``; when
  they are missing or repeat, only list lengths can be compared);
- a poller, staging handler or metadata row that raises fails only its
  request, on every rank, instead of killing one rank and hanging the others;
- the failure-probability variables read on every call as before, but drawn
  from a generator seeded once per process by ``PDLIFE_FAULT_SEED`` and rank,
  so a failing run repeats.

Where the field's semantics are kept on purpose (see docs/compat.md): the
metadata gate holds a Success only while the row's room is 0; the fake path
skips it. Where ours is stricter: a row that carries another request's
non-zero room fails that request (reason metadata corrupt) instead of letting
it through, and a poll value outside KVPoll fails its request instead of
flowing into the reduce. Injected faults still poll the request (its backend
latches as usual); only the value reported changes.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lifecycle import faults as _faults
from lifecycle.collective import Collective, Hierarchical, TorchCollective
from lifecycle.protocols import MetadataSource, StagingGate
from lifecycle.step import Failure, StepConfig, Stepper
from lifecycle.table import RequestTable

__all__ = [
    "FAKE_BOOTSTRAP_HOST",
    "poll_and_all_reduce",
    "poll_and_all_reduce_attn_cp_tp_group",
    "poll_and_all_reduce_with_staging",
]

FAKE_BOOTSTRAP_HOST = "2.2.2.2"

logger = logging.getLogger(__name__)

# agreed buffer capacity per (kind, group); process groups live as long as the process
_capacity: dict[tuple[str, int], int] = {}
_last_failures: list[Failure] = []
# one seeded generator per (seed, rank) for the whole process: re-creating it on
# every call would draw the same numbers every call
_fault_hooks: dict[tuple[int, int], _faults.ProbabilisticFaults] = {}


def last_failures() -> list[Failure]:
    """Failures (room, reason, origin rank) agreed by the last compat call in this process."""
    return list(_last_failures)


def _fault_hook(rank: int) -> _faults.ProbabilisticFaults | None:
    """The failure probability as set now, drawing from this process's seeded generator."""
    fresh = _faults.from_env(rank)
    if fresh is None:
        return None
    hook = _fault_hooks.setdefault((fresh.seed, rank), fresh)
    hook.prob = fresh.prob
    return hook


def _room(value: object) -> int | None:
    if type(value) is int:  # the common case, without the slower ABC check below
        return value if 0 < value < 1 << 64 else None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # a 0-d tensor
            return _room(value.item())
        return None
    room = int(value)
    return room if 0 < room < 1 << 64 else None


def _is_fake(req: Any, server_args: Any) -> bool:
    host = getattr(req, "bootstrap_host", None)
    if host == FAKE_BOOTSTRAP_HOST:
        return True
    backend = getattr(server_args, "disaggregation_transfer_backend", None)
    return host is None and backend == "fake"


class _RoomColumn:
    """The metadata gate over any object with a ``bootstrap_room`` tensor of
    shape (size, k): the field's own buffers as well as ours.

    Landed is the field's rule: the row's room is not 0. Corrupt is ours: the
    row carries a non-zero room that is not the request's (only where the
    request's room is known).
    """

    def __init__(self, buffers: Any, rooms_known: bool) -> None:
        col = getattr(buffers, "bootstrap_room", None)
        if col is None:  # our core buffers keep their tensors by name
            col = getattr(buffers, "tensors", {}).get("bootstrap_room")
        if col is None:
            raise TypeError(
                f"metadata_buffers ({type(buffers).__name__}) has no bootstrap_room tensor "
                "of shape (size, k) for the metadata gate to read"
            )
        self._col = col
        self._rooms_known = rooms_known
        self._np: NDArray[np.int64] | None = None
        if _is_cpu_tensor(col) and col.element_size() == 8:
            import torch

            self._np = col.view(torch.int64).numpy()[:, 0]  # no copy: reads see every write

    def landed(
        self, slots: NDArray[np.int64], rooms: NDArray[np.uint64]
    ) -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
        # a slot outside the buffers, or a column that cannot be read, fails the
        # request (agreed, reason metadata corrupt) rather than raising on one rank
        # between two collectives, which would leave the other ranks waiting
        bad = (slots < 0) | (slots >= len(self._col))
        try:
            got = self._read(np.where(bad, 0, slots)) if len(self._col) else np.zeros(slots.size)
        except Exception:
            logger.exception("metadata gate: cannot read the bootstrap_room column")
            return np.zeros(slots.size, dtype=bool), np.ones(slots.size, dtype=bool)
        written = (got != 0) & ~bad
        if not self._rooms_known:
            return written, bad
        want = np.asarray(rooms, dtype=np.uint64).view(np.int64)
        return written, bad | (written & (got != want))

    def _read(self, slots: NDArray[np.int64]) -> NDArray[np.int64]:
        col = self._col
        if self._np is not None:
            out: NDArray[np.int64] = np.take(self._np, slots)
            return out
        if hasattr(col, "view") and hasattr(col, "numpy"):  # another torch tensor
            import torch

            picked = col[torch.as_tensor(slots, dtype=torch.int64), 0]
            wide = picked.view(torch.int64) if picked.element_size() == 8 else picked.long()
            out = wide.cpu().numpy()
            return out
        out = np.asarray(col)[slots, 0].astype(np.int64)
        return out


def _is_cpu_tensor(t: Any) -> bool:
    device = getattr(t, "device", None)
    return getattr(device, "type", None) == "cpu" and callable(getattr(t, "element_size", None))


class _StagingHandler:
    """The field's staging handler (``is_done`` / ``advance_scatter`` per decode
    request, for receivers whose ``require_staging`` is set) as the step's gate.

    A handler that raises for a request fails that request on every rank: its
    poller is swapped for one that raises the same error when the step polls.
    """

    def __init__(self, decode_reqs: Sequence[Any], handler: Any, table: RequestTable) -> None:
        self._reqs = decode_reqs
        self._handler = handler
        self._table = table

    def _staged(self, i: int) -> bool:
        dr = self._reqs[i]
        return bool(getattr(dr.kv_receiver, "require_staging", False)) and not bool(
            self._handler.is_done(dr)
        )

    def advance(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> None:
        for room, i in zip(rooms.tolist(), indices.tolist()):
            try:
                if self._staged(i):
                    self._handler.advance_scatter(self._reqs[i])
            except Exception as e:
                self._table.handles[self._table.slot_of(room)] = _Raises(e)

    def pending(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.bool_]:
        out = np.zeros(indices.size, dtype=bool)
        for k, i in enumerate(indices.tolist()):
            try:
                out[k] = self._staged(i)
            except Exception:
                out[k] = True  # its advance raised too, so the request is already failing
        return out


class _Raises:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def poll(self) -> int:
        raise self.error


def _table_for(
    pollers: Sequence[Any],
    decode_reqs: Sequence[Any] | None,
    server_args: Any,
    rank: int,
) -> tuple[RequestTable, bool]:
    """The call's requests as a table; True when their rooms are real (unique, non-zero)."""
    n = len(pollers)
    t = RequestTable(rank=rank, capacity=max(1, n))
    fake = np.zeros(n, dtype=bool)
    slots = np.full(n, -1, dtype=np.int64)
    if decode_reqs is None:
        rooms = [_room(getattr(p, "bootstrap_room", None)) for p in pollers]
    else:
        if len(decode_reqs) != n:
            raise ValueError(f"decode_reqs has {len(decode_reqs)} entries for {n} pollers")
        rooms = [None] * n
        for i, dr in enumerate(decode_reqs):
            req = getattr(dr, "req", dr)
            idx = getattr(dr, "metadata_buffer_index", None)
            slots[i] = -1 if idx is None else int(idx)
            fake[i] = _is_fake(req, server_args)
            room = _room(getattr(req, "bootstrap_room", None))
            rooms[i] = (
                room if room is not None else _room(getattr(pollers[i], "bootstrap_room", None))
            )
    known = all(r is not None for r in rooms) and len(set(rooms)) == n
    ids = [int(r) for r in rooms if r is not None] if known else list(range(1, n + 1))
    t.extend(
        ids, handles=list(pollers), fake=fake, metadata_slots=slots, handle_indices=np.arange(n)
    )
    return t, known


def _run(
    pollers: Sequence[Any],
    collective: Collective,
    group_key: tuple[str, int],
    *,
    decode_reqs: Sequence[Any] | None = None,
    metadata_buffers: Any = None,
    server_args: Any = None,
    staging_handler: Any = None,
) -> list[int]:
    rank = collective.rank
    table, known = _table_for(pollers, decode_reqs, server_args, rank)
    metadata: MetadataSource | None = None
    if metadata_buffers is not None:
        metadata = _RoomColumn(metadata_buffers, known)
    staging: StagingGate | None = None
    if staging_handler is not None and decode_reqs is not None:
        staging = _StagingHandler(decode_reqs, staging_handler, table)
    stepper = Stepper(
        table,
        rank,
        staging=staging,
        metadata=metadata,
        faults=_fault_hook(rank),
        config=StepConfig(invalid_status="fail"),
        # a capacity learnt from an earlier call's reduced header: agreed on every rank
        agreed_capacity=_capacity.get(group_key),
    )
    result = stepper.step(collective)
    _capacity[group_key] = stepper.capacity
    _last_failures[:] = result.failures()
    out: list[int] = result.statuses.tolist()
    return out


def poll_and_all_reduce(
    pollers: Sequence[Any],
    gloo_group: Any,
    decode_reqs: Sequence[Any] | None = None,
    metadata_buffers: Any = None,
    server_args: Any = None,
) -> list[int]:
    """One agreed (MIN over ``gloo_group``) status per poller, as ints.

    The metadata gate runs when ``decode_reqs``, ``metadata_buffers`` and
    ``server_args`` are all given: a local Success whose row
    ``metadata_buffers.bootstrap_room[decode_req.metadata_buffer_index, 0]``
    is still 0 counts as Transferring, except on the fake path.
    """
    gated = decode_reqs is not None and metadata_buffers is not None and server_args is not None
    return _run(
        pollers,
        TorchCollective(gloo_group),
        ("flat", id(gloo_group)),
        decode_reqs=decode_reqs if gated else None,
        metadata_buffers=metadata_buffers if gated else None,
        server_args=server_args,
    )


def poll_and_all_reduce_attn_cp_tp_group(
    pollers: Sequence[Any], attn_cp_cpu_group: Any, attn_tp_cpu_group: Any
) -> list[int]:
    """As :func:`poll_and_all_reduce` over the attention TP group, then MIN over
    the CP group: the MIN over TP x CP."""
    coll = Hierarchical([TorchCollective(attn_tp_cpu_group), TorchCollective(attn_cp_cpu_group)])
    return _run(pollers, coll, ("cp_tp", id(attn_cp_cpu_group)))


def poll_and_all_reduce_with_staging(
    decode_reqs: Sequence[Any],
    staging_handler: Any,
    gloo_group: Any,
    metadata_buffers: Any = None,
    server_args: Any = None,
) -> list[int]:
    """Poll each ``decode_req.kv_receiver``; before that, advance the scatter of
    every request whose receiver requires staging and is not done; hold a local
    Success at Transferring until its scatter is done; then the metadata gate
    (when ``metadata_buffers`` and ``server_args`` are given); MIN over ``gloo_group``.
    """
    gated = metadata_buffers is not None and server_args is not None
    return _run(
        [dr.kv_receiver for dr in decode_reqs],
        TorchCollective(gloo_group),
        ("staging", id(gloo_group)),
        decode_reqs=decode_reqs,
        metadata_buffers=metadata_buffers if gated else None,
        server_args=server_args,
        staging_handler=staging_handler,
    )
