"""pd-lifecycle: the KV-cache transfer lifecycle of prefill/decode
disaggregated serving as explicit, typed state machines that every rank
advances in one collective step."""

from lifecycle.collective import (
    Collective,
    CountingCollective,
    Hierarchical,
    SingleRank,
    TorchCollective,
    start_min,
)
from lifecycle.config import StepConfig
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
from lifecycle.graph import EDGES, GATES, VERDICTS, Edge, EdgeKind
from lifecycle.group import StepGroup
from lifecycle.lockstep import lockstep
from lifecycle.reasons import FailureReason
from lifecycle.reference import RequestMachine
from lifecycle.result import Failure, StepResult, StuckReport
from lifecycle.simulated import SimulatedWorld
from lifecycle.status import KVPoll, Role
from lifecycle.stepper import Stepper
from lifecycle.table import RequestTable

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
