"""Per-request senders and receivers with the field's call shapes, over a
backend's own handles (the ``KVSender`` / ``KVReceiver`` shapes of :mod:`transport.protocols`).

The field's sender: ``init(num_kv_indices, aux_index)``, ``send(kv_indices,
state_indices)``; its receiver: built with the prefill address (the handshake
starts at once) and ``init(kv_indices, aux_index, state_indices)`` saying where
to write. Neither has ``clear``: the backend's slot is given back when the
object is collected, or at once by calling ``clear()``.
"""

from __future__ import annotations

import contextlib
from typing import Any

from numpy.typing import ArrayLike

from lifecycle.status import KVPoll

__all__ = ["FieldSender", "FieldReceiver"]


class _Handle:
    core: Any

    @property
    def conclude_state(self) -> KVPoll | None:
        """Success or Failed once the request has ended here, else None."""
        status = KVPoll(self.core.poll())
        return status if status.terminal else None

    def poll(self) -> KVPoll:
        return KVPoll(self.core.poll())

    def failure_exception(self) -> None:
        """Raise why this request failed (a :class:`~transport.errors.TransferFailed`)."""
        self.core.failure_exception()

    def abort(self) -> None:
        self.core.abort()

    def clear(self) -> None:
        """Give the backend's slot for this request back (also done on collection)."""
        self.core.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.core.clear()


class FieldSender(_Handle):
    """Prefill side of one request."""

    def __init__(
        self,
        core: Any,
        mgr: Any,
        bootstrap_addr: str | None,
        bootstrap_room: int | None,
        dest_tp_ranks: list[int] | None = None,
        pp_rank: int | None = None,
    ) -> None:
        self.core = core
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.dest_tp_ranks = dest_tp_ranks
        self.pp_rank = pp_rank

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """How many pages will follow and which metadata row carries the first token."""
        self.core.init(int(num_kv_indices), aux_index)

    def send(self, kv_indices: ArrayLike, state_indices: Any = None) -> None:
        """One chunk of pages (the last chunk's send also ships the metadata row)."""
        self.core.send(kv_indices, state_indices)


class FieldReceiver(_Handle):
    """Decode side of one request; the handshake starts when it is built."""

    @property
    def require_staging(self) -> bool:
        """Whether this request lands in staging (the backend decides once registered)."""
        return bool(getattr(self.core, "require_staging", False))

    def __init__(
        self,
        core: Any,
        mgr: Any,
        bootstrap_addr: str | None,
        bootstrap_room: int | None = None,
        prefill_dp_rank: int | None = None,
    ) -> None:
        self.core = core
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.prefill_dp_rank = prefill_dp_rank
        core.init(prefill_dp_rank)

    def init(
        self, kv_indices: ArrayLike, aux_index: int | None = None, state_indices: Any = None
    ) -> None:
        """Where prefill must write: these pages, this metadata row."""
        self.core.send_metadata(
            kv_indices, -1 if aux_index is None else int(aux_index), state_indices
        )
