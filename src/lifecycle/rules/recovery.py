"""What happens to a failed request, declared once: the recovery table.

Every rank of a group agrees a failed request's reason (the MIN of the
packed words, :mod:`lifecycle.core.packing`) and holds the same attempt
number for it (the request's *epoch*, a table column the list fingerprint
covers). The recovery decision is a pure function of those two agreed facts
and of :class:`RecoveryTable`, whose fingerprint every rank's
:class:`~lifecycle.config.StepConfig` shares. So every rank takes the same
decision without another collective.

An action is one of:

- ``fail``: today's behaviour: the request ends Failed and the client sees
  the error;
- ``retry``: the request starts again at Bootstrapping with ``epoch + 1``
  (so on the ``max_attempts``-th attempt it fails instead); ``where`` says
  which prefill serves the new attempt: the ``same`` peer, ``another`` one
  (the next prefill DP group, or the next healthy peer), or a user ``hook``;
- ``recompute``: the request leaves the transfer lifecycle; every transfer
  resource is released and the engine prefills it locally.

:data:`DEFAULT_RECOVERY` retries what a new attempt can cure (each reason's
row of :data:`lifecycle.rules.reasons.REASONS` says which: a transfer
error, a timeout, a dead peer, a checksum mismatch, an injected fault) up to
three attempts, and fails the rest: a client's abort, corrupt metadata
(another request's row: a bug, not bad luck), a status outside the lattice,
a poller's exception, a misbehaving hook, a reason nobody gave. :data:`FAIL_ALL`
is the behaviour without recovery. The import-time check holds every table
built here to the rules that make it safe: each reason has one policy, a
client's abort is never retried or recomputed, attempts are at least one.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray

from lifecycle.errors import InvalidArgument
from lifecycle.reasons import REASON_BITS, FailureReason
from lifecycle.rules.reasons import REASONS, Recovery, agree

__all__ = [
    "Action",
    "Where",
    "Policy",
    "RecoveryTable",
    "FAIL",
    "RECOMPUTE",
    "retry",
    "DEFAULT_RECOVERY",
    "FAIL_ALL",
    "MAX_ATTEMPTS",
    "preset",
]

#: the largest attempt count a policy may name (epochs travel as uint16)
MAX_ATTEMPTS = 1 << 15


class Action(enum.IntEnum):
    """What a failed request's agreed reason and epoch decide (a StepResult column)."""

    NONE = -1  # the row did not fail in this step
    FAIL = 0
    RETRY = 1
    RECOMPUTE = 2

    @property
    def label(self) -> str:
        return self.name.lower()


class Where(enum.Enum):
    """Which prefill serves a retried request's next attempt."""

    SAME = "same"
    ANOTHER = "another"
    HOOK = "hook"


@attrs.frozen
class Policy:
    """A reason's policy: ``action``, and for a retry the attempts in all
    (the first one included) and where the next one goes."""

    action: Action
    max_attempts: int = 1
    where: Where = Where.SAME

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.action, Action) or self.action is Action.NONE:
            raise InvalidArgument("Policy.action", self.action, "Action.FAIL, RETRY or RECOMPUTE")
        if (
            isinstance(self.max_attempts, bool)
            or not isinstance(self.max_attempts, int)
            or not 1 <= self.max_attempts <= MAX_ATTEMPTS
        ):
            raise InvalidArgument(
                "Policy.max_attempts", self.max_attempts, f"an int in 1..{MAX_ATTEMPTS}"
            )
        if not isinstance(self.where, Where):
            raise InvalidArgument("Policy.where", self.where, "a Where (same, another, hook)")

    def __str__(self) -> str:
        if self.action is Action.RETRY:
            return f"retry({self.max_attempts}, {self.where.value})"
        return self.action.label


FAIL = Policy(Action.FAIL)
RECOMPUTE = Policy(Action.RECOMPUTE)


def retry(max_attempts: int = 3, where: Where | str = Where.SAME) -> Policy:
    """A retry policy: ``max_attempts`` attempts in all, the next one ``where``."""
    try:
        w = where if isinstance(where, Where) else Where(where)
    except ValueError:
        raise InvalidArgument("retry where", where, "'same', 'another' or 'hook'") from None
    return Policy(Action.RETRY, max_attempts, w)


R = FailureReason
#: reasons a new attempt can cure (their rows in lifecycle.rules.reasons say retry)
RETRYABLE: frozenset[FailureReason] = frozenset(
    row.reason for row in REASONS if row.recovery is not Recovery.FAIL
)
#: where each retryable reason's next attempt goes by default (read from its row)
_WHERE = {
    row.reason: Where.ANOTHER if row.recovery is Recovery.RETRY_ANOTHER else Where.SAME
    for row in REASONS
    if row.reason in RETRYABLE
}


class RecoveryTable:
    """A policy per failure reason (every reason but NONE, exactly once).

    Build one from :data:`DEFAULT_RECOVERY` with :meth:`override`, or from a
    full mapping. :meth:`decide` is the batch executor the step runs.
    """

    def __init__(self, policies: Mapping[FailureReason, Policy]) -> None:
        reasons = {r for r in FailureReason if r is not R.NONE}
        if not isinstance(policies, Mapping):
            raise InvalidArgument("RecoveryTable policies", policies, "a mapping reason -> Policy")
        keys = set(policies)
        if keys != reasons:
            missing = sorted(r.name for r in reasons - keys)
            extra = sorted(map(repr, keys - reasons))
            raise InvalidArgument(
                "RecoveryTable policies",
                f"missing {missing}, extra {extra}",
                "one Policy for every FailureReason except NONE",
            )
        for r, p in policies.items():
            if not isinstance(p, Policy):
                raise InvalidArgument(f"RecoveryTable policy for {r.name}", p, "a Policy")
        if policies[R.ABORTED].action is not Action.FAIL:
            raise InvalidArgument(
                "RecoveryTable policy for ABORTED",
                str(policies[R.ABORTED]),
                "fail (a client's abort is never retried or recomputed)",
            )
        self.policies: Mapping[FailureReason, Policy] = MappingProxyType(
            {r: policies[r] for r in sorted(reasons)}
        )
        # the batch executor's columns, indexed by reason code
        size = 1 << REASON_BITS
        self._action = np.full(size, Action.NONE, dtype=np.int8)
        self._max = np.ones(size, dtype=np.int32)
        for r, p in self.policies.items():
            self._action[r] = p.action
            self._max[r] = p.max_attempts

    def override(self, **changes: Policy | str) -> RecoveryTable:
        """A copy with some reasons' policies replaced, by reason name:
        ``table.override(transfer_error=FAIL, peer_dead=retry(5, "another"))``;
        a string is "fail" or "recompute"."""
        new = dict(self.policies)
        for name, p in changes.items():
            try:
                reason = FailureReason[name.upper()]
            except KeyError:
                raise InvalidArgument(
                    "RecoveryTable.override reason", name, "a FailureReason name, e.g. peer_dead"
                ) from None
            if isinstance(p, str):
                if p not in ("fail", "recompute"):
                    raise InvalidArgument(
                        f"RecoveryTable.override {name}", p, "a Policy, 'fail' or 'recompute'"
                    )
                p = FAIL if p == "fail" else RECOMPUTE
            new[reason] = p
        return RecoveryTable(new)

    def __getitem__(self, reason: FailureReason) -> Policy:
        return self.policies[reason]

    def decide(
        self, reasons: NDArray[Any], epochs: NDArray[Any]
    ) -> tuple[NDArray[np.int8], NDArray[np.uint16]]:
        """Per failed row (agreed reason, the epoch of the attempt that failed):
        the action, and the epoch of the next attempt (``epoch + 1`` where the
        action is retry, else ``epoch``). A retry on its last attempt fails."""
        r = np.asarray(reasons, dtype=np.int64)
        e = np.asarray(epochs, dtype=np.int64)
        if r.shape != e.shape or r.ndim != 1:
            raise InvalidArgument("decide", (r.shape, e.shape), "one reason and one epoch per row")
        if not r.size:  # (the common step: no row failed)
            return _NO_ACTIONS.copy(), _NO_NEXT.copy()
        known = r.min() >= 0 and r.max() < _NONE and self._action[r].min() >= 0
        if not known or (e.size and (e.min() < 0 or e.max() >= 1 << 16)):
            raise InvalidArgument(
                "decide reasons/epochs",
                (r.tolist()[:8], e.tolist()[:8]),
                "failure reason codes (not NONE) and epochs in 0..65535",
            )
        action = self._action[r]  # (a gather: a new array)
        retry = action == _RETRY
        spent = retry & (e + 1 >= self._max[r])
        if spent.any():
            action[spent] = _FAIL
            retry &= ~spent
        nxt = (e + retry).astype(np.uint16)
        return action, nxt

    @property
    def fingerprint(self) -> str:
        """The table as text: every rank of a group must hold the same one."""
        return ";".join(f"{r.name}={p}" for r, p in self.policies.items())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RecoveryTable) and dict(self.policies) == dict(other.policies)

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        return f"RecoveryTable({self.fingerprint})"


#: the codes :meth:`RecoveryTable.decide` reads, as plain integers (an enum
#: member's lookup on its class is a slow path of Python's enum)
_NONE, _RETRY, _FAIL = int(R.NONE), int(Action.RETRY), int(Action.FAIL)
_NO_ACTIONS = np.zeros(0, dtype=np.int8)
_NO_NEXT = np.zeros(0, dtype=np.uint16)

#: retry what a new attempt can cure, three attempts in all; fail the rest
DEFAULT_RECOVERY = RecoveryTable(
    {r: retry(3, _WHERE[r]) if r in RETRYABLE else FAIL for r in FailureReason if r is not R.NONE}
)
#: no recovery: every failure ends the request
FAIL_ALL = RecoveryTable({r: FAIL for r in FailureReason if r is not R.NONE})


def preset(mode: str, max_attempts: int = 3) -> RecoveryTable:
    """The table behind ``--recovery``: "fail" (:data:`FAIL_ALL`), "retry"
    (:data:`DEFAULT_RECOVERY` with ``max_attempts``), or "recompute" (what a
    retry would cure is recomputed locally instead)."""
    if mode == "fail":
        return FAIL_ALL
    if mode == "retry":
        return RecoveryTable(
            {
                r: retry(max_attempts, p.where) if p.action is Action.RETRY else p
                for r, p in DEFAULT_RECOVERY.policies.items()
            }
        )
    if mode == "recompute":
        return RecoveryTable(
            {r: RECOMPUTE if r in RETRYABLE else FAIL for r in DEFAULT_RECOVERY.policies}
        )
    raise InvalidArgument("recovery mode", mode, "'fail', 'retry' or 'recompute'")


def _check_declaration() -> None:
    if not set(FailureReason) - {R.NONE, R.ABORTED, R.HOOK_ERROR} >= RETRYABLE:
        raise AssertionError("an abort, a hook error or NONE is never retryable")
    for t in (DEFAULT_RECOVERY, FAIL_ALL, preset("recompute")):
        if t[R.ABORTED] != FAIL or t[R.HOOK_ERROR].action is not Action.FAIL:
            raise AssertionError("aborts and hook errors fail in every preset")
    agree(
        "DEFAULT_RECOVERY",
        {r: _declared(p) for r, p in DEFAULT_RECOVERY.policies.items()},
        "recovery",
    )


def _declared(p: Policy) -> Recovery:
    """A default policy as the reason table says it (its attempts are the table's)."""
    if p.action is Action.FAIL:
        return Recovery.FAIL
    if p.action is Action.RETRY:
        return Recovery.RETRY_ANOTHER if p.where is Where.ANOTHER else Recovery.RETRY_SAME
    raise AssertionError(f"{p}: the default table only fails or retries")


_check_declaration()
