"""0.5.23's ``StateType``: every kind of per-request state a connector may carry.

A ``str`` enum with 0.5.23's members and values, so an engine's
``StateType.X`` and its comparisons work unchanged. Our backends move six of
them (the core's :class:`buffers.StateType`, matched by value);
:func:`core_state_type` turns one into the core's and refuses the others with
a typed error naming the kind, before anything is registered.
"""

from __future__ import annotations

import enum

from buffers.errors import BadArgument
from buffers.kv_args import StateType as CoreStateType

__all__ = ["StateType", "core_state_type", "UnsupportedStateType"]


class StateType(str, enum.Enum):
    MAMBA = "mamba"
    QSA_PENDING = "qsa_pending"
    QSA_COMPRESSED = "qsa_compressed"
    SWA = "swa"
    DSA = "dsa"
    DSA_TAIL = "dsa_tail"
    MINIMAX_INDEX_K = "minimax_index_k"
    MINIMAX_DENSE_KV = "minimax_dense_kv"
    SWA_RING = "swa_ring"
    DSV4_REQUEST_STATE = "c128_state"
    REQUEST_ROW = "request_row"
    BLOCK_SCALE = "block_scale"
    BLOCK_SCALE_SWA = "block_scale_swa"
    #: the core's name for DSV4_REQUEST_STATE (the same member)
    C128_STATE = "c128_state"


class UnsupportedStateType(BadArgument):
    """A state kind 0.5.23 knows that our backends do not move."""


_MOVED = {t.value for t in CoreStateType}


def core_state_type(kind: object) -> CoreStateType:
    """The core's state type of ``kind`` (ours, 0.5.23's, the core's, or its value)."""
    value = getattr(kind, "value", kind)
    if isinstance(value, str) and value in _MOVED:
        return CoreStateType(value)
    raise UnsupportedStateType(
        "state type",
        kind,
        f"one our backends move ({', '.join(sorted(_MOVED))}); "
        "leave this component out of KVArgs or move it with the engine's own connector",
    )
