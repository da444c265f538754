"""The field's metadata gate and staging handler, as the step's gates.

Both are asked by position in the caller's list: the session keeps each
request's position in the table's ``handle_index`` column (and, for the
metadata gate, in ``metadata_slot``), and hands each gate the list of the
current call with :meth:`rebind`. Nothing is read per request except for the
rows the step asks about.
"""

from __future__ import annotations

import logging
import numbers
import operator
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lifecycle.status import KVPoll

__all__ = [
    "FAKE_BOOTSTRAP_HOST",
    "RoomGate",
    "StagingAdapter",
    "is_fake",
    "metadata_index",
    "room_of",
]

FAKE_BOOTSTRAP_HOST = "2.2.2.2"
_INDEX = operator.attrgetter("metadata_buffer_index")

logger = logging.getLogger(__name__)


def _runtime_backend() -> Any:
    """The transfer backend SGLang's runtime context names, when SGLang is loaded."""
    ctx = sys.modules.get("sglang.srt.runtime_context")
    if ctx is None:
        return None
    try:
        return getattr(ctx.get_disagg(), "disaggregation_transfer_backend", None)
    except Exception:  # no context published: nothing to read
        return None


def is_fake(req: Any, server_args: Any) -> bool:
    """The field's fake path: the fake bootstrap host, or no host with the fake backend
    (named by ``server_args`` when given, else by SGLang's runtime context)."""
    host = getattr(req, "bootstrap_host", None)
    if host == FAKE_BOOTSTRAP_HOST:
        return True
    if host is not None:
        return False
    if server_args is not None:
        backend = getattr(server_args, "disaggregation_transfer_backend", None)
    else:
        backend = _runtime_backend()
    return bool(backend == "fake")


def metadata_index(value: object) -> int:
    """A request's ``metadata_buffer_index`` as a row number, or -1 when it is not one
    (None, a negative number, a bool, a float, anything else)."""
    if type(value) is int:
        return value if value >= 0 else -1
    if isinstance(value, (bool, np.bool_)) or value is None:
        return -1
    if isinstance(value, np.integer):
        return int(value) if value >= 0 else -1
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # a 0-d tensor
        return metadata_index(value.item())
    return -1


def _is_cpu_tensor(t: Any) -> bool:
    device = getattr(t, "device", None)
    return getattr(device, "type", None) == "cpu" and callable(getattr(t, "element_size", None))


def room_column(buffers: Any) -> Any:
    """The ``bootstrap_room`` tensor of shape (size, k) of the field's buffers or ours."""
    col = getattr(buffers, "bootstrap_room", None)
    if col is None:  # our core buffers keep their tensors by name
        col = getattr(buffers, "tensors", {}).get("bootstrap_room")
    if col is None:
        raise TypeError(
            f"metadata_buffers ({type(buffers).__name__}) has no bootstrap_room tensor "
            "of shape (size, k) for the metadata gate to read"
        )
    return col


def room_of(value: object) -> int | None:
    """A bootstrap room as a table key (1..2**64-1), or None when it is not one."""
    if type(value) is int:  # the common case, without the slower ABC check below
        return value if 0 < value < 1 << 64 else None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # a 0-d tensor
            return room_of(value.item())
        return None
    room = int(value)
    return room if 0 < room < 1 << 64 else None


class RoomGate:
    """The metadata gate: a local Success counts only once its row has landed.

    Landed is the field's rule: the row's room is not 0. Corrupt is ours: the
    row carries a non-zero room that is not the request's (only where rooms
    are known), or the request has no usable row (index None, negative, not an
    integer, or past the buffers): the field would read row -1 or raise on one
    rank; here that request fails on every rank with reason metadata corrupt.

    The step passes positions in the caller's list as ``slots``; the row is
    read from that request's ``metadata_buffer_index`` at the time of the call.
    """

    def __init__(self, buffers: Any, rooms_known: bool) -> None:
        self.buffers = buffers
        self._col = room_column(buffers)
        self._rooms_known = rooms_known
        self._np: NDArray[np.int64] | None = None
        if _is_cpu_tensor(self._col) and self._col.element_size() == 8:
            import torch

            self._np = self._col.view(torch.int64).numpy()[:, 0]  # no copy: reads see writes
        self._reqs: Sequence[Any] = ()

    def rebind(self, decode_reqs: Sequence[Any], rooms_known: bool) -> None:
        self._reqs = decode_reqs
        self._rooms_known = rooms_known

    def landed(
        self, slots: NDArray[np.int64], rooms: NDArray[np.uint64]
    ) -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
        col = self._np
        if col is not None and self._rooms_known:  # the common case, in few numpy calls
            try:
                idx = list(map(_INDEX, map(self._reqs.__getitem__, slots.tolist())))
            except Exception:  # a request without the attribute: the slow path says which
                idx = None
            readable = idx is not None and set(map(type, idx)) <= {int}
            if readable and idx and min(idx) >= 0 and max(idx) < col.shape[0]:
                room = col[np.fromiter(idx, dtype=np.int64, count=len(idx))]
                landed = room != 0
                want = np.asarray(rooms, dtype=np.uint64).view(np.int64)
                return landed, landed & (room != want)
        rows = self._rows(slots)
        bad = (rows < 0) | (rows >= len(self._col))
        try:
            got = self._read(np.where(bad, 0, rows)) if len(self._col) else np.zeros(rows.size)
        except Exception:
            logger.exception("metadata gate: cannot read the bootstrap_room column")
            return np.zeros(rows.size, dtype=bool), np.ones(rows.size, dtype=bool)
        written = (got != 0) & ~bad
        if self._rooms_known:
            want = np.asarray(rooms, dtype=np.uint64).view(np.int64)
            return written, bad | (written & (got != want))
        # the table names rows by position: hold each request that has a room to it
        own = [self._room(p) for p in slots.tolist()]
        has = np.fromiter((r is not None for r in own), dtype=bool, count=len(own))
        want = np.array([r or 0 for r in own], dtype=np.uint64).view(np.int64)
        return written, bad | (written & has & (got != want))

    def _room(self, position: int) -> int | None:
        req = self._reqs[position]
        return room_of(getattr(getattr(req, "req", req), "bootstrap_room", None))

    def _rows(self, slots: NDArray[np.int64]) -> NDArray[np.int64]:
        """Each asked request's row (-1 where it has none that can be read)."""
        reqs = self._reqs
        at = slots.tolist()
        try:
            idx = [reqs[p].metadata_buffer_index for p in at]
        except Exception:  # a request without the attribute: the slow path says which
            idx = None
        if idx is not None and set(map(type, idx)) <= {int}:
            rows = np.fromiter(idx, dtype=np.int64, count=len(idx))
            rows[rows < 0] = -1
            return rows
        return np.fromiter(
            (metadata_index(getattr(reqs[p], "metadata_buffer_index", None)) for p in at),
            dtype=np.int64,
            count=len(at),
        )

    def _read(self, rows: NDArray[np.int64]) -> NDArray[np.int64]:
        col = self._col
        if self._np is not None:
            # indexing reads the strided column in place (np.take copies it whole first)
            out: NDArray[np.int64] = self._np[rows]
            return out
        if hasattr(col, "view") and hasattr(col, "numpy"):  # another torch tensor
            import torch

            picked = col[torch.as_tensor(rows, dtype=torch.int64), 0]
            wide = picked.view(torch.int64) if picked.element_size() == 8 else picked.long()
            out = wide.cpu().numpy()
            return out
        out = np.asarray(col)[rows, 0].astype(np.int64)
        return out


class Answer:
    """A poller standing in for a request whose outcome is already decided here."""

    def __init__(self, value: int = int(KVPoll.Failed), error: BaseException | None = None) -> None:
        self.value = value
        self.error = error

    def poll(self) -> int:
        if self.error is not None:
            raise self.error
        return self.value


class StagingAdapter:
    """The field's staging handler (``is_done`` / ``advance_scatter`` /
    ``is_failed`` per decode request, for receivers whose ``require_staging``
    is set) as the step's staging gate.

    Before the poll, every staged request that is not done is advanced; one
    whose staging failed (``is_failed``: its scatter timed out) reports Failed,
    whatever its receiver says, as in 0.5.23. A local Success is held at
    Transferring until its scatter is done. A handler that raises for a
    request fails that request on every rank (reason hook error).
    """

    def __init__(self, handler: Any, swap: Any) -> None:
        self.handler = handler
        self._swap = swap  # (position, poller) -> None: replaces that row's poller
        self._reqs: Sequence[Any] = ()

    def rebind(self, decode_reqs: Sequence[Any], handler: Any) -> None:
        self._reqs = decode_reqs
        self.handler = handler

    def _staged(self, i: int) -> bool:
        dr = self._reqs[i]
        return bool(getattr(dr.kv_receiver, "require_staging", False)) and not bool(
            self.handler.is_done(dr)
        )

    def advance(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> None:
        failed = getattr(self.handler, "is_failed", None)
        for i in indices.tolist():
            dr = self._reqs[i]
            try:
                if not getattr(dr.kv_receiver, "require_staging", False):
                    continue
                if not self.handler.is_done(dr):
                    self.handler.advance_scatter(dr)
                if failed is not None and failed(dr):
                    self._swap(i, Answer(int(KVPoll.Failed)))
            except Exception as e:
                self._swap(i, Answer(error=e))

    def pending(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.bool_]:
        out = np.zeros(indices.size, dtype=bool)
        for k, i in enumerate(indices.tolist()):
            try:
                out[k] = self._staged(i)
            except Exception:
                out[k] = True  # its advance raised too, so the request is already failing
        return out
