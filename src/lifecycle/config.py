"""How a stepper is configured: :class:`StepConfig`, the step tag, the
capacity bounds every rank agrees on."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, Literal

import attrs

from lifecycle import validate
from lifecycle.core.fingerprint import stable_hash
from lifecycle.core.observe import contained
from lifecycle.errors import HookError, InvalidArgument
from lifecycle.rules.recovery import FAIL_ALL, RecoveryTable

__all__ = [
    "StepConfig",
    "tag_word",
    "require_method",
    "read_clock",
    "Reading",
    "FIRST_CAPACITY",
    "MAX_CAPACITY",
    "MAX_RANK",
]

#: size of every stepper's first reduce, whatever its configuration: the group
#: agrees there on the largest ``initial_capacity`` any rank asked for, so
#: ranks built with different settings never hand gloo different sizes
FIRST_CAPACITY = 64
#: the largest buffer capacity a config may ask for
MAX_CAPACITY = 1 << 24


def _seconds_or_none(inst: Any, attribute: Any, value: object) -> None:
    if value is not None:
        validate.seconds(value, f"StepConfig.{attribute.name}")


@attrs.frozen
class StepConfig:
    """How a stepper behaves; all deadlines off by default.

    Every rank of a group must use the same config (except
    ``initial_capacity``, of which the group takes the largest): a hash of
    it travels in the header and a difference raises
    :class:`~lifecycle.errors.CollectiveMismatch` on every rank.
    """

    #: seconds a request may stay Bootstrapping before it fails (None: never);
    #: this and the next are lifecycle.rules.deadlines.DEADLINES, as in every layer
    bootstrap_timeout: float | None = attrs.field(default=None, validator=_seconds_or_none)
    #: seconds from ``mark_metadata_sent`` until a request still WaitingForInput
    #: or Transferring fails (the deadline's row in lifecycle.rules.reasons)
    waiting_timeout: float | None = attrs.field(default=None, validator=_seconds_or_none)
    #: a poll value outside KVPoll: "raise" InvalidStatus on every rank after the
    #: reduce (nothing applied), or "fail" the request with reason INVALID_STATUS
    invalid_status: Literal["raise", "fail"] = "raise"
    #: report requests that have not changed status for this many steps
    stuck_after: int | None = None
    #: buffer capacity to keep at least (the largest over the ranks is agreed)
    initial_capacity: int = 64
    #: what each failure reason leads to (lifecycle.rules.recovery): no
    #: recovery by default; the results' ``retries()`` and ``recomputed`` read it
    recovery: RecoveryTable = attrs.field(default=FAIL_ALL)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.invalid_status, str) or self.invalid_status not in ("raise", "fail"):
            raise InvalidArgument(
                "StepConfig.invalid_status", self.invalid_status, "'raise' or 'fail'"
            )
        if self.stuck_after is not None:
            validate.integer(self.stuck_after, "StepConfig.stuck_after", 1, 1 << 40)
        validate.integer(self.initial_capacity, "StepConfig.initial_capacity", 1, MAX_CAPACITY)
        if not isinstance(self.recovery, RecoveryTable):
            raise InvalidArgument("StepConfig.recovery", self.recovery, "a RecoveryTable")

    @property
    def fingerprint(self) -> int:
        """Hash of the settings every rank of a group must share (the capacity
        is agreed instead, so it is not part of it)."""
        return stable_hash(
            repr(
                (
                    None if self.bootstrap_timeout is None else float(self.bootstrap_timeout),
                    None if self.waiting_timeout is None else float(self.waiting_timeout),
                    self.invalid_status,
                    None if self.stuck_after is None else int(self.stuck_after),
                    # no recovery leaves the hash as it was
                    None if self.recovery == FAIL_ALL else self.recovery.fingerprint,
                )
            )
        )


def tag_word(tag: object, rank: int) -> int:
    """The header word for ``tag`` (the caller's iteration number, or None).

    Tags are compared modulo 2**63 (a tag travels as ``tag % 2**63 + 1``;
    0 means none), so any iteration counter fits; a negative one is refused.
    """
    if tag is None:
        return 0
    value = operator.index(tag) if validate.is_integer(tag) else -1  # type: ignore[arg-type]
    if value < 0:
        raise InvalidArgument("step tag", tag, "None or a non-negative integer", rank)
    return value % (1 << 63) + 1


def require_method(obj: object, method: str, what: str) -> None:
    """Refuse a hook object that lacks ``method`` (None: no hook)."""
    if obj is not None and not callable(getattr(obj, method, None)):
        raise InvalidArgument(what, obj, f"an object with a {method}() method")


#: ranks are stamped into the origin fetch as int32
MAX_RANK = (1 << 24) - 1


#: a clock's reading: the time, and the hook error of a clock that misbehaved
Reading = tuple[float, HookError | None]


def read_clock(clock: Callable[[], float], rank: int, last: float) -> Reading:
    """The clock's reading; a clock that raises or answers a non-finite or
    non-numeric value is a hook error (``last``, the table's last time, stands
    in; 0 if it has none)."""
    try:
        value = clock()
        if type(value) is float and math.isfinite(value):  # the common reading, in one check
            return value, None
        now = validate.finite(value)
        if now is None:
            raise HookError("clock", rank, f"answered {value!r}, not a finite time")
        return now, None
    except Exception as e:
        return (0.0 if math.isnan(last) else float(last)), contained("clock", rank, e)
