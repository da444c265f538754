"""Argument checks shared by the field-facing names: each raises a typed
error naming the argument, the value and what was expected, before anything
is changed.

The errors are :class:`~buffers.errors.BadArgumentType` for a value of the
wrong type (a None where an object is required, a float where an integer is,
a string where a slice is) and :class:`~buffers.errors.BadArgument` for a
value of the right type out of range; the first is also a TypeError and both
are ValueErrors, so a caller written for the field's own errors still
catches them.
"""

from __future__ import annotations

import enum
import operator
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray

from buffers.errors import BadArgument, BadArgumentType

__all__ = [
    "integer",
    "optional_integer",
    "int_or_raw",
    "uint64",
    "page_indices",
    "required",
    "sequence",
    "forward_slice",
    "member",
]

E = TypeVar("E", bound=enum.Enum)


def integer(name: str, value: object, minimum: int | None, hint: str = "") -> int:
    """``value`` as an int (Python, numpy or 0-d tensor integers; never a bool
    or a float), at least ``minimum`` unless that is None."""
    expected = "an integer" if minimum is None else f"an integer >= {minimum}"
    expected += hint
    if isinstance(value, (bool, np.bool_)):
        raise BadArgumentType(name, value, f"{expected}, not a bool")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise BadArgumentType(name, value, expected) from None
    if minimum is not None and number < minimum:
        raise BadArgument(name, value, expected)
    return number


def optional_integer(name: str, value: object, minimum: int, hint: str = "") -> int | None:
    return None if value is None else integer(name, value, minimum, hint)


def int_or_raw(value: object) -> Any:
    """``value`` as a Python int when it is an integer (numpy, 0-d tensor; not
    a bool), else ``value`` itself, for a settings class to refuse by name."""
    if isinstance(value, (bool, np.bool_)):
        return value
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return value


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


def required(name: str, value: Any, expected: str) -> Any:
    """``value`` itself; None raises, naming ``name`` and what to pass."""
    if value is None:
        raise BadArgumentType(name, value, expected)
    return value


def sequence(name: str, value: Any, expected: str) -> Any:
    """``value`` itself when it is a list-like with a length (not a string or bytes)."""
    if (
        isinstance(value, (str, bytes))
        or not hasattr(value, "__len__")
        or not hasattr(value, "__getitem__")
    ):
        raise BadArgumentType(name, value, expected)
    return value


def forward_slice(name: str, value: object, hint: str = "") -> tuple[int | None, int | None]:
    """``(start, stop)`` of a forward slice of positions: a ``slice`` whose step is
    None or 1, whose bounds are None or integers, and whose start is not past
    its stop."""
    expected = f"a forward slice of positions, slice(start, stop){hint}"
    if not isinstance(value, slice):
        raise BadArgumentType(name, value, expected)
    step = int_or_raw(value.step)
    if step is not None and (type(step) is not int or step != 1):
        raise BadArgument(name, value, f"{expected} with no step (every position, in order)")
    start = None if value.start is None else integer(f"{name}.start", value.start, None, hint)
    stop = None if value.stop is None else integer(f"{name}.stop", value.stop, None, hint)
    if start is not None and stop is not None and start > stop:
        raise BadArgument(name, value, f"{expected} whose start is not past its stop")
    return start, stop


def member(name: str, value: object, kind: type[E], hint: str = "") -> E:
    """The member of the enum ``kind`` that ``value`` is or names (by value)."""
    known = ", ".join(f"{kind.__name__}.{m.name}" for m in kind)
    raw = getattr(value, "value", value)
    try:
        return kind(raw)
    except (ValueError, TypeError):
        pass
    expected = f"one of {known}{hint}"
    if not isinstance(raw, str):
        raise BadArgumentType(name, value, expected)
    raise BadArgument(name, value, expected)
