"""The fake backend: moves no bytes; used for warm-up and lifecycle tests.

Semantics: a sender says WaitingForInput until it is given the page count,
then Transferring, and Success once every page was "sent" (zero pages: at
once). A receiver goes Bootstrapping -> WaitingForInput after ``init`` ->
Success after its metadata was sent. ``abort`` makes either Failed. Terminal
states latch.

It keeps the real backends' deadlines when given them (:class:`FakeConfig`):
a request still Bootstrapping ``bootstrap_timeout`` seconds on, or waiting
for input for ``waiting_timeout`` (lifecycle.rules.deadlines; a sender never given its pages
among them, SGLang PR #28652), is Failed with that reason when polled. With
``peer_alive`` (a callable: is the other side up?), a request never reports
Success while it answers False: every live request is Failed, peer dead.

Statuses live in one numpy array in the :class:`FakeManager`, indexed by the
request's ``index``; ``poll_many`` is one gather.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

from buffers.checks import Checks
from lifecycle.reasons import FailureReason
from lifecycle.rules.deadlines import DEADLINES, late, limit_of
from lifecycle.rules.reasons import Clock
from lifecycle.status import KVPoll
from transport.connector.config import MAX_SECONDS
from transport.errors import ConfigError, ConfigTypeError, epoch_of_arg
from transport.status_arrays import StatusArrays, StatusHandle

__all__ = ["FakeConfig", "FakeManager", "FakeSender", "FakeReceiver", "FakeBootstrap"]

_C = Checks(ConfigError, ConfigTypeError)
_S, _F = int(KVPoll.Success), int(KVPoll.Failed)


def _callable(inst: Any, attr: Any, value: Any) -> None:
    if value is not None and not callable(value):
        _C.fail(inst, attr.name, value, "None or a callable", wrong_type=True)


def _clock(inst: Any, attr: Any, value: Any) -> None:
    if not callable(value):
        _C.fail(inst, attr.name, value, "a callable giving seconds", wrong_type=True)


@attrs.frozen
class FakeConfig:
    """The fake backend's deadlines and peer (every field checked here)."""

    #: seconds a request may stay Bootstrapping (None: no deadline)
    bootstrap_timeout: float | None = attrs.field(
        default=None, validator=_C.number(0.0, MAX_SECONDS, none="no deadline")
    )
    #: seconds a request may wait for input (None: no deadline)
    waiting_timeout: float | None = attrs.field(
        default=None, validator=_C.number(0.0, MAX_SECONDS, none="no deadline")
    )
    #: is the other side up? (None: always; False fails every live request)
    peer_alive: Callable[[], bool] | None = attrs.field(default=None, validator=_callable)
    #: seconds, monotonic (the deadlines' clock)
    clock: Callable[[], float] = attrs.field(default=time.monotonic, validator=_clock)


class FakeManager(StatusArrays):
    """Holds every fake request's status; one per rank."""

    #: when each request was taken, and when it began to wait for input
    COLUMNS: ClassVar[dict[str, tuple[Any, Any]]] = {
        "born": (np.float64, 0.0),
        "waited": (np.float64, 0.0),
    }

    def __init__(self, capacity: int = 1024, config: FakeConfig | None = None) -> None:
        super().__init__(capacity)
        if config is not None and not isinstance(config, FakeConfig):
            raise ConfigTypeError("config", config, "None or a FakeConfig", "FakeManager")
        self.config = config or FakeConfig()
        self.pages_left: dict[int, int] = {}
        self.born: NDArray[np.float64]
        self.waited: NDArray[np.float64]

    def peer_dead(self) -> bool:
        alive = self.config.peer_alive
        return alive is not None and not alive()

    def poll_many(self, rooms: NDArray[np.uint64], indices: NDArray[np.int64]) -> NDArray[np.int8]:
        c = self.config
        if c.bootstrap_timeout is not None or c.waiting_timeout is not None or c.peer_alive:
            self._expire(indices)
        return super().poll_many(rooms, indices)

    def _expire(self, indices: NDArray[np.int64]) -> None:
        """Fail the live requests among ``indices`` whose peer is dead or whose
        deadline passed, before they are read."""
        c = self.config
        with self._lock:
            st = self.status[indices]
            live = (st != _S) & (st != _F)
            if not live.any():
                return
            now = c.clock()
            checks: list[tuple[NDArray[np.bool_], FailureReason]] = []
            if self.peer_dead():
                checks.append((live, FailureReason.PEER_DEAD))
            clocks = {Clock.BORN: self.born, Clock.WAITED: self.waited}
            for d in DEADLINES:  # (their clocks and statuses are the reason table's)
                if (limit := limit_of(d, c)) is not None:
                    checks.append((live & late(d, now, limit, st, clocks, indices), d.reason))
            for mask, reason in checks:
                hit = indices[mask & (self.status[indices] != _F)]
                self.status[hit], self.reason[hit] = _F, int(reason)

    def sender(self, room: int, epoch: int = 0) -> FakeSender:
        """A prefill handle on ``room``'s attempt ``epoch`` (a retry is the next one)."""
        return FakeSender(self, room, epoch)

    def receiver(self, room: int, epoch: int = 0) -> FakeReceiver:
        """A decode handle on ``room``'s attempt ``epoch`` (a retry is the next one)."""
        return FakeReceiver(self, room, epoch)


class _FakeRequest(StatusHandle):
    def __init__(self, manager: FakeManager, room: int, initial: KVPoll, epoch: int) -> None:
        epoch = epoch_of_arg(room, epoch, "fake", 0)
        super().__init__(manager, room, manager.take(initial))
        self.manager = manager
        self.epoch = epoch
        manager.born[self.index] = manager.waited[self.index] = manager.config.clock()

    def _move(self, status: KVPoll, reason: FailureReason = FailureReason.NONE) -> None:
        if self.detached:  # a cleared handle's slot may be another request's now
            return
        m = self.manager
        if status == KVPoll.Success and m.peer_dead():  # no Success without a peer
            status, reason = KVPoll.Failed, FailureReason.PEER_DEAD
        if status == KVPoll.WaitingForInput and not m.terminal(self.index):
            m.waited[self.index] = m.config.clock()
        elif status == KVPoll.Transferring:  # a sender given its pages waits no more
            m.waited[self.index] = np.nan
        m.set(self.index, status, reason)

    def abort(self) -> None:
        self._move(KVPoll.Failed, FailureReason.ABORTED)

    def fail(self, reason: FailureReason) -> None:
        """The scheduler gave up on it (or the other side said it failed)."""
        self._move(KVPoll.Failed, reason)

    def clear(self) -> None:
        if self._detach():
            self.manager.pages_left.pop(self.index, None)
            self.manager.release(self.index)


class FakeSender(_FakeRequest):
    def __init__(self, manager: FakeManager, room: int, epoch: int = 0) -> None:
        super().__init__(manager, room, KVPoll.WaitingForInput, epoch)

    def init(self, num_pages: int, metadata_slot: int | None = None) -> None:
        if num_pages < 0:
            raise ValueError(f"room={self.bootstrap_room}: num_pages must be >= 0")
        if self.detached:
            return
        self.manager.pages_left[self.index] = num_pages
        self._move(KVPoll.Success if num_pages == 0 else KVPoll.Transferring)

    def send(self, page_indices: ArrayLike, state_indices: Any = None) -> None:
        m = self.manager
        if self.detached or m.terminal(self.index):
            return
        left = m.pages_left.get(self.index, 0) - np.asarray(page_indices).size
        m.pages_left[self.index] = left
        if left <= 0:
            self._move(KVPoll.Success)


class FakeReceiver(_FakeRequest):
    def __init__(self, manager: FakeManager, room: int, epoch: int = 0) -> None:
        super().__init__(manager, room, KVPoll.Bootstrapping, epoch)

    def init(self, prefill_dp_rank: int | None = None) -> None:
        self._move(KVPoll.WaitingForInput)

    def send_metadata(
        self,
        page_indices: ArrayLike,
        metadata_slot: int,
        state_indices: Any = None,
        decode_prefix_len: int = 0,
    ) -> None:
        self._move(KVPoll.Success)


class FakeBootstrap:
    """An in-process bootstrap table (the fake path needs no rendezvous)."""

    def __init__(self) -> None:
        self._table: dict[str, bytes] = {}

    def publish(self, key: str, value: bytes) -> None:
        self._table[key] = value

    def lookup(self, key: str, timeout: float = 0.0) -> bytes | None:
        return self._table.get(key)
