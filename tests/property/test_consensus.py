"""The consensus invariants, and proof that the suite catches broken variants."""

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, run_state_machine_as_test

from lifecycle.testing.consensus import ConsensusMachine
from lifecycle.testing.invariants import InvariantViolation

TestConsensus = ConsensusMachine.TestCase


class Distributed(ConsensusMachine):
    """Negative controls need at least two ranks to disagree."""

    @initialize(world=st.integers(2, 8))
    def init_world(self, world):
        super().init_world(world)


class MaxReduce(Distributed):
    def reduce(self, bufs):
        return np.maximum.reduce(bufs)


class GateAfterReduce(Distributed):
    """The field's bug class: a local gate consulted after the reduce."""

    def make_stepper(self, rank):
        from lifecycle import Stepper

        return Stepper(
            self.tables[rank],
            rank,
            poller=self.boards[rank],
            staging=self.staging[rank],
            metadata=self.metas[rank],
            faults=self.faults[rank],
        )

    def after_apply(self, rank, result):
        closed = np.array(
            [r in self.gates[rank].closed_rooms for r in result.rooms.tolist()], dtype=bool
        )
        statuses = np.where(closed & (result.statuses == 4), 3, result.statuses).astype(np.int8)
        import attrs

        return attrs.evolve(result, statuses=statuses)


class DropsFaults(Distributed):
    """A step that never consults the fault hook: its own local values look
    consistent, so only a check against the raw inputs sees it."""

    def make_stepper(self, rank):
        from lifecycle import Stepper

        return Stepper(
            self.tables[rank],
            rank,
            poller=self.boards[rank],
            staging=self.staging[rank],
            metadata=self.metas[rank],
            gates=[self.gates[rank]],
        )


class HeaderOnlyFastPath(Distributed):
    """A common-step shortcut that trusts the header alone: a step where some
    row moved is taken for one where nothing did."""

    def make_stepper(self, rank):
        from lifecycle import Stepper
        from lifecycle.core.packing import HEADER

        class Shortcut(Stepper):
            def _unchanged(self, reduced):
                return self._prepared and reduced[:HEADER].tobytes() == self._buffer.header

        return self.stepper_of(Shortcut, rank)


class HidesItsFailures(Distributed):
    """Rank 1 never says in the header that it failed rows: when rank 0 fails
    some too, the header names rank 0 as the only origin."""

    def make_stepper(self, rank):
        from lifecycle import Stepper

        class Hiding(Stepper):
            def _failer(self, k):
                return False if self.rank == 1 else super()._failer(k)

        return self.stepper_of(Hiding, rank)


class MislabelsItsSlots(Distributed):
    """Rank 1 writes its failure slots under rank 0's name: on a step where
    both fail rows, the origins read from the slots blame rank 0."""

    def make_stepper(self, rank):
        from lifecycle import Stepper
        from lifecycle.core.buffer import StepBuffer
        from lifecycle.core.packing import HEADER, REGIONS

        class Mislabelling(StepBuffer):
            def pack(self, f, local, capacity, tag, want, failer):
                buf = super().pack(f, local, capacity, tag, want, failer)
                if failer:
                    region = buf[HEADER + capacity :].view(">u4").reshape(REGIONS, -1)[1]
                    region[0], region[1] = 0, 0xFFFFFFFF
                return buf

        stepper = self.stepper_of(Stepper, rank)
        if rank == 1:
            old = stepper._buffer
            stepper._buffer = Mislabelling(old.rank, old._config_hash, old._queue_hash)
        return stepper


class PromotingGate(Distributed):
    def adjust_local(self, rank, local):
        return np.where(local == 3, 4, local).astype(np.int8)


BROKEN = settings(
    max_examples=1000,
    phases=[Phase.generate],
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    stateful_step_count=40,
)


@pytest.mark.parametrize(
    ("variant", "caught_by"),
    [
        (MaxReduce, "validity|agreement|success|monotone|latch|step|origin"),
        (GateAfterReduce, "agreement"),
        (PromotingGate, "success|validity"),
        (DropsFaults, "validity|doomed"),
        (HeaderOnlyFastPath, "validity|success|monotone|step|origin|doomed"),
        (HidesItsFailures, "origin"),
        (MislabelsItsSlots, "origin"),
    ],
)
def test_property_suite_catches_broken_variants(variant, caught_by):
    with pytest.raises(InvariantViolation, match=caught_by):
        run_state_machine_as_test(variant, settings=BROKEN)
