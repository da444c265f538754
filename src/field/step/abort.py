"""Aborting a request the way the engine reads it back.

The engine tells an aborted request by ``isinstance(reason, FINISH_ABORT)``
with its own class. So when SGLang is importable here, :func:`prepare_abort`
sets SGLang's own ``FINISH_ABORT``; otherwise it sets our
:class:`~field.engine.FinishAbort`. :func:`is_aborted` recognises both.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from buffers.errors import BadArgument
from field._checks import integer, required
from field.engine import FinishAbort

__all__ = ["prepare_abort", "is_aborted", "is_unadmitted_reject", "engine_abort_class"]

_INPUT_LOGPROB_LISTS = (
    "input_token_logprobs_val",
    "input_token_logprobs_idx",
    "input_top_logprobs_val",
    "input_top_logprobs_idx",
    "input_token_ids_logprobs_val",
    "input_token_ids_logprobs_idx",
)

_UNSET: Any = object()
_engine_class: Any = _UNSET


def engine_abort_class() -> Any:
    """SGLang's ``FINISH_ABORT`` when SGLang is importable here, else None (looked up once)."""
    global _engine_class
    if _engine_class is _UNSET:
        _engine_class = None
        if importlib.util.find_spec("sglang") is not None:
            try:
                from sglang.srt.managers.schedule_batch import (  # type: ignore[import-not-found]
                    FINISH_ABORT,
                )
            except Exception:  # installed without its import set: ours is used
                pass
            else:
                _engine_class = FINISH_ABORT
    return _engine_class


def prepare_abort(req: Any, error_message: str, status_code: Any = None) -> None:
    """Mark ``req`` aborted with ``error_message`` (the engine's own abort reason
    when SGLang is importable); with ``req.return_logprob``, empty its six
    input-logprob lists (under ``req.logprob`` where it has one).

    With our own reason, a missing status code becomes 500 (ours always carries one).

    Checked before the request is touched: no request (None) or a status code
    that is not an integer (``"400"``, ``400.0``) raises
    :class:`~buffers.errors.BadArgumentType` (a TypeError), a code outside
    100..599 :class:`~buffers.errors.BadArgument` (a ValueError).
    """
    required("req", req, "the request to abort")
    code = 500 if status_code is None else _status(status_code)
    cls = engine_abort_class()
    if cls is not None:
        req.finished_reason = cls(error_message, status_code)
    else:
        req.finished_reason = FinishAbort(error_message, code)
    if getattr(req, "return_logprob", False):
        holder = getattr(req, "logprob", None) or req
        for name in _INPUT_LOGPROB_LISTS:
            setattr(holder, name, [])


def _status(status_code: object) -> int:
    hint = " status code in 100..599 (e.g. 400 or HTTPStatus.BAD_REQUEST), or None for 500"
    code = integer("status_code", status_code, None, hint)
    if not 100 <= code <= 599:
        raise BadArgument("status_code", status_code, "an integer" + hint)
    return code


def _is_abort(reason: object) -> bool:
    if isinstance(reason, FinishAbort):
        return True
    cls = engine_abort_class()
    if cls is not None:
        return isinstance(reason, cls)
    return type(reason).__name__ == "FINISH_ABORT"


def is_aborted(req: Any) -> bool:
    """True when the request is finishing or finished with an abort (ours or the engine's)."""
    return _is_abort(getattr(req, "to_finish", None)) or _is_abort(
        getattr(req, "finished_reason", None)
    )


def is_unadmitted_reject(req: Any) -> bool:
    """An abort of a request rejected at intake, before it held anything: aborted,
    and not retracted, holding no KV or Mamba state, no metadata row and no
    retraction backup. Anything it holds is its queue's to release."""
    if not is_aborted(req):
        return False
    kv = getattr(req, "kv", None)
    index = getattr(req, "metadata_buffer_index", -1)
    holds_row = isinstance(index, int) and not isinstance(index, bool) and index >= 0
    return not (
        bool(getattr(req, "is_retracted", False))
        or bool(getattr(kv, "holds_kv", False))
        or bool(getattr(kv, "holds_mamba", False))
        or holds_row
        or getattr(kv, "retraction_backup", None) is not None
    )
