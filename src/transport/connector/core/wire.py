"""How a connector message travels: its fields as JSON holds them, and read back.

Each message of :mod:`transport.connector.core.messages` is a frozen attrs class
derived from :class:`Wire`, its fields annotated with the names of
:data:`CHECKS`. That table is the one declaration of what a field may hold
on the wire: :meth:`Wire.from_wire` checks every field of a JSON object
against it (type and range, in one pass; page lists as int64 arrays) and
raises :class:`MalformedMessage`, naming the field, for anything else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import attrs
import numpy as np
from numpy.typing import NDArray

from lifecycle.reasons import FailureReason
from transport.errors import TransportError

__all__ = [
    "CHECKS",
    "Check",
    "Geometry",
    "HeadSlice",
    "Ints",
    "MalformedMessage",
    "Rows",
    "Slot",
    "Span",
    "Wire",
    "fields_of",
    "whole",
]


class MalformedMessage(TransportError):
    """A message off the wire that is not one of :data:`MESSAGES` as declared:
    ``field`` names what is wrong (``kind``, ``from``, a missing or mistyped
    field). The connector counts it (``stats["malformed"]``) and drops it."""

    def __init__(self, field: str, value: object, want: str, kind: object = "?") -> None:
        self.field, self.value = field, value
        super().__init__(
            f"a {kind!s} message whose {field} is {value!r}: want {want}; it is dropped "
            "(is the peer running another version of the connector?)"
        )


# -- what a field may hold on the wire: a check that returns the typed value -------------
Check = Callable[[Any], Any]


def whole(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError("a whole number >= 0")
    return v


def _signed(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError("a whole number")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("true or false")
    return v


def _reason(v: Any) -> FailureReason:
    try:
        return FailureReason(whole(v))
    except ValueError:
        raise ValueError(f"a failure reason code {sorted(int(r) for r in FailureReason)}") from None


def _ints(v: Any) -> NDArray[np.int64]:
    """A list of whole numbers, as an int64 array (one pass, in C)."""
    if not isinstance(v, list):
        raise ValueError("a list of whole numbers")
    a = np.asarray(v) if v else np.empty(0, dtype=np.int64)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise ValueError("a list of whole numbers")
    return a.astype(np.int64, copy=False)


def _optional(check: Check) -> Check:
    return lambda v: None if v is None else check(v)


def _rows(v: Any) -> list[NDArray[np.int64]]:
    if not isinstance(v, list):
        raise ValueError("a list of lists of whole numbers")
    return [_ints(r) for r in v]


def _slice(v: Any) -> tuple[int, int, int]:
    if not isinstance(v, list) or len(v) != 3:
        raise ValueError("[first head, first head there, count]")
    a, b, c = (whole(x) for x in v)
    return a, b, c


def _span(v: Any) -> tuple[int, int]:
    if not isinstance(v, list | tuple) or len(v) != 2:
        raise ValueError("[first page, end page]")
    a, b = (whole(x) for x in v)
    return a, b


def _geometry(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise ValueError("a list (the state rows' geometry)")
    return v


def _text(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("a string")
    return v


#: what the fields of a message hold (a message's fields are annotated with these)
Slot = int  # a metadata row, or -1: none on this leg
HeadSlice = tuple[int, int, int]  # (first head here, first head there, count)
Span = tuple[int, int]  # pages [first, end) of a leg
Geometry = list[Any]  # a side's state rows (transport.layout.state_geometry)
Ints = NDArray[np.int64]
Rows = list[NDArray[np.int64]]  # one array of rows per state component

#: fields a peer of an older version may leave out, and what that means
_ABSENT: Mapping[str, Any] = MappingProxyType({"epoch": 0})

#: how each field type is read off the wire: the one declaration of what a
#: message may hold (every field of every message is checked against it at import)
CHECKS: Mapping[str, Check] = MappingProxyType(
    {
        "int": whole,
        "int | None": _optional(whole),
        "Slot": _signed,
        "bool": _bool,
        "FailureReason": _reason,
        "str | None": _optional(_text),
        "HeadSlice | None": _optional(_slice),
        "Span": _span,
        "Geometry": _geometry,
        "Ints": _ints,
        "Ints | None": _optional(_ints),
        "Rows | None": _optional(_rows),
    }
)


def _array_eq(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_array_eq(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _out(v: Any) -> Any:
    """A field's value as JSON holds it."""
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, list):
        return [_out(x) for x in v]
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, FailureReason):
        return int(v)
    return v


class Wire:
    """What every message is: a room's attempt, and its word on the wire."""

    KIND: ClassVar[str]  # its word (a messages.Msg)
    room: int
    epoch: int

    def to_wire(self) -> dict[str, Any]:
        """The JSON object this message travels as (the mailbox adds the sender)."""
        out: dict[str, Any] = {"kind": str(self.KIND)}
        for name, _, _ in fields_of(type(self)):
            out[name] = _out(getattr(self, name))
        return out

    @classmethod
    def from_wire(cls, raw: Mapping[str, Any]) -> Any:
        """The message ``raw`` holds; :class:`MalformedMessage` if a field is
        missing (and has no default) or holds what it may not."""
        kw = {}
        for name, check, required in fields_of(cls):
            if name not in raw:
                if name in _ABSENT:
                    kw[name] = _ABSENT[name]
                elif required:
                    raise MalformedMessage(name, None, "the field (it is missing)", cls.KIND)
                continue
            try:
                kw[name] = check(raw[name])
            except (ValueError, TypeError) as e:
                raise MalformedMessage(name, raw[name], str(e), cls.KIND) from None
        return cls(**kw)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(
            _array_eq(getattr(self, f.name), getattr(other, f.name))
            for f in attrs.fields(type(self))  # type: ignore[arg-type]
        )

    __hash__ = None  # type: ignore[assignment]


_FIELDS: dict[type[Wire], list[tuple[str, Check, bool]]] = {}


def fields_of(cls: type[Wire]) -> list[tuple[str, Check, bool]]:
    """A message's fields: (name, how it is read off the wire, whether it must be there)."""
    got = _FIELDS.get(cls)
    if got is None:
        got = _FIELDS[cls] = [
            (f.name, CHECKS[str(f.type)], f.default is attrs.NOTHING)
            for f in attrs.fields(cls)  # type: ignore[arg-type]
        ]
    return got
