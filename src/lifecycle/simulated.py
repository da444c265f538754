"""W ranks in one process: a collective for tests and the simulator.

Each rank runs in its own thread; a collective call blocks until every rank
has made it (or ``timeout`` passes, which raises :class:`RankFailure` naming
the ranks that never arrived). Buffer sizes and dtypes are checked the way a
careful network would, raising instead of aborting the process.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lifecycle.collective import Pending, _Thread
from lifecycle.errors import LifecycleError, RankFailure

__all__ = ["SimulatedWorld"]


class SimulatedWorld:
    """W ranks in one process. ``world.rank(r)`` is rank r's collective.

    Each rank runs in its own thread; a collective call blocks until every
    rank has made it (or ``timeout`` passes, which raises
    :class:`RankFailure` naming the ranks that never arrived).
    """

    def __init__(self, world_size: int, timeout: float = 30.0) -> None:
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.size = world_size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._bufs: dict[int, NDArray[Any]] = {}
        self._gen = 0
        self._result: dict[int, NDArray[Any] | BaseException] = {}

    def rank(self, r: int) -> _SimRank:
        return _SimRank(self, r)

    def _exchange(self, r: int, buf: NDArray[Any], op: str) -> NDArray[Any]:
        with self._cond:
            gen = self._gen
            self._bufs[r] = buf.copy()
            if len(self._bufs) == self.size:
                self._result[gen] = self._combine(op)
                self._bufs = {}
                self._gen += 1
                self._cond.notify_all()
            elif not self._cond.wait_for(lambda: self._gen != gen, timeout=self.timeout):
                missing = sorted(set(range(self.size)) - set(self._bufs))
                raise RankFailure(r, missing, f"no answer within {self.timeout} s")
            res = self._result[gen]
        if isinstance(res, BaseException):
            raise res
        return res

    def _combine(self, op: str) -> NDArray[Any] | BaseException:
        bufs = [self._bufs[i] for i in range(self.size)]
        sizes = {(b.size, b.dtype.str) for b in bufs}
        if len(sizes) != 1:
            return LifecycleError(
                f"simulated {op}: buffer sizes differ across ranks "
                f"{[b.size for b in bufs]} (a real gloo group would abort the process)"
            )
        out: NDArray[Any] = np.minimum.reduce(bufs) if op == "min" else np.stack(bufs)
        return out


class _SimRank:
    def __init__(self, world: SimulatedWorld, r: int) -> None:
        self.world = world
        self._rank = r

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self.world.size

    def all_reduce_min(self, buf: NDArray[Any]) -> None:
        buf[...] = self.world._exchange(self._rank, buf, "min")

    def start_all_reduce_min(self, buf: NDArray[Any]) -> Pending:
        return _Thread(lambda: self.all_reduce_min(buf))

    def all_gather(self, buf: NDArray[np.int32]) -> NDArray[np.int32]:
        return self.world._exchange(self._rank, buf, "gather")
