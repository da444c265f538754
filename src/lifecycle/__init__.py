"""pd-lifecycle: the KV-cache transfer lifecycle of prefill/decode
disaggregated serving as explicit, typed state machines that every rank
advances in one collective step.

What a scheduler needs is here; the rest stays under its own module:
the rule tables in :mod:`lifecycle.rules`, the sans-I/O step in
:mod:`lifecycle.core`, the drivers in :mod:`lifecycle.drive`, every error in
:mod:`lifecycle.errors`, test doubles and test-only executors in
:mod:`lifecycle.testing`.
"""

from lifecycle.config import StepConfig
from lifecycle.drive.collective import (
    Collective,
    Hierarchical,
    SingleRank,
    TorchCollective,
)
from lifecycle.drive.group import StepGroup
from lifecycle.drive.stepper import Stepper
from lifecycle.errors import (
    CollectiveMismatch,
    HookError,
    LifecycleError,
    RankFailure,
    TableBusy,
)
from lifecycle.protocols import (
    BatchPoller,
    FaultHook,
    Gate,
    MetadataSource,
    StagingGate,
    StepContext,
)
from lifecycle.reasons import FailureReason
from lifecycle.result import Failure, StepResult, StuckReport
from lifecycle.status import KVPoll, Role
from lifecycle.table import RequestTable

__version__ = "0.1.0"

__all__ = [
    # the statuses and why a request failed
    "KVPoll",
    "FailureReason",
    "Role",
    # the requests of one queue, stepped on one rank
    "RequestTable",
    "Stepper",
    "StepGroup",
    "StepConfig",
    "StepResult",
    "Failure",
    "StuckReport",
    # what a step reduces over
    "Collective",
    "TorchCollective",
    "Hierarchical",
    "SingleRank",
    # what a step raises
    "LifecycleError",
    "CollectiveMismatch",
    "RankFailure",
    "TableBusy",
    "HookError",
    # what a user implements: pollers, gates, staging, metadata, faults
    "BatchPoller",
    "Gate",
    "StagingGate",
    "MetadataSource",
    "FaultHook",
    "StepContext",
]
