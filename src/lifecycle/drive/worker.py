"""The worker thread of ``start(worker=True)`` and the order of its launches.

A group's worker runs the local half of a step (hooks, verdicts, gates,
packing) and launches the reduce while the caller runs its forward pass.
Ranks pair collectives by the order they launch them, so every worker start
takes a turn in its calling thread's order (:func:`wait_launches`).
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable

from lifecycle.drive.collective import Pending

__all__ = ["Job", "Latch", "Turn", "Worker", "wait_launches", "take_turn"]


class Latch:
    """Closed until released once; ``wait`` returns from then on (a bare
    lock: cheaper to make than an Event)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def release(self) -> None:
        self._lock.release()

    def wait(self) -> None:
        with self._lock:
            pass


#: a worker start's launch: released once it has launched its reduce (or failed to)
Turn = Latch


class Job:
    """One start() handed to the worker: what it returned or raised."""

    __slots__ = ("done", "error", "fn", "result")

    def __init__(self, fn: Callable[[], Pending]) -> None:
        self.fn = fn
        self.done = Latch()
        self.result: Pending | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        fn, self.fn = self.fn, _ran  # the worker must not keep the group alive
        try:
            self.result = fn()
        except BaseException as e:  # re-raised by finish() on the caller's thread
            self.error = e
        self.done.release()

    def wait(self) -> Pending:
        self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def _ran() -> Pending:
    raise RuntimeError("a step job runs once")


#: per calling thread (one rank's program order): the launch of its latest
#: worker start. Ranks pair collectives by the order they issue them, so
#: every later collective of that thread, and every later worker's launch,
#: waits for it: a worker still running its hooks must not let the next
#: queue's reduce overtake its own on one rank only
_ORDER = threading.local()


def wait_launches() -> None:
    """Wait until every reduce a worker start of this thread launches has
    been launched (call before issuing a collective on this thread)."""
    tail: Turn | None = getattr(_ORDER, "tail", None)
    if tail is not None:
        tail.wait()
        _ORDER.tail = None


def _work_loop(jobs: queue.SimpleQueue[Job | None]) -> None:
    while True:
        job = jobs.get()
        if job is None:  # the group is gone
            return
        job.run()
        del job


class Worker:
    """A group's own thread for ``start(worker=True)`` (ends with the group)."""

    def __init__(self, owner: object) -> None:
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        thread = threading.Thread(
            target=_work_loop, args=(self.jobs,), name="pdlife-step", daemon=True
        )
        thread.start()
        weakref.finalize(owner, self.jobs.put, None)

    def submit(self, fn: Callable[[], Pending]) -> Job:
        job = Job(fn)
        self.jobs.put(job)
        return job


def take_turn() -> tuple[Turn | None, Turn]:
    """(the previous launch to wait for, this start's own turn)."""
    prev: Turn | None = getattr(_ORDER, "tail", None)
    mine = _ORDER.tail = Turn()
    return prev, mine
