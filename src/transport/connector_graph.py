"""The per-request protocol of the connector, declared once.

Theory of operation
-------------------
Every transfer engine we drive (Mooncake, NIXL) is wrapped by one connector
(:mod:`transport.connector`); what a request has done on the wire is one
:class:`Phase`, and it moves only along the edges below. A prefill request
goes Bootstrap -> Handshaken (decode registered the room) -> Metadata (decode
said where to write) -> Writing (page and metadata-field writes in flight) ->
RoomWritten (every one landed; the room field, written last, in flight) ->
Done. A decode request goes Bootstrap -> Handshaken -> Metadata (it told
prefill where to write) -> Done (prefill said every byte landed).

Failure is two phases, because a request that failed may still have writes
in flight towards its pages: Aborted quarantines it until nothing more can
land, then Drained releases it. A peer whose heartbeat stopped fails its
requests the same way (reason peer dead): it may only be paused and write
again when it resumes, so they stay Aborted until it says it stopped, or
until the drain timeout, when they are released on its silence (PeerDead).
Done, Drained and PeerDead are terminal, and exactly the phases whose memory
may be reused.

Each edge names the :class:`KVPoll` it implies (``poll``): the scheduler's
status is raised to it (never lowered), and a Failed latches with the
reason given. Everything below is derived from :data:`EDGES`: the numpy
tables that drive the connector in batch, the ``transitions`` machine the
unit tests hold the tables to, and ``pdlife diagram --protocol``.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray

from lifecycle.status import KVPoll
from transport.errors import TransportError

__all__ = [
    "Phase",
    "ProtocolEdge",
    "EDGES",
    "TRIGGERS",
    "TERMINAL",
    "DEST",
    "POLL",
    "ProtocolError",
    "fire",
    "build_machine",
    "diagram",
]


class Phase(enum.IntEnum):
    Bootstrap = 0
    Handshaken = 1
    Metadata = 2
    Writing = 3
    RoomWritten = 4
    Done = 5
    Aborted = 6
    Drained = 7
    PeerDead = 8


@attrs.frozen
class ProtocolEdge:
    trigger: str
    sources: tuple[Phase, ...]
    dest: Phase
    poll: KVPoll | None = None
    doc: str = ""


P = Phase
_LIVE = (P.Bootstrap, P.Handshaken, P.Metadata, P.Writing, P.RoomWritten)

#: The one declaration; order is only for display and trigger ids.
EDGES: tuple[ProtocolEdge, ...] = (
    ProtocolEdge(
        "handshake",
        (P.Bootstrap,),
        P.Handshaken,
        KVPoll.WaitingForInput,
        "decode registered the room with prefill",
    ),
    ProtocolEdge(
        "metadata", (P.Handshaken,), P.Metadata, None, "decode's page list and slot were sent"
    ),
    ProtocolEdge("write", (P.Metadata,), P.Writing, None, "prefill issued page/field writes"),
    ProtocolEdge(
        "write_room",
        (P.Writing,),
        P.RoomWritten,
        None,
        "every write landed; the room field goes last",
    ),
    ProtocolEdge(
        "complete",
        (P.Metadata, P.RoomWritten),
        P.Done,
        KVPoll.Success,
        "the room field landed (prefill) / prefill said so (decode)",
    ),
    ProtocolEdge(
        "abort", _LIVE, P.Aborted, KVPoll.Failed, "failed here; writes may still be in flight"
    ),
    ProtocolEdge(
        "drain", (P.Aborted,), P.Drained, None, "nothing more can land: memory may be reused"
    ),
    ProtocolEdge(
        "peer_failed",
        _LIVE,
        P.Drained,
        KVPoll.Failed,
        "the peer failed it after its writes drained",
    ),
    ProtocolEdge(
        "peer_dead",
        (P.Aborted,),
        P.PeerDead,
        None,
        "failed for a peer whose heartbeat stopped, which never said it stopped "
        "writing: released on its silence at the drain timeout",
    ),
)

TRIGGERS: tuple[str, ...] = tuple(e.trigger for e in EDGES)
TRIGGER_ID: dict[str, int] = {t: i for i, t in enumerate(TRIGGERS)}
TERMINAL: frozenset[Phase] = frozenset({P.Done, P.Drained, P.PeerDead})


def _compile() -> tuple[NDArray[np.int8], NDArray[np.int8], NDArray[np.bool_]]:
    dest = np.full((len(TRIGGERS), len(Phase)), -1, dtype=np.int8)
    poll = np.full(len(TRIGGERS), -1, dtype=np.int8)
    terminal = np.zeros(len(Phase), dtype=bool)
    for i, e in enumerate(EDGES):
        dest[i, list(e.sources)] = e.dest
        poll[i] = -1 if e.poll is None else int(e.poll)
    terminal[[int(p) for p in TERMINAL]] = True
    for arr in (dest, poll, terminal):
        arr.setflags(write=False)
    return dest, poll, terminal


#: DEST[trigger, phase]: the phase it moves to, -1 where it is not declared
#: POLL[trigger]: the KVPoll it implies, -1 for none; IS_TERMINAL[phase]
DEST, POLL, IS_TERMINAL = _compile()


class ProtocolError(TransportError):
    """A request was asked to take a protocol step its phase does not allow."""

    def __init__(self, room: int, rank: int, phase: int, trigger: str) -> None:
        self.room, self.rank, self.phase, self.trigger = room, rank, phase, trigger
        allowed = [t for t in TRIGGERS if DEST[TRIGGER_ID[t], phase] >= 0]
        super().__init__(
            f"request room={room} on tp rank {rank}: protocol step {trigger!r} is not allowed "
            f"in phase {Phase(phase).name} (allowed there: {', '.join(allowed) or 'none'}). "
            "Follow the connector's order: init, then send_metadata once the handshake is done."
        )


def fire(phases: NDArray[np.integer], trigger: str) -> tuple[NDArray[np.int8], NDArray[np.bool_]]:
    """Fire ``trigger`` on every row: (new phases, illegal mask); illegal rows stay put."""
    try:
        t = TRIGGER_ID[trigger]
    except KeyError:
        raise ValueError(f"unknown protocol trigger {trigger!r}; declared: {TRIGGERS}") from None
    ph = np.asarray(phases)
    dest = DEST[t, ph]
    illegal = dest < 0
    return np.where(illegal, ph, dest).astype(np.int8, copy=False), illegal


def build_machine(model: Any, initial: Phase = Phase.Bootstrap) -> Any:
    """A ``transitions`` machine with exactly the declared edges (the reference)."""
    from transitions import Machine

    return Machine(
        model=model,
        states=Phase,
        transitions=[
            {"trigger": e.trigger, "source": list(e.sources), "dest": e.dest} for e in EDGES
        ],
        initial=initial,
        auto_transitions=False,
    )


def _check_declaration() -> None:
    if len(set(TRIGGERS)) != len(TRIGGERS):
        raise AssertionError("each protocol trigger is declared once")
    for e in EDGES:
        if any(s in TERMINAL for s in e.sources):
            raise AssertionError(f"{e.trigger}: terminal phases latch")
    reach = {P.Bootstrap}
    for _ in Phase:
        reach |= {e.dest for e in EDGES if set(e.sources) & reach}
    if reach != set(Phase):
        raise AssertionError(f"unreachable phases: {set(Phase) - reach}")


_check_declaration()


def diagram(fmt: str) -> str:
    """The per-request protocol as a mermaid or dot diagram, from :data:`EDGES`."""
    if fmt not in ("mermaid", "dot"):
        raise ValueError(f"unknown diagram format {fmt!r}; use 'mermaid' or 'dot'")
    title = "connector per-request protocol (prefill and decode)"
    if fmt == "mermaid":
        lines = ["stateDiagram-v2", f"    %% {title}", f"    [*] --> {Phase.Bootstrap.name}"]
        for e in EDGES:
            status = f" / {e.poll.name}" if e.poll is not None else ""
            lines += [f"    {s.name} --> {e.dest.name}: {e.trigger}{status}" for s in e.sources]
        lines += [f"    {p.name} --> [*]" for p in Phase if p in TERMINAL]
    else:
        lines = ["digraph protocol {", f'    label="{title}";', "    rankdir=LR;"]
        for p in Phase:
            shape = "doublecircle" if p in TERMINAL else "circle"
            lines.append(f"    {p.name} [shape={shape}];")
        for e in EDGES:
            lines += [f'    {s.name} -> {e.dest.name} [label="{e.trigger}"];' for s in e.sources]
        lines.append("}")
    return "\n".join(lines) + "\n"
