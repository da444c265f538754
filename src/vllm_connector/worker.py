"""The worker side of the vLLM connector: each step's loads and sends started
on this worker's connector, ``get_finished`` answered from the group.

:class:`WorkerSide` takes the scheduler's :class:`~vllm_connector.scheduler.Meta`
and this worker's connector (anything that hands out the connector's
handles: :class:`Handles`), and keeps every transfer in a
:class:`~vllm_connector.agreement.WorkerAgreement`. Each :meth:`WorkerSide.finished`
steps the group once; then, on every worker alike:

- a transfer every worker sees handshaken is handed its pages (decode says
  where to write; prefill hands over the pages decode's list names) by the
  next ``start_load_kv`` (:meth:`WorkerSide.hand_over`), where vLLM's own
  connectors start their reads: the call that answers ``get_finished`` only
  steps and reports;
- a transfer that ended is reported once its pages are drained (no write of it
  can land any more), never before: vLLM reuses the blocks it is told of.
  A load that failed is the exception: it is reported at once (with its
  blocks as load errors), so vLLM's scheduler recomputes or fails the
  request as its ``kv_load_failure_policy`` says instead of waiting on a
  writer that may be silent for ever, and its blocks are reported freeable
  (as sent) once drained: until then the scheduler side holds them
  (:mod:`vllm_connector.scheduler`, quarantined);
- a failure the recovery table retries starts the next attempt (epoch + 1,
  the same blocks) on both sides, unseen by vLLM: the old attempt's writes are
  fenced by its epoch;
- a load the scheduler gave up while in flight is aborted, and reported as
  sent (the blocks vLLM held for it may be freed) once drained; one it gave
  up after the load ended here (the two crossed) is reported so too.

A local prefix-cache hit on decode (whole blocks) is not written: prefill
skips those pages. Only vLLM's one-group KV (a model of one attention kind) is moved; a request
whose blocks span several KV cache groups is refused by name.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import attrs
import numpy as np
from numpy.typing import NDArray

from lifecycle import Role
from lifecycle.rules.recovery import Action
from transport.connector.handles import ConnectorReceiver, ConnectorSender, clear_drained
from vllm_connector.agreement import Begun, WorkerAgreement
from vllm_connector.params import ParamsError
from vllm_connector.scheduler import Meta

__all__ = ["Handles", "Report", "WorkerSide"]


class Handles(Protocol):
    """What the worker side asks of its connector: the handles of an attempt."""

    def sender(self, room: int, epoch: int = 0) -> ConnectorSender: ...

    def receiver(self, room: int, epoch: int = 0) -> ConnectorReceiver: ...


@attrs.frozen
class Report:
    """What ``get_finished`` and ``get_block_ids_with_load_errors`` answer."""

    #: prefill sends ended, and aborted loads drained: vLLM may free their blocks
    sending: frozenset[str] = frozenset()
    #: loads ended (succeeded or failed)
    recving: frozenset[str] = frozenset()
    #: the blocks of the loads that failed
    load_errors: frozenset[int] = frozenset()
    #: the loads that failed (also in ``recving``), by request id
    failed: frozenset[str] = frozenset()


@attrs.define
class _Transfer:
    room: int
    epoch: int
    role: Role
    pages: NDArray[np.int64]
    handle: ConnectorSender | ConnectorReceiver
    aborted: bool = False
    #: decode: the prompt's tokens held here already (whole pages, not written)
    skip: int = 0


#: what a drained transfer is reported as: freeable blocks (prefill's send
#: ended, an aborted or failed load), a load ended, or nothing (an attempt the
#: next one replaced)
SENT, RECEIVED, UNSEEN = "sent", "received", "unseen"
_SENDER = Role.SENDER  # (an enum member's lookup on its class is slow)


class _Ending(NamedTuple):
    request_id: str
    transfer: _Transfer
    #: what it is reported as once drained
    then: str


@attrs.define
class _Told:
    """What one call reports."""

    sending: set[str] = attrs.field(factory=set)
    recving: set[str] = attrs.field(factory=set)
    errors: set[int] = attrs.field(factory=set)
    failed: set[str] = attrs.field(factory=set)


def _pages(request_id: str, block_ids: tuple[tuple[int, ...], ...]) -> NDArray[np.int64]:
    if len(block_ids) != 1:
        raise ParamsError(
            request_id,
            "remote_block_ids",
            [list(g) for g in block_ids],
            "the blocks of one KV cache group (models of several attention kinds are "
            "not moved by this connector yet)",
        )
    return np.asarray(block_ids[0], dtype=np.int64)


class WorkerSide:
    """One worker's transfers (see the module)."""

    def __init__(self, handles: Handles, agreement: WorkerAgreement, page_size: int = 1) -> None:
        self.handles = handles
        #: tokens per page (vLLM's block size)
        self.page_size = page_size
        self.agreement = agreement
        self.live: dict[str, _Transfer] = {}
        #: ended, waiting for their pages to drain
        self.ending: list[_Ending] = []
        #: loads the scheduler gave up after they ended here: reported as sent
        #: (their blocks freeable) once drained
        self.freeable: set[str] = set()
        #: transfers the group agreed ready, to be handed their pages (:meth:`hand_over`)
        self.ready: list[tuple[str, _Transfer]] = []

    def start(self, meta: Meta) -> None:
        """Start the step's loads and sends; abort the loads it gives up; hand
        the transfers found ready their pages (:meth:`hand_over`). Every
        request is checked before any is started."""
        planned = {rid: _pages(rid, x.block_ids) for rid, x in meta.loads.items()}
        planned |= {rid: _pages(rid, x.block_ids) for rid, x in meta.sends.items()}
        for rid in planned:
            if rid in self.live:
                raise ParamsError(rid, "", "started twice", "one transfer per request at a time")
        for rid, load in meta.loads.items():
            if load.skip_tokens % self.page_size or load.skip_tokens < 0:
                raise ParamsError(
                    rid,
                    "num_computed_tokens",
                    load.skip_tokens,
                    f"a whole number of {self.page_size}-token blocks (a prefix-cache hit)",
                )
        begun: list[Begun] = []
        try:
            for rid, load in meta.loads.items():
                begun.append(
                    self._begin(
                        rid, load.room, load.epoch, Role.RECEIVER, planned[rid], load.skip_tokens
                    )
                )
            for rid, send in meta.sends.items():
                begun.append(self._begin(rid, send.room, send.epoch, Role.SENDER, planned[rid]))
        finally:  # (those begun before one that raised are in flight: the group steps them)
            self.agreement.add_many(begun)
        for rid in meta.aborts:
            t = self.live.get(rid)
            if t is None:  # it ended here before the scheduler knew: freeable once drained
                self.freeable.add(rid)
            elif not t.aborted:
                t.aborted = True
                t.handle.abort()
                self.agreement.abort(rid)
        self.hand_over()

    def _begin(
        self,
        rid: str,
        room: int,
        epoch: int,
        role: Role,
        pages: NDArray[np.int64],
        skip: int = 0,
    ) -> Begun:
        """The transfer's handle on this worker's connector; what the group adds."""
        h: ConnectorSender | ConnectorReceiver
        if role is Role.RECEIVER:
            r = h = self.handles.receiver(room, epoch)
            r.init()
        else:
            h = self.handles.sender(room, epoch)
        self.live[rid] = _Transfer(room, epoch, role, pages, h, skip=skip)
        return Begun(rid, room, h.index, role, epoch)

    def hand_over(self) -> None:
        """Hand the transfers the group agreed ready their pages (decode says
        where to write; prefill starts writing where decode's list says): what
        ``start_load_kv`` does, as vLLM's own connectors start their reads
        there. A transfer that ended or was aborted since is skipped."""
        ready, self.ready = self.ready, []
        for rid, t in ready:
            if self.live.get(rid) is not t or t.aborted:
                continue
            if isinstance(t.handle, ConnectorReceiver):  # (a cached prefix is not written)
                t.handle.send_metadata(
                    t.pages[t.skip // self.page_size :], -1, decode_prefix_len=t.skip
                )
            else:
                t.handle.init(int(t.pages.size))
                t.handle.send(t.pages)

    def finished(self) -> Report:
        """Step the group once; what ended and drained since the last call. The
        transfers it finds ready are handed their pages by the next
        :meth:`start` (or, if none comes first, the next call of this)."""
        self.hand_over()
        ended = self.agreement.step()
        self.ready.extend((rid, self.live[rid]) for rid in sorted(ended.ready))
        live, ending = self.live, self.ending
        for rid in sorted(ended.succeeded):
            t = live.pop(rid)
            ending.append(_Ending(rid, t, SENT if t.role is _SENDER else RECEIVED))
        now = _Told()
        for rid, f in sorted(ended.failed.items()):
            t = live.pop(rid)
            if f.action is Action.RETRY and not t.aborted:
                # the failed attempt drains unseen while the next one runs (fenced by its epoch)
                ending.append(_Ending(rid, t, UNSEEN))
                self.agreement.add_many(
                    [self._begin(rid, t.room, t.epoch + 1, t.role, t.pages, t.skip)]
                )
            elif t.role is Role.RECEIVER and not t.aborted:
                # told at once, so vLLM never waits on a silent writer; its blocks are
                # reported freeable (sending) only once no write can land
                now.recving.add(rid)
                now.failed.add(rid)
                now.errors.update(t.pages.tolist())
                ending.append(_Ending(rid, t, SENT))
            else:
                ending.append(_Ending(rid, t, SENT))
        return self._drained(now)

    def _drained(self, told: _Told) -> Report:
        sending, recving = told.sending, told.recving
        keep = []
        ending = self.ending
        if ending:  # (the connector asked once for every handle)
            for e, gone in zip(ending, clear_drained([e.transfer.handle for e in ending])):
                if not gone:
                    keep.append(e)
                elif e.then == SENT:
                    sending.add(e.request_id)
                elif e.then == RECEIVED:
                    recving.add(e.request_id)
        self.ending = keep
        waiting = {e.request_id for e in keep}
        done = {rid for rid in self.freeable if rid not in waiting and rid not in self.live}
        sending |= done
        self.freeable -= done
        errors, failed = told.errors, told.failed
        return Report(frozenset(sending), frozenset(recving), frozenset(errors), frozenset(failed))
