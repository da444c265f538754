"""Who is who in a simulated cluster: the prefill DP groups and TP ranks, the
decode TP group, and the KV heads each rank holds.

Global ranks: prefill DP group ``g`` is ranks ``g*P .. g*P+P-1`` (``P`` the
prefill TP size), the decode group follows them. Request ``i`` is served by
prefill DP group ``i % prefill_dp``; every decode rank sees every request.

The head split is stated here independently of the transport, so that the
bytes decode checks say what the layout should be, not what the connector did.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from pdlife.plan import FaultPlan
    from pdlife.sim_config import SimConfig

__all__ = [
    "HEAD_BYTES",
    "Place",
    "dp_faults",
    "heads_of",
    "place",
    "primary_of",
    "topology_problem",
]

#: bytes of one KV head of one token in one layer (a latent vector under MLA)
HEAD_BYTES = 128


def heads_of(tp_size: int, tp_rank: int, total_heads: int) -> range:
    """The global KV heads TP rank ``tp_rank`` of ``tp_size`` holds: an even
    split, or, with more ranks than heads, one head replicated on
    ``tp_size // total_heads`` consecutive ranks."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is not a rank of a TP group of {tp_size}")
    if tp_size > total_heads:
        h = tp_rank * total_heads // tp_size
        return range(h, h + 1)
    per = total_heads // tp_size
    return range(tp_rank * per, (tp_rank + 1) * per)


def topology_problem(prefill_tp: int, decode_tp: int, kv_heads: int, mla: bool) -> str | None:
    """Why these sizes cannot split the KV heads evenly, or None."""
    if mla:
        return None if kv_heads == 1 else f"an MLA model has one latent KV head, not {kv_heads}"
    for name, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
        if kv_heads % tp and tp % kv_heads:
            return (
                f"{kv_heads} KV heads do not split over {name} TP {tp} "
                "(one must divide the other); choose --kv-heads accordingly"
            )
    return None


@attrs.frozen
class Place:
    """One global rank's place: its side, its DP group (prefill), its TP rank."""

    side: str  # "prefill" | "decode"
    dp_rank: int
    tp_rank: int
    tp_size: int
    group: tuple[int, ...]  # the global ranks of its TP group (its gloo group)
    dp_size: int = 1

    @property
    def name(self) -> str:
        """The group's name in reports: ``prefill``, ``decode``, or ``prefill/g`` under DP."""
        return self.side if self.dp_size == 1 else f"{self.side}/{self.dp_rank}"


def place(rank: int, prefill_tp: int, prefill_dp: int, decode_tp: int) -> Place:
    n_prefill = prefill_tp * prefill_dp
    if rank < n_prefill:
        g = rank // prefill_tp
        group = tuple(range(g * prefill_tp, (g + 1) * prefill_tp))
        return Place("prefill", g, rank % prefill_tp, prefill_tp, group, prefill_dp)
    if rank >= n_prefill + decode_tp:
        raise ValueError(f"rank {rank} is not in a cluster of {n_prefill + decode_tp} ranks")
    group = tuple(range(n_prefill, n_prefill + decode_tp))
    return Place("decode", 0, rank - n_prefill, decode_tp, group)


def primary_of(cfg: SimConfig, where: Place) -> list[int]:
    """The global decode ranks whose metadata row the rank at ``where`` writes
    (it is their primary sender, as the transport pairs them); a decode rank:
    itself."""
    from transport.topology import Topology

    if where.side == "decode":
        return [cfg.prefill_ranks + where.tp_rank]
    topo = Topology(cfg.prefill, cfg.decode, 1 if cfg.mla else cfg.total_heads, cfg.mla)
    return [
        cfg.prefill_ranks + d
        for d in range(cfg.decode)
        if topo.senders(d)[0].prefill == where.tp_rank
    ]


def dp_faults(cfg: SimConfig, where: Place) -> FaultPlan:
    """The plan's targeted faults of the requests the rank at ``where`` sees:
    under prefill DP a prefill rank sees its group's share only (a fault naming
    a room of no request stays with group 0, which reports it unfired)."""
    if where.side != "prefill" or cfg.prefill_dp == 1:
        return cfg.plan
    from pdlife.sim_config import Workload

    limit = Workload(cfg).limit  # a soak's requests never end: undo the room instead

    def group(request: int | None, room: int | None) -> int:
        i = request
        if i is None:
            i = Workload.index_of(cfg.seed, room or 0)
            if i is None or (limit is not None and i >= limit):
                i = 0
        return i % cfg.prefill_dp

    kept = tuple(f for f in cfg.plan.faults if group(f.request, f.room) == where.dp_rank)
    return attrs.evolve(cfg.plan, faults=kept)
