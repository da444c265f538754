"""Test doubles and the reusable consensus state machine.

``lifecycle.testing.doubles`` has pollers, gates and staging stand-ins that
need nothing but numpy. ``lifecycle.testing.consensus`` (needs hypothesis)
holds the rule-based state machine users point at their own pollers.
"""

from lifecycle.testing.doubles import (
    ListFaults,
    ScriptedPoller,
    SetGate,
    SetStaging,
    StatusBoard,
)

__all__ = ["ListFaults", "ScriptedPoller", "SetGate", "SetStaging", "StatusBoard"]
