"""Typed errors. Every message names the request, the rank, the states and
what to do, because the person reading it is debugging a hung or diverged
group at 3 a.m."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = [
    "LifecycleError",
    "IllegalTransition",
    "UnknownTrigger",
    "InvalidStatus",
    "CollectiveMismatch",
    "TableBusy",
    "StepInFlight",
    "DuplicateRequest",
    "UnknownRequest",
    "ReservedRoom",
    "FaultPlanError",
    "PartialPollError",
    "RankFailure",
    "InvalidArgument",
    "InvalidRoom",
    "ReducedBufferMismatch",
    "HookError",
]


class LifecycleError(Exception):
    """Base class of every error raised by :mod:`lifecycle`."""


def _name(status: int) -> str:
    from lifecycle.status import KVPoll

    try:
        return KVPoll(status).name
    except ValueError:
        return f"<invalid {status}>"


class IllegalTransition(LifecycleError):
    """A request was asked to move along an edge the graph does not declare."""

    def __init__(self, room: int, rank: int, src: int, dst: int, trigger: str) -> None:
        self.room, self.rank, self.src, self.dst, self.trigger = room, rank, src, dst, trigger
        super().__init__(
            f"request room={room} on rank {rank}: illegal transition "
            f"{_name(src)} -> {_name(dst)} (trigger {trigger!r}). Agreed statuses never "
            "regress and Success/Failed latch; retire a request once a step reports it "
            "finished, and make sure every rank steps the same requests in the same order."
        )


class UnknownTrigger(LifecycleError):
    def __init__(self, trigger: object, known: Iterable[str]) -> None:
        self.trigger = trigger
        super().__init__(
            f"unknown trigger {trigger!r}; the graph declares: {', '.join(sorted(known))}"
        )


class InvalidStatus(LifecycleError):
    """A poller returned a value outside :class:`KVPoll`."""

    def __init__(self, room: int, rank: int, value: object = None) -> None:
        self.room, self.rank, self.value = room, rank, value
        seen = f"returned {value!r}" if value is not None else "returned a value"
        super().__init__(
            f"request room={room}: the poll on rank {rank} {seen}, which is not a "
            "KVPoll value (0..4). Fix the backend, or configure the step with "
            "invalid_status='fail' to turn such values into an agreed Failed "
            "(reason 'invalid status')."
        )


class CollectiveMismatch(LifecycleError):
    """Ranks stepped different request lists, or stepped with a different
    configuration, queue or iteration tag; raised on every rank of the group.

    ``differs`` names what differs: any of ``"request list"``,
    ``"step configuration"``, ``"queue"`` and ``"tag"``.
    """

    def __init__(
        self,
        rank: int,
        local_len: int,
        lens: tuple[int, int],
        local_fingerprint: int,
        fingerprints: tuple[int, int],
        differs: tuple[str, ...] = ("request list",),
        detail: str = "",
    ) -> None:
        self.rank = rank
        self.local_len = local_len
        self.lens = lens
        self.local_fingerprint = local_fingerprint
        self.fingerprints = fingerprints
        self.differs = differs
        what = " and ".join(differs)
        parts = [f"rank {rank}: the ranks diverged ({what} not the same on every rank)."]
        if "request list" in differs:
            parts.append(
                f"Request lists: local length {local_len}, lengths across ranks "
                f"{lens[0]}..{lens[1]}; local fingerprint {local_fingerprint:#018x}, "
                f"fingerprints across ranks {fingerprints[0]:#018x}..{fingerprints[1]:#018x}."
            )
        if detail:
            parts.append(detail)
        parts.append(
            "No request was advanced. Every rank must add, remove and order requests "
            "identically (no early return on an empty queue, no rank-local filtering before "
            "the step), build its steppers with the same StepConfig and queue name, and "
            "step the same queue on the same iteration."
        )
        super().__init__(" ".join(parts))


class TableBusy(LifecycleError):
    """A table was edited while a started step was in flight."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        super().__init__(
            f"rank {rank}: this table is being stepped (start() was called, finish() not yet); "
            "adding, removing or aborting requests now would change what the step applies to. "
            "Make the change after finish()."
        )


class StepInFlight(TableBusy, RuntimeError):
    """A stepper's step was read or driven by hand while a started step was in
    flight (a :class:`TableBusy`, and a ``RuntimeError`` as misuse of a protocol)."""

    def __init__(self, rank: int, queue: str, method: str) -> None:
        self.rank, self.queue, self.method = rank, queue, method
        name = f"queue {queue!r}" if queue else "this queue"
        LifecycleError.__init__(
            self,
            f"rank {rank}, {name}: {method}() was called between start() and finish(); "
            "the step in flight owns the stepper until then, and a hand-driven prepare, "
            "resize, origins or apply now would make this rank apply a different step "
            "than its peers. Call finish() first.",
        )


class DuplicateRequest(LifecycleError):
    def __init__(self, room: int, rank: int) -> None:
        self.room, self.rank = room, rank
        super().__init__(
            f"request room={room} is already live in this table on rank {rank}; "
            "bootstrap rooms must be unique among live requests. Remove the old one first."
        )


class UnknownRequest(LifecycleError):
    def __init__(self, room: int, rank: int) -> None:
        self.room, self.rank = room, rank
        super().__init__(
            f"request room={room} is not live in this table on rank {rank}; it was never "
            "added or was already removed."
        )


class ReservedRoom(LifecycleError):
    def __init__(self, rank: int) -> None:
        self.rank = rank
        super().__init__(
            f"rank {rank}: bootstrap room 0 means 'not written' in metadata rows, so a real "
            "request cannot use it. Give the request a non-zero room, or add it with "
            "fake=True if it is a warm-up request whose metadata is never written."
        )


class PartialPollError(LifecycleError):
    """Raised by a batch poll that answered for most requests but not all.

    ``statuses`` has one value per polled request (ignored where ``errors``
    has an entry); ``errors`` maps positions in the batch to what went wrong.
    The step fails just those requests (reason local exception).
    """

    def __init__(self, statuses: object, errors: dict[int, BaseException]) -> None:
        self.statuses = statuses
        self.errors = errors
        super().__init__(f"batch poll failed for {len(errors)} request(s)")


class FaultPlanError(LifecycleError):
    """A fault plan failed validation; ``field`` names the offending entry."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        super().__init__(f"fault plan: {field}: {problem}")


class RankFailure(LifecycleError):
    """A peer rank stopped answering collectives (dead or hung)."""

    def __init__(self, rank: int, dead: Iterable[int], detail: str) -> None:
        self.rank = rank
        self.dead = tuple(dead)
        super().__init__(
            f"rank {rank}: rank(s) {list(self.dead) or 'unknown'} stopped taking part in the "
            f"collective ({detail}). The group cannot agree without them: restart the group."
        )


class InvalidArgument(LifecycleError, ValueError):
    """A caller handed the library a value of the wrong type or range; nothing changed."""

    def __init__(self, what: str, value: object, expected: str, rank: int | None = None) -> None:
        self.what, self.value, self.expected, self.rank = what, value, expected, rank
        where = f" on rank {rank}" if rank is not None else ""
        super().__init__(
            f"{what}{where}: got {value!r} ({type(value).__name__}), expected {expected}. "
            "Nothing was changed."
        )


class InvalidRoom(InvalidArgument):
    """A bootstrap room that is not an integer in 1..2**64-1 (0 only for warm-ups)."""

    def __init__(self, value: object, rank: int | None = None) -> None:
        super().__init__(
            "bootstrap room",
            value,
            "an integer (int or numpy integer, not bool) in 1..2**64-1",
            rank,
        )


class ReducedBufferMismatch(InvalidArgument):
    """A hand-driven step (``resize``, ``unchanged``, ``origins``, ``apply``,
    ``settle``) was given a buffer that is not this step's: another size, type
    or shape than what ``prepare``/``repack`` returned (or, for ``origins=``,
    than what ``origins()`` returned). Nothing was changed."""

    def __init__(
        self, rank: int, queue: str, method: str, what: str, expected: str, value: object
    ) -> None:
        self.what, self.value, self.expected, self.rank = what, value, expected, rank
        self.queue, self.method = queue, method
        if isinstance(value, np.ndarray):
            given = f"an array of {value.nbytes} bytes ({value.dtype}, shape {value.shape})"
        else:
            given = f"a {type(value).__name__}"
        name = f"queue {queue!r}" if queue else "this queue"
        LifecycleError.__init__(
            self,
            f"rank {rank}, {name}: {method}() got {given} as {what}, expected {expected}. "
            "Hand it the buffer the step returned, MIN-reduced in place over the group "
            "(every rank's is the same size). Nothing was changed.",
        )


class HookError(LifecycleError):
    """A user hook (poll, gate, staging, fault hook, metadata source, failure
    reasons) raised or answered nonsense. The step failed the requests it
    concerned (reason ``hook error``) on every rank; this is what
    ``StepResult.exceptions`` holds for them."""

    def __init__(self, hook: str, rank: int, problem: str) -> None:
        self.hook, self.rank, self.problem = hook, rank, problem
        super().__init__(
            f"rank {rank}: hook {hook} {problem}; the requests it was asked about failed "
            "(reason 'hook error') on every rank and the group kept stepping. Fix the hook."
        )
