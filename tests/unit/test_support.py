"""The shared test helpers fail loudly: a wait that runs out names what it waited for."""

import time

import pytest

from support.clock import Clock
from support.wait import WaitTimedOut, wait_for


def test_a_wait_that_runs_out_raises_naming_what_it_waited_for():
    t0 = time.monotonic()
    with pytest.raises(WaitTimedOut, match=r"timed out after 0\.\d s waiting for the door to open"):
        wait_for(lambda: False, "the door to open", timeout=0.05)
    assert time.monotonic() - t0 >= 0.05
    assert issubclass(WaitTimedOut, AssertionError)  # a failing test, not an erroring one


def test_a_wait_returns_once_the_condition_holds():
    seen = []
    wait_for(lambda: seen.append(1) or len(seen) >= 3, "three polls", timeout=5.0, interval=0)
    assert len(seen) == 3


def test_the_clock_reads_what_the_test_set():
    clock = Clock(100.0)
    assert clock() == 100.0
    clock.t += 2.5
    assert clock() == 102.5
    assert Clock()() == 0.0
