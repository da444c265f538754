"""The scheduler side of the vLLM connector, without vLLM: a declared machine
per request, plain data in, the step's connector metadata out.

vLLM's scheduler calls its connector at fixed points of a request's life
(see ``KVConnectorBase_V1``): ``get_num_new_matched_tokens`` when it
considers a waiting request, ``update_state_after_alloc`` once blocks are
given, ``build_connector_meta`` once per step (what the workers must do),
``update_connector_output`` with what the workers finished, and
``request_finished`` exactly once at the end. Each becomes an event of
:data:`EDGES`; a call the table has no edge for is a
:class:`SchedulerProtocolError` naming the request, its phase and the call,
and changes nothing.

Decode (``do_remote_prefill`` in the request's params) asks to load the
whole prompt asynchronously (``ASKED``), learns its blocks (``PLANNED``),
hands the load to the workers in the next step's metadata (``LOADING``) and
forgets the request when the workers report it received. A request that
finishes (an abort) while its load is in flight keeps its blocks
(``request_finished`` answers True) until the workers report its writes
drained (``DRAINING``): no write can land in blocks vLLM gave to another
request.

A load that fails is told to vLLM at once (so vLLM fails or recomputes the
request), but a writer may still land in its blocks (a prefill paused, not
dead): this side takes its own hold on them (``QUARANTINED``: the driver
adds a reference in vLLM's block pool, :meth:`SchedulerCore.take_holds`) and
lets go once the workers report them drained, so vLLM never hands them to
another request meanwhile.

Prefill (``do_remote_decode``) that finishes normally keeps its blocks for
decode (``HELD``), answers the params decode's request carries, hands the
send to the workers (``SENDING``) and frees the blocks when they report it
sent (or failed, every worker agreeing).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from transport.errors import TransportError
from vllm_connector.params import TransferParams, room_of

__all__ = [
    "EDGES",
    "Load",
    "Meta",
    "Phase",
    "SchedulerCore",
    "SchedulerProtocolError",
    "Send",
]


class Phase(enum.Enum):
    ASKED = "asked"  # decode: a load of the prompt was offered to the scheduler
    PLANNED = "planned"  # decode: blocks given; the load goes out with the next step
    LOADING = "loading"  # decode: the workers load it
    DRAINING = "draining"  # decode: finished while loading; blocks held until drained
    QUARANTINED = "quarantined"  # decode: the load failed; its blocks held here until drained
    HELD = "held"  # prefill: finished; blocks held for decode; the send goes out next step
    SENDING = "sending"  # prefill: the workers serve decode's load


#: None stands for "not held here" (before the first event, after the last)
EDGES: Mapping[tuple[Phase | None, str], Phase | None] = {
    (None, "match"): Phase.ASKED,
    (Phase.ASKED, "match"): Phase.ASKED,  # asked again before blocks were given
    (Phase.ASKED, "alloc"): Phase.PLANNED,
    (Phase.ASKED, "finish"): None,  # ended before blocks: nothing to load or hold
    (Phase.PLANNED, "meta"): Phase.LOADING,
    (Phase.PLANNED, "finish"): None,  # the workers never heard of it
    (Phase.LOADING, "received"): None,
    (Phase.LOADING, "failed"): Phase.QUARANTINED,  # (its blocks taken out of vLLM's reuse)
    (Phase.LOADING, "finish"): Phase.DRAINING,
    (Phase.DRAINING, "received"): Phase.DRAINING,  # (it ended at the workers; still draining)
    (Phase.DRAINING, "failed"): Phase.DRAINING,  # (vLLM holds its blocks already)
    (Phase.DRAINING, "drained"): None,
    (Phase.QUARANTINED, "received"): Phase.QUARANTINED,
    (Phase.QUARANTINED, "finish"): Phase.QUARANTINED,  # vLLM frees its own hold; ours stays
    (Phase.QUARANTINED, "drained"): None,  # (the blocks go back to vLLM's pool)
    (None, "hold"): Phase.HELD,
    (Phase.HELD, "meta"): Phase.SENDING,
    (Phase.SENDING, "sent"): None,
}


@attrs.frozen
class Load:
    """Decode's workers: load ``room`` (attempt ``epoch``) into ``block_ids``
    (this engine's blocks per KV cache group) from prefill as ``remote`` says."""

    room: int
    epoch: int
    block_ids: tuple[tuple[int, ...], ...]
    remote: TransferParams
    #: the prompt's first tokens decode holds already (a local prefix-cache hit,
    #: whole blocks): their blocks are in ``block_ids`` but are not written
    skip_tokens: int = 0


@attrs.frozen
class Send:
    """Prefill's workers: serve decode's load of ``room`` from ``block_ids``."""

    room: int
    epoch: int
    block_ids: tuple[tuple[int, ...], ...]


@attrs.frozen
class Meta:
    """What one step asks of the workers (vLLM's connector metadata)."""

    loads: Mapping[str, Load] = attrs.field(factory=dict)
    sends: Mapping[str, Send] = attrs.field(factory=dict)
    #: loads the scheduler gave up while in flight: stop them, report them drained
    aborts: Mapping[str, int] = attrs.field(factory=dict)


class SchedulerProtocolError(TransportError, RuntimeError):
    """A scheduler call the request's phase has no edge for; nothing changed."""

    def __init__(self, request_id: str, phase: Phase | None, event: str) -> None:
        self.request_id, self.phase, self.event = request_id, phase, event
        where = "not held by the connector" if phase is None else f"in phase {phase.value}"
        super().__init__(
            f"request {request_id}: {event!r} while {where}; the connector's scheduler "
            "side expects vLLM's order of calls (match, alloc, meta, finish)"
        )


@attrs.define
class _Req:
    phase: Phase
    room: int
    epoch: int = 0
    blocks: tuple[tuple[int, ...], ...] = ()
    remote: TransferParams | None = None
    skip: int = 0


class SchedulerCore:
    """Every request the scheduler side holds, by vLLM request id. ``engine_id``,
    ``host``, ``port``, ``tp_size``: what prefill tells decode about itself."""

    def __init__(self, engine_id: str, host: str, port: int, tp_size: int) -> None:
        self.me = (engine_id, host, port, tp_size)
        self.reqs: dict[str, _Req] = {}
        self._meta: list[str] = []  # requests whose work goes out with the next step
        self._aborts: dict[str, int] = {}
        self._hold: list[tuple[int, ...]] = []  # block ids to take a hold on
        self._release: list[tuple[int, ...]] = []  # block ids to let go of

    def phase(self, request_id: str) -> Phase | None:
        r = self.reqs.get(request_id)
        return None if r is None else r.phase

    def _move(self, request_id: str, event: str) -> Phase | None:
        """The edge ``event`` takes from the request's phase (checked, not taken)."""
        now = self.phase(request_id)
        if (now, event) not in EDGES:
            raise SchedulerProtocolError(request_id, now, event)
        return EDGES[now, event]

    def _land(self, request_id: str, nxt: Phase | None) -> None:
        if nxt is None:
            self.reqs.pop(request_id, None)
        else:
            self.reqs[request_id].phase = nxt

    # -- the scheduler's calls ---------------------------------------------------------------
    def matched(
        self, request_id: str, params: object, prompt_tokens: int, computed: int
    ) -> tuple[int, bool]:
        """``get_num_new_matched_tokens``: decode loads the prompt's tokens not
        computed here, asynchronously; anything else loads nothing."""
        remote = TransferParams.from_params(request_id, params)
        if remote is None or self.phase(request_id) not in (None, Phase.ASKED):
            return 0, False
        count = prompt_tokens - computed
        if count <= 0:
            return 0, False
        nxt = self._move(request_id, "match")
        self.reqs.setdefault(request_id, _Req(Phase.ASKED, remote.room, remote.epoch))
        self.reqs[request_id].remote = remote
        self.reqs[request_id].skip = computed
        self._land(request_id, nxt)
        return count, True

    def allocated(
        self, request_id: str, block_ids: Sequence[Sequence[int]], external_tokens: int
    ) -> None:
        """``update_state_after_alloc``: the blocks the load lands in. Called for a
        request this side never offered a load (or with no external tokens):
        nothing to do."""
        if self.phase(request_id) is not Phase.ASKED or external_tokens <= 0:
            return
        nxt = self._move(request_id, "alloc")
        self.reqs[request_id].blocks = tuple(tuple(int(b) for b in g) for g in block_ids)
        self._land(request_id, nxt)
        self._meta.append(request_id)

    def finished(
        self, request_id: str, params: object, block_ids: Sequence[Sequence[int]], normal: bool
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished``: (whether vLLM must keep the blocks until the
        workers report the request, the params for the request's output).
        ``normal``: it finished by length or stop (not aborted)."""
        now = self.phase(request_id)
        if now is not None:  # decode: a load offered, planned, in flight
            nxt = self._move(request_id, "finish")
            room = self.reqs[request_id].room
            self._land(request_id, nxt)
            if nxt is Phase.DRAINING:
                self._aborts[request_id] = room
                return True, None
            if request_id in self._meta:
                self._meta.remove(request_id)
            return False, None
        if not (isinstance(params, Mapping) and params.get("do_remote_decode")) or not normal:
            return False, None
        blocks = tuple(tuple(int(b) for b in g) for g in block_ids)
        if not any(blocks):
            return False, None
        nxt = self._move(request_id, "hold")
        room = room_of(request_id)
        self.reqs[request_id] = _Req(Phase.HELD, room, 0, blocks)
        self._land(request_id, nxt)
        self._meta.append(request_id)
        engine_id, host, port, tp = self.me
        return True, TransferParams.answer(room, 0, engine_id, request_id, host, port, tp, blocks)

    def build_meta(self) -> Meta:
        """``build_connector_meta``: the loads and sends planned since the last
        step, and the loads given up while in flight."""
        loads: dict[str, Load] = {}
        sends: dict[str, Send] = {}
        for rid in self._meta:
            r = self.reqs[rid]
            nxt = self._move(rid, "meta")
            if r.phase is Phase.PLANNED:
                assert r.remote is not None
                loads[rid] = Load(r.room, r.epoch, r.blocks, r.remote, r.skip)
            else:
                sends[rid] = Send(r.room, r.epoch, r.blocks)
            self._land(rid, nxt)
        aborts, self._meta, self._aborts = self._aborts, [], {}
        return Meta(loads, sends, aborts)

    def workers_report(
        self, sending: set[str] | None, recving: set[str] | None, failed: set[str] | None = None
    ) -> None:
        """``update_connector_output``: the requests every worker finished
        (sending: a prefill's send ended, or a load's blocks drained after it
        was aborted or failed; receiving: a load ended; failed: the loads among
        them that failed). A report for a request not held is stale (vLLM
        reports it once; this side may have forgotten it): ignored."""
        for rid in sorted(failed or ()):
            if self.phase(rid) in (Phase.LOADING, Phase.DRAINING):
                nxt = self._move(rid, "failed")
                if nxt is Phase.QUARANTINED:
                    self._hold.append(self.reqs[rid].blocks[0])
                self._land(rid, nxt)
        for rid in sorted(recving or ()):
            if self.phase(rid) in (Phase.LOADING, Phase.DRAINING, Phase.QUARANTINED):
                self._land(rid, self._move(rid, "received"))
        for rid in sorted(sending or ()):
            ph = self.phase(rid)
            if ph is Phase.SENDING:
                self._land(rid, self._move(rid, "sent"))
            elif ph in (Phase.DRAINING, Phase.QUARANTINED):
                if ph is Phase.QUARANTINED:
                    self._release.append(self.reqs[rid].blocks[0])
                self._land(rid, self._move(rid, "drained"))

    def take_holds(self) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """(block ids to take a hold on, block ids to let go of) since the last
        call, for the driver to apply to vLLM's block pool, holds first."""
        out = (self._hold, self._release)
        self._hold, self._release = [], []
        return out


def _check_declaration() -> None:
    """Every phase is entered and left; every event names a scheduler call."""
    entered = {n for n in EDGES.values() if n is not None}
    left = {p for p, _ in EDGES if p is not None}
    if entered != set(Phase) or left != set(Phase):
        raise AssertionError(f"EDGES: phases never entered or left: {set(Phase) ^ entered}")
    events = {e for _, e in EDGES}
    if events != {
        "match",
        "alloc",
        "finish",
        "meta",
        "received",
        "failed",
        "drained",
        "hold",
        "sent",
    }:
        raise AssertionError(f"EDGES: unexpected events {sorted(events)}")


_check_declaration()
