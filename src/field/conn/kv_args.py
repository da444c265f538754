"""The field's KV-args bag: built empty, filled in field by field."""

from __future__ import annotations

from typing import Any

from buffers.kv_args import KVArgs as CoreKVArgs
from buffers.kv_args import StateComponent
from field._checks import int_or_raw
from field.data.state_types import core_state_type

__all__ = ["KVArgs"]


class KVArgs:
    """What a transfer engine needs to know about this rank's memory.

    ``KVArgs()`` takes no arguments; the engine assigns the fields it knows.
    Every field of 0.5.23's ``KVArgs`` is here under its name, with 0.5.23's
    default where it has one (``kv_layout``, the ``host_*`` lists,
    ``num_draft_entries``); the seed's fields that 0.5.23 dropped
    (``ib_traffic_class``, ``decode_tp_size``, ``prefill_pp_size``) are kept.

    Unlike the field, whose fields without a default are unset until
    assigned (reading one raises AttributeError), every field here starts at
    an empty value (0, an empty list, None). :meth:`to_core` checks them
    (parallel lists, whole rows) and returns the frozen
    :class:`buffers.KVArgs` our backends take.
    """

    engine_rank: int
    kv_data_ptrs: list[int]
    kv_data_lens: list[int]
    kv_item_lens: list[int]
    kv_layer_ids: list[int]
    kv_cache_dtype_str: str
    kv_layout: str | None = None
    host_kv_data_ptrs: list[int] | None = None
    host_kv_data_lens: list[int] | None = None
    host_kv_item_lens: list[int] | None = None
    host_state_data_ptrs: list[list[int]] | None = None
    host_state_data_lens: list[list[int]] | None = None
    host_state_item_lens: list[list[int]] | None = None
    aux_data_ptrs: list[int]
    aux_data_lens: list[int]
    aux_item_lens: list[int]
    state_types: list[Any]
    state_data_ptrs: list[list[int]]
    state_data_lens: list[list[int]]
    state_item_lens: list[list[int]]
    state_layer_ids: list[list[int]]
    state_dim_per_tensor: list[list[int]]
    state_slice_outer_counts: list[list[int]]
    is_hybrid_mla_backend: bool
    state_conv_shard_groups: list[list[list[int] | None]]
    swa_kv_cache_layout: str | None
    ib_device: str | None
    gpu_id: int
    kv_head_num: int
    total_kv_head_num: int
    page_size: int
    system_dp_rank: int
    rust_http_port: int | None
    pp_rank: int
    prefill_start_layer: int
    prefill_end_layer: int | None
    mla_compression_ratios: list[int] | None
    kv_buf_groups: int
    hidden_kv_layers: int
    draft_kv_layers: int
    num_draft_entries: int = 0
    # the seed's, no longer in 0.5.23
    ib_traffic_class: str | None
    decode_tp_size: int
    prefill_pp_size: int

    def __init__(self) -> None:
        self.engine_rank = 0
        self.kv_data_ptrs = []
        self.kv_data_lens = []
        self.kv_item_lens = []
        self.kv_layer_ids = []
        self.kv_cache_dtype_str = ""
        self.aux_data_ptrs = []
        self.aux_data_lens = []
        self.aux_item_lens = []
        self.state_types = []
        self.state_data_ptrs = []
        self.state_data_lens = []
        self.state_item_lens = []
        self.state_layer_ids = []
        self.state_dim_per_tensor = []
        self.state_slice_outer_counts = []
        self.is_hybrid_mla_backend = False
        self.state_conv_shard_groups = []
        self.swa_kv_cache_layout = None
        self.ib_device = None
        self.gpu_id = 0
        self.kv_head_num = 1
        self.total_kv_head_num = 1
        self.page_size = 1
        self.system_dp_rank = 0
        self.rust_http_port = None
        self.pp_rank = 0
        self.prefill_start_layer = 0
        self.prefill_end_layer = None
        self.mla_compression_ratios = None
        self.kv_buf_groups = 1
        self.hidden_kv_layers = 0
        self.draft_kv_layers = 0
        self.ib_traffic_class = None
        self.decode_tp_size = 1
        self.prefill_pp_size = 1

    def to_core(self) -> CoreKVArgs:
        """The frozen :class:`buffers.KVArgs` of these fields. Integers of any
        kind (numpy, 0-d tensors) become ints; anything else (a float or a
        string rank) is handed on as it is, and the core refuses it by name
        with :class:`~buffers.errors.BadSettingType` (a TypeError). Nothing
        here changes either way."""
        dims = self.state_dim_per_tensor or [[] for _ in self.state_types]
        state = tuple(
            StateComponent(
                core_state_type(t),
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
            engine_rank=int_or_raw(self.engine_rank),
            kv_data_ptrs=self.kv_data_ptrs,
            kv_data_lens=self.kv_data_lens,
            kv_item_lens=self.kv_item_lens,
            aux_data_ptrs=self.aux_data_ptrs,
            aux_data_lens=self.aux_data_lens,
            aux_item_lens=self.aux_item_lens,
            state=state,
            page_size=int_or_raw(self.page_size),
            ib_device=self.ib_device,
            kv_head_num=int_or_raw(self.kv_head_num),
        )
