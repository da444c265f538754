"""Stage 1 of a step: one raw status per active request, every hook contained.

A backend's batch poll answers for all active rows in one call; without one,
each request's ``poll()`` is called. Whatever a poller does -- raise, answer
with the wrong shape or dtype, return a value outside KVPoll, a float, a
bool -- becomes a verdict on the rows it concerns (``hook_error`` or
``poll_value``), so it travels through the reduce and every rank fails the
same requests. Nothing a poller does can make one rank leave the collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lifecycle.errors import PartialPollError
from lifecycle.graph import VERDICTS
from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll

__all__ = ["Observation", "observe", "BACKEND_REASONS"]

_F = np.int8(KVPoll.Failed)
_NONE = np.int8(FailureReason.NONE)
#: reasons a backend may report for a Failed (its own, or a peer's it relays)
BACKEND_REASONS = np.array(
    sorted(int(v.reason) for v in VERDICTS if "backend" in v.sources), dtype=np.int8
)


class Observation:
    """Raw statuses of the active rows and the verdicts observing produced.

    ``backend``: reason codes of Failed values the poller reported (NONE
    elsewhere); ``invalid``: values outside KVPoll; ``errors``: rows whose
    poll raised or answered nonsense. Each is None when nothing hit.
    """

    __slots__ = ("backend", "errors", "exceptions", "given", "invalid", "raw", "raw_invalid")

    def __init__(self, raw: NDArray[np.int8]) -> None:
        self.raw = raw
        self.backend: NDArray[np.int8] | None = None
        self.invalid: NDArray[np.bool_] | None = None
        self.errors: NDArray[np.bool_] | None = None
        self.exceptions: dict[int, BaseException] = {}
        self.raw_invalid: dict[int, object] = {}
        self.given: NDArray[np.integer] | None = None  # a batch poll's answer as given

    def error(
        self, rows: NDArray[np.bool_] | None, rooms: NDArray[np.uint64], exc: Exception
    ) -> None:
        """Mark ``rows`` (all when None) as failed by a hook that raised ``exc``."""
        mask = np.ones(rooms.size, dtype=bool) if rows is None else rows
        self.errors = mask if self.errors is None else self.errors | mask
        for r in rooms[mask].tolist():
            self.exceptions.setdefault(r, exc)


def _either(a: NDArray[np.bool_] | None, b: NDArray[np.bool_] | None) -> NDArray[np.bool_] | None:
    if a is None:
        return b
    return a if b is None else a | b


def _is_status(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def observe(
    poller: Any,
    handles: Sequence[Any],
    rows: NDArray[np.int64],
    rooms: NDArray[np.uint64],
    hidx: NDArray[np.int64],
) -> Observation:
    """Poll the active rows; see the module docstring for what is contained."""
    k = rooms.size
    if poller is not None:
        obs, values = _batch(poller, rooms, hidx)
    else:
        obs, values = _each(handles, rows, rooms)
    given = values if values is not None else obs.given
    raw = obs.raw
    if k:
        lo, hi = int(raw.min()), int(raw.max())
        if lo < 0 or hi > 4 or values is not None:
            bad = (raw < 0) | (raw > 4)
            if values is not None:  # per-object answers that are not integers
                bad |= np.fromiter((not _is_status(v) for v in values), dtype=bool, count=k)
            if obs.errors is not None:
                bad &= ~obs.errors
            if bad.any():
                obs.invalid = bad
                for i in np.flatnonzero(bad).tolist():
                    v = given[i] if given is not None else raw[i]
                    obs.raw_invalid[int(rooms[i])] = v.item() if isinstance(v, np.generic) else v
        broken = _either(obs.invalid, obs.errors)
        if broken is not None:
            raw = obs.raw = np.where(broken, _F, raw).astype(np.int8)
            failed = (raw == _F) & ~broken
        else:
            failed = raw == _F if lo == 0 else None
        if failed is not None and failed.any():
            obs.backend = _backend_reasons(obs, poller, handles, rows, rooms, hidx, failed)
    return obs


def _batch(
    poller: Any, rooms: NDArray[np.uint64], hidx: NDArray[np.int64]
) -> tuple[Observation, list[object] | None]:
    k = rooms.size
    errors: dict[int, BaseException] = {}
    try:
        try:
            arr = np.asarray(poller.poll_many(rooms, hidx))
        except PartialPollError as pe:
            arr = np.asarray(pe.statuses)
            errors = {int(i): e for i, e in pe.errors.items() if 0 <= int(i) < k}
        if arr.shape != (k,):
            raise ValueError(f"poll_many returned shape {arr.shape}, expected ({k},)")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"poll_many must return integers, got dtype {arr.dtype}")
    except Exception as e:  # never let one rank's error desync the group
        obs = Observation(np.full(k, _F, dtype=np.int8))
        obs.error(None, rooms, e)
        return obs, None
    if k and arr.dtype != np.int8 and (int(arr.min()) < 0 or int(arr.max()) > 4):
        arr8 = np.clip(arr, -1, 5).astype(np.int8)  # narrowing keeps out-of-range values out
    else:
        arr8 = arr.astype(np.int8)  # a copy: the backend's array is never written to
    obs = Observation(arr8)
    obs.given = arr
    if errors:
        mask = np.zeros(k, dtype=bool)
        mask[list(errors)] = True
        obs.errors = mask
        for i, err in errors.items():
            obs.exceptions[int(rooms[i])] = err
    return obs, None


def _each(
    handles: Sequence[Any], rows: NDArray[np.int64], rooms: NDArray[np.uint64]
) -> tuple[Observation, list[object] | None]:
    k = rooms.size
    out: list[object] = []
    errors: dict[int, BaseException] = {}
    for i, s in enumerate(rows.tolist()):
        try:
            out.append(handles[s].poll())
        except Exception as e:
            errors[i] = e
            out.append(int(KVPoll.Failed))
    plain = all(type(v) is int or type(v) is KVPoll for v in out)
    if plain:
        arr = np.clip(np.fromiter(out, dtype=np.int64, count=k), -1, 5)
    else:
        arr = np.array([int(v) if _is_status(v) else -1 for v in out], dtype=np.int64)  # type: ignore[call-overload]
        arr = np.clip(arr, -1, 5)
    obs = Observation(arr.astype(np.int8))
    if errors:
        mask = np.zeros(k, dtype=bool)
        mask[list(errors)] = True
        obs.errors = mask
        for i, err in errors.items():
            obs.exceptions[int(rooms[i])] = err
    return obs, None if plain else out


def _backend_reasons(
    obs: Observation,
    poller: Any,
    handles: Sequence[Any],
    rows: NDArray[np.int64],
    rooms: NDArray[np.uint64],
    hidx: NDArray[np.int64],
    failed: NDArray[np.bool_],
) -> NDArray[np.int8]:
    """Reason codes for the Failed values a poller reported (UNKNOWN when it gave none)."""
    codes = np.full(rooms.size, _NONE, dtype=np.int8)
    codes[failed] = FailureReason.UNKNOWN
    if poller is not None:
        fn = getattr(poller, "failure_reasons", None)
        if fn is None:
            return codes
        try:
            given = np.asarray(fn(rooms[failed], hidx[failed]))
            if given.shape != (int(failed.sum()),) or given.dtype.kind not in "iu":
                raise ValueError(
                    f"failure_reasons returned shape {given.shape} dtype {given.dtype}, "
                    f"expected ({int(failed.sum())},) integers"
                )
        except Exception as e:
            obs.error(failed, rooms, e)
            return codes
        codes[failed] = np.where(np.isin(given, BACKEND_REASONS), given, FailureReason.UNKNOWN)
        return codes
    for i in np.flatnonzero(failed).tolist():
        codes[i] = _reason_of(handles[int(rows[i])])
    return codes


def _reason_of(handle: Any) -> FailureReason:
    """A per-object poller's reason for a Failed it reported."""
    fn = getattr(handle, "failure_reason", None)
    if fn is not None:
        try:
            code = int(fn())
        except Exception:
            return FailureReason.UNKNOWN
        return FailureReason(code) if code in BACKEND_REASONS else FailureReason.UNKNOWN
    fn = getattr(handle, "failure_exception", None)
    if fn is not None:
        try:
            return FailureReason.TRANSFER_ERROR if fn() is not None else FailureReason.UNKNOWN
        except Exception:
            return FailureReason.TRANSFER_ERROR
    return FailureReason.UNKNOWN
