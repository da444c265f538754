"""A clock the test moves by hand, for the deadlines of steppers and managers."""

from __future__ import annotations


class Clock:
    """Reads ``t``; a test sets or advances ``t`` to move time on."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
