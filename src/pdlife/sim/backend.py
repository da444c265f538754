"""What a byte-moving backend is told about one simulated rank: the connector's
configuration and the KV, state and metadata buffers it registers."""

from __future__ import annotations

from typing import Any

from pdlife.cluster.config import STATE_SPLIT_BLOCKS, SimConfig
from pdlife.cluster.topology import Place
from pdlife.sim.kv_bytes import RankBytes

__all__ = ["DRAIN_TIMEOUT_S", "connector_config", "kv_args"]

DRAIN_TIMEOUT_S = 3.0


def connector_config(cfg: SimConfig, where: Place, store_addr: tuple[str, int]) -> Any:
    """The connector's configuration for one simulated rank."""
    from transport.connector.config import ConnectorConfig

    return ConnectorConfig(
        role=where.side,
        tp_rank=where.tp_rank,
        tp_size=where.tp_size,
        dp_rank=where.dp_rank,
        mla=cfg.mla,
        kv_heads=cfg.total_heads,
        staging=cfg.staging and where.side == "decode",
        staging_pages=cfg.staging_pages or cfg.max_pages,
        store_host=store_addr[0],
        store_port=store_addr[1],
        namespace=f"sim{cfg.seed}",
        bootstrap_timeout=float(cfg.pg_timeout) * 4,
        waiting_timeout=float(cfg.pg_timeout) * 4,
        # a failed request whose peer never confirmed it stopped writing (dead,
        # or an engine write that never finished) is released after this: within
        # a run's step budget, and well past a loopback write's time in flight
        drain_timeout=DRAIN_TIMEOUT_S,
        digest=cfg.digest,
    )


def kv_args(buffers: RankBytes, rank: int) -> Any:
    """The KV, state and metadata buffers global rank ``rank`` registers."""
    from buffers.kv_args import StateComponent, StateType
    from transport.layout import kv_args_for

    state: tuple[StateComponent, ...] = ()
    if buffers.state_tensors:
        ts = buffers.state_tensors
        tp = buffers.where.tp_size
        state = (
            StateComponent(
                type=StateType.MAMBA,
                ptrs=[t.data_ptr() for t in ts],
                lens=[t.nbytes for t in ts],
                item_lens=[t[0].nbytes for t in ts],
                split_dims=(
                    [tuple(b // tp for b in bs) for bs in STATE_SPLIT_BLOCKS]
                    if buffers.state_split
                    else None
                ),
            ),
        )
    return kv_args_for(
        buffers.kv,
        buffers.meta.buf_infos(),
        rank,
        page_size=buffers.page_size,
        kv_head_num=len(buffers.heads),
        state=state,
    )
