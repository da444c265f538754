"""Test doubles, test-only executors and the reusable consensus state machine.

``lifecycle.testing.doubles`` has pollers, gates and staging stand-ins that
need nothing but numpy; :func:`lockstep` drives W steppers as W ranks in one
thread and :class:`SimulatedWorld` runs W ranks in one process (a thread
each). ``lifecycle.testing.consensus`` (needs hypothesis) holds the
rule-based state machine users point at their own pollers.
"""

from lifecycle.testing.doubles import (
    ListFaults,
    ScriptedPoller,
    SetGate,
    SetStaging,
    StatusBoard,
)
from lifecycle.testing.lockstep import lockstep
from lifecycle.testing.simulated import SimulatedWorld

__all__ = [
    "ListFaults",
    "ScriptedPoller",
    "SetGate",
    "SetStaging",
    "StatusBoard",
    "SimulatedWorld",
    "lockstep",
]
