"""``sglang.srt.disaggregation.base.conn`` by its own names: the connector bases.

An engine that checks ``isinstance(sender, BaseKVSender)`` (or builds its own
connector on these bases) keeps working after changing the import. The
abstract methods are the ones 0.5.23 leaves to each backend; the concrete
ones answer as 0.5.23's bases answer, so a backend that does not override
them behaves as it would there:

- manager: ``should_verify_kv_checksum`` says True, ``teardown`` raises
  NotImplementedError (a backend that supports a runtime role switch
  overrides it), and the ``supports_*`` / ``enable_*`` flags are False;
- sender: ``pop_decode_prefix_len`` gives 0, ``get_max_transfer_tokens``
  None, ``should_send_kv_chunk`` sends a chunk that has pages,
  ``mark_prefill_complete`` raises NotImplementedError, ``clear`` and
  ``abort`` do nothing;
- receiver: ``supports_host_destination`` is False,
  ``is_abort_release_safe`` raises NotImplementedError, ``clear`` and
  ``abort`` do nothing.

:class:`KVPoll` is the core's (an IntEnum with the field's values, Failed 0 to
Success 4), :class:`KVArgs` the field-shaped bag of :mod:`field.conn.kv_args`
and :class:`StateType` 0.5.23's (:mod:`field.data.state_types`: every member, of
which our backends move six and refuse the others by name).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from field.conn.kv_args import KVArgs
from field.data.state_types import StateType
from lifecycle.status import KVPoll

__all__ = [
    "KVPoll",
    "KVArgs",
    "StateType",
    "KVTransferMetric",
    "KVTransferDestination",
    "BaseKVManager",
    "BaseKVSender",
    "BaseKVReceiver",
    "BaseKVBootstrapServer",
]


@dataclass
class KVTransferMetric:
    """What a sender measured of its request's transfer; None where it cannot tell."""

    #: seconds from the first chunk handed over to the transfer's success
    transfer_latency_s: float | None = None
    #: seconds spent waiting for decode to allocate the destination
    alloc_latency_s: float | None = None
    #: bytes the request's transfer covers
    transfer_total_bytes: int | None = None


class KVTransferDestination(str, enum.Enum):
    """Where decode asks the KV to be written."""

    DEVICE = "device"
    HOST = "host"


class BaseKVManager(ABC):
    """One per rank: owns the transfer engine and the state of its requests."""

    #: decode holds an aborted request's pages until prefill acknowledges the abort
    enable_deferred_decode_kv_release: bool = False
    #: decode may ask for KV written to host memory
    supports_host_destination: bool = False
    #: :meth:`teardown` is implemented, so the rank may switch between prefill and decode
    supports_role_switch: bool = False
    #: prefill acknowledges a drained abort, so decode may release pages on the ack
    supports_deferred_decode_kv_release: bool = False

    @abstractmethod
    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None: ...

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        """Whether a KV digest from the prefill at ``bootstrap_addr`` covers the same
        bytes as one over this rank's KV (False for a peer whose digest covers
        another byte range, such as a slice of it)."""
        return True

    @abstractmethod
    def register_to_bootstrap(self) -> None:
        """Make this prefill rank known to the bootstrap server."""

    def teardown(self) -> None:
        """Release the transfer resources (not the KV pool, which the scheduler owns)
        so the manager can be dropped; only backends with ``supports_role_switch``."""
        raise NotImplementedError(f"{type(self).__name__} does not support PD role switch teardown")


class BaseKVSender(ABC):
    """Prefill side of one request."""

    @abstractmethod
    def __init__(
        self,
        mgr: BaseKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None: ...

    @abstractmethod
    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """How many pages will be sent, and the metadata row that goes with the last."""

    @abstractmethod
    def send(
        self,
        kv_indices: npt.NDArray[np.int32],
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
    ) -> None:
        """Hand over the next chunk of pages (and, with the last, the state rows)."""

    def mark_prefill_complete(self) -> None:
        """Publish the finished prefill's KV, for a policy that allocates on decode
        only then; a backend without such a policy does not implement it."""
        raise NotImplementedError

    def pop_decode_prefix_len(self) -> int:
        """Tokens of this request decode holds already (not to be sent), once."""
        return 0

    def get_max_transfer_tokens(self) -> int | None:
        """A page-aligned cap on one send's tokens, or None for no cap."""
        return None

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """Whether a chunk of ``num_pages`` pages is worth a ``send`` call."""
        return num_pages > 0

    @abstractmethod
    def get_transfer_metric(self) -> KVTransferMetric:
        """This request's transfer measurements."""

    @abstractmethod
    def poll(self) -> KVPoll:
        """Where the transfer stands."""

    @abstractmethod
    def failure_exception(self) -> None:
        """Raise why the transfer failed."""

    def clear(self) -> None:  # noqa: B027 (a concrete no-op, as in 0.5.23)
        """Forget this request's state."""

    def abort(self) -> None:  # noqa: B027 (a concrete no-op, as in 0.5.23)
        """Give the transfer up."""


class BaseKVReceiver(ABC):
    """Decode side of one request."""

    @property
    def supports_host_destination(self) -> bool:
        """Whether this request's KV may be written to host memory."""
        return False

    def is_abort_release_safe(self) -> bool:
        """Whether no write for this aborted request can land any more, so its
        destination may be reused (host destinations ask this)."""
        raise NotImplementedError

    @abstractmethod
    def __init__(
        self,
        mgr: BaseKVManager,
        bootstrap_addr: str,
        bootstrap_room: int | None = None,
    ) -> None: ...

    @abstractmethod
    def init(self, prefill_dp_rank: int) -> None:
        """Pair with that prefill DP rank; ready for :meth:`send_metadata` after."""

    @abstractmethod
    def send_metadata(
        self,
        kv_indices: npt.NDArray[np.int32],
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
    ) -> None:
        """Tell prefill where to write: these pages (those after the first
        ``decode_prefix_len`` tokens, which decode holds), this metadata row,
        these state rows."""

    @abstractmethod
    def poll(self) -> KVPoll:
        """Where the transfer stands."""

    @abstractmethod
    def failure_exception(self) -> None:
        """Raise why the transfer failed."""

    def clear(self) -> None:  # noqa: B027 (a concrete no-op, as in 0.5.23)
        """Forget this request's state."""

    def abort(self) -> None:  # noqa: B027 (a concrete no-op, as in 0.5.23)
        """Give the transfer up."""


class BaseKVBootstrapServer(ABC):
    """Where prefill and decode ranks meet."""

    @abstractmethod
    def __init__(self, host: str, port: int) -> None: ...
