"""Type and range checks for the fields of settings classes, as attrs validators.

A :class:`Checks` is bound to one package's pair of typed errors, each called
as ``cls(field, value, allowed, owner)``: ``bad_type`` for a value of the
wrong type, ``bad_value`` for one out of range or not fitting the others.
The rules are the same everywhere: a bool is not an integer, a float is not
an integer (``2.0`` included), NaN and the infinities are not times, a string
is not a number, and None passes only where the field says what it means.
Python and numpy integers are integers, kept as Python ints by
:func:`int_tuple`.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import attrs

__all__ = [
    "Checks",
    "ErrorClass",
    "Validator",
    "int_tuple",
    "is_int",
    "is_real",
    "finite",
    "setting_message",
]

#: a typed error's class, called as ``cls(field, value, allowed, owner)``
ErrorClass = Callable[[str, object, str, str], Exception]
#: an attrs validator: ``(instance, attribute, value)``
Validator = Callable[[Any, Any, Any], None]


def is_int(value: object) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """An int or float (Python or numpy), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def finite(value: object) -> float | None:
    """``value`` as a float when it is a real, finite number (not a bool); else
    None. The one finite-number check every layer uses."""
    if type(value) is float:  # the common case, in one comparison
        return value if math.isfinite(value) else None
    if not is_real(value):
        return None
    v = float(value)  # type: ignore[arg-type]
    return v if math.isfinite(v) else None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def setting_message(field: str, value: object, allowed: str, owner: str = "") -> str:
    """``Owner.field: got VALUE (TYPE), expected ALLOWED``."""
    where = f"{owner}.{field}" if owner else field
    return f"{where}: got {_shown(value)} ({type(value).__name__}), expected {allowed}"


def int_tuple(value: Any) -> Any:
    """A converter: a list, tuple, range or one-dimensional array as a tuple,
    its integers as Python ints; anything else (a bool, a float, a string, a
    scalar), and any element not an integer, is left as it is for the field's
    validator to refuse by name."""
    if isinstance(value, list | tuple | range) or (
        hasattr(value, "__array__") and getattr(value, "ndim", None) == 1
    ):
        return tuple(operator.index(x) if is_int(x) else x for x in value)
    return value


def _num(x: float) -> str:
    """``x`` as a reader would write it: 2**64-1, 65535, 0.5."""
    if isinstance(x, int) and x >= 2**32:
        for k in range(33, 129):
            if x in (2**k, 2**k - 1):
                return f"2**{k}" if x == 2**k else f"2**{k}-1"
        return str(x)
    return str(x) if isinstance(x, int) else f"{x:g}"


def _range_text(noun: str, lo: float | None, hi: float | None, above: bool = False) -> str:
    if lo is not None and hi is not None:
        return (
            f"{noun} in ({_num(lo)}, {_num(hi)}]" if above else f"{noun} in {_num(lo)}..{_num(hi)}"
        )
    if lo is not None:
        return f"{noun} {'>' if above else '>='} {_num(lo)}"
    if hi is not None:
        return f"{noun} <= {_num(hi)}"
    return noun


@attrs.frozen
class Checks:
    """Validators raising one package's typed errors."""

    bad_value: ErrorClass
    bad_type: ErrorClass

    def fail(
        self, owner: object, field: str, value: object, allowed: str, wrong_type: bool = False
    ) -> NoReturn:
        """Raise the typed error for ``field`` of ``owner`` (an instance or a name)."""
        name = owner if isinstance(owner, str) else type(owner).__name__
        raise (self.bad_type if wrong_type else self.bad_value)(field, value, allowed, name)

    def integer(
        self, lo: int | None = 0, hi: int | None = None, *, none: str = "", why: str = ""
    ) -> Validator:
        """An integer in ``lo..hi``; None too when ``none`` says what it means."""
        allowed = _range_text("an integer", lo, hi) + (f", or None ({none})" if none else "") + why

        def check(inst: Any, attr: Any, value: Any) -> None:
            if value is None and none:
                return
            if not is_int(value):
                self.fail(inst, attr.name, value, allowed, wrong_type=True)
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                self.fail(inst, attr.name, value, allowed)

        return check

    def number(
        self,
        lo: float | None = 0.0,
        hi: float | None = None,
        *,
        above: bool = True,
        none: str = "",
        noun: str = "a finite number of seconds",
        why: str = "",
    ) -> Validator:
        """A finite int or float above ``lo`` (``above=False``: at least ``lo``),
        at most ``hi``; None too when ``none`` says what it means."""
        allowed = _range_text(noun, lo, hi, above) + (f", or None ({none})" if none else "") + why

        def check(inst: Any, attr: Any, value: Any) -> None:
            if value is None and none:
                return
            if not is_real(value):
                self.fail(inst, attr.name, value, allowed, wrong_type=True)
            v = finite(value)
            low = v is not None and lo is not None and (v <= lo if above else v < lo)
            if v is None or low or (hi is not None and v > hi):
                self.fail(inst, attr.name, value, allowed)

        return check

    def flag(self) -> Validator:
        """True or False (not 0, 1, 'no' or None)."""

        def check(inst: Any, attr: Any, value: Any) -> None:
            if not isinstance(value, bool):
                self.fail(inst, attr.name, value, "True or False", wrong_type=True)

        return check

    def text(
        self,
        choices: Sequence[str] = (),
        *,
        none: str = "",
        forbid: str = "",
        noun: str = "a non-empty string",
    ) -> Validator:
        """A non-empty string (one of ``choices`` if given) holding none of the
        characters of ``forbid`` nor whitespace; None too when ``none`` says
        what it means."""
        if choices:
            allowed = "one of " + ", ".join(repr(c) for c in choices)
        else:
            allowed = noun + " without whitespace" + "".join(f" or {c!r}" for c in forbid)
        allowed += f", or None ({none})" if none else ""

        def check(inst: Any, attr: Any, value: Any) -> None:
            if value is None and none:
                return
            if not isinstance(value, str):
                self.fail(inst, attr.name, value, allowed, wrong_type=True)
            if choices and value not in choices:
                self.fail(inst, attr.name, value, allowed)
            if not value or any(c.isspace() or c in forbid for c in value):
                self.fail(inst, attr.name, value, allowed)

        return check

    def ints(self, lo: int = 0, hi: int | None = None, *, noun: str = "integers") -> Validator:
        """A tuple (after :func:`int_tuple`) of integers in ``lo..hi``; an
        element's error names the field and its index."""
        each = _range_text(noun, lo, hi)
        allowed = f"a list or tuple of {each}"

        def check(inst: Any, attr: Any, value: Any) -> None:
            if not isinstance(value, tuple):
                self.fail(inst, attr.name, value, allowed, wrong_type=True)
            for i, x in enumerate(value):
                if not is_int(x):
                    self.fail(inst, f"{attr.name}[{i}]", x, each, wrong_type=True)
                if x < lo or (hi is not None and x > hi):
                    self.fail(inst, f"{attr.name}[{i}]", x, each)

        return check
