"""A request's handles on a connector: the prefill sender and decode receiver
the scheduler holds (the field's ``KVSender``/``KVReceiver`` calls). A handle
reaches its connector through the calls of :class:`Requests` alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

from buffers.kv_args import KVArgs
from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll
from transport.connector.config import ConnectorConfig
from transport.connector.core.graph import IS_TERMINAL, Phase, ProtocolError
from transport.connector.core.legs import DecodeRequest, PrefillRequest, Request, rows_of
from transport.staging import Staging
from transport.status_arrays import Statuses, StatusHandle, detach_many

__all__ = ["ConnectorSender", "ConnectorReceiver", "Requests"]

T = int(KVPoll.Transferring)
#: the phases of a request that failed already (a page list is no longer told)
_FAILED_ALREADY = frozenset([int(Phase.Aborted), *[int(p) for p in Phase if IS_TERMINAL[p]]])
Q = TypeVar("Q", bound="Request[Any]")
R = TypeVar("R", bound="Request[Any]")


class Requests(Protocol):
    """What a handle asks of its connector (:class:`~transport.connector.hub.Connector`)."""

    config: ConnectorConfig
    kv_args: KVArgs

    @property
    def lock(self) -> AbstractContextManager[Any]: ...

    @property
    def arrays(self) -> Statuses: ...

    @property
    def staging(self) -> Staging | None: ...

    def take(self, room: int, make: Callable[[int, int], R], epoch: int = 0) -> R: ...

    def fail(self, req: Request[Any], reason: FailureReason) -> None: ...

    def clear(self, req: Request[Any]) -> None: ...

    def drained_many(self, reqs: Sequence[Request[Any]]) -> list[bool]: ...

    def clear_many(self, reqs: Sequence[Request[Any]]) -> None: ...

    def phase_of(self, req: Request[Any]) -> int: ...

    def set_status(self, index: int, status: int) -> None: ...

    def tell_pages(
        self,
        req: Request[Any],
        pages: NDArray[np.int64],
        slot: int,
        state: list[NDArray[np.int64]] | None,
        skip: int,
    ) -> None: ...

    def wake(self) -> None: ...


class _Handle(StatusHandle, Generic[Q]):
    def __init__(self, manager: Requests, req: Q) -> None:
        self.manager = manager
        self._req = req
        super().__init__(manager.arrays, req.room, req.index)

    @property
    def epoch(self) -> int:
        """The attempt this handle serves (0 for a request's first)."""
        return self._req.epoch

    def abort(self) -> None:
        self.fail(FailureReason.ABORTED)

    def fail(self, reason: FailureReason) -> None:
        """The scheduler gave up on this request (agreed Failed, or a client abort):
        stop, and make the peers stop writing; see :attr:`drained`."""
        if not self.detached:
            self.manager.fail(self._req, reason)

    @property
    def drained(self) -> bool:
        """No write for this request can land any more: its pages and metadata
        row may be reused. Until then, keep them quarantined."""
        req = self._req
        return req.released or bool(IS_TERMINAL[self.manager.phase_of(req)])

    @property
    def fenced(self) -> bool:
        """Failed for a writer that stopped beating and never said it stopped:
        its pages stay out of reuse while that writer is silent (they are
        released once it speaks again and stops, see :mod:`transport.connector.core.liveness`)."""
        req = self._req
        return not req.released and self.manager.phase_of(req) == Phase.Fenced

    def clear(self) -> None:
        if self._detach():
            self.manager.clear(self._req)


def clear_drained(handles: Sequence[_Handle[Any]]) -> list[bool]:
    """For each of ``handles``: is it :attr:`~_Handle.drained`? Those that are
    are cleared, as :meth:`~_Handle.clear` does; the others are left as they
    were. Two calls to each connector for the lot, where each handle's own
    ``drained`` and ``clear`` would take the connector's lock twice."""
    out = [False] * len(handles)
    by_manager: dict[int, tuple[Requests, list[int]]] = {}
    for i, h in enumerate(handles):
        by_manager.setdefault(id(h.manager), (h.manager, []))[1].append(i)
    for manager, at in by_manager.values():
        drained = manager.drained_many([handles[i]._req for i in at])
        fresh: list[_Handle[Any]] = []
        for i, d in zip(at, drained):
            if d:
                out[i] = True
                h = handles[i]
                if not h.detached:
                    fresh.append(h)
        if fresh:  # (a handle given twice reads the same answer twice, and is released once)
            detach_many(fresh, manager.arrays)
            manager.clear_many([h._req for h in fresh])
    return out


class ConnectorSender(_Handle[PrefillRequest]):
    def __init__(self, manager: Requests, room: int, epoch: int = 0) -> None:
        super().__init__(manager, manager.take(room, PrefillRequest, epoch))

    def init(self, num_pages: int, metadata_slot: int | None = None, first_page: int = 0) -> None:
        """``num_pages`` pages will be handed to :meth:`send`, the metadata row is
        ``metadata_slot``. ``first_page``: those pages start at this page of the
        request; the ones before it are a prefix every decode rank holds already
        (see :attr:`decode_prefix_pages`) and are never handed over. A decode
        rank that holds fewer cached pages fails the request (it would need a
        page prefill never had)."""
        if num_pages < 0 or first_page < 0:
            raise ValueError(
                f"room={self.bootstrap_room}: num_pages ({num_pages}) and first_page "
                f"({first_page}) must be >= 0"
            )
        req = self._req
        if first_page and (req.sent or req.src.size):
            raise ValueError(
                f"room={self.bootstrap_room}: first_page={first_page} given after pages "
                "were handed to send(); call init(..., first_page) before the first send()"
            )
        if self.detached:
            return
        req.local_slot = -1 if metadata_slot is None else metadata_slot
        if first_page:
            # placeholders for the prefix: every leg skips at least these positions
            req.src = np.full(first_page, -1, dtype=np.int64)
        req.first_page = first_page
        req.num_pages = first_page + num_pages
        if num_pages > 0:
            self.manager.set_status(self.index, T)
        else:
            self.manager.wake()

    @property
    def decode_prefix_pages(self) -> int | None:
        """How many leading pages of this request decode holds already (a cached
        prefix it will not be sent): the fewest any decode rank named. None
        until every decode rank said where to write."""
        m, req = self.manager, self._req
        with m.lock:
            if self.detached or m.phase_of(req) in (Phase.Bootstrap, Phase.Handshaken):
                return None
            return min((leg.skip for leg in req.legs.values() if leg.told), default=0)

    def send(self, page_indices: ArrayLike, state_indices: Any = None) -> None:
        """Hand over the next pages (in request order) and, once, the state rows:
        one int array per state component, or one array for every component."""
        m, req = self.manager, self._req
        pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
        rows = rows_of(req.room, state_indices, len(m.kv_args.state), "state_indices")
        if self.detached:
            return
        if rows is not None:
            req.src_state = rows
        if pages.size:
            req.src = np.concatenate((req.src, pages))  # one swap: the loop reads either
        if pages.size or rows is not None or not req.sent:
            req.sent = True
            m.wake()


class ConnectorReceiver(_Handle[DecodeRequest]):
    def __init__(self, manager: Requests, room: int, epoch: int = 0) -> None:
        super().__init__(manager, manager.take(room, DecodeRequest, epoch))

    def init(self, prefill_dp_rank: int | None = None) -> None:
        """Pair with prefill DP group ``prefill_dp_rank`` (0 if None); registers once
        that group and its ranks are known."""
        dp = 0 if prefill_dp_rank is None else prefill_dp_rank
        if not isinstance(dp, (int, np.integer)) or isinstance(dp, bool) or dp < 0:
            raise ValueError(
                f"room={self.bootstrap_room}: prefill_dp_rank must be an int >= 0, got {dp!r}"
            )
        self._req.dp = int(dp)
        self._req.want_register = True
        self.manager.wake()

    @property
    def require_staging(self) -> bool:
        """Whether this request lands in staging and is scattered (known once registered)."""
        return self._req.staged

    def send_metadata(
        self,
        page_indices: ArrayLike,
        metadata_slot: int,
        state_indices: Any = None,
        decode_prefix_len: int = 0,
    ) -> None:
        """Tell prefill where to write: ``page_indices`` are this rank's pages for the
        request's pages after the first ``decode_prefix_len`` tokens, which decode
        holds already (a cached prefix, whole pages) and which are not sent."""
        m, req = self.manager, self._req
        ph = m.phase_of(req)
        if self.detached or ph in _FAILED_ALREADY:
            return  # it already failed: nothing to tell
        if ph != Phase.Handshaken:
            raise ProtocolError(req.room, m.config.tp_rank, ph, "metadata", m.config.role)
        pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
        ps = m.kv_args.page_size
        if decode_prefix_len < 0 or decode_prefix_len % ps:
            raise ValueError(
                f"room={req.room}: decode_prefix_len {decode_prefix_len} is not a whole "
                f"number of {ps}-token pages; only whole cached pages can be skipped"
            )
        rows = rows_of(req.room, state_indices, len(m.kv_args.state), "state_indices")
        st = m.staging
        if (req.staged and st is not None) and (
            not 0 <= metadata_slot < st.slots or pages.size > st.pages
        ):
            raise ValueError(
                f"room={req.room}: staging holds {st.pages} pages in each of {st.slots} "
                f"slots; got {pages.size} pages for slot {metadata_slot} "
                "(raise ConnectorConfig.staging_pages)"
            )
        m.tell_pages(req, pages, metadata_slot, rows, decode_prefix_len // ps)
