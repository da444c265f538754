"""Which of the plan's faults a simulated rank carries: its prefill DP group's
share of the targeted faults, and the metadata faults of the decode ranks it
is the primary sender of."""

from __future__ import annotations

import attrs

from pdlife.cluster.config import SimConfig, Workload
from pdlife.cluster.plan import RankFaults
from pdlife.cluster.plan_doc import FaultPlan
from pdlife.cluster.topology import Place

__all__ = ["dp_faults", "dp_group_of", "primary_of", "rank_faults"]


def dp_group_of(cfg: SimConfig, rank: int) -> int | None:
    """The prefill DP group a rank serves; None for a decode rank (it sees all)."""
    if rank >= cfg.prefill_ranks:
        return None
    return rank // cfg.prefill


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


def rank_faults(
    cfg: SimConfig, rank: int, where: Place, work: Workload
) -> tuple[RankFaults, list[RankFaults]]:
    """The plan bound to ``rank``, and the faults it carries out for the decode
    ranks it is the primary sender of: it writes their metadata row (one row,
    so a bad one reaches every decode rank it is the primary of), for the
    requests its DP group serves (another group's it never writes)."""
    own = RankFaults(
        cfg.plan, rank, work, cfg.mode, cfg.world, cfg.abort_prob, cfg.seed, cfg.prefill_ranks
    )
    served = dp_faults(cfg, where)
    return own, [RankFaults(served, r, work) for r in primary_of(cfg, where)]
