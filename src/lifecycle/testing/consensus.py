"""A reusable hypothesis state machine for the consensus invariants.

Point it at your own backend by subclassing :class:`ConsensusMachine` and
overriding :meth:`~ConsensusMachine.make_board` (anything with the
``StatusBoard`` surface: ``set(rooms, status)``, a ``raising`` attribute and
``poll_many``); the rules then drive your poller inside a simulated world of
1 to 8 ranks and every invariant is checked after every step::

    class MyBackendMachine(ConsensusMachine):
        def make_board(self, rank):
            return MyBoardAdapter(...)

    TestMyBackend = MyBackendMachine.TestCase

Invariants (checked after every step; the checks are in
:mod:`lifecycle.testing.invariants`):

1. agreement -- every rank holds the same agreed status, reason and origin;
2. validity -- agreed status == MIN over ranks of each rank's local value,
   computed here from the raw inputs (the board's poll, faults, aborts,
   metadata rows, gates), not read back from the steppers;
3. Failed absorbs, Success latches, the agreed status never regresses;
4. Success only if every rank's raw poll was Success and all its gates open;
5. a failure's reason and origin name a rank that failed it for that reason;
6. an abort or an injected fault on any rank ends the request Failed on
   every rank in that step (an abort with reason ``aborted``);
7. every slot has at most one live owner; a retired request frees its slot
   exactly once; in use + free == size;
8. the reference executor (``transitions``) agrees with the batch executor,
   state and trigger.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from numpy.typing import NDArray

from buffers import MetadataBuffers, MetadataLayout, SlotAllocator
from lifecycle.drive.stepper import Stepper
from lifecycle.errors import LifecycleError
from lifecycle.result import StepResult
from lifecycle.rules.reference import RequestMachine
from lifecycle.status import B, F, Role, S
from lifecycle.table import RequestTable
from lifecycle.testing.doubles import ListFaults, SetGate, SetStaging, StatusBoard
from lifecycle.testing.invariants import (
    InvariantViolation,
    check,
    check_step,
    expected_local,
    gates_open,
)
from lifecycle.testing.lockstep import lockstep, reduce_min

__all__ = ["ConsensusMachine"]

SLOTS = 12
_LAYOUT = MetadataLayout(
    hidden_size=16, hidden_dtype=__import__("torch").float32, max_top_logprobs=16
)


class ConsensusMachine(RuleBasedStateMachine):
    """W ranks of decode-side request tables stepped in lockstep."""

    def __init__(self) -> None:
        super().__init__()
        self.world = 0
        self.next_room = 1
        self.agreed: dict[int, int] = {}
        self.slot_of: dict[int, int] = {}
        self.fake: dict[int, bool] = {}
        self.reference: dict[int, RequestMachine] = {}
        self.freed: list[tuple[int, int]] = []
        self.last: list[StepResult] = []

    # -- hooks a subclass may override --------------------------------------
    def make_board(self, rank: int) -> Any:
        return StatusBoard()

    def make_stepper(self, rank: int) -> Stepper:
        return self.stepper_of(Stepper, rank)

    def stepper_of(self, cls: type[Stepper], rank: int) -> Stepper:
        """A stepper of class ``cls`` on rank ``rank``'s table, hooks and gates."""
        return cls(
            self.tables[rank],
            rank,
            poller=self.boards[rank],
            staging=self.staging[rank],
            metadata=self.metas[rank],
            gates=[self.gates[rank]],
            faults=self.faults[rank],
        )

    reduce = staticmethod(reduce_min)  # the status reduce (negative controls replace it)

    def adjust_local(self, rank: int, local: NDArray[np.int8]) -> NDArray[np.int8]:
        """Change a rank's gated local values before the reduce (for negative controls)."""
        return local

    def after_apply(self, rank: int, result: StepResult) -> StepResult:
        """Act on a rank's result after the reduce (for negative controls)."""
        return result

    # -- world ---------------------------------------------------------------
    @initialize(world=st.integers(1, 8))
    def init_world(self, world: int) -> None:
        self.world = world
        self.tables = [RequestTable(rank=r) for r in range(world)]
        self.boards = [self.make_board(r) for r in range(world)]
        self.gates = [SetGate() for _ in range(world)]
        self.staging = [SetStaging() for _ in range(world)]
        self.faults = [ListFaults() for _ in range(world)]
        self.metas = [MetadataBuffers(SLOTS, _LAYOUT) for _ in range(world)]
        self.allocs = [SlotAllocator(SLOTS, self.metas[r]) for r in range(world)]
        self.steppers = [self.make_stepper(r) for r in range(world)]

    def _live(self) -> list[int]:
        return list(self.agreed)

    def _pick(self, data: st.DataObject) -> tuple[int, int]:
        rank = data.draw(st.integers(0, self.world - 1), label="rank")
        room = data.draw(st.sampled_from(self._live()), label="room")
        return rank, room

    # -- rules -----------------------------------------------------------------
    @rule(k=st.integers(1, 3), fake=st.booleans())
    def admit(self, k: int, fake: bool) -> None:
        for _ in range(k):
            room = self.next_room
            slots = [a.alloc(room) for a in self.allocs]
            if slots[0] is None:
                check(all(s is None for s in slots), "slots", "allocators diverged")
                return
            check(len(set(slots)) == 1, "slots", f"ranks got different slots {slots}")
            self.next_room += 1
            for t in self.tables:
                t.add(room, role=Role.RECEIVER, metadata_slot=slots[0], fake=fake)
            self.agreed[room] = B
            self.slot_of[room] = int(slots[0])
            self.fake[room] = fake
            self.reference[room] = RequestMachine(room, 0, Role.RECEIVER)

    @precondition(lambda self: self.agreed)
    @rule(data=st.data(), everywhere=st.booleans())
    def set_raw(self, data: st.DataObject, everywhere: bool) -> None:
        """A backend reports progress (or failure) on one rank, or on all of them."""
        rank, room = self._pick(data)
        floor = max(self.agreed[room], B)
        status = data.draw(st.sampled_from([F, *range(floor, S + 1)]), label="status")
        for r in range(self.world) if everywhere else [rank]:
            self.boards[r].set([room], status)

    @precondition(lambda self: self.agreed)
    @rule(data=st.data())
    def land_everywhere(self, data: st.DataObject) -> None:
        """The whole transfer lands: every rank reports Success and has the row."""
        room = data.draw(st.sampled_from(self._live()), label="room")
        for r in range(self.world):
            self.boards[r].set([room], S)
            self.metas[r].write(self.slot_of[room], room, {"output_ids": [room % 1000]})

    @precondition(lambda self: self.agreed)
    @rule(data=st.data(), which=st.sampled_from(["gate", "staging"]))
    def toggle_gate(self, data: st.DataObject, which: str) -> None:
        rank, room = self._pick(data)
        target = (
            self.gates[rank].closed_rooms if which == "gate" else self.staging[rank].pending_rooms
        )
        target.symmetric_difference_update({room})

    @precondition(lambda self: self.agreed)
    @rule(data=st.data(), corrupt=st.booleans())
    def write_metadata(self, data: st.DataObject, corrupt: bool) -> None:
        rank, room = self._pick(data)
        owner = self.next_room + 1000 if corrupt else room
        self.metas[rank].write(self.slot_of[room], owner, {"output_ids": [room % 1000]})

    @precondition(lambda self: self.agreed)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rank, room = self._pick(data)
        self.tables[rank].request_abort(room)

    @precondition(lambda self: self.agreed)
    @rule(data=st.data())
    def inject_failure(self, data: st.DataObject) -> None:
        rank, room = self._pick(data)
        self.faults[rank].rooms.add(room)

    @rule(data=st.data())
    def raise_in_poll(self, data: st.DataObject) -> None:
        rank = data.draw(st.integers(0, self.world - 1), label="rank")
        self.boards[rank].raising = RuntimeError(f"injected poll error on rank {rank}")

    @rule()
    def step(self) -> None:
        rows = self.tables[0].rooms().tolist()
        before = {room: self.agreed[room] for room in rows}
        opened = gates_open(self, rows)
        expected = {
            room: min(expected_local(self, r, room) for r in range(self.world))
            for room in rows
            if before[room] not in (S, F)
        }
        # room -> must its agreed reason be ABORTED? (some rank aborted it:
        # ABORTED is the smallest reason code, on one rank as across ranks)
        doomed: dict[int, bool] = {}
        for room in expected:
            aborts = [bool(t.abort_requested[t.slot_of(room)]) for t in self.tables]
            faults = [room in f.rooms for f in self.faults]
            if any(aborts) or any(faults):
                doomed[room] = any(aborts)
        try:
            outcome = lockstep(self.steppers, reduce=self.reduce, adjust=self.adjust_local)
        except LifecycleError as e:  # the ranks disagreed on the origin fetch
            raise InvariantViolation("agreement", str(e)) from e
        results: list[StepResult] = []
        for r, res in enumerate(outcome):
            if isinstance(res, BaseException):
                raise InvariantViolation("step", f"rank {r} raised {res!r}") from res
            results.append(self.after_apply(r, res))
        self.last = results
        check_step(self, rows, before, opened, results, expected, doomed)

    @precondition(lambda self: self.agreed)
    @rule()
    def retire(self) -> None:
        done = [r for r, s in self.agreed.items() if s in (S, F)]
        for room in done:
            for t in self.tables:
                t.remove(room)
            for rank, alloc in enumerate(self.allocs):
                owner = alloc.owner_of(self.slot_of[room])
                check(owner == room, "slots", f"slot of room {room} owned by {owner} on {rank}")
                alloc.free(self.slot_of[room], room)
                self.freed.append((rank, room))
            del self.agreed[room]
            self.reference.pop(room).close()

    @invariant()
    def slots_consistent(self) -> None:
        if not self.world:
            return
        for rank, alloc in enumerate(self.allocs):
            check(
                alloc.in_use + alloc.available + alloc.quarantined == alloc.size,
                "slots",
                f"rank {rank}: in use {alloc.in_use} + free {alloc.available} != {alloc.size}",
            )
            live = alloc.live()
            check(len(set(live.values())) == len(live), "slots", "a room owns two slots")
            check(
                sorted(live.values()) == sorted(self.agreed),
                "slots",
                f"rank {rank}: slot owners {sorted(live.values())} != live {sorted(self.agreed)}",
            )
        check(len(self.freed) == len(set(self.freed)), "slots", "a slot was freed twice")
