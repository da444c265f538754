"""Disaggregation mode, engine type and abort bookkeeping."""

from __future__ import annotations

import enum
from collections.abc import MutableSequence
from typing import Any

import attrs

__all__ = ["DisaggregationMode", "engine_type", "FinishAbort", "record_abort"]


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


_INPUT_LOGPROB_FIELDS = (
    "input_token_logprobs_val",
    "input_token_logprobs_idx",
    "input_top_logprobs_val",
    "input_top_logprobs_idx",
)


def record_abort(req: Any, message: str, status_code: int = 500) -> FinishAbort:
    """Mark ``req`` aborted: set ``finished_reason`` and empty its input log-prob lists."""
    reason = FinishAbort(message, status_code)
    req.finished_reason = reason
    for name in _INPUT_LOGPROB_FIELDS:
        lst = getattr(req, name, None)
        if isinstance(lst, MutableSequence):
            del lst[:]
        elif lst is not None:
            setattr(req, name, [])
    return reason
