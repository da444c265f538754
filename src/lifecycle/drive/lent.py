"""Tensors lent to a ``torch.distributed`` backend, held until its threads let go.

A gloo collective keeps its tensors in a work object that the backend's own
thread destroys once the collective has completed, which can be after
``wait()`` has returned to the caller. If Python has dropped a tensor by then,
torch hands the tensor's Python object to C++, and the backend's thread later
releases it, which means taking the GIL. While the interpreter is finalizing,
a thread that asks for the GIL is ended on the spot; ended that way, the
backend's C++ thread aborts the whole process ("terminate called without an
active exception", SIGABRT, exit status 134) after the program itself has
finished. In a run of twenty two-rank programs that stepped 110 times and
exited, five aborted so.

So every tensor the collectives lend to a backend stays referenced here until
only its own Python object holds it (``Tensor._use_count() == 1``), and at
exit the interpreter waits, at most :data:`EXIT_WAIT` seconds, for the
backends to let go of what is still lent (:func:`settle`). Nothing here
imports torch: a tensor is anything with ``_use_count()``.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["EXIT_WAIT", "lend", "hold", "outstanding", "settle"]

logger = logging.getLogger(__name__)

#: seconds the interpreter waits at exit for backends to let go of lent tensors
EXIT_WAIT = 1.0

_lock = threading.Lock()
_lent: list[Any] = []  # tensors a backend may still hold, dropped once it does not
#: live holders of a tensor they keep reusing (a collective's cached buffer):
#: asked for it at exit, since finalization may drop the holder first
_holders: weakref.WeakSet[Any] = weakref.WeakSet()
_Held = Callable[[], Iterable[Any]]


def _shared(tensor: Any) -> bool:
    """True while something besides the tensor's Python object holds it."""
    try:
        return bool(tensor._use_count() > 1)
    except Exception:  # not a torch tensor, or a torch without the call: not ours to hold
        return False


def lend(*tensors: Any) -> None:
    """Keep ``tensors`` referenced until the backend they were handed to lets
    go of them (call when Python is about to drop them)."""
    with _lock:
        _lent[:] = [t for t in _lent if _shared(t)]
        _lent.extend(t for t in tensors if _shared(t))


def hold(holder: Any) -> None:
    """Register ``holder``, which keeps reusing tensors it lends: at exit its
    ``lent_tensors()`` are waited for as well (weakly referenced)."""
    with _lock:
        _holders.add(holder)


def outstanding() -> list[Any]:
    """The lent tensors a backend still holds; lets go of the others (a view
    lent with its base holds the base until it is let go itself)."""
    with _lock:
        _lent[:] = [t for t in _lent if _shared(t)]
        held = [t for h in list(_holders) for t in h.lent_tensors() if _shared(t)]
        return [*_lent, *held]


def settle(timeout: float | None = None, poll: float = 0.001) -> int:
    """Wait until no backend holds a lent tensor, at most ``timeout`` seconds
    (None: :data:`EXIT_WAIT`); returns how many are still held (0: every
    backend let go)."""
    deadline = time.monotonic() + (EXIT_WAIT if timeout is None else timeout)
    while (left := len(outstanding())) and time.monotonic() < deadline:
        time.sleep(poll)
    return left


def _at_exit() -> None:
    left = settle()
    if left:
        logger.debug("exit: a collective backend still holds %d lent tensors", left)


atexit.register(_at_exit)
