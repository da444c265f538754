"""The reference executor: one ``transitions`` machine per request.

Slow (microseconds per trigger, far more per machine) and obviously correct:
it is what the batch executor is held equal to, what a debugger steps
through, and what draws the diagrams. All machines share one
``transitions.Machine`` built from :data:`lifecycle.rules.graph.EDGES`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transitions import EventData, MachineError

from lifecycle.errors import IllegalTransition, UnknownTrigger
from lifecycle.reasons import FailureReason
from lifecycle.rules.graph import EDGES, FAIL_TRIGGER, KERNEL, TRIGGERS, EdgeKind
from lifecycle.status import KVPoll, Role

__all__ = ["RequestMachine", "build_machine"]


def _guard(name: str) -> Any:
    def check(event: EventData) -> bool:
        return bool(event.kwargs.get(name, True))

    check.__name__ = name
    return check


def build_machine(models: list[Any] | None = None, initial: KVPoll = KVPoll.Bootstrapping) -> Any:
    """A ``transitions.Machine`` over :class:`KVPoll` with exactly the declared edges."""
    return KERNEL.machine(
        models if models is not None else [],
        initial,
        lambda e: [_guard(e.guard)] if e.guard else [],
        send_event=True,
        model_attribute="state",
    )


_SHARED: Any = None


def _shared_machine() -> Any:
    global _SHARED
    if _SHARED is None:
        _SHARED = build_machine()
    return _SHARED


class RequestMachine:
    """One request's lifecycle on one rank, driven through ``transitions``."""

    state: KVPoll
    trigger: Callable[..., bool]  # bound by transitions when the model is added

    def __init__(
        self,
        room: int,
        rank: int = 0,
        role: Role = Role.SENDER,
        initial: KVPoll = KVPoll.Bootstrapping,
    ) -> None:
        self.room = room
        self.rank = rank
        self.role = role
        self.reason = FailureReason.NONE
        self.origin = -1
        _shared_machine().add_model(self, initial=initial)

    def close(self) -> None:
        """Detach from the shared machine (lets the model be collected)."""
        _shared_machine().remove_model(self)

    def fire(self, trigger: str, **guards: bool) -> bool:
        """Fire ``trigger``; False when its guard is closed.

        Raises :class:`UnknownTrigger` for a name the graph lacks and
        :class:`IllegalTransition` when it is not declared from this state.
        """
        if trigger not in TRIGGERS:
            raise UnknownTrigger(trigger, TRIGGERS)
        src = self.state
        try:
            return bool(self.trigger(trigger, **guards))
        except MachineError:
            dst = next(e.dest for e in EDGES if e.trigger == trigger)
            raise IllegalTransition(self.room, self.rank, src, dst, trigger) from None

    def advance(
        self, target: KVPoll | int, reason: FailureReason = FailureReason.UNKNOWN, origin: int = -1
    ) -> str | None:
        """Move the agreed status to ``target`` along a declared edge.

        Returns the trigger taken (None when unchanged). A move no progress or
        fail edge declares raises :class:`IllegalTransition`.
        """
        target = KVPoll(target)
        src = self.state
        if target == src:
            return None
        machine = _shared_machine()
        kinds = (EdgeKind.PROGRESS, EdgeKind.FAIL)
        candidates = [
            e.trigger
            for e in EDGES
            if e.kind in kinds and machine.get_transitions(e.trigger, src, target)
        ]
        if not candidates:
            raise IllegalTransition(self.room, self.rank, src, target, "advance")
        trigger = candidates[0]
        if target == KVPoll.Failed:  # the failure edge its reason takes
            trigger = FAIL_TRIGGER[FailureReason(reason)]
        self.fire(trigger)
        if target == KVPoll.Failed:
            self.reason, self.origin = FailureReason(reason), origin
        return trigger

    def __repr__(self) -> str:
        return f"RequestMachine(room={self.room}, rank={self.rank}, state={self.state.name})"
