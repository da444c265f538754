"""One answer for ``get_finished`` on every TP worker: the transfers in flight,
stepped together.

vLLM's scheduler learns that a transfer finished by counting the workers that
reported it; each worker answers from its own view, so one worker may report
a request finished that another reports failed, and the scheduler sees
neither reason nor origin. Here every worker of the group holds its
in-flight transfers in a :class:`~lifecycle.table.RequestTable` and, before
``get_finished`` answers, steps them with this library's step: one MIN
all-reduce over the group. So every worker reports the same requests ended,
in the same step, each failure with the agreed reason, the rank it came from
and the recovery table's decision; a worker whose list of requests differs
from the others' raises :class:`~lifecycle.errors.CollectiveMismatch` on
every worker instead of hanging. A request ended is reported once, then
forgotten.

:class:`WorkerAgreement` takes plain data: request ids, rooms and the
handle index the transfer's poller answers for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import attrs

from lifecycle import Collective, KVPoll, RequestTable, Role, StepConfig, Stepper
from lifecycle.errors import InvalidArgument
from lifecycle.protocols import BatchPoller
from lifecycle.result import Failure, StepResult

__all__ = ["Begun", "Ended", "WorkerAgreement"]

#: statuses as plain integers (an enum member's lookup on its class is slow)
_WAITING, _SUCCESS, _FAILED = (
    int(KVPoll.WaitingForInput),
    int(KVPoll.Success),
    int(KVPoll.Failed),
)
_NONE: frozenset[str] = frozenset()


class Begun(NamedTuple):
    """A transfer that starts on this worker (:meth:`WorkerAgreement.add_many`)."""

    request_id: str
    room: int
    handle_index: int
    role: Role
    epoch: int = 0


@attrs.frozen
class Ended:
    """The requests one step ended, the same on every worker of the group."""

    #: request ids whose transfer every worker finished
    succeeded: frozenset[str] = frozenset()
    #: request id -> the agreed failure (reason, origin rank, attempt, decision)
    failed: Mapping[str, Failure] = attrs.field(factory=dict)
    #: request ids every worker now reports WaitingForInput (decode: handshaken,
    #: say where to write; prefill: every page list in, hand over the pages)
    ready: frozenset[str] = frozenset()

    @property
    def ids(self) -> frozenset[str]:
        """Every request this step ended, succeeded or failed."""
        return self.succeeded | frozenset(self.failed)


class WorkerAgreement:
    """One worker's transfers in flight (``poller``: their statuses, by handle
    index), stepped over ``collective`` with the group's other workers."""

    def __init__(
        self,
        rank: int,
        poller: BatchPoller,
        collective: Collective,
        config: StepConfig | None = None,
    ) -> None:
        self.table = RequestTable(rank)
        self.collective = collective
        self.stepper = Stepper(self.table, rank, poller=poller, config=config, queue="vllm")
        self._ids: dict[int, str] = {}  # room -> request id
        self._rooms: dict[str, int] = {}  # request id -> room

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._rooms

    def add(
        self, request_id: str, room: int, handle_index: int, role: Role, epoch: int = 0
    ) -> None:
        """A transfer starts on this worker (every worker of the group adds the
        same requests, in the same order, before the next step)."""
        self.add_many([Begun(request_id, room, handle_index, role, epoch)])

    def add_many(self, begun: Sequence[Begun]) -> None:
        """:meth:`add` of each of ``begun``, in order, with one table extend per
        run of one role. Every one is checked first; a refused batch adds none."""
        rooms = self._rooms
        seen: set[str] = set()
        for b in begun:
            rid = b.request_id
            if not isinstance(rid, str):
                raise InvalidArgument("request id", rid, "a string (vLLM's request id)")
            if rid in rooms or rid in seen:
                raise InvalidArgument(
                    f"request {rid}", "added twice", "one transfer per request at a time"
                )
            seen.add(rid)
        runs: list[list[Begun]] = []
        for b in begun:
            if runs and runs[-1][0].role == b.role:
                runs[-1].append(b)
            else:
                runs.append([b])
        t = self.table
        added: list[int] = []
        try:  # the table checks each run before it changes; a refused run undoes the others
            for run in runs:
                t.extend(
                    [b.room for b in run],
                    role=run[0].role,
                    handle_indices=[b.handle_index for b in run],
                    epochs=[b.epoch for b in run],
                )
                added.extend(int(b.room) for b in run)
        except BaseException:
            if added:
                t.remove_many(added)
            raise
        ids = self._ids
        for b in begun:
            ids[int(b.room)] = b.request_id
            rooms[b.request_id] = int(b.room)

    def abort(self, request_id: str) -> None:
        """The scheduler gave up on ``request_id``: it ends Failed (aborted) at the
        next step, on every worker alike."""
        room = self._rooms.get(request_id)
        if room is None:
            raise InvalidArgument(f"request {request_id}", "not in flight", "a request added")
        self.table.request_abort(room)

    def step(self) -> Ended:
        """Step every transfer in flight with the group; what ended, once."""
        res: StepResult = self.stepper.step(self.collective)
        changed = res.changed
        if changed.size == 0:
            return Ended()
        ids = self._ids
        now = res.statuses[changed]
        waiting = changed[now == _WAITING]
        ready = frozenset([ids[r] for r in res.rooms[waiting].tolist()]) if waiting.size else _NONE
        failing = now == _FAILED
        ended = changed[failing | (now == _SUCCESS)]
        if ended.size == 0:
            return Ended(ready=ready)
        failed = {ids[f.room]: f for f in res.failures()} if failing.any() else {}
        rooms = res.rooms[ended]
        self.table.remove_many(rooms)
        gone = [ids.pop(r) for r in rooms.tolist()]
        for rid in gone:
            del self._rooms[rid]
        succeeded = frozenset(gone).difference(failed) if failed else frozenset(gone)
        return Ended(succeeded, failed, ready)
