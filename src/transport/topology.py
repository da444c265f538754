"""Who sends which KV heads to whom when prefill and decode TP sizes differ.

Theory of operation
-------------------
A model has ``kv_heads`` KV heads. A TP group of size ``tp`` splits them
evenly: rank *r* holds ``kv_heads // tp`` consecutive heads; when ``tp`` is
larger than ``kv_heads`` each head is replicated on ``tp // kv_heads``
consecutive ranks. A decode rank hears from every prefill rank that holds
some of its heads (one holder per head, spread over the replicas), each
sending the overlap: a :class:`Slice`. The first slice of a decode rank is
its *primary*: that prefill rank also writes the metadata row and the
per-request state rows that every rank holds whole. State that TP splits
(``split_state``: a mamba state's heads, say) is cut like the heads: a TP
group of size ``tp`` gives rank *r* the share ``[r/tp, (r+1)/tp)`` of each
row's outermost dimension, and every prefill rank whose share overlaps a
decode rank's writes that overlap to it (:meth:`Topology.state_sources`).

With MLA every rank holds the same latent KV: decode rank *d* hears from
prefill rank ``d % prefill_tp`` alone and gets whole pages.

A prefill rank that writes nothing to any decode rank (more prefill than
decode ranks under MLA, or replicated heads, and no share of split state)
still takes part: decode rank ``p % decode_tp`` registers the request with
it (its *informer*), so that it leaves Bootstrapping and reports Success
with the others.

Everything here is pure and deterministic: both sides compute the same
answer from the same five values.
"""

from __future__ import annotations

import functools

import attrs

from buffers.checks import Checks
from transport.errors import ConfigError, ConfigTypeError, TransportError

__all__ = [
    "TopologyError",
    "TopologySettingError",
    "TopologySettingTypeError",
    "Slice",
    "Topology",
    "head_range",
]


class TopologyError(TransportError, ValueError):
    """The two sides' TP sizes and head counts do not fit together."""


class TopologySettingError(TopologyError, ConfigError):
    """A :class:`Topology` field out of range, or fields that do not fit
    together, named with what it accepts."""


class TopologySettingTypeError(TopologySettingError, ConfigTypeError):
    """A :class:`Topology` field of the wrong type (also a TypeError)."""


_C = Checks(TopologySettingError, TopologySettingTypeError)


def head_range(tp_size: int, tp_rank: int, total_heads: int) -> range:
    """The global KV heads rank ``tp_rank`` of a TP group of ``tp_size`` holds."""
    if not 0 <= tp_rank < tp_size:
        raise TopologyError(f"TP rank {tp_rank} is outside a TP group of size {tp_size}")
    if total_heads < 1:
        raise TopologyError(f"a model needs at least one KV head, got {total_heads}")
    if tp_size <= total_heads:
        if total_heads % tp_size:
            raise TopologyError(
                f"{total_heads} KV heads do not split over TP size {tp_size}; "
                "use a TP size that divides the head count (or a multiple of it)"
            )
        n = total_heads // tp_size
        return range(tp_rank * n, (tp_rank + 1) * n)
    if tp_size % total_heads:
        raise TopologyError(
            f"TP size {tp_size} is not a multiple of the {total_heads} KV heads it replicates"
        )
    h = tp_rank * total_heads // tp_size
    return range(h, h + 1)


@attrs.frozen
class Slice:
    """Prefill rank ``prefill`` sends heads ``[src_head, src_head + count)`` of its
    own to heads ``[dst_head, dst_head + count)`` of decode rank ``decode``."""

    prefill: int
    decode: int
    src_head: int
    dst_head: int
    count: int
    primary: bool


@attrs.frozen
class Topology:
    prefill_tp: int = attrs.field(validator=_C.integer(1))
    decode_tp: int = attrs.field(validator=_C.integer(1))
    #: without MLA, a multiple or a divisor of each TP size (ignored under MLA)
    kv_heads: int = attrs.field(default=1, validator=_C.integer(1))
    mla: bool = attrs.field(default=False, validator=_C.flag())
    #: the model has per-request state that TP splits (a state component with
    #: ``split_dims``): each decode rank then takes its share of it from every
    #: prefill rank holding a part, not whole rows from its primary sender
    split_state: bool = attrs.field(default=False, validator=_C.flag())

    def __attrs_post_init__(self) -> None:
        if self.mla:  # every rank holds the one latent head: any two TP sizes fit
            return
        h, pt, dt = self.kv_heads, self.prefill_tp, self.decode_tp
        bad = [f"TP size {tp} ({name})" for name, tp in (("prefill_tp", pt), ("decode_tp", dt))
               if (h % tp if tp <= h else tp % h)]  # fmt: skip
        if bad:
            _C.fail(
                self,
                "kv_heads",
                h,
                f"a head count that can be split over {' and '.join(bad)}: a multiple of the TP "
                "size, or a divisor of it (each head then replicated)",
            )

    def heads(self, role: str, tp_rank: int) -> range:
        """The global heads a rank holds (MLA: the one latent, head 0). A role
        other than "prefill" or "decode" raises :class:`TopologySettingError`
        (a :class:`TopologyError` and a ValueError; for a value that is not a
        string, :class:`TopologySettingTypeError`, also a TypeError)."""
        if role != "prefill" and role != "decode":
            error = TopologySettingError if isinstance(role, str) else TopologySettingTypeError
            raise error(
                "role", role, "'prefill' or 'decode' (the side the rank is on)", "Topology.heads"
            )
        if self.mla:
            return range(0, 1)
        tp = self.prefill_tp if role == "prefill" else self.decode_tp
        return head_range(tp, tp_rank, self.kv_heads)

    def senders(self, decode_rank: int) -> tuple[Slice, ...]:
        """The slices decode rank ``decode_rank`` receives, primary first."""
        return _senders(self, decode_rank)

    def targets(self, prefill_rank: int) -> tuple[Slice, ...]:
        """The slices prefill rank ``prefill_rank`` sends, by decode rank."""
        if not 0 <= prefill_rank < self.prefill_tp:
            raise TopologyError(f"prefill rank {prefill_rank} is outside TP {self.prefill_tp}")
        return tuple(
            s for d in range(self.decode_tp) for s in self.senders(d) if s.prefill == prefill_rank
        )

    def state_sources(self, decode_rank: int) -> tuple[int, ...]:
        """The prefill ranks that write decode rank ``decode_rank``'s state rows:
        its primary sender (whole rows), or, with ``split_state``, every prefill
        rank whose share of the split state overlaps this rank's."""
        if not self.split_state:
            return (self.senders(decode_rank)[0].prefill,)
        pt, dt, d = self.prefill_tp, self.decode_tp, decode_rank
        return tuple(p for p in range(pt) if p * dt < (d + 1) * pt and (p + 1) * dt > d * pt)

    def _writes(self, prefill_rank: int) -> bool:
        """Prefill rank ``prefill_rank`` writes something: KV heads or state."""
        return bool(self.targets(prefill_rank)) or (
            self.split_state
            and any(prefill_rank in self.state_sources(d) for d in range(self.decode_tp))
        )

    def contacts(self, decode_rank: int) -> tuple[int, ...]:
        """Every prefill rank decode rank ``decode_rank`` registers a request with:
        its senders, the other ranks holding part of its split state, then the
        idle prefill ranks it informs."""
        return _contacts(self, decode_rank)

    def peers(self, prefill_rank: int) -> tuple[int, ...]:
        """The decode ranks that register a request with prefill rank ``prefill_rank``."""
        if not 0 <= prefill_rank < self.prefill_tp:
            raise TopologyError(f"prefill rank {prefill_rank} is outside TP {self.prefill_tp}")
        return _peers(self, prefill_rank)


# every request plans its legs from these: computed once per topology and rank
@functools.lru_cache(maxsize=1024)
def _contacts(topo: Topology, decode_rank: int) -> tuple[int, ...]:
    send = [s.prefill for s in topo.senders(decode_rank)]
    state = list(topo.state_sources(decode_rank)) if topo.split_state else []
    idle = [
        p
        for p in range(topo.prefill_tp)
        if p % topo.decode_tp == decode_rank and not topo._writes(p)
    ]
    return tuple(dict.fromkeys(send + state + idle))


@functools.lru_cache(maxsize=1024)
def _peers(topo: Topology, prefill_rank: int) -> tuple[int, ...]:
    return tuple(d for d in range(topo.decode_tp) if prefill_rank in topo.contacts(d))


@functools.lru_cache(maxsize=1024)
def _senders(topo: Topology, decode_rank: int) -> tuple[Slice, ...]:
    if topo.mla:
        if not 0 <= decode_rank < topo.decode_tp:
            raise TopologyError(f"decode rank {decode_rank} is outside TP {topo.decode_tp}")
        return (Slice(decode_rank % topo.prefill_tp, decode_rank, 0, 0, 1, True),)
    mine = topo.heads("decode", decode_rank)
    out: list[Slice] = []
    h = mine.start
    while h < mine.stop:
        holders = [p for p in range(topo.prefill_tp) if h in topo.heads("prefill", p)]
        p = holders[decode_rank % len(holders)]
        theirs = topo.heads("prefill", p)
        stop = min(mine.stop, theirs.stop)
        out.append(Slice(p, decode_rank, h - theirs.start, h - mine.start, stop - h, not out))
        h = stop
    return tuple(out)
