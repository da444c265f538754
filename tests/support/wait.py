"""Polling until a condition holds, failing loudly when it does not."""

from __future__ import annotations

import time
from collections.abc import Callable


class WaitTimedOut(AssertionError):
    """A condition did not hold in time (an AssertionError: a test's failure, not its error)."""


def wait_for(
    cond: Callable[[], object], what: str, timeout: float = 30.0, interval: float = 0.002
) -> None:
    """Poll ``cond`` every ``interval`` seconds until it is true; raise
    :class:`WaitTimedOut` naming ``what`` once ``timeout`` seconds pass."""
    t0 = time.monotonic()
    while not cond():
        waited = time.monotonic() - t0
        if waited > timeout:
            raise WaitTimedOut(f"timed out after {waited:.1f} s waiting for {what}")
        time.sleep(interval)
