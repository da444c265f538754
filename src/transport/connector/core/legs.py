"""One request's peers on the connector: a :class:`Leg` per peer rank, and
the :class:`Request` that holds them with the rest of its bookkeeping.

What both sides keep is in :class:`Leg` and :class:`Request`; what only one
side keeps is in its own subclass. On prefill, a :class:`PrefillLeg` per
decode rank that registers the request: where that rank said to write, and
how far this rank has written there (a :class:`PrefillRequest` holds the
pages and rows handed to ``send()``). On decode, a :class:`DecodeLeg` per
prefill rank the request was registered with: its senders, and the idle
prefill ranks it informs (see :mod:`transport.topology`); a
:class:`DecodeRequest` knows its prefill DP group and its staging. What moves
along a prefill leg (:func:`kv_writes`) is checked first to name only rows
and pages the buffers at both ends hold (:func:`refs_misfit`,
:func:`rows_misfit`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs
import numpy as np
from numpy.typing import NDArray

from buffers.kv_args import KVArgs
from lifecycle.reasons import FailureReason
from lifecycle.rules.kernel import Kernel
from transport.layout import Writes, page_writes, sliced_page_writes
from transport.topology import Slice

if TYPE_CHECKING:
    from transport.connector.core.messages import Incoming
    from transport.staging import Scatter

__all__ = [
    "Leg",
    "PrefillLegPhase",
    "DecodeLegPhase",
    "PREFILL_LEG_EDGES",
    "DECODE_LEG_EDGES",
    "LEG_KERNELS",
    "leg_diagrams",
    "PrefillLeg",
    "DecodeLeg",
    "Request",
    "PrefillRequest",
    "DecodeRequest",
    "describe",
    "leg_of",
    "kv_writes",
    "rows_of",
    "refs_misfit",
    "rows_misfit",
]

L = TypeVar("L", bound="Leg")


# -- each side's view of a leg, declared as a machine on the graph kernel ---------------------
class PrefillLegPhase(enum.IntEnum):
    """Where a prefill rank's leg to a decode rank stands."""

    Planned = 0  # known from the first register (of this or another decode rank)
    Registered = 1  # its decode rank registered the request
    Told = 2  # its decode rank said where to write
    Out = 3  # every write it owes is issued (pages, fields, state rows; the room aside)
    Verified = 4  # its decode rank said the bytes matched the digest
    Stopping = 5  # its decode rank aborted: it is told "stopped" once nothing is in flight


class DecodeLegPhase(enum.IntEnum):
    """Where a decode rank's leg to a prefill rank (a sender, or one it informs) stands."""

    Open = 0  # the sender may still write
    Stopped = 1  # it can write nothing more here (it stopped or failed, or was never told)
    Done = 2  # it said every write landed


@attrs.frozen
class LegEdge:
    trigger: str
    sources: tuple[enum.IntEnum, ...]
    dest: enum.IntEnum
    doc: str = ""


_PL, _DL = PrefillLegPhase, DecodeLegPhase
#: prefill's legs: each word of its decode rank (and its own writes) moves one on
PREFILL_LEG_EDGES: tuple[LegEdge, ...] = (
    LegEdge("register", (_PL.Planned,), _PL.Registered, "the decode rank registered it"),
    LegEdge("pages", (_PL.Registered,), _PL.Told, "the decode rank said where to write"),
    LegEdge("out", (_PL.Told,), _PL.Out, "every write the leg owes is issued"),
    LegEdge("verified", (_PL.Out,), _PL.Verified, "the decode rank's bytes matched"),
    LegEdge(
        "ask_stop",
        (_PL.Planned, _PL.Registered, _PL.Told, _PL.Out, _PL.Verified),
        _PL.Stopping,
        "the decode rank aborted the request",
    ),
)
#: decode's legs: the sender's words
DECODE_LEG_EDGES: tuple[LegEdge, ...] = (
    LegEdge("stop", (_DL.Open,), _DL.Stopped, "the sender stopped, failed, or was never told"),
    LegEdge("done", (_DL.Open, _DL.Stopped), _DL.Done, "the sender said every write landed"),
)
LEG_KERNELS: dict[str, Kernel[Any]] = {
    "prefill": Kernel(PrefillLegPhase, PREFILL_LEG_EDGES, (_PL.Stopping,)),
    "decode": Kernel(DecodeLegPhase, DECODE_LEG_EDGES, (_DL.Done,)),
}
_REGISTERED = frozenset({_PL.Registered, _PL.Told, _PL.Out, _PL.Verified})
_TOLD = frozenset({_PL.Told, _PL.Out, _PL.Verified})
_OUT = frozenset({_PL.Out, _PL.Verified})


def _move(kernel: Kernel[Any], phase: int, trigger: str) -> int:
    """Where ``trigger`` takes a leg at ``phase`` (-1: nowhere: a word said twice)."""
    return int(kernel.dest[kernel.trigger_id[trigger], phase])


def _check_legs() -> None:
    phases: tuple[type[enum.IntEnum], ...] = (PrefillLegPhase, DecodeLegPhase)
    for role, edges, states in zip(
        ("prefill", "decode"), (PREFILL_LEG_EDGES, DECODE_LEG_EDGES), phases
    ):
        k = LEG_KERNELS[role]
        if k.reachable(states(0)) != set(states):
            raise AssertionError(f"{role} legs: a phase no word reaches")
        if any(not e.doc for e in edges):
            raise AssertionError(f"{role} legs: every edge says what moves it")


_check_legs()


def leg_diagrams(fmt: str) -> str:
    """Each side's leg machine as a mermaid or dot diagram (``pdlife diagram --protocol``)."""
    out = []
    for role, k in LEG_KERNELS.items():
        first = k.states(0)
        title = f"connector {role} leg (one per peer rank of a request)"
        out.append(k.diagram(fmt, f"{role}_leg", title, first, label=lambda a: f"{a.trigger}"))
    return "".join(out)


@attrs.define(eq=False)
class Leg:
    peer: int  # the peer rank's global id (DP group x TP size + TP rank)
    sends: bool  # data moves on this leg (an idle prefill rank's leg moves none)
    primary: bool = False  # the metadata row (and whole state rows) move on this leg
    state: bool = False  # state rows (whole, or a share of split ones) move on this leg
    src_head: int = 0
    dst_head: int = 0
    count: int = 0
    #: the peer's incarnation this leg was registered with (None: not yet)
    inc: int | None = None

    @property
    def slice(self) -> tuple[int, int, int] | None:
        return (self.src_head, self.dst_head, self.count) if self.sends else None

    @classmethod
    def of(cls: type[L], peer: int, s: Slice | None, state: bool = False) -> L:
        """A leg to ``peer``: the KV slice it carries (None: no KV), and whether state
        rows move on it (the primary leg's always do)."""
        if s is None:
            return cls(peer, sends=False, state=state)
        return cls(peer, True, s.primary, state or s.primary, s.src_head, s.dst_head, s.count)


@attrs.define(eq=False)
class PrefillLeg(Leg):
    """A prefill rank's leg to a decode rank: where it said to write, what went."""

    #: where the leg stands (:class:`PrefillLegPhase`); moved by :meth:`move` alone
    phase: int = int(PrefillLegPhase.Planned)
    dst_pages: NDArray[np.int64] | None = None
    dst_slot: int = -1
    skip: int = 0  # leading pages decode already holds (a cached prefix)
    dst_ptrs: list[int] | None = None  # a staging region; None: the peer's KV buffers
    dst_heads: int = 0
    dst_state: list[NDArray[np.int64]] | None = None
    issued: int = 0  # this request's source pages written (or skipped) so far
    verify: bool = False  # the decode rank asked for a digest: it says whether it matched
    pending: Any = None  # the digest of its bytes being hashed (a transport.digest.Pending)

    def move(self, trigger: str) -> bool:
        """Take ``trigger`` (see :data:`PREFILL_LEG_EDGES`); False where it is not
        declared from here (a word said twice moves nothing)."""
        dest = _move(LEG_KERNELS["prefill"], self.phase, trigger)
        if dest >= 0:
            self.phase = dest
        return dest >= 0

    @property
    def registered(self) -> bool:
        return self.phase in _REGISTERED

    @property
    def told(self) -> bool:
        """The decode rank said where to write."""
        return self.phase in _TOLD

    @property
    def fields_out(self) -> bool:
        return self.phase in _OUT

    @property
    def verified(self) -> bool:
        return self.phase == _PL.Verified

    @property
    def asked_stop(self) -> bool:
        """The decode rank aborted: it is told "stopped"."""
        return self.phase == _PL.Stopping


@attrs.define(eq=False)
class DecodeLeg(Leg):
    """A decode rank's leg to a prefill rank: what that sender said."""

    #: where the leg stands (:class:`DecodeLegPhase`); moved by :meth:`move` alone
    phase: int = int(DecodeLegPhase.Open)
    digest: Any = None  # the transport.digest.LegDigest its "done" carried (None: none)
    pending: Any = None  # the digest of its bytes here, being hashed (transport.digest.Pending)
    progress: Any = None  # its pages hashed as they land (transport.digest.Progress)

    def move(self, trigger: str) -> bool:
        """Take ``trigger`` (see :data:`DECODE_LEG_EDGES`); False where it is not declared."""
        dest = _move(LEG_KERNELS["decode"], self.phase, trigger)
        if dest >= 0:
            self.phase = dest
        return dest >= 0

    @property
    def done(self) -> bool:
        return self.phase == _DL.Done

    @property
    def stopped(self) -> bool:
        """It can write nothing more here."""
        return self.phase != _DL.Open


class Request(Generic[L]):
    """One request's bookkeeping; its phase and clocks live in the manager's columns."""

    def __init__(self, room: int, index: int) -> None:
        self.room, self.index = room, index
        self.legs: dict[int, L] = {}  # peer rank -> leg, once known
        #: pages of the request (prefill: handed over at most; decode: told to prefill)
        self.num_pages = -1
        self.tokens: list[Any] = []  # the engine's handles of writes in flight
        self.cleared = self.released = False
        self.reason = FailureReason.NONE  # why it failed here, told to every leg
        #: the attempt: every message about it carries this, and one of another
        #: attempt is never applied to it (see Hub._handle)
        self.epoch = 0


class PrefillRequest(Request[PrefillLeg]):
    """A request on prefill: the pages and rows handed to ``send()``."""

    def __init__(self, room: int, index: int) -> None:
        super().__init__(room, index)
        self.local_slot = -1  # its metadata row here
        self.src = np.empty(0, dtype=np.int64)  # pages handed to send() so far
        #: the page send()'s pages start at (before it: -1, a prefix never handed)
        self.first_page = 0
        self.src_state: list[NDArray[np.int64]] | None = None
        self.sent = False  # send() was called (init(0)'s state rows come with it)
        self.decode_tp = 0  # the registering decode group's TP size
        self.held: list[Incoming] = []  # page lists that overtook a register
        #: released at the drain timeout with writes the engine never finished
        self.abandoned = False


class DecodeRequest(Request[DecodeLeg]):
    """A request on decode: the prefill DP group it pairs with, and its staging."""

    def __init__(self, room: int, index: int) -> None:
        super().__init__(room, index)
        self.dp = 0  # the prefill DP group it pairs with
        self.want_register = False  # init() named the group: register once it is known
        self.staged = False  # lands in staging, then scatters
        self.scatter: Scatter | None = None
        self.why: str | None = None  # a misfit it was refused for, told to prefill
        #: where its data goes, as told to prefill (the digest is checked there)
        self.pages = np.empty(0, dtype=np.int64)
        self.slot = -1
        self.rows: list[NDArray[np.int64]] | None = None

    def senders(self) -> list[DecodeLeg]:
        """The legs data comes from: KV, or a share of split state."""
        return [leg for leg in self.legs.values() if leg.sends or leg.state]


def leg_of(peer: int, s: Slice | None, state: bool = False) -> PrefillLeg:
    """A prefill rank's leg to decode rank ``peer`` (see :meth:`Leg.of`): what
    :func:`kv_writes` writes along."""
    return PrefillLeg.of(peer, s, state)


def kv_writes(
    local: KVArgs,
    info: dict[str, Any],
    leg: PrefillLeg,
    src: NDArray[np.int64],
    dst: NDArray[np.int64],
) -> Writes:
    """Local pages ``src`` to the leg's pages ``dst``: whole pages when both sides
    hold exactly the leg's heads in the peer's own KV buffers (and in one head
    group: pages cut in several are written group by group), head slices else.
    A staging block (``leg.dst_ptrs``) holds the leg's heads alone: they start
    at its head 0, whichever heads of decode's pages they are."""
    whole = leg.count == local.kv_head_num == leg.dst_heads and leg.dst_ptrs is None
    if whole and local.head_groups == 1:
        return page_writes(local, info, src, dst)
    ptrs, at = (info["kv_ptrs"], leg.dst_head) if leg.dst_ptrs is None else (leg.dst_ptrs, 0)
    lens = info.get("kv_lens") if leg.dst_ptrs is None else None
    heads = (leg.src_head, at, leg.count)
    return sliced_page_writes(local, ptrs, leg.dst_heads, src, dst, *heads, dst_lens=lens)


def rows_of(
    room: int, state_indices: Any, components: int, what: str
) -> list[NDArray[np.int64]] | None:
    """State rows as one int64 array per state component: None, one array for
    every component, or a sequence of ``components`` arrays."""
    if state_indices is None:
        return None
    if components == 0:
        raise ValueError(f"room={room}: {what} given, but no state component is registered")
    if isinstance(state_indices, Sequence) and state_indices and not np.isscalar(state_indices[0]):
        rows = [np.asarray(r, dtype=np.int64).reshape(-1) for r in state_indices]
        if len(rows) != components:
            raise ValueError(
                f"room={room}: {what} has {len(rows)} arrays for {components} state components"
            )
    else:
        rows = [np.asarray(state_indices, dtype=np.int64).reshape(-1)] * components
    if any((r < 0).any() for r in rows):
        raise ValueError(f"room={room}: {what} holds a negative row")
    return rows


def _count(lens: Any, items: Any) -> int | None:
    """How many pages (or rows) every buffer holds; None if not known (an older peer)."""
    if not lens or not items:
        return None
    return min(int(b) // int(i) for b, i in zip(lens, items))


def refs_misfit(
    local: KVArgs,
    rank: int,
    req: PrefillRequest,
    leg: PrefillLeg,
    info: dict[str, Any],
    new: NDArray[np.int64],
) -> str | None:
    """Why a page or metadata row named for ``leg`` lies outside the buffers it
    indexes on prefill rank ``rank`` (``new``: the pages about to go) or on the
    leg's decode rank (``info``: its endpoint record), or None. A stale,
    consumed or unknown reference is never written."""
    here = f"prefill rank {rank}"
    refs = [
        ("page", new, _count(local.kv_data_lens, local.kv_item_lens), here),
        (
            "metadata slot",
            np.array([req.local_slot]),
            _count(local.aux_data_lens, local.aux_item_lens),
            here,
        ),
    ]
    there = f"decode rank {leg.peer}"
    if leg.issued == 0 and leg.dst_pages is not None and leg.dst_ptrs is None and leg.sends:
        refs.append(
            ("page", leg.dst_pages, _count(info.get("kv_lens"), info["kv_item_lens"]), there)
        )
    if leg.primary:
        rows = _count(info.get("aux_lens"), info["aux_item_lens"])
        refs.append(("metadata slot", np.array([leg.dst_slot]), rows, there))
    for what, named, count, who in refs:
        bad = named[
            (named < -1) | (named >= (count if count is not None else np.iinfo(np.int64).max))
        ]
        if what == "page":
            bad = np.concatenate((bad, named[named == -1]))
        if bad.size:
            return (
                f"{what} {int(bad[0])} is outside the {count} that {who} holds "
                "(a stale or unknown reference); nothing of the request is written"
            )
    return None


def rows_misfit(req: PrefillRequest, leg: PrefillLeg) -> str | None:
    """Why the state rows handed to send() do not pair one to one with those the
    leg's decode rank gave, or None (more rows would run past decode's own)."""
    if not leg.state or req.src_state is None or leg.dst_state is None:
        return None
    for c, (src, dst) in enumerate(zip(req.src_state, leg.dst_state)):
        if src.size != dst.size:
            return (
                f"{src.size} state rows of component {c} were handed to send(), but decode "
                f"rank {leg.peer} gave {dst.size}; give both sides one row per state row"
            )
    return None


_FLAGS = ("registered", "told", "done", "stopped", "asked_stop")


def describe(req: Request[Any], phase: str, status: str) -> str:
    """One line on where a request stands with each peer (for a stuck report)."""
    legs = []
    for leg in req.legs.values():
        flags = ",".join(f for f in _FLAGS if getattr(leg, f, False)) or "-"
        kind = "primary" if leg.primary else "sends" if leg.sends else "informed"
        legs.append(f"{leg.peer}({kind}: {flags})")
    return (
        f"room={req.room} phase {phase}, status {status}, {len(req.tokens)} write(s) in "
        f"flight, legs {' '.join(legs) or 'none planned'}"
    )
