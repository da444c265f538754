"""Stage 2 of a step (observe): one raw status per active request, every poller contained.

A backend's batch poll answers for all active rows in one call; without one,
each request's ``poll()`` is called. Whatever a poller does becomes a verdict
on the rows it concerns, so it travels through the reduce and every rank
fails the same requests; nothing a poller does can make one rank leave the
collective:

- a poll that raises, or a batch answer of the wrong shape or dtype:
  ``poll_error`` (reason LOCAL_EXCEPTION);
- a value outside KVPoll, a float, a bool: ``poll_value`` (INVALID_STATUS);
- a row a by-index batch poller cannot answer for (no handle index), or a
  ``failure_reasons`` hook that raises or answers nonsense: ``hook_error``
  (HOOK_ERROR).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lifecycle import validate
from lifecycle.errors import HookError, PartialPollError
from lifecycle.reasons import FailureReason
from lifecycle.rules.graph import VERDICTS
from lifecycle.status import I8, KVPoll

__all__ = ["Observation", "observe", "poll_each", "statuses", "status_bytes", "contained"]

#: each answer of a per-request poll, and what the polls that raised raised,
#: by position (see :func:`poll_each`)
Polled = tuple[list[object], dict[int, BaseException]]

_F = I8.F
_I8 = np.dtype(np.int8)
_NONE = np.int8(FailureReason.NONE)
_UNKNOWN = np.int8(FailureReason.UNKNOWN)
#: the bytes of the non-failed statuses (a byte scan is far cheaper than a
#: numpy reduction right after a collective, when caches are cold)
_LIVE = bytes(int(s) for s in KVPoll if s != KVPoll.Failed)
_FAILED_BYTE = bytes([int(KVPoll.Failed)])
_STATUS_BYTES = bytes(int(s) for s in KVPoll)
_HOOK = FailureReason.HOOK_ERROR
#: reasons a backend may report for a Failed (its own, or a peer's it relays)
BACKEND_REASONS = np.array(
    sorted(int(v.reason) for v in VERDICTS if "backend" in v.sources), dtype=np.int8
)
_NO_INDEX = (
    "cannot answer for a request without a handle index (set it with add(handle_index=...) "
    "or set_handle_index, or mark a poller that answers from rooms alone with by_room = True)"
)


def contained(hook: str, rank: int, exc: Exception) -> HookError:
    """``exc`` from ``hook`` as the :class:`HookError` reported for its rows."""
    if isinstance(exc, HookError):
        return exc
    err = HookError(hook, rank, f"raised {exc!r}")
    err.__cause__ = exc
    return err


class Observation:
    """Raw statuses of the active rows and the verdicts observing produced.

    ``backend``: reason codes of Failed values the poller reported (NONE
    elsewhere); ``invalid``, ``errors`` (poll errors) and ``hooked`` (hook
    errors) are masks. Each is None when nothing hit.
    """

    __slots__ = (
        "backend",
        "clean",
        "errors",
        "exceptions",
        "failed",
        "given",
        "hooked",
        "invalid",
        "raw",
        "raw_invalid",
        "scan",
    )

    def __init__(self, raw: NDArray[np.int8]) -> None:
        self.raw = raw
        #: every value is a live status and nothing was failed (the common poll)
        self.clean = False
        #: ``raw``'s bytes, when clean and taken (a short list): the step counts in them
        self.scan: bytes | None = None
        self.backend: NDArray[np.int8] | None = None
        #: the rows the poller reported Failed, when that was all it did wrong
        #: (their reasons are ``backend``'s); else None
        self.failed: NDArray[np.bool_] | None = None
        self.invalid: NDArray[np.bool_] | None = None
        self.errors: NDArray[np.bool_] | None = None
        self.hooked: NDArray[np.bool_] | None = None
        self.exceptions: dict[int, BaseException] = {}
        self.raw_invalid: dict[int, object] = {}
        self.given: list[object] | NDArray[Any] | None = None  # the poller's answer as given

    def hook_failed(
        self, rows: NDArray[np.bool_], rooms: NDArray[np.uint64], err: HookError
    ) -> None:
        """Fail ``rows`` for a misbehaving hook (reason HOOK_ERROR)."""
        self.hooked = rows.copy() if self.hooked is None else self.hooked | rows
        self.exceptions.update(dict.fromkeys(rooms[rows].tolist(), err))


def _either(a: NDArray[np.bool_] | None, b: NDArray[np.bool_] | None) -> NDArray[np.bool_] | None:
    if a is None:
        return b
    return a if b is None else a | b


#: past this many rows statuses are checked and packed by numpy calls, not as bytes
LONG = 2048


def observe(
    poller: Any,
    handles: Sequence[Any],
    rows: NDArray[np.int64],
    rooms: NDArray[np.uint64],
    hidx: NDArray[np.int64],
    no_index: NDArray[np.bool_] | None,
    rank: int,
    polled: Polled | None = None,
    values: NDArray[np.int8] | None = None,
) -> Observation:
    """Poll the active rows; see the module docstring for what is contained.

    ``polled``: a driver without a batch poller that already called each
    active row's handle, in the frame's order (:func:`poll_each`); those
    answers are taken instead of polling again (``values``: their
    :func:`statuses`, if the driver has them)."""
    k = rooms.size
    if poller is not None:
        obs = _batch(poller, rooms, hidx, no_index, rank)
    elif polled is not None:
        if len(polled[0]) != k:
            raise ValueError(f"{len(polled[0])} polled answers for {k} active rows")
        obs = _observed(polled[0], polled[1], rooms, k, values)
    else:
        obs = _observed(*poll_each(map(handles.__getitem__, rows.tolist())), rooms, k)
    raw = obs.raw
    if not k:
        return obs
    rest = None
    if obs.errors is None and obs.hooked is None:
        if k > LONG and raw[raw.argmin()] >= 1 and raw[raw.argmax()] <= 4:
            obs.clean = True  # a long list: two cheap calls, no copy to scan
            return obs
        scan = raw.tobytes()
        rest = scan.translate(None, _LIVE)
        if not rest:
            obs.clean, obs.scan = True, scan
            return obs  # the common poll: every value a live status, nothing to fail
    if rest is not None and not rest.translate(None, _FAILED_BYTE):
        # every other value is a Failed: none is out of range, some failed
        obs.failed = failed = raw == _F
        obs.backend = _backend_reasons(obs, poller, handles, rows, rooms, hidx, failed, rank)
        return obs
    lo, hi = int(raw.min()), int(raw.max())
    if lo < 0 or hi > 4:
        bad = (raw < 0) | (raw > 4)
        skip = _either(obs.errors, obs.hooked)
        if skip is not None:
            bad &= ~skip
        if bad.any():
            obs.invalid = bad
            given = obs.given
            for i in np.flatnonzero(bad).tolist():
                v = given[i] if given is not None else raw[i]
                obs.raw_invalid[int(rooms[i])] = v.item() if isinstance(v, np.generic) else v
    broken = _either(_either(obs.invalid, obs.errors), obs.hooked)
    if broken is not None:
        raw = obs.raw = np.where(broken, _F, raw).astype(np.int8)
        failed = (raw == _F) & ~broken
    elif lo == 0:
        failed = raw == _F
    else:
        return obs
    if failed.any():
        obs.backend = _backend_reasons(obs, poller, handles, rows, rooms, hidx, failed, rank)
    return obs


def _batch(
    poller: Any,
    rooms: NDArray[np.uint64],
    hidx: NDArray[np.int64],
    no_index: NDArray[np.bool_] | None,
    rank: int,
) -> Observation:
    k = rooms.size
    pos: NDArray[np.int64] | None = None
    ask_rooms, ask_hidx = rooms, hidx
    if no_index is not None:
        pos = np.flatnonzero(~no_index)
        ask_rooms, ask_hidx = rooms[pos], hidx[pos]
    m = ask_rooms.size
    errors: dict[int, BaseException] = {}
    try:
        try:
            arr = poller.poll_many(ask_rooms, ask_hidx)
            if type(arr) is not np.ndarray:
                arr = np.asarray(arr)
        except PartialPollError as pe:
            arr = np.asarray(pe.statuses)
            bad = [i for i in pe.errors if not validate.is_integer(i) or not 0 <= i < m]
            if bad:
                raise ValueError(
                    f"PartialPollError names positions {bad} outside the batch of {m}"
                ) from pe
            errors = {int(i): e for i, e in pe.errors.items()}
        if arr.shape != (m,):
            raise ValueError(f"poll_many returned shape {arr.shape}, expected ({m},)")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"poll_many must return integers, got dtype {arr.dtype}")
    except Exception as e:  # never let one rank's error desync the group
        obs = Observation(np.full(k, _F, dtype=np.int8))
        obs.errors = np.ones(k, dtype=bool) if pos is None else ~no_index  # type: ignore[operator]
        obs.exceptions.update(dict.fromkeys(ask_rooms.tolist(), e))
        if no_index is not None:
            obs.hook_failed(no_index, rooms, HookError("batch poll", rank, _NO_INDEX))
        return obs
    dt = arr.dtype
    if dt is _I8 or dt == _I8 or not m or (int(arr.min()) >= 0 and int(arr.max()) <= 4):
        arr8 = arr.astype(np.int8)  # a copy: the backend's array is never written to
    else:
        arr8 = np.clip(arr, -1, 5).astype(np.int8)  # narrowing keeps out-of-range values out
    if pos is not None:
        full = np.full(k, _F, dtype=np.int8)
        full[pos] = arr8
        arr8 = full
    obs = Observation(arr8)
    if pos is None:
        obs.given = arr
    if errors:
        _raised(obs, errors, ask_rooms, k, pos)
    if no_index is not None:
        obs.hook_failed(no_index, rooms, HookError("batch poll", rank, _NO_INDEX))
    return obs


def poll_each(pollers: Iterable[Any]) -> Polled:
    """Call each poller's ``poll()`` in order: the answers, and the exception of
    each poll that raised by its position (its answer there is Failed)."""
    out: list[object] = []
    append = out.append
    errors: dict[int, BaseException] = {}
    it = iter(pollers)
    while True:  # one loop over every poller; a poll that raises is noted and skipped
        try:
            for p in it:
                append(p.poll())
            break
        except Exception as e:
            errors[len(out)] = e
            append(_FAILED)
    return out, errors


def _observed(
    out: list[object],
    errors: dict[int, BaseException],
    rooms: NDArray[np.uint64],
    k: int,
    values: NDArray[np.int8] | None = None,
) -> Observation:
    obs = Observation(statuses(out, k) if values is None else values)
    obs.given = out
    _raised(obs, errors, rooms, k, None)
    return obs


def statuses(out: list[object], k: int, raw: bytearray | None = None) -> NDArray[np.int8]:
    """Each answer as a status, or -1 where it is not one: only integers are
    statuses (2.7, True or "4" are invalid, never rounded). When every answer is
    an integer in 0..255, one pass over their types and one conversion to bytes
    (``raw``: :func:`status_bytes` of ``out``, if taken already)."""
    raw = raw if raw is not None else status_bytes(out)
    if raw is not None:
        arr: NDArray[np.int8] = np.frombuffer(raw, dtype=np.int8)  # writable, no copy
        if raw.translate(None, _STATUS_BYTES):  # some value past 4
            arr = np.where((arr < 0) | (arr > 4), np.int8(-1), arr).astype(np.int8)
        return arr
    return np.fromiter(  # some answer not an integer, or past 255: one by one
        (int(x) if validate.is_integer(x) and 0 <= x <= 4 else -1 for x in out),  # type: ignore[call-overload, operator]
        dtype=np.int8,
        count=k,
    )


def status_bytes(out: list[object]) -> bytearray | None:
    """The answers as bytes, one per answer, when every one is an integer (not a
    bool) in 0..255; else None."""
    types = set(map(type, out))
    if not (types <= _INT_TYPES or all([t in _INT_TYPES or _int_type(t) for t in types])):
        return None
    try:
        return bytearray(out)  # type: ignore[arg-type]  # integers only (no bool)
    except (OverflowError, TypeError, ValueError):  # some value outside 0..255
        return None


_FAILED = int(KVPoll.Failed)
_INT_TYPES = {int, KVPoll}


def _int_type(t: type) -> bool:
    ok = issubclass(t, (int, np.integer)) and not issubclass(t, (bool, np.bool_))
    if ok and len(_INT_TYPES) < 64:
        _INT_TYPES.add(t)
    return ok


def _raised(
    obs: Observation,
    errors: dict[int, BaseException],
    asked: NDArray[np.uint64],
    k: int,
    pos: NDArray[np.int64] | None,
) -> None:
    """Record the polls that raised: ``errors`` by position among the ``asked``
    rooms, which are the frame's rows ``pos`` (all ``k`` of them if None)."""
    if not errors:
        return
    at = np.fromiter(errors, dtype=np.int64, count=len(errors))
    mask = np.zeros(k, dtype=bool)
    mask[at if pos is None else pos[at]] = True
    obs.errors = mask
    for i, err in errors.items():
        obs.exceptions[int(asked[i])] = err


def _backend_reasons(
    obs: Observation,
    poller: Any,
    handles: Sequence[Any],
    rows: NDArray[np.int64],
    rooms: NDArray[np.uint64],
    hidx: NDArray[np.int64],
    failed: NDArray[np.bool_],
    rank: int,
) -> NDArray[np.int8]:
    """Reason codes for the Failed values a poller reported (UNKNOWN when it gave none)."""
    codes: NDArray[np.int8] = np.where(failed, _UNKNOWN, _NONE)
    if poller is not None:
        fn = getattr(poller, "failure_reasons", None)
        if fn is None:
            return codes
        nf = int(failed.sum())
        try:
            given = np.asarray(fn(rooms[failed], hidx[failed]))
            if given.shape != (nf,) or given.dtype.kind not in "iu":
                raise HookError(
                    "failure_reasons",
                    rank,
                    f"answered dtype {given.dtype} shape {given.shape}, not {nf} integer reason codes",
                )
        except Exception as e:
            obs.hook_failed(failed, rooms, contained("failure_reasons", rank, e))
            codes[failed] = _NONE
            return codes
        codes[failed] = np.where(np.isin(given, BACKEND_REASONS), given, FailureReason.UNKNOWN)
        return codes
    for i in np.flatnonzero(failed).tolist():
        code, why = _reason_of(handles[int(rows[i])])
        codes[i] = code
        if why is not None:
            obs.exceptions[int(rooms[i])] = contained("failure_reason", rank, why)
    return codes


def _reason_of(handle: Any) -> tuple[FailureReason, Exception | None]:
    """A per-object poller's reason for a Failed it reported, and what its
    reason hook raised (its reason is then ``hook error``)."""
    fn = getattr(handle, "failure_reason", None)
    if fn is not None:
        try:
            raw = fn()
            if not validate.is_integer(raw):
                raise TypeError(f"failure_reason() returned {raw!r}, not a reason code")
            code = int(raw)
        except Exception as e:
            return _HOOK, e
        return (FailureReason(code) if code in BACKEND_REASONS else FailureReason.UNKNOWN), None
    fn = getattr(handle, "failure_exception", None)
    if fn is not None:
        try:
            return (
                FailureReason.TRANSFER_ERROR if fn() is not None else FailureReason.UNKNOWN
            ), None
        except Exception:
            return FailureReason.TRANSFER_ERROR, None
    return FailureReason.UNKNOWN, None
