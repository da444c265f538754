"""Fault plans: seeded probabilistic faults plus targeted, replayable ones.

A plan is a JSON or TOML document. Two modes decide *when* a fault fires.

**Phase-keyed** (``mode = "phase"``, the default): a fault is tied to a
request's lifecycle, not to the clock. For every (seed, rank, request) one
draw decides whether that rank fails the request and at which phase
(Bootstrapping, WaitingForInput or Transferring); client aborts are drawn the
same way per request (which ones, at which phase). A fault fires on the first
step at which the request has reached its phase on that rank (its agreed
status, or what the backend reports this step, whichever is further), so it
fires before the request can finish, however fast a real transport moves.
It fires while the transfer is still incomplete for the other side too: the
simulator holds back the data of a request a rank of either side is still to
fail (:meth:`RankFaults.holds`), and counts a request in decode's transfer
queue as Transferring (``pdlife.sim.hooks.QueueFaults``)::

    seed = 7
    mode = "phase"
    [probabilistic]
    prob = 0.05             # per rank and request: fails it at a drawn phase
    ranks = [0, 1]          # optional: only these ranks draw
    [[faults]]
    kind = "fail"
    request = 12            # index into the run's requests (or: room = ...)
    rank = 3                # the global rank that misbehaves
    at = "Transferring"     # when the request reaches this phase there

Of all the draws for one request (every rank's fault, and the abort) only
the one at the earliest phase fires (ties: the abort, then the lowest rank),
so which requests fail, and why, is a function of the seed alone: the same
on every run and on every backend. See the README's guarantee for what can
still differ (timings, step counts, the origin rank of a tie).

**Step-keyed** (``mode = "step"``): each rank draws per request *per step*,
and targeted faults name a scheduler iteration. How many steps a request
lives depends on real transfer timing, so on a real transport two runs fail
different requests; use it for soak-style noise::

    seed = 7
    mode = "step"
    [probabilistic]
    prob = 0.01             # per rank, per request, per step
    [[faults]]
    kind = "delay"          # fail | transfer_error | delay | hold_gate |
                            # hold_staging | drop_metadata |
                            # corrupt_metadata | raise_in_poll |
                            # kill_rank | pause_rank
    request = 12
    rank = 3
    step = 5                # scheduler iteration on that rank (default: first
                            # step the request is live there, or ``at``)
    steps = 4               # for delay, hold_gate and hold_staging: how long

``fail`` fails the request through the step's fault hook (injected fault);
``transfer_error`` makes the rank's backend report it Failed with a transfer
error, once (the rank is then the failure's origin: a peer whose transfer
broke). ``hold_gate`` closes the step's user gate on that rank, ``hold_staging`` its
staging gate (as a scatter from the staging buffer still running would):
either holds the request at Transferring there while its poll says Success.

A rank's whole process can be killed (``kill_rank``) or stopped for a while
(``pause_rank``, every thread including the engine's, as a long GC pause or
a starved host would: its heartbeats stop too), at a step::

    [[faults]]
    kind = "pause_rank"
    rank = 1
    step = 20
    seconds = 3.0

Every field is validated; an error names the entry and the field, e.g.
``faults[2].kind``. The same plan and seed give the same faults.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lifecycle.faults import ProbabilisticFaults
from lifecycle.protocols import StepContext
from lifecycle.status import KVPoll
from pdlife.cluster.phase_draws import PHASE_VALUE, Decision, phase_decisions
from pdlife.cluster.plan_doc import (
    MAX_PAUSE_S,
    FaultPlan,
    TargetedFault,
)

__all__ = ["RankFaults"]

#: the kinds that fail a request (the other side holds its data back for them)
_FAILS = ("fail", "transfer_error")


class RankFaults:
    """A plan bound to one rank of a run: the step's fault hook, plus the
    queries the simulated scheduler asks (delay, hold, metadata, raise, kill, pause).

    ``room_of`` maps a request index to its room (a sequence or any object
    with ``__getitem__``). In phase mode the simulator calls :meth:`admit`
    for new requests and passes each queue's observed statuses to
    :meth:`inject_phase`.
    """

    def __init__(
        self,
        plan: FaultPlan,
        rank: int,
        room_of: Any,
        mode: str = "step",
        world: int = 1,
        abort_prob: float = 0.0,
        abort_seed: int = 0,
        prefill_ranks: int = 0,
    ) -> None:
        self.rank = rank
        self.plan = plan
        self.mode = mode
        self.world = world
        self.abort_prob = abort_prob
        self.abort_seed = abort_seed
        self._room_of_request = room_of
        self.prob = (
            ProbabilisticFaults(plan.prob, seed=plan.seed, rank=rank)
            if mode == "step" and plan.prob and (plan.prob_ranks is None or rank in plan.prob_ranks)
            else None
        )
        self.mine: list[TargetedFault] = list(plan.for_rank(rank))
        self._rooms = [self.room(f) for f in self.mine]
        self._fired_idx: set[int] = set()
        self.first_seen: dict[int, int] = {}
        self.reached_at: dict[tuple[int, int], int] = {}  # (fault index, room) -> step
        self.fired: list[tuple[int, str, int | None]] = []  # (step, kind, room)
        # phase mode: the winners this rank carries out, room -> phase value
        self.pending_fail: dict[int, int] = {}
        self.pending_abort: dict[int, int] = {}
        self.decisions: list[Decision] = []
        #: the ranks of the other side (none: ``prefill_ranks`` not given), and the
        #: rooms whose live attempt one of them is to fail (see :meth:`holds`)
        mine_prefill = rank < prefill_ranks
        self._others = [
            r for r in range(world) if prefill_ranks and (r < prefill_ranks) != mine_prefill
        ]
        #: room -> the ranks of the other side a targeted ``at`` fault has fail it
        self._other_targets: dict[int | None, list[int]] = {}
        for f in plan.faults:
            if f.kind in _FAILS and f.at and f.rank in self._others:
                self._other_targets.setdefault(self.room(f), []).append(f.rank)
        self.peer_fail: set[int] = set()

    def room(self, f: TargetedFault) -> int | None:
        if f.kind in ("kill_rank", "pause_rank"):
            return None
        return f.room if f.room is not None else int(self._room_of_request[f.request or 0])

    # -- phase mode --------------------------------------------------------------
    def admit(
        self,
        rooms: Sequence[int],
        aborts_here: bool,
        groups: Sequence[int] | None = None,
        rank_group: Any = None,
        epoch: int = 0,
    ) -> None:
        """Draw the phase-keyed decisions of new requests (at attempt ``epoch``);
        keep those this rank carries out (its own faults; the client's aborts if
        ``aborts_here``). With prefill DP, ``groups`` holds each request's DP
        group and ``rank_group(rank)`` a rank's (None: it sees every request)."""
        serves = None
        if groups is not None and rank_group is not None:
            g = np.asarray(groups, np.int64)

            def serves(rank: int) -> NDArray[np.bool_]:
                mine = rank_group(rank)
                return np.ones(g.size, bool) if mine is None else g == mine

        if epoch == 0 and self._other_targets:
            for j, r in enumerate(rooms):
                ranks = self._other_targets.get(r, ())
                if any(serves is None or serves(k)[j] for k in ranks):
                    self.peer_fail.add(r)
        if self.mode != "phase" or not rooms or (self.plan.prob == 0 and self.abort_prob == 0):
            return
        for d in phase_decisions(
            self.plan,
            self.abort_prob,
            self.abort_seed,
            self.world,
            np.asarray(rooms, np.uint64),
            serves,
            epoch,
        ):
            if d.wins and d.kind == "fail" and d.rank in self._others:
                self.peer_fail.add(d.room)
            if d.rank == self.rank or (d.rank == -1 and aborts_here):
                self.decisions.append(d)
                if d.wins and d.kind == "fail":
                    self.pending_fail[d.room] = PHASE_VALUE[d.phase]
                elif d.wins:
                    self.pending_abort[d.room] = PHASE_VALUE[d.phase]

    def forget(self, room: int) -> None:
        """The request finished here: drop what was kept for it."""
        self.first_seen.pop(room, None)
        self.pending_fail.pop(room, None)
        self.pending_abort.pop(room, None)
        self.peer_fail.discard(room)

    def holds(self, room: int) -> bool:
        """Whether ``room``'s transfer must go no further on this rank (its data
        must not complete on the other side) until the request has ended here:
        this rank is to fail it (a phase-keyed winner, or a targeted ``at`` fail
        not fired yet), or a rank of the other side is (its failure is what ends
        it here). A fault at any phase then fires, on either side, while the
        transfer is still incomplete for the other side. A targeted fault of the
        other side holds a room's first attempt only (it fires once, in the
        first attempt that reaches its phase: a later one would wait for it in
        vain)."""
        if room in self.pending_fail or room in self.peer_fail:
            return True
        return any(
            self._rooms[i] == room
            and (
                (f.kind == "fail" and f.at and (i, room) not in self.reached_at)
                or (f.kind == "transfer_error" and f.at and i not in self._fired_idx)
            )
            for i, f in enumerate(self.mine)
        )

    def _reached(self, ctx: StepContext, observed: NDArray[np.int8] | None) -> NDArray[np.int8]:
        if observed is None:
            return ctx.states
        return np.where(ctx.states == KVPoll.Failed, ctx.states, np.maximum(ctx.states, observed))

    def inject_phase(
        self, ctx: StepContext, observed: NDArray[np.int8] | None, abort: Any = None
    ) -> NDArray[np.bool_]:
        """The step's fault hook with the statuses the backend reported this step:
        targeted ``at`` faults and phase-keyed winners that have reached their
        phase fire now; an abort winner is handed to ``abort(room)``."""
        rooms = ctx.rooms.tolist()
        hit = self.inject(ctx)
        if not rooms:
            return hit
        reached = self._reached(ctx, observed).tolist()
        for i, f in enumerate(self.mine):
            if f.at is None:
                continue
            want = PHASE_VALUE[f.at]
            for j, r in enumerate(rooms):
                if r == self._rooms[i] and reached[j] >= want and reached[j] != KVPoll.Failed:
                    first = self.reached_at.setdefault((i, r), ctx.step)
                    if f.kind == "fail" and first == ctx.step:
                        hit[j] = True
                        self._fired(i, ctx.step, r)
        if self.pending_fail or self.pending_abort:
            for j, r in enumerate(rooms):
                if reached[j] == KVPoll.Failed:
                    continue
                p = self.pending_fail.get(r)
                if p is not None and reached[j] >= p:
                    hit[j] = True
                    del self.pending_fail[r]
                    self.fired.append((ctx.step, "fail", r))
                p = self.pending_abort.get(r)
                if p is not None and reached[j] >= p and abort is not None:
                    del self.pending_abort[r]
                    self.fired.append((ctx.step, "abort", r))
                    abort(r)
        return hit

    # -- step mode and targeted faults -----------------------------------------
    def _fired(self, i: int, step: int, room: int | None) -> None:
        if i not in self._fired_idx:
            self._fired_idx.add(i)
        self.fired.append((step, self.mine[i].kind, room))

    def _start(self, i: int, room: int, step: int) -> int | None:
        """The step fault ``i`` begins for ``room``: its phase's (None: not
        reached yet), its own, or the room's first (``step`` if not seen)."""
        f = self.mine[i]
        if f.at is not None:
            return self.reached_at.get((i, room))
        return f.step if f.step is not None else self.first_seen.get(room, step)

    def _active(self, kind: str, room: int, step: int) -> bool:
        for i, f in enumerate(self.mine):
            if f.kind != kind or self._rooms[i] != room:
                continue
            start = self._start(i, room, step)
            if start is not None and start <= step < start + f.steps:
                if i not in self._fired_idx:
                    self._fired(i, step, room)
                return True
        return False

    def note_live(self, rooms: Sequence[int], step: int) -> None:
        for r in rooms:
            self.first_seen.setdefault(r, step)

    def inject(self, ctx: StepContext) -> NDArray[np.bool_]:
        rooms = ctx.rooms.tolist()
        self.note_live(rooms, ctx.step)
        hit = np.array([self._active("fail", r, ctx.step) for r in rooms], dtype=bool)
        if self.prob is not None:
            hit |= self.prob.inject(ctx)
        return hit

    def transfer_fails(self, room: int, step: int) -> bool:
        """A ``transfer_error`` fault of this rank fires for ``room`` now: its
        phase was reached (or its step came), and it has not fired yet (it
        fires once: a retry's attempt is not failed again)."""
        for i, f in enumerate(self.mine):
            if f.kind != "transfer_error" or self._rooms[i] != room or i in self._fired_idx:
                continue
            start = self._start(i, room, step)
            if start is not None and step >= start:
                self._fired(i, step, room)
                return True
        return False

    def delayed(self, room: int, step: int) -> bool:
        return self._active("delay", room, step)

    def gate_held(self, room: int, step: int) -> bool:
        return self._active("hold_gate", room, step)

    def staging_held(self, room: int, step: int) -> bool:
        return self._active("hold_staging", room, step)

    def raises(self, room: int, step: int) -> bool:
        return self._active("raise_in_poll", room, step)

    def metadata_fault(self, room: int) -> str | None:
        for i, f in enumerate(self.mine):
            if f.kind in ("drop_metadata", "corrupt_metadata") and self._rooms[i] == room:
                self._fired(i, 0, room)
                return f.kind
        return None

    def kill_at(self, step: int) -> bool:
        return any(f.kind == "kill_rank" and f.step == step for f in self.mine)

    def pause_at(self, step: int) -> float:
        """Seconds this rank's process stops at ``step`` (0: none); recorded as fired."""
        total = 0.0
        for i, f in enumerate(self.mine):
            if f.kind == "pause_rank" and f.step == step:
                self._fired(i, step, None)
                total += f.seconds
        return min(total, MAX_PAUSE_S)  # two pauses at one step are one, as long

    def unfired(self, kinds: Sequence[str] | None = None) -> list[str]:
        """The targeted faults of this rank that never fired (kill_rank aside:
        a rank that fired it is dead), as plan-file descriptions."""
        out = []
        for i, f in enumerate(self.mine):
            if f.kind == "kill_rank" or i in self._fired_idx:
                continue
            if kinds is not None and f.kind not in kinds:
                continue
            when = f"at {f.at}" if f.at else (f"step {f.step}" if f.step else "its first step")
            if f.kind == "pause_rank":
                out.append(f"pause_rank on rank {f.rank} at step {f.step} ({f.seconds:g} s)")
                continue
            who = f"request {f.request}" if f.request is not None else f"room {f.room}"
            out.append(f"{f.kind} on rank {f.rank}, {who}, {when}")
        return out
