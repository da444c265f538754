"""Checks for what callers hand the library, run before anything changes.

Each returns the value in its canonical type or raises a typed
:class:`~lifecycle.errors.InvalidArgument`; callers validate every argument
first and mutate only afterwards, so a refused call leaves no trace.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Any, SupportsIndex, cast

import numpy as np
from numpy.typing import NDArray

from lifecycle.errors import InvalidArgument, InvalidRoom
from lifecycle.status import KVPoll, Role

__all__ = [
    "MAX_ROOM",
    "is_integer",
    "room",
    "rooms",
    "status",
    "role",
    "integer",
    "seconds",
    "int_column",
    "bool_column",
]

MAX_ROOM = (1 << 64) - 1


def _int(value: object) -> int:
    """``value`` as an int (only called on values that passed an integer check)."""
    return operator.index(cast("SupportsIndex", value))


def is_integer(value: object) -> bool:
    """An int or numpy integer, and not a bool (``True`` is not a room or a count)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def room(value: object, rank: int | None = None, *, allow_zero: bool = False) -> int:
    if not is_integer(value):
        raise InvalidRoom(value, rank)
    r = _int(value)
    if not (0 if allow_zero else 1) <= r <= MAX_ROOM:
        raise InvalidRoom(value, rank)
    return r


def rooms(values: Iterable[Any] | NDArray[Any], rank: int | None = None) -> list[int]:
    """Rooms as Python ints (0 allowed here: the table decides whether a row may use it)."""
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "iu" or values.ndim != 1:
            raise InvalidRoom(values, rank)
        if values.dtype.kind == "i" and values.size and int(values.min()) < 0:
            raise InvalidRoom(int(values[values < 0][0]), rank)
        out: list[int] = values.tolist()
        return out
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidRoom(values, rank)
    items = list(values)
    if all(type(v) is int for v in items):  # the common case: one pass, no calls
        if items and (min(items) < 0 or max(items) > MAX_ROOM):
            raise InvalidRoom(next(v for v in items if not 0 <= v <= MAX_ROOM), rank)
        return items
    return [room(v, rank, allow_zero=True) for v in items]


def status(value: object, what: str = "status", rank: int | None = None) -> KVPoll:
    if isinstance(value, KVPoll):
        return value
    if is_integer(value) and 0 <= _int(value) <= 4:
        return KVPoll(_int(value))
    raise InvalidArgument(what, value, "a KVPoll member (Failed .. Success)", rank)


def role(value: object, rank: int | None = None) -> Role:
    if isinstance(value, Role):
        return value
    if is_integer(value) and _int(value) in (0, 1):
        return Role(_int(value))
    raise InvalidArgument("role", value, "a Role member (SENDER or RECEIVER)", rank)


def integer(value: object, what: str, lo: int, hi: int, rank: int | None = None) -> int:
    if not is_integer(value) or not lo <= _int(value) <= hi:
        raise InvalidArgument(what, value, f"an integer in {lo}..{hi}", rank)
    return _int(value)


def finite(value: object) -> float | None:
    """``value`` as a float when it is a real, finite number (not a bool, numpy's
    included); else None. The core's one finite-number check."""
    if type(value) is float:  # the common case, in one comparison
        return value if math.isfinite(value) else None
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(
        value, (bool, np.bool_)
    ):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def seconds(value: object, what: str, rank: int | None = None) -> float:
    """A positive, finite duration (int or float; not bool)."""
    v = finite(value)
    if v is None or not v > 0:
        raise InvalidArgument(what, value, "a finite number of seconds > 0", rank)
    return v


def int_column(
    value: object, k: int, what: str, lo: int, hi: int, rank: int | None = None
) -> NDArray[np.int64] | int:
    """A scalar or length-``k`` sequence of integers in lo..hi, as an int64
    array (a plain int comes back as it is: numpy broadcasts it)."""
    if type(value) is int and lo <= value <= hi:
        return value
    arr = np.asarray(value)
    if arr.shape == (0,) == (k,):  # an empty column for an empty batch (numpy reads float)
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu" or arr.ndim > 1 or (arr.ndim == 1 and arr.size != k):
        raise InvalidArgument(what, value, f"an integer or {k} integers in {lo}..{hi}", rank)
    if arr.size and (int(arr.min()) < lo or int(arr.max()) > hi):
        bad = arr[(arr < lo) | (arr > hi)].ravel()[0]
        raise InvalidArgument(what, int(bad), f"integers in {lo}..{hi}", rank)
    out: NDArray[np.int64] = np.broadcast_to(arr.astype(np.int64), (k,))
    return out


def bool_column(
    value: object, k: int, what: str, rank: int | None = None
) -> NDArray[np.bool_] | bool:
    """A bool or length-``k`` sequence of bools (a plain bool comes back as it is)."""
    if type(value) is bool:
        return value
    arr = np.asarray(value)
    if arr.shape == (0,) == (k,):  # an empty column for an empty batch
        arr = arr.astype(np.bool_)
    if arr.dtype != np.bool_ or arr.ndim > 1 or (arr.ndim == 1 and arr.size != k):
        raise InvalidArgument(what, value, f"a bool or {k} bools", rank)
    out: NDArray[np.bool_] = np.broadcast_to(arr, (k,))
    return out
