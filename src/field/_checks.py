"""Argument checks shared by the field-facing names: each raises a typed
error naming the argument, the value and what was expected, before anything
is changed."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
from numpy.typing import NDArray

from buffers.errors import BadArgument, BadArgumentType

__all__ = ["integer", "optional_integer", "uint64", "page_indices"]


def integer(name: str, value: object, minimum: int, hint: str = "") -> int:
    """``value`` as an int (Python, numpy or 0-d tensor integers; never a bool
    or a float), at least ``minimum``."""
    expected = f"an integer >= {minimum}{hint}"
    if isinstance(value, (bool, np.bool_)):
        raise BadArgumentType(name, value, f"{expected}, not a bool")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise BadArgumentType(name, value, expected) from None
    if number < minimum:
        raise BadArgument(name, value, expected)
    return number


def optional_integer(name: str, value: object, minimum: int, hint: str = "") -> int | None:
    return None if value is None else integer(name, value, minimum, hint)


def uint64(name: str, value: object) -> int:
    """``value`` as an int that fits a uint64."""
    number = integer(name, value, 0, " that fits a uint64")
    if number >= 1 << 64:
        raise BadArgument(name, value, "an integer in 0..2**64-1 (a uint64)")
    return number


def page_indices(name: str, value: Any, hint: str = "") -> NDArray[np.int64]:
    """A one-dimensional sequence of page indices, as an int64 array."""
    try:
        arr = np.asarray(value)
    except Exception:
        arr = np.asarray(None)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise BadArgumentType(name, value, f"a one-dimensional sequence of page indices{hint}")
    return arr.astype(np.int64, copy=False)
