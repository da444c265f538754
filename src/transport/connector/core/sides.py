"""Each role's part of the connector protocol, picked once as a core is built;
the words each says and hears are held to :data:`~transport.connector.core.messages.MESSAGES`
at import."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transport.connector.core.decode import DecodeSide
from transport.connector.core.machine import ConnectorCore
from transport.connector.core.messages import check_words
from transport.connector.core.prefill import PrefillSide
from transport.connector.core.side import Side

__all__ = ["SIDES"]

#: each role's part of the protocol
SIDES: dict[str, Callable[[ConnectorCore], Side[Any]]] = {
    "prefill": PrefillSide,
    "decode": DecodeSide,
}
check_words(
    {
        "prefill": (PrefillSide.SAYS, PrefillSide.HEARS),
        "decode": (DecodeSide.SAYS, DecodeSide.HEARS),
    }
)
