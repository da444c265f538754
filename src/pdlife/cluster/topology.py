"""Who is who in a simulated cluster: the prefill DP groups and TP ranks, the
decode TP group, and the KV heads each rank holds.

Global ranks: prefill DP group ``g`` is ranks ``g*P .. g*P+P-1`` (``P`` the
prefill TP size), the decode group follows them. Request ``i`` is served by
prefill DP group ``i % prefill_dp``; every decode rank sees every request.

The head split is stated here independently of the transport, so that the
bytes decode checks say what the layout should be, not what the connector did.
"""

from __future__ import annotations

import attrs

__all__ = [
    "HEAD_BYTES",
    "Place",
    "heads_of",
    "place",
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
