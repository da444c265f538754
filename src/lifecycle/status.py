"""The status lattice every rank reports for every request.

The integer values and member names are the ones transfer backends already
return, so a status from an existing backend is a valid :class:`KVPoll` as
is. The order is the progress order with failure at the bottom; that order is
what lets a single MIN all-reduce produce the agreed status of a request.
"""

from __future__ import annotations

import enum

import numpy as np

__all__ = ["KVPoll", "Role", "NUM_STATUSES", "TERMINAL", "meaning", "B", "W", "T", "S", "F", "I8"]


class KVPoll(enum.IntEnum):
    """Transfer status of one request on one rank (lower is less progress)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def terminal(self) -> bool:
        """Success and Failed latch: once agreed, a request never leaves them."""
        return self in (KVPoll.Failed, KVPoll.Success)


#: short names for tables and tests: ``B, W, T, S, F``
B, W, T, S, F = (
    KVPoll.Bootstrapping,
    KVPoll.WaitingForInput,
    KVPoll.Transferring,
    KVPoll.Success,
    KVPoll.Failed,
)


class I8:
    """The statuses as numpy int8 scalars, for array comparisons on hot paths."""

    F = np.int8(KVPoll.Failed)
    B = np.int8(KVPoll.Bootstrapping)
    S = np.int8(KVPoll.Success)


NUM_STATUSES = len(KVPoll)
#: Boolean table indexed by status value: is this status terminal?
TERMINAL = np.array([s.terminal for s in KVPoll], dtype=bool)


class Role(enum.IntEnum):
    """Which side of the transfer a rank plays for a request."""

    SENDER = 0  # prefill: computes the KV cache and writes it out
    RECEIVER = 1  # decode: receives the KV cache and the first-token metadata

    @property
    def node(self) -> str:
        return "prefill" if self is Role.SENDER else "decode"


_MEANINGS: dict[tuple[Role, KVPoll], str] = {
    (Role.SENDER, KVPoll.Failed): "transfer failed or aborted",
    (Role.SENDER, KVPoll.Bootstrapping): (
        "waiting for decode to register the request and say where to write"
    ),
    (Role.SENDER, KVPoll.WaitingForInput): (
        "decode said where to write; ready for a metadata row and the KV"
    ),
    (Role.SENDER, KVPoll.Transferring): "chunks being written",
    (Role.SENDER, KVPoll.Success): "all chunks and the metadata row written",
    (Role.RECEIVER, KVPoll.Failed): "transfer failed or aborted",
    (Role.RECEIVER, KVPoll.Bootstrapping): "registering with the bootstrap service",
    (Role.RECEIVER, KVPoll.WaitingForInput): ("handshake done; metadata sent, waiting for data"),
    (Role.RECEIVER, KVPoll.Transferring): "data arriving (backends rarely report it)",
    (Role.RECEIVER, KVPoll.Success): "all expected senders reported done",
}


def meaning(role: Role, status: KVPoll) -> str:
    """What ``status`` means for a rank playing ``role``."""
    return _MEANINGS[(Role(role), KVPoll(status))]
