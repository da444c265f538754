"""Collectives the step reduces over.

The core hands a buffer (uint8 for the step, int32 for origin fetches and
gathers) to a :class:`Collective` and reads the result back; it may also
*start* a reduce and wait later (:func:`start_min`), to overlap the forward
pass. :class:`TorchCollective` runs ``torch.distributed`` on any process group
(gloo on CPU; a group of one makes no round trip), :class:`Hierarchical` TP
then CP (MIN is associative: the MIN over the product), :class:`SingleRank` a
world of one; ``lifecycle.testing.SimulatedWorld`` W ranks in one process.
"""

from __future__ import annotations

import os
import socket
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from lifecycle.drive import lent
from lifecycle.errors import LifecycleError, RankFailure

__all__ = [
    "Collective",
    "SingleRank",
    "TorchCollective",
    "Hierarchical",
    "CountingCollective",
    "Pending",
    "start_min",
]


@runtime_checkable
class Collective(Protocol):
    """What a step needs from a group of ranks."""

    @property
    def rank(self) -> int:
        """This rank's id as stamped into reduced words (a global rank)."""
        ...

    @property
    def world_size(self) -> int: ...

    def all_reduce_min(self, buf: NDArray[Any]) -> None:
        """Element-wise MIN over the group, in place. Same length and dtype on every rank."""
        ...

    def all_gather(self, buf: NDArray[np.int32]) -> NDArray[np.int32]:
        """Every rank's ``buf`` stacked: shape ``(world_size, len(buf))``."""
        ...


@runtime_checkable
class Pending(Protocol):
    """A reduce in flight; ``wait`` returns once the buffer holds the result.

    A pending reduce may also offer ``then(fn)``: run ``fn`` (which must not
    raise) on the thread that completes the reduce, ``wait`` returning only
    after it; a step uses it to do the read-only half of ``finish`` while the
    caller runs its forward pass."""

    def wait(self) -> None: ...


class _Done:
    def wait(self) -> None:
        return None


_DONE = _Done()


def start_min(coll: Collective, buf: NDArray[Any]) -> Pending:
    """Start a MIN all-reduce of ``buf`` in place; ``wait()`` on the result.

    Uses the collective's own ``start_all_reduce_min`` when it has one (torch
    groups: ``async_op=True``), else reduces at once.
    """
    start = getattr(coll, "start_all_reduce_min", None)
    if start is None:
        coll.all_reduce_min(buf)
        return _DONE
    pending: Pending = start(buf)
    return pending


class SingleRank:
    """A group of one: reduce and gather are identities."""

    def __init__(self, rank: int = 0) -> None:
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return 1

    def all_reduce_min(self, buf: NDArray[Any]) -> None:
        return None

    def all_gather(self, buf: NDArray[np.int32]) -> NDArray[np.int32]:
        out: NDArray[np.int32] = buf.reshape(1, -1).copy()
        return out


_PUBLISHED: dict[tuple[int, int], Any] = {}


def _process_gone(pid: int) -> bool:
    """True when process ``pid`` on this host has exited (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, owned by someone else
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return False


class TorchCollective:
    """``torch.distributed`` over ``group`` (None: the default group).

    Each rank writes its host and pid to the group's store when the collective
    is built, so a failure can name a peer on this host whose process is gone
    (peers on other hosts, or without a store, stay unnamed).
    """

    name_dead_within = 5.0  # seconds a failure waits to see a same-host peer exit

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise LifecycleError(
                "TorchCollective: torch.distributed is not initialised; call "
                "init_process_group('gloo', ...) first"
            )
        self._dist = dist
        self.group = group
        self._rank = dist.get_rank()
        self._world = dist.get_world_size(group)
        self._min = dist.ReduceOp.MIN
        self._peers: tuple[int, ...] = tuple(
            range(dist.get_world_size()) if group is None else dist.get_process_group_ranks(group)
        )
        self._store: Any = None
        try:
            from torch.distributed import distributed_c10d

            store = distributed_c10d._get_default_store()
            key = (id(store), self._rank)
            if key not in _PUBLISHED:  # once per process: collectives are built per call
                store.set(f"pdlife/pid/{self._rank}", f"{socket.gethostname()} {os.getpid()}")
                _PUBLISHED[key] = store  # holding it keeps the id from being reused
            self._store = store
        except Exception:  # no store reachable: dead peers stay unnamed
            self._store = None
        # the step's reduce goes straight to the process group: the Python
        # wrapper of dist.all_reduce costs tens of microseconds when caches are
        # cold, and a started reduce is visible to the caller for all of it
        self._pg: Any = None
        try:
            from torch.distributed import distributed_c10d as c10d

            self._coalescing = c10d._world.pg_coalesce_state
            self._pg = group if group is not None else c10d._get_default_group()
            self._opts = {}
            for is_async in (False, True):
                opts = dist.AllreduceOptions()
                opts.reduceOp = self._min  # type: ignore[assignment]
                if hasattr(opts, "asyncOp"):
                    opts.asyncOp = is_async
                self._opts[is_async] = opts
        except Exception:  # another torch: the public call does the same
            self._pg = None
        self._last: tuple[NDArray[Any], Any] | None = None
        # the cached tensor, lent when this collective dies before the backend lets go
        self._box: list[Any] = [None]
        weakref.finalize(self, lent.lend_later, self._box).atexit = False
        lent.hold(self)

    def lent_tensors(self) -> tuple[Any, ...]:
        """The tensor this collective keeps handing to the backend (see
        :mod:`lifecycle.drive.lent`)."""
        last = self._last
        return () if last is None else (last[1],)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def dead_peers(self, wait: float = 0.0) -> tuple[int, ...]:
        """Same-host peers whose process is gone, looking for up to ``wait`` s (a
        peer's sockets close before it is reaped: a survivor can see that first)."""
        host, mine, deadline = socket.gethostname(), [], time.monotonic() + wait
        for r in self._peers if self._store is not None else ():
            try:
                if r != self._rank and self._store.check([key := f"pdlife/pid/{r}"]):
                    peer_host, pid = self._store.get(key).decode().split()
                    if peer_host == host:
                        mine.append((r, int(pid)))
            except Exception:  # the store itself is gone: nothing more to learn
                break
        while not (dead := tuple(r for r, p in mine if _process_gone(p))) and mine:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        return dead

    def _failure(self, exc: RuntimeError) -> RankFailure:
        dead = self.dead_peers(wait=self.name_dead_within)
        return RankFailure(self._rank, dead, str(exc).splitlines()[0])

    def _launch(self, buf: NDArray[Any], is_async: bool) -> Any:
        """Start a MIN all-reduce of ``buf`` in place; the backend's work handle."""
        last = self._last
        if last is not None and last[0] is buf:  # a stepper reduces the same buffer each step
            tensor = last[1]
        else:
            import torch

            tensor = torch.from_numpy(buf)
            if last is not None:  # the backend may still hold the one it replaces
                lent.lend(last[1])
            self._last = (buf, tensor)
            self._box[0] = tensor
        pg = self._pg
        if pg is None or pg in self._coalescing:
            return self._dist.all_reduce(tensor, op=self._min, group=self.group, async_op=True)
        return pg.allreduce([tensor], self._opts[is_async])

    def all_reduce_min(self, buf: NDArray[Any]) -> None:
        if self._world == 1:  # the MIN over one rank is its own buffer: no round trip
            return
        try:
            work = self._launch(buf, False)
            if work is not None:
                work.wait()
        except RuntimeError as exc:  # gloo reports a dead or hung peer this way
            raise self._failure(exc) from exc

    def start_all_reduce_min(self, buf: NDArray[Any]) -> Pending:
        if self._world == 1:
            return _DONE
        try:
            work = self._launch(buf, True)
        except RuntimeError as exc:
            raise self._failure(exc) from exc
        return _TorchWork(work, self)

    def all_gather(self, buf: NDArray[np.int32]) -> NDArray[np.int32]:
        if self._world == 1:
            return SingleRank(self._rank).all_gather(buf)
        import torch

        out = torch.empty((self._world, buf.size), dtype=torch.int32)
        rows, mine = list(out.unbind(0)), torch.from_numpy(buf)
        try:
            self._dist.all_gather(rows, mine, group=self.group)
        except RuntimeError as exc:
            raise self._failure(exc) from exc
        finally:
            lent.lend(out, mine, *rows)
        result: NDArray[np.int32] = out.numpy()
        return result


class _TorchWork:
    def __init__(self, work: Any, coll: TorchCollective) -> None:
        self._work, self._coll = work, coll
        self._after: Any = None

    def then(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the backend's thread once the reduce has landed (at
        once when it was waited for already)."""
        if self._work is None:
            fn()
            return
        try:
            self._after = self._work.get_future().then(lent.Callback(fn))
        except Exception:  # a backend without futures: finish does it all
            self._after = None

    def wait(self) -> None:
        work = self._work
        if work is None:  # waited for already
            return
        try:
            work.wait()
        except RuntimeError as exc:
            raise self._coll._failure(exc) from exc
        after = self._after
        if after is not None and not after.done():  # done: no wait to pay for
            after.wait()
        # landed: the backend's handle holds the reduced tensor; let go of it
        self._work = self._after = None


class Hierarchical:
    """Reduce over each level in order (TP, then CP, ...)."""

    def __init__(self, levels: Sequence[Collective]) -> None:
        if not levels:
            raise ValueError("Hierarchical needs at least one level")
        self.levels = tuple(levels)

    @property
    def rank(self) -> int:
        return self.levels[0].rank

    @property
    def world_size(self) -> int:
        return int(np.prod([lvl.world_size for lvl in self.levels]))

    def all_reduce_min(self, buf: NDArray[Any]) -> None:
        for lvl in self.levels:
            lvl.all_reduce_min(buf)

    def start_all_reduce_min(self, buf: NDArray[Any]) -> Pending:
        first = start_min(self.levels[0], buf)
        if len(self.levels) == 1:
            return first
        rest = Hierarchical(self.levels[1:])
        return _Chain(first, lambda: rest.all_reduce_min(buf))

    def all_gather(self, buf: NDArray[np.int32]) -> NDArray[np.int32]:
        out = buf.reshape(1, -1)
        for lvl in self.levels:
            out = lvl.all_gather(out.ravel()).reshape(-1, buf.size)
        return out


class _Chain:
    """Wait for the first level, then run the others (they need its result)."""

    def __init__(self, first: Pending, then: Callable[[], None]) -> None:
        self._first, self._then = first, then

    def wait(self) -> None:
        self._first.wait()
        self._then()


class CountingCollective:
    """Wraps a collective and counts calls (for tests and metrics)."""

    def __init__(self, inner: Collective) -> None:
        self.inner = inner
        self.reduces = 0
        self.gathers = 0

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def all_reduce_min(self, buf: NDArray[Any]) -> None:
        self.reduces += 1
        self.inner.all_reduce_min(buf)

    def start_all_reduce_min(self, buf: NDArray[Any]) -> Pending:
        self.reduces += 1
        return start_min(self.inner, buf)

    def all_gather(self, buf: NDArray[np.int32]) -> NDArray[np.int32]:
        self.gathers += 1
        return self.inner.all_gather(buf)
