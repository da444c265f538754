"""Argument checks for the ``pdlife`` commands: every check runs before any
rank is spawned, and a failed one names the argument and what to do."""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

__all__ = [
    "MAX_SECONDS",
    "SimConfigError",
    "SimConfigTypeError",
    "UsageError",
    "positive_int",
    "nonneg_int",
    "probability",
    "seconds",
    "writable_dir",
]

#: the longest time a flag takes (a year): past it a wait overflows what a
#: thread or a store timeout accepts
MAX_SECONDS = 365 * 86400.0


class UsageError(Exception):
    """A bad argument or input file (exit status 2); the message is one line."""

    def __init__(self, what: str, problem: str) -> None:
        self.what = what
        super().__init__(f"{what}: {problem}")


class SimConfigError(UsageError):
    """A :class:`~pdlife.cluster.config.SimConfig` field out of range, or fields
    that do not fit together; ``field`` is the field's name, ``allowed`` what
    it accepts. Raised before anything is started."""

    def __init__(self, field: str, value: object, allowed: str, owner: str = "") -> None:
        from buffers.checks import setting_message  # (buffers imports torch)

        self.field, self.value, self.allowed, self.owner = field, value, allowed, owner
        what = f"{owner}.{field}" if owner else field
        super().__init__(what, setting_message(field, value, allowed, owner)[len(what) + 2 :])


class SimConfigTypeError(SimConfigError, TypeError):
    """A :class:`~pdlife.cluster.config.SimConfig` field of the wrong type (also a TypeError)."""


def _number(text: str, kind: type) -> float:
    try:
        return kind(text)  # type: ignore[no-any-return]
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None


def positive_int(text: str) -> int:
    v = int(_number(text, int))
    if not 1 <= v < 2**63:
        raise argparse.ArgumentTypeError(f"must be an integer in 1..2**63-1, got {v}")
    return v


def nonneg_int(text: str) -> int:
    v = int(_number(text, int))
    if not 0 <= v < 2**63:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..2**63-1, got {v}")
    return v


def probability(text: str) -> float:
    v = _number(text, float)
    if not (math.isfinite(v) and 0.0 <= v <= 1.0):
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1], got {text}")
    return v


def seconds(text: str) -> float:
    v = _number(text, float)
    if not (math.isfinite(v) and 0 < v <= MAX_SECONDS):
        raise argparse.ArgumentTypeError(
            f"must be a positive number of seconds, at most {MAX_SECONDS:.0f} (a year), got {text}"
        )
    return v


def port(text: str) -> int:
    """A TCP port, or 0: one the OS picks as it binds."""
    v = int(_number(text, int))
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 0..65535 (0: any free), got {v}")
    return v


def writable_dir(path: Path, flag: str) -> Path:
    """Create ``path`` (and parents) or say why it cannot be the output directory."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        # a name of its own: every rank under torchrun checks the same directory
        with tempfile.NamedTemporaryFile(dir=path, prefix=".pdlife-write-test-"):
            pass
    except OSError as e:
        raise UsageError(
            f"{flag} {path}", f"cannot write there ({e.strerror}); choose another directory"
        ) from None
    return path
