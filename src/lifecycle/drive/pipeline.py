"""Pipeline parallelism: the first stage agrees, every later stage applies.

With pipeline parallelism only the first stage's ranks (PP rank 0) poll and
agree, over their own TP and CP groups. Each later stage must apply exactly
the words the first stage agreed, or the stages' queues diverge.
:class:`PipelineForward` is the collective every stage steps with: on the
first stage it reduces over ``first`` (a :class:`~lifecycle.drive.collective.Collective`,
usually TP then CP) and hands the result to the next stage; on a later stage
it takes the result from the stage before it and hands it on. The next
stage's hand-over is sent without waiting and waited for at the next call, so
a stage never waits for the stages after it.

Every stage builds the same table and steps it with this collective, so each
keeps the agreed state. A later stage takes the MIN of what it receives and
what it would have sent: its header's matched fields then show a request list
(or configuration, queue, iteration) that differs from the first stage's, and
it raises :class:`~lifecycle.errors.CollectiveMismatch` there. Its rows must
contribute nothing to that MIN: step a later stage with a poller that answers
Success for every request (the largest word) and no gates, deadlines, aborts
or fault hooks, so the first stage's words are what it applies.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from lifecycle.drive import lent
from lifecycle.drive.collective import Collective
from lifecycle.errors import InvalidArgument

__all__ = ["PipelineForward"]


class PipelineForward:
    """The collective of one stage of a pipeline (see the module's docstring).

    ``group`` is a torch.distributed (gloo) group joining this rank's
    counterparts on every stage, its group rank i being stage i; ``stage`` and
    ``stages`` place this rank. ``first`` is the first stage's reduce (None on
    the other stages). ``rank`` and ``world_size`` are what the first stage's
    collective reports (the origin ranks of failures are the first stage's).
    """

    def __init__(
        self,
        first: Collective | None,
        group: Any,
        stage: int,
        stages: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        import torch.distributed as dist

        for name, value in (("stage", stage), ("stages", stages)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgument(f"PipelineForward {name}", value, "an int")
        if not 0 <= stage < stages:
            raise InvalidArgument("PipelineForward stage", stage, f"in 0..{stages - 1}")
        if (first is None) != (stage > 0):
            raise InvalidArgument(
                "PipelineForward first", first, "the first stage's collective, on stage 0 only"
            )
        if stage > 0 and (rank is None or world_size is None):
            raise InvalidArgument(
                "PipelineForward rank/world_size", (rank, world_size), "given on a later stage"
            )
        if stages > 1 and dist.get_world_size(group) != stages:
            raise InvalidArgument(
                "PipelineForward group", dist.get_world_size(group), f"{stages} ranks, one a stage"
            )
        self._dist = dist
        self.first, self.group, self.stage, self.stages = first, group, stage, stages
        self._rank = first.rank if first is not None else int(rank)  # type: ignore[arg-type]
        self._world = first.world_size if first is not None else int(world_size)  # type: ignore[arg-type]
        self._prev = dist.get_global_rank(group, stage - 1) if stage > 0 else -1
        self._next = dist.get_global_rank(group, stage + 1) if stage + 1 < stages else -1
        self._sending: list[Any] = []  # hand-overs in flight (works and their tensors)
        lent.hold(self)

    def lent_tensors(self) -> list[Any]:
        """The hand-overs' tensors still in flight (see :mod:`lifecycle.drive.lent`)."""
        return [copy for _, copy in self._sending]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def _settle(self) -> None:
        """Wait for the last hand-over to the next stage."""
        for work, _ in self._sending:
            work.wait()
        lent.lend(*(copy for _, copy in self._sending))
        self._sending.clear()

    def _through(self, data: NDArray[Any], merge: bool) -> None:
        """Take ``data`` from the stage before (in place; with ``merge``, the MIN of
        it and what this stage holds); hand it to the next."""
        import torch

        self._settle()
        tensor = torch.from_numpy(data)
        if self._prev >= 0:
            mine = data.copy() if merge else None
            try:
                self._dist.recv(tensor, src=self._prev, group=self.group)
            finally:
                lent.lend(tensor)
            if mine is not None:
                np.minimum(data, mine, out=data)
        if self._next >= 0:
            copy = tensor.clone()  # the caller may reuse its buffer before this lands
            self._sending.append((self._dist.isend(copy, dst=self._next, group=self.group), copy))

    def all_reduce_min(self, buf: NDArray[Any]) -> None:
        if self.first is not None:
            self.first.all_reduce_min(buf)
        self._through(buf, merge=True)

    def all_gather(self, buf: NDArray[np.int32]) -> NDArray[np.int32]:
        if self.first is not None:
            out = np.ascontiguousarray(self.first.all_gather(buf), dtype=np.int32)
        else:
            out = np.empty((self._world, buf.size), dtype=np.int32)
        self._through(out, merge=False)
        return out

    def close(self) -> None:
        """Wait for the last hand-over (call before the group is destroyed)."""
        self._settle()
