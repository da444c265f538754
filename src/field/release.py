"""Which field release's conventions apply, where two releases disagree.

Two releases are known: ``"seed"``, the surface described in COMPAT.md (the
one this project began against), and ``"0.5.23"``, SGLang 0.5.23. Most names
behave the same in both; where they do not (a constructor's keywords, how many
values ``get_buf`` returns, the fake receiver's ``init``), the release picks.

The release is, in order of precedence:

1. the one set with :func:`set_release` (for the whole process);
2. the environment variable ``PDLIFE_FIELD_RELEASE``;
3. the installed SGLang's version, when the package ``sglang`` is installed
   (read from its metadata, without importing it): 0.5.23 or later gives
   ``"0.5.23"``, anything older gives ``"seed"``;
4. otherwise ``"0.5.23"``.

Where two releases give a *positional* argument different meanings,
:func:`bind_positional` names the arguments by the current release's shape;
keywords mean the same in both. An object that keeps a layout (metadata
buffers, a fake receiver) reads the release once, when it is built.
"""

from __future__ import annotations

import enum
import inspect
import os
from collections.abc import Mapping
from importlib import metadata
from typing import Any

__all__ = [
    "RELEASES",
    "DEFAULT",
    "UNSET",
    "FieldReleaseError",
    "FieldSignatureError",
    "SignatureByRelease",
    "bind_positional",
    "release",
    "set_release",
    "installed",
]

#: the releases whose conventions this package knows, oldest first
RELEASES = ("seed", "0.5.23")
DEFAULT = "0.5.23"
ENV = "PDLIFE_FIELD_RELEASE"

_chosen: str | None = None


class FieldReleaseError(ValueError):
    """A release name that is not one of :data:`RELEASES`."""

    def __init__(self, value: object, where: str) -> None:
        self.value = value
        super().__init__(
            f"{where}: unknown field release {value!r}; known releases: "
            f"{', '.join(RELEASES)} (set {ENV} or call field.release.set_release with one)"
        )


def _check(value: object, where: str) -> str:
    if not isinstance(value, str) or value not in RELEASES:
        raise FieldReleaseError(value, where)
    return value


def _version_key(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit()) if part else ""
        out.append(int(digits) if digits else 0)
    return tuple(out)


def installed() -> str | None:
    """The installed SGLang's version string, or None when it is not installed."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def release() -> str:
    """The release whose conventions apply now (see the module's docstring)."""
    if _chosen is not None:
        return _chosen
    env = os.environ.get(ENV)
    if env:
        return _check(env, ENV)
    version = installed()
    if version is not None:
        return "0.5.23" if _version_key(version) >= (0, 5, 23) else "seed"
    return DEFAULT


def set_release(value: str | None) -> None:
    """Use ``value``'s conventions in this process; None goes back to the default rule."""
    global _chosen
    _chosen = None if value is None else _check(value, "set_release")


class _Unset(enum.Enum):
    """The type of :data:`UNSET`."""

    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "<unset>"


#: a keyword that was not passed (None is a value some parameters take)
UNSET = _Unset.UNSET


class FieldSignatureError(TypeError):
    """A call that fits neither the current release's argument shape nor its
    keywords (too many positional arguments, or one argument given twice)."""

    def __init__(self, where: str, problem: str, shape: tuple[str, ...], current: str) -> None:
        self.where, self.shape, self.release = where, shape, current
        super().__init__(
            f"{where}: {problem}. Under the {current!r} release's conventions its positional "
            f"parameters are ({', '.join(shape)}); pass the others by keyword, or choose the "
            f"release with {ENV} or field.release.set_release"
        )


def bind_positional(
    where: str,
    leading: tuple[str, ...],
    args: tuple[Any, ...],
    shapes: Mapping[str, tuple[str, ...]],
    keywords: Mapping[str, Any],
) -> tuple[str, dict[str, Any]]:
    """Name ``args`` (what followed the ``leading`` parameters positionally)
    by the current release's shape in ``shapes``, and add the ``keywords``
    that were passed (those not :data:`UNSET`). Returns ``(release, values)``.

    Raises :class:`FieldSignatureError` (a TypeError, as Python raises for a
    call that does not fit) for too many positional arguments or an argument
    given both ways.
    """
    current = release()
    shape = shapes[current]
    full = leading + shape
    if len(args) > len(shape):
        raise FieldSignatureError(
            where,
            f"takes at most {len(full)} positional argument{'s' if len(full) != 1 else ''}, "
            f"got {len(leading) + len(args)}",
            full,
            current,
        )
    values = dict(zip(shape, args))
    for name, value in keywords.items():
        if value is UNSET:
            continue
        if name in values:
            raise FieldSignatureError(
                where, f"got multiple values for argument {name!r}", full, current
            )
        values[name] = value
    return current, values


class SignatureByRelease:
    """A class's ``__signature__`` that follows the current release, so that
    :func:`inspect.signature` shows the call shape that applies now."""

    def __init__(self, signatures: Mapping[str, inspect.Signature]) -> None:
        self.signatures = dict(signatures)

    def __get__(self, obj: object, owner: type | None = None) -> inspect.Signature:
        return self.signatures[release()]
