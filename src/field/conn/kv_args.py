"""The field's KV-args bag: built empty, filled in field by field."""

from __future__ import annotations

from typing import Any

from buffers.kv_args import KVArgs as CoreKVArgs
from buffers.kv_args import StateComponent, StateType

__all__ = ["KVArgs"]


class KVArgs:
    """What a transfer engine needs to know about this rank's memory.

    ``KVArgs()`` takes no arguments; the engine assigns the fields it knows.
    :meth:`to_core` checks them (parallel lists, whole rows) and returns the
    frozen :class:`buffers.KVArgs` our backends take.
    """

    def __init__(self) -> None:
        self.engine_rank = 0
        self.kv_data_ptrs: list[int] = []
        self.kv_data_lens: list[int] = []
        self.kv_item_lens: list[int] = []
        self.aux_data_ptrs: list[int] = []
        self.aux_data_lens: list[int] = []
        self.aux_item_lens: list[int] = []
        self.state_types: list[Any] = []
        self.state_data_ptrs: list[list[int]] = []
        self.state_data_lens: list[list[int]] = []
        self.state_item_lens: list[list[int]] = []
        self.state_dim_per_tensor: list[list[int]] = []
        self.is_hybrid_mla_backend = False
        self.ib_device: str | None = None
        self.ib_traffic_class: str | None = None
        self.gpu_id = 0
        self.decode_tp_size = 1
        self.kv_head_num = 1
        self.page_size = 1
        self.prefill_pp_size = 1
        self.pp_rank = 0
        self.prefill_start_layer = 0
        self.system_dp_rank = 0

    def to_core(self) -> CoreKVArgs:
        dims = self.state_dim_per_tensor or [[] for _ in self.state_types]
        state = tuple(
            StateComponent(
                t if isinstance(t, StateType) else StateType(getattr(t, "value", t)),
                ptrs,
                lens,
                items,
                dim or None,
            )
            for t, ptrs, lens, items, dim in zip(
                self.state_types,
                self.state_data_ptrs,
                self.state_data_lens,
                self.state_item_lens,
                dims,
            )
        )
        return CoreKVArgs(
            engine_rank=int(self.engine_rank),
            kv_data_ptrs=self.kv_data_ptrs,
            kv_data_lens=self.kv_data_lens,
            kv_item_lens=self.kv_item_lens,
            aux_data_ptrs=self.aux_data_ptrs,
            aux_data_lens=self.aux_data_lens,
            aux_item_lens=self.aux_item_lens,
            state=state,
            page_size=int(self.page_size),
            ib_device=self.ib_device,
            kv_head_num=int(self.kv_head_num),
        )
