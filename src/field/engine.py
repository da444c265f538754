"""Disaggregation mode, engine type and our abort reason (set by :func:`field.step.abort.prepare_abort`)."""

from __future__ import annotations

import enum
from typing import Any

import attrs

__all__ = ["DisaggregationMode", "engine_type", "FinishAbort"]


class DisaggregationMode(enum.Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"

    @staticmethod
    def to_engine_type(mode: str) -> str:
        """The field's spelling of :func:`engine_type`."""
        return engine_type(mode)


def engine_type(mode: str | DisaggregationMode | None) -> str:
    """ "prefill" -> "prefill", "decode" -> "decode", anything else -> "unified"."""
    value = mode.value if isinstance(mode, DisaggregationMode) else mode
    return value if value in ("prefill", "decode") else "unified"


@attrs.frozen
class FinishAbort:
    """The finish reason an aborted request carries back to the client."""

    message: str
    status_code: int = 500
    err_type: str = "abort"

    def to_json(self) -> dict[str, Any]:
        return {"type": self.err_type, "message": self.message, "status_code": self.status_code}
