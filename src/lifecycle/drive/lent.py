"""Tensors lent to a ``torch.distributed`` backend, held until its threads let go.

A gloo collective keeps its tensors in a work object that the backend's own
thread destroys once the collective has completed, which can be after
``wait()`` has returned to the caller. If Python has dropped a tensor by then,
torch hands the tensor's Python object to C++, and the backend's thread later
releases it, which means taking the GIL. A Python callback chained on a
reduce (``then``) is released on that thread too, under the GIL. While the
interpreter is finalizing, a thread that asks for the GIL is ended on the
spot; ended that way, the backend's C++ thread aborts the whole process
("terminate called without an active exception", SIGABRT) after the program
itself has finished. In a run of twenty two-rank programs that stepped 110
times and exited, five aborted so.

So every tensor the collectives lend to a backend stays referenced here until
only its own Python object holds it (``Tensor._use_count() == 1``), every
callback until the backend has released it, and at exit the interpreter
waits, at most :data:`EXIT_WAIT` seconds, for the backends to let go
(:func:`settle`). Nothing here imports torch: a tensor is anything with
``_use_count()``.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

__all__ = [
    "EXIT_WAIT",
    "Callback",
    "Holder",
    "lend",
    "lend_later",
    "hold",
    "track",
    "outstanding",
    "settle",
]

logger = logging.getLogger(__name__)

#: seconds the interpreter waits at exit for backends to let go of lent tensors
EXIT_WAIT = 1.0


class Holder(Protocol):
    """Something that keeps reusing tensors it lends (a collective's cached buffer)."""

    def lent_tensors(self) -> Iterable[Any]: ...


_lock = threading.Lock()
_lent: list[Any] = []  # tensors a backend may still hold, dropped once it does not
# lent from a finalizer, which may run inside a garbage collection on a thread
# that holds _lock: appended without it, taken in by the next look
_incoming: collections.deque[Any] = collections.deque()
_holders: list[weakref.ref[Any]] = []  # asked at exit: finalization may drop them first
_callbacks: list[weakref.ref[Any]] = []  # alive until the backend releases them


def _after_fork() -> None:  # a thread may have held the lock when the process forked
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def _shared(tensor: Any) -> bool:
    """True while something besides the tensor's Python object holds it."""
    try:
        return bool(tensor._use_count() > 1)
    except Exception:  # not a torch tensor, or a torch without the call: not ours to hold
        return False


def _take_in() -> None:
    """Under the lock: the finalizers' tensors in, the released ones out."""
    while _incoming:
        _lent.append(_incoming.popleft())
    _lent[:] = [t for t in _lent if _shared(t)]


def lend(*tensors: Any) -> None:
    """Keep ``tensors`` referenced until the backend they were handed to lets
    go of them (call when Python is about to drop them)."""
    with _lock:
        _take_in()
        _lent.extend(t for t in tensors if _shared(t))


def lend_later(box: list[Any]) -> None:
    """Lend what ``box`` holds, from a finalizer (takes no lock)."""
    _incoming.extend(t for t in box if t is not None)


def hold(holder: Holder) -> None:
    """Register ``holder``: at exit its ``lent_tensors()`` are waited for as
    well (weakly referenced)."""
    with _lock:
        _holders[:] = [r for r in _holders if r() is not None]
        _holders.append(weakref.ref(holder))


def track(callback: Any) -> None:
    """Wait at exit until the backend has released ``callback`` (weakly referenced)."""
    with _lock:
        _callbacks[:] = [r for r in _callbacks if r() is not None]
        _callbacks.append(weakref.ref(callback))


class Callback:
    """A callback to chain on a reduce (``future.then``): the backend's thread
    releases it after the reduce's waiters may have returned, so exit waits
    until it has."""

    __slots__ = ("__weakref__", "fn")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        track(self)

    def __call__(self, _: Any) -> None:
        self.fn()


def outstanding() -> list[Any]:
    """The lent tensors a backend still holds and the callbacks it has not
    released; lets go of the others (a view lent with its base holds the
    base until it is let go itself)."""
    with _lock:
        _take_in()
        holders = [h for r in _holders if (h := r()) is not None]
        callbacks = [c for r in _callbacks if (c := r()) is not None]
    held = [t for h in holders for t in h.lent_tensors() if _shared(t)]
    return [*_lent, *held, *callbacks]


def settle(timeout: float | None = None, poll: float = 0.001) -> int:
    """Wait until no backend holds a lent tensor or a callback, at most
    ``timeout`` seconds (None: :data:`EXIT_WAIT`); returns how many are still
    held (0: every backend let go)."""
    deadline = time.monotonic() + (EXIT_WAIT if timeout is None else timeout)
    while (left := len(outstanding())) and time.monotonic() < deadline:
        time.sleep(poll)
    return left


def _at_exit() -> None:
    left = settle()
    if left:
        logger.debug("exit: a collective backend still holds %d lent tensors", left)


atexit.register(_at_exit)
