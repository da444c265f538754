"""The call shapes every backend provides (the field's API, typed).

A backend is a manager (one per rank: owns the engine, registers memory,
answers batch polls), a sender per request on prefill, a receiver per
request on decode, and usually a bootstrap service for rendezvous.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["KVManager", "KVSender", "KVReceiver", "BootstrapService"]


@runtime_checkable
class KVSender(Protocol):
    """Prefill side of one request."""

    def init(self, num_pages: int, metadata_slot: int | None) -> None: ...

    def send(self, page_indices: ArrayLike, state_indices: Any = None) -> None: ...

    def poll(self) -> int: ...

    def failure_exception(self) -> None:
        """Raise the reason this request failed (no-op if it did not)."""
        ...

    def abort(self) -> None: ...

    def clear(self) -> None: ...


@runtime_checkable
class KVReceiver(Protocol):
    """Decode side of one request."""

    def init(self, prefill_dp_rank: int | None = None) -> None: ...

    def send_metadata(
        self,
        page_indices: ArrayLike,
        metadata_slot: int,
        state_indices: Any = None,
        decode_prefix_len: int = 0,
    ) -> None: ...

    def poll(self) -> int: ...

    def failure_exception(self) -> None: ...

    def abort(self) -> None: ...

    def clear(self) -> None: ...


@runtime_checkable
class KVManager(Protocol):
    """One per rank: creates senders/receivers and polls them in batch."""

    def poll_many(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> ArrayLike: ...


@runtime_checkable
class BootstrapService(Protocol):
    """Where prefill ranks publish endpoints and decode ranks look them up."""

    def publish(self, key: str, value: bytes) -> None: ...

    def lookup(self, key: str, timeout: float) -> bytes | None: ...
