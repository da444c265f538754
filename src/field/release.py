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
"""

from __future__ import annotations

import os
from importlib import metadata

__all__ = ["RELEASES", "DEFAULT", "FieldReleaseError", "release", "set_release", "installed"]

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
