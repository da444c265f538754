"""pd-lifecycle: the KV-cache transfer lifecycle of prefill/decode
disaggregated serving as explicit, typed state machines that every rank
advances in one collective step."""

from lifecycle.config import StepConfig
from lifecycle.drive.collective import (
    Collective,
    CountingCollective,
    Hierarchical,
    SingleRank,
    TorchCollective,
    start_min,
)
from lifecycle.drive.group import StepGroup
from lifecycle.drive.stepper import Stepper
from lifecycle.errors import (
    CollectiveMismatch,
    DuplicateRequest,
    FaultPlanError,
    IllegalTransition,
    InvalidStatus,
    LifecycleError,
    RankFailure,
    ReservedRoom,
    StepInFlight,
    TableBusy,
    UnknownRequest,
    UnknownTrigger,
)
from lifecycle.reasons import FailureReason
from lifecycle.result import Failure, StepResult, StuckReport
from lifecycle.rules.graph import EDGES, GATES, VERDICTS, Edge, EdgeKind
from lifecycle.rules.reference import RequestMachine
from lifecycle.status import KVPoll, Role
from lifecycle.table import RequestTable
from lifecycle.testing.lockstep import lockstep
from lifecycle.testing.simulated import SimulatedWorld

__version__ = "0.1.0"

__all__ = [
    "EDGES",
    "GATES",
    "VERDICTS",
    "Collective",
    "CollectiveMismatch",
    "CountingCollective",
    "DuplicateRequest",
    "Edge",
    "EdgeKind",
    "Failure",
    "FailureReason",
    "FaultPlanError",
    "Hierarchical",
    "IllegalTransition",
    "InvalidStatus",
    "KVPoll",
    "LifecycleError",
    "RankFailure",
    "RequestMachine",
    "RequestTable",
    "ReservedRoom",
    "Role",
    "SimulatedWorld",
    "SingleRank",
    "StepConfig",
    "StepGroup",
    "StepResult",
    "Stepper",
    "StuckReport",
    "StepInFlight",
    "TableBusy",
    "TorchCollective",
    "UnknownRequest",
    "UnknownTrigger",
    "lockstep",
    "start_min",
]
