"""W ranks in one process: a collective for tests and the simulator.

Each rank runs in its own thread; a collective call blocks until every rank
has made it (or ``timeout`` passes, which raises :class:`RankFailure` naming
the ranks that never arrived). Collectives pair in the order each rank
issues them, as in a real group. Buffer sizes, dtypes and the kind of
collective are checked the way a careful network would, raising instead of
aborting the process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lifecycle.drive.collective import Pending
from lifecycle.errors import LifecycleError, RankFailure

__all__ = ["SimulatedWorld"]


class _Thread:
    """A blocking reduce run on a thread (for collectives without async ops)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._landed = False
        self._after: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:
            self._error = e
        with self._lock:
            self._landed = True
            after = self._after
        if self._error is None:
            for cb in after:
                cb()

    def then(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the reduce has landed (on this thread, or at once if
        it already has); ``wait`` returns after it."""
        with self._lock:
            if not self._landed:
                self._after.append(fn)
                return
        if self._error is None:
            fn()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


class SimulatedWorld:
    """W ranks in one process. ``world.rank(r)`` is rank r's collective.

    Each rank runs in its own thread; a collective call blocks until every
    rank has made it (or ``timeout`` passes, which raises
    :class:`RankFailure` naming the ranks that never arrived).

    Collectives pair as a real group pairs them: each rank's k-th collective
    with every other rank's k-th, numbered when it is *issued*. A rank with
    two reduces in flight (``start_all_reduce_min`` twice) has them paired
    in the order it started them, whichever thread gets there first.
    """

    def __init__(self, world_size: int, timeout: float = 30.0) -> None:
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.size = world_size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._issued = [0] * world_size  # per rank: collectives issued so far
        self._posted: dict[int, dict[int, tuple[str, NDArray[Any]]]] = {}  # k -> rank -> post
        self._results: dict[int, NDArray[Any] | BaseException | _GaveUp] = {}
        self._reads: dict[int, int] = {}

    def rank(self, r: int) -> _SimRank:
        if not 0 <= r < self.size:
            raise ValueError(f"rank {r} is not a rank of a world of {self.size}")
        return _SimRank(self, r)

    def _post(self, r: int, buf: NDArray[Any], op: str) -> int:
        """Issue rank ``r``'s next collective (a copy of ``buf``); its number."""
        with self._cond:
            k = self._issued[r]
            self._issued[r] += 1
            if k in self._results:  # a rank gave up on it: it fails here too
                return k
            posts = self._posted.setdefault(k, {})
            posts[r] = (op, buf.copy())
            if len(posts) == self.size:
                self._results[k] = self._combine(k, posts)
                del self._posted[k]
                self._cond.notify_all()
            return k

    def _wait(self, r: int, k: int) -> NDArray[Any]:
        """The result of collective ``k``, once every rank has issued its own."""
        with self._cond:
            if not self._cond.wait_for(lambda: k in self._results, timeout=self.timeout):
                missing = sorted(set(range(self.size)) - set(self._posted.pop(k, {})))
                # as in a real group, the others cannot complete it without this
                # rank: whoever waits for it, or comes late, fails too
                self._results[k] = _GaveUp(r, missing)
                self._cond.notify_all()
                res: NDArray[Any] | BaseException | _GaveUp = RankFailure(
                    r, missing, f"no answer within {self.timeout} s"
                )
            else:
                res = self._results[k]
            self._reads[k] = self._reads.get(k, 0) + 1
            if self._reads[k] == self.size:  # every rank has it: forget it
                del self._results[k], self._reads[k]
        if isinstance(res, _GaveUp):  # still missing ranks are named; else the one that left
            dead = [x for x in res.missing if x != r] or [res.rank]
            raise RankFailure(
                r,
                dead,
                f"rank {res.rank} stopped waiting for rank(s) {res.missing} after {self.timeout} s",
            )
        if isinstance(res, BaseException):
            raise res
        return res

    def _exchange(self, r: int, buf: NDArray[Any], op: str) -> NDArray[Any]:
        return self._wait(r, self._post(r, buf, op))

    def _combine(self, k: int, posts: dict[int, tuple[str, NDArray[Any]]]) -> Any:
        ops = {op for op, _ in posts.values()}
        if len(ops) != 1:
            by_rank = {r: posts[r][0] for r in sorted(posts)}
            return LifecycleError(
                f"simulated collective {k}: ranks issued different collectives {by_rank} "
                "(a real group would pair them and corrupt or hang)"
            )
        op = ops.pop()
        bufs = [posts[i][1] for i in range(self.size)]
        sizes = {(b.size, b.dtype.str) for b in bufs}
        if len(sizes) != 1:
            return LifecycleError(
                f"simulated {op}: buffer sizes differ across ranks "
                f"{[b.size for b in bufs]} (a real gloo group would abort the process)"
            )
        out: NDArray[Any] = np.minimum.reduce(bufs) if op == "min" else np.stack(bufs)
        return out


class _GaveUp:
    """A collective one rank stopped waiting for (it timed out)."""

    def __init__(self, rank: int, missing: list[int]) -> None:
        self.rank, self.missing = rank, missing


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
        k = self.world._post(self._rank, buf, "min")  # its place in the order: now

        def land() -> None:
            buf[...] = self.world._wait(self._rank, k)

        return _Thread(land)

    def all_gather(self, buf: NDArray[np.int32]) -> NDArray[np.int32]:
        return self.world._exchange(self._rank, buf, "gather")
