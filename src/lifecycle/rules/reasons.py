"""Every failure reason's rules, declared once: one row per
:class:`~lifecycle.reasons.FailureReason`.

A row says, for its reason:

- its code, which *is* its priority (the enum value: on one rank the smallest
  code among the verdicts that hit wins, across ranks MIN keeps it);
- ``sources``: where a step's verdict for it comes from (the verdict sources
  of :data:`lifecycle.rules.graph.VERDICTS`; ``backend`` is a Failed the
  poller reported with this reason);
- ``deadline``: the deadline that fails a request with it, if any: the name of
  its setting (``<name>_timeout`` in every layer's config), the clock it runs
  from (:class:`Clock`) and the statuses it runs in;
- ``recovery``: its default recovery (:data:`lifecycle.rules.recovery.DEFAULT_RECOVERY`);
- ``counts``: whether it counts against the health of the prefill peer the
  request was routed to (:data:`lifecycle.rules.peers.COUNTED`), and why.

Whether a failed decode request's pages are fenced is not a reason's: any
request whose writer is still silent at the drain timeout is fenced, whatever
it failed for (a client's abort that the paused writer never heard included;
see :mod:`transport.connector.core.liveness`).

The other tables are derived from :data:`REASONS`, each where it is used, and
each checks at import that it still says what the row says (:func:`agree`);
:func:`check_reasons` holds the table itself to its rules at import.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from types import MappingProxyType

import attrs

from lifecycle.reasons import FailureReason
from lifecycle.status import B, KVPoll, T, W

__all__ = [
    "Clock",
    "Recovery",
    "DeadlineRule",
    "ReasonRule",
    "REASONS",
    "RULES",
    "BACKEND",
    "ReasonTableError",
    "check_reasons",
    "agree",
]


class Clock(enum.Enum):
    """The clock a deadline runs from: each layer keeps one column per clock
    (NaN where it has not started, which no deadline ever passes)."""

    BORN = "born"  # the attempt began (every attempt begins Bootstrapping)
    # decode told prefill where to write: it waits for the data (a fake sender:
    # it waits for its pages)
    WAITED = "waited"


class Recovery(enum.Enum):
    """A reason's default recovery: fail, or retry where a new attempt can cure
    it, on the same prefill peer or another one."""

    FAIL = "fail"
    RETRY_SAME = "retry on the same peer"
    RETRY_ANOTHER = "retry on another peer"


@attrs.frozen
class DeadlineRule:
    """A deadline: ``<name>_timeout`` seconds on ``clock`` while the request
    reports one of ``statuses``; ``covers`` says what that interval is."""

    name: str
    clock: Clock
    statuses: tuple[KVPoll, ...]
    covers: str

    @property
    def source(self) -> str:
        """The step's verdict source for it."""
        return f"{self.name}_deadline"


@attrs.frozen
class ReasonRule:
    """One failure reason's row (see the module's docstring for each field)."""

    reason: FailureReason
    sources: tuple[str, ...]
    recovery: Recovery
    counts: bool
    counts_why: str
    deadline: DeadlineRule | None = None

    @property
    def code(self) -> int:
        """The reason code, which is its priority (smaller wins)."""
        return int(self.reason)


R = FailureReason
#: the verdict source that is the poller's own reason codes, not a mask
BACKEND = "backend"
_FAIL, _SAME, _ANOTHER = Recovery.FAIL, Recovery.RETRY_SAME, Recovery.RETRY_ANOTHER

#: The one declaration, in code (= priority) order. A new reason is one row
#: here (and, for a new verdict source, one entry in lifecycle.core.sources).
REASONS: tuple[ReasonRule, ...] = (
    ReasonRule(
        R.ABORTED,
        ("abort_flag", BACKEND),  # the table's abort column, or a peer's abort relayed
        _FAIL,  # a client's abort is never retried or recomputed
        False,
        "a client asked for it; the peer did nothing wrong",
    ),
    ReasonRule(
        R.PEER_DEAD,
        (BACKEND,),
        _ANOTHER,  # a dead or silent peer is best left for another
        True,
        "the peer is gone (NIXL deregisters it, #1983)",
    ),
    ReasonRule(
        R.BOOTSTRAP_TIMEOUT,
        ("bootstrap_deadline", BACKEND),
        _ANOTHER,
        True,
        "the peer never completed the rendezvous",
        deadline=DeadlineRule(
            "bootstrap",
            Clock.BORN,
            (B,),
            "while the request reports Bootstrapping: its peer has not registered it, or "
            "(prefill) not every decode leg has said where to write",
        ),
    ),
    ReasonRule(
        R.WAITING_TIMEOUT,
        ("waiting_deadline", BACKEND),
        _SAME,  # bytes that went wrong once may go right on the same path
        True,
        "the peer was told where to write and never did",
        deadline=DeadlineRule(
            "waiting",
            Clock.WAITED,
            (W, T),
            "from decode telling prefill where to write until every byte has landed (a "
            "Success a gate holds back, its metadata row not landed, is Transferring)",
        ),
    ),
    ReasonRule(
        R.METADATA_CORRUPT,
        ("metadata_row", BACKEND),  # another request's row: a bug, not bad luck
        _FAIL,
        False,
        "a row carrying another request's room: as likely this side's slot reuse",
    ),
    ReasonRule(
        R.TRANSFER_ERROR,
        (BACKEND,),
        _SAME,
        True,
        "the engine reported a failed write from the peer",
    ),
    ReasonRule(
        R.INVALID_STATUS,
        ("poll_value",),  # a value outside KVPoll: never a backend's own reason
        _FAIL,
        False,
        "this side's backend returned a value outside KVPoll",
    ),
    ReasonRule(
        R.LOCAL_EXCEPTION,
        ("poll_error", BACKEND),  # a poll that raised or answered the wrong shape or dtype
        _FAIL,
        False,
        "this side's poller raised",
    ),
    ReasonRule(
        R.INJECTED_FAULT,
        ("fault_hook", BACKEND),
        _SAME,
        False,
        "a fault plan failed the request, not the peer",
    ),
    ReasonRule(
        R.UNKNOWN,
        (BACKEND,),  # a Failed the backend gave no reason for
        _FAIL,
        True,
        "a backend reported Failed without a reason (a plain backend always does): "
        "the transfer from the peer failed, as far as anyone can tell",
    ),
    ReasonRule(
        R.CHECKSUM_MISMATCH,
        (BACKEND,),
        _SAME,
        True,
        "the bytes the peer sent are not the bytes that landed",
    ),
    ReasonRule(
        R.HOOK_ERROR,
        # a gate, staging, metadata source, fault hook or reasons hook that raised
        # or answered nonsense: any real cause on another rank wins
        ("hook_error", BACKEND),
        _FAIL,
        False,
        "a user hook misbehaved; it says nothing about the transfer",
    ),
)


class ReasonTableError(AssertionError):
    """The reason table, or a table derived from it, breaks a rule (at import)."""

    def __init__(self, reason: FailureReason | None, field: str, problem: str) -> None:
        self.reason, self.field = reason, field
        where = f"{reason.name}.{field}" if reason is not None else field
        super().__init__(
            f"failure reason table, {where}: {problem}. Fix the row in lifecycle.rules.reasons"
            " (the other tables are derived from it)."
        )


def _check_deadline(row: ReasonRule, names: set[str]) -> None:
    d = row.deadline
    if d is None:
        return
    if not isinstance(d, DeadlineRule):
        raise ReasonTableError(row.reason, "deadline", f"{d!r} is not a DeadlineRule or None")
    if not isinstance(d.name, str) or not d.name.isidentifier() or d.name in names:
        raise ReasonTableError(row.reason, "deadline.name", f"{d.name!r} is not a new identifier")
    names.add(d.name)
    if not isinstance(d.clock, Clock):
        known = ", ".join(c.name for c in Clock)
        raise ReasonTableError(
            row.reason, "deadline.clock", f"{d.clock!r} is not a known clock ({known})"
        )
    bad = [s for s in d.statuses if not isinstance(s, KVPoll) or s.terminal]
    if not d.statuses or bad or len(set(d.statuses)) != len(d.statuses):
        raise ReasonTableError(
            row.reason,
            "deadline.statuses",
            f"{d.statuses!r} must name live KVPoll statuses (not Success or Failed), each once",
        )
    if d.clock is Clock.BORN and set(d.statuses) != {B}:
        # a step's row knows when it entered its status; only at Bootstrapping,
        # where every attempt begins, is that its birth
        raise ReasonTableError(
            row.reason, "deadline.statuses", "a deadline on the born clock runs in Bootstrapping"
        )
    if d.source not in row.sources:
        raise ReasonTableError(
            row.reason, "sources", f"the deadline's verdict source {d.source!r} is missing"
        )


#: reasons that say nothing about the transfer or the peer
_SAYS_NOTHING = (R.ABORTED, R.HOOK_ERROR)


def check_reasons(rows: tuple[ReasonRule, ...]) -> None:
    """Raise :class:`ReasonTableError`, naming the reason and the field, unless
    every failure reason but NONE has exactly one well-formed row, in code order."""
    seen: list[FailureReason] = []
    names: set[str] = set()
    for row in rows:
        r = row.reason
        if not isinstance(r, FailureReason) or r is R.NONE:
            raise ReasonTableError(None, "reason", f"{r!r} is not a failure reason (NONE is not)")
        if r in seen:
            raise ReasonTableError(r, "reason", "has two rows; declare each reason once")
        if seen and r < seen[-1]:
            raise ReasonTableError(r, "reason", f"comes after {seen[-1].name}: keep code order")
        seen.append(r)
        if not row.sources or not all(isinstance(s, str) and s for s in row.sources):
            raise ReasonTableError(r, "sources", f"{row.sources!r}: name at least one source")
        if len(set(row.sources)) != len(row.sources):
            raise ReasonTableError(r, "sources", f"{row.sources!r} names a source twice")
        if not isinstance(row.recovery, Recovery):
            raise ReasonTableError(r, "recovery", f"{row.recovery!r} is not a Recovery")
        if not isinstance(row.counts, bool):
            raise ReasonTableError(r, "counts", f"{row.counts!r} is not a bool")
        if not isinstance(row.counts_why, str) or not row.counts_why:
            raise ReasonTableError(r, "counts_why", "say why it does or does not count")
        if r in _SAYS_NOTHING and (row.recovery is not Recovery.FAIL or row.counts):
            # a client's abort or a misbehaving hook says nothing a new attempt or
            # another peer could change, nor anything about the peer
            field = "recovery" if row.recovery is not Recovery.FAIL else "counts"
            raise ReasonTableError(r, field, "must fail and not count against the peer")
        _check_deadline(row, names)
    missing = [r.name for r in R if r is not R.NONE and r not in seen]
    if missing:
        raise ReasonTableError(None, "reason", f"no row for {', '.join(missing)}")


def agree(
    table: str,
    derived: Mapping[FailureReason, object],
    field: str,
    rows: tuple[ReasonRule, ...] = REASONS,
    read: Callable[[ReasonRule], object] | None = None,
) -> None:
    """Raise :class:`ReasonTableError` unless ``derived`` (the table named
    ``table``) holds, for exactly the rows that have one, what each row's
    ``field`` says (``read``: how to read it from a row; a None it reads is
    "no entry")."""
    get = read if read is not None else (lambda row: getattr(row, field))
    want = {row.reason: v for row in rows if (v := get(row)) is not None}
    for r in sorted(set(want) | set(derived)):
        if r not in derived:
            raise ReasonTableError(r, field, f"{table} has no entry for it")
        if r not in want:
            raise ReasonTableError(r, field, f"{table} has an entry the row does not declare")
        if derived[r] != want[r]:
            raise ReasonTableError(r, field, f"{table} says {derived[r]!r}, the row {want[r]!r}")


check_reasons(REASONS)

#: each reason's row
RULES: Mapping[FailureReason, ReasonRule] = MappingProxyType({row.reason: row for row in REASONS})
