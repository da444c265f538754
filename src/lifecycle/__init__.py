"""pd-lifecycle: the KV-cache transfer lifecycle of prefill/decode
disaggregated serving as explicit, typed state machines that every rank
advances in one collective step."""

from lifecycle.collective import (
    Collective,
    CountingCollective,
    Hierarchical,
    SimulatedWorld,
    SingleRank,
    TorchCollective,
)
from lifecycle.errors import (
    CollectiveMismatch,
    DuplicateRequest,
    FaultPlanError,
    IllegalTransition,
    InvalidStatus,
    LifecycleError,
    RankFailure,
    ReservedRoom,
    UnknownRequest,
    UnknownTrigger,
)
from lifecycle.graph import EDGES, Edge, EdgeKind
from lifecycle.lockstep import lockstep
from lifecycle.reasons import FailureReason
from lifecycle.reference import RequestMachine
from lifecycle.status import KVPoll, Role
from lifecycle.step import Failure, StepConfig, Stepper, StepResult, StuckReport
from lifecycle.table import RequestTable

__version__ = "0.1.0"

__all__ = [
    "EDGES",
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
    "StepResult",
    "Stepper",
    "StuckReport",
    "TorchCollective",
    "UnknownRequest",
    "UnknownTrigger",
    "lockstep",
]
