"""The field's state-component helpers (:mod:`field.utils` gives them by the engine's names).

Pools are recognised by what they declare, never by importing an engine: a
pool may list its kinds in ``pd_pool_kinds`` (e.g. ``{"swa"}``); otherwise the
names of its classes are read (an engine's ``BaseSWAKVPool`` subclass counts
as "swa" without this package importing that engine).
"""

from __future__ import annotations

from typing import Any

from buffers.errors import GeometryMismatch
from field._checks import required
from field.data.state_types import StateType

__all__ = ["is_mla_backend", "append_state_component", "setup_state_kv_args"]


_KIND_OF_CLASS = {
    "MLATokenToKVPool": "mla",
    "NPUMLATokenToKVPool": "npu_mla",
    "DSATokenToKVPool": "dsa",
    "BaseSWAKVPool": "swa",
    "HybridLinearKVPool": "hybrid_linear",
    "MiniMaxSparseKVPool": "minimax_sparse",
    "DeepSeekV4TokenToKVPool": "dsv4",
}


def _kinds(pool: Any) -> frozenset[str]:
    if pool is None:
        return frozenset()
    declared = getattr(pool, "pd_pool_kinds", None)
    if declared is not None:
        return frozenset(declared)
    return frozenset(
        _KIND_OF_CLASS[c.__name__] for c in type(pool).__mro__ if c.__name__ in _KIND_OF_CLASS
    )


def is_mla_backend(target_kv_pool: Any) -> bool:
    """True for an MLA pool (DeepSeek-V4 pools included)."""
    return bool(_kinds(target_kv_pool) & {"mla", "npu_mla", "dsa", "dsv4"})


def append_state_component(
    kv_args: Any,
    state_type: StateType,
    data_ptrs: list[int],
    data_lens: list[int],
    item_lens: list[int],
    dim_per_tensor: list[int] | None = None,
    conv_shard_groups: list[list[int] | None] | None = None,
    slice_outer_counts: list[int] | None = None,
    layer_ids: list[int] | None = None,
) -> None:
    """Append one state component to ``kv_args``'s parallel state lists (both
    sides must append in the same order). 0.5.23's three extra lists (conv
    shard groups, slice outer counts, layer ids) are appended to where
    ``kv_args`` has them, and, where it has them not, kept only when given."""
    kv_args.state_types.append(state_type)
    kv_args.state_data_ptrs.append(data_ptrs)
    kv_args.state_data_lens.append(data_lens)
    kv_args.state_item_lens.append(item_lens)
    kv_args.state_dim_per_tensor.append(dim_per_tensor or [])
    for name, value in (
        ("state_conv_shard_groups", conv_shard_groups),
        ("state_slice_outer_counts", slice_outer_counts),
        ("state_layer_ids", layer_ids),
    ):
        lst = getattr(kv_args, name, None)
        if lst is None and value is not None:
            lst = []
            setattr(kv_args, name, lst)
        if lst is not None:
            lst.append(value or [])


class _DraftStateMismatch(GeometryMismatch, RuntimeError):
    """A draft pool whose state cannot ride with the target's (a RuntimeError, as in the field)."""


def _has(obj: Any, name: str) -> bool:
    return obj is not None and callable(getattr(obj, name, None))


def setup_state_kv_args(
    kv_args: Any,
    token_to_kv_pool: Any,
    draft_token_to_kv_pool: Any = None,
    total_kv_layers: int | None = None,
    req_to_token_pool: Any = None,
) -> None:
    """Fill ``kv_args``'s state lists from what the pools describe of themselves.

    No ``kv_args`` (None) raises :class:`~buffers.errors.BadArgumentType` (a
    TypeError) naming it, before anything is read from the pools."""
    required("kv_args", kv_args, "the KVArgs whose state lists are filled in")
    kv_args.state_types = []
    kv_args.state_data_ptrs = []
    kv_args.state_data_lens = []
    kv_args.state_item_lens = []
    kv_args.state_dim_per_tensor = []
    for name in ("state_conv_shard_groups", "state_slice_outer_counts", "state_layer_ids"):
        if getattr(kv_args, name, None) is not None:
            setattr(kv_args, name, [])  # parallel to state_types: start empty with it
    kv_args.is_hybrid_mla_backend = False
    pool, draft = token_to_kv_pool, draft_token_to_kv_pool
    kinds, draft_kinds = _kinds(pool), _kinds(draft)

    if "minimax_sparse" in kinds:
        if getattr(pool, "index_kv_pool", None) is not None:
            raise NotImplementedError(
                "PD transfer of MiniMax sparse layers with an index value pool is not "
                "supported; only K-only sparse layers can be shipped"
            )
        if getattr(pool, "index_k_pool", None) is not None:
            append_state_component(
                kv_args, StateType.MINIMAX_INDEX_K, *pool.get_index_k_state_buf_infos()
            )
    elif _has(pool, "get_state_buf_infos"):
        ptrs, lens, items = pool.get_state_buf_infos()
        if "swa" in kinds or "dsv4" in kinds:
            append_state_component(kv_args, StateType.SWA, ptrs, lens, items)
            if getattr(pool, "_unified_kv", False) and _has(pool, "get_unified_swa_ring_buf_infos"):
                ring = pool.get_unified_swa_ring_buf_infos()
                if ring[0]:
                    append_state_component(kv_args, StateType.SWA_RING, *ring)
            if _has(pool, "get_c128_state_buf_infos"):
                c128 = pool.get_c128_state_buf_infos()
                if c128[0]:
                    append_state_component(kv_args, StateType.C128_STATE, *c128)
        elif "hybrid_linear" in kinds:
            dim = (
                pool.get_state_dim_per_tensor() if _has(pool, "get_state_dim_per_tensor") else None
            )
            kv_args.is_hybrid_mla_backend = is_mla_backend(getattr(pool, "full_kv_pool", None))
            append_state_component(kv_args, StateType.MAMBA, ptrs, lens, items, dim)
        elif kinds & {"dsa", "npu_mla"}:
            if "dsa" in draft_kinds:
                d_ptrs, d_lens, d_items = draft.get_state_buf_infos()
                ptrs, lens, items = ptrs + d_ptrs, lens + d_lens, items + d_items
            if "npu_mla" in kinds:
                kv_args.kv_buf_groups = len(kv_args.kv_data_ptrs) // pool.layer_num
                kv_args.total_kv_layers = total_kv_layers
            else:
                append_state_component(kv_args, StateType.DSA, ptrs, lens, items)

    if "dsv4" in kinds and "dsv4" in draft_kinds:
        _append_dsv4_draft(kv_args, pool, draft)

    if StateType.MAMBA not in kv_args.state_types and _has(
        req_to_token_pool, "get_state_buf_infos"
    ):
        ptrs, lens, items = req_to_token_pool.get_state_buf_infos()
        if ptrs:
            dim = (
                req_to_token_pool.get_state_dim_per_tensor()
                if _has(req_to_token_pool, "get_state_dim_per_tensor")
                else None
            )
            append_state_component(kv_args, StateType.MAMBA, ptrs, lens, items, dim)


def _append_dsv4_draft(kv_args: Any, pool: Any, draft: Any) -> None:
    """A DeepSeek-V4 draft's SWA state rides as its own component, after checks
    that its geometry is the target's."""
    ratios = list(getattr(draft, "compression_ratios", None) or [])
    if not ratios or any(r != 0 for r in ratios):
        raise _DraftStateMismatch(
            "compression ratios (the draft must be SWA-only NextN layers)",
            list(getattr(pool, "compression_ratios", None) or []),
            ratios,
        )
    unified = bool(getattr(pool, "_unified_kv", False))
    names: tuple[str, ...]
    if unified != bool(getattr(draft, "_unified_kv", False)):
        raise _DraftStateMismatch("unified-KV mode", unified, not unified)
    if unified:
        names = ("unified_swa_window", "unified_swa_ring_size", "unified_swa_pages")
        state_type = StateType.SWA_RING
    else:
        if pool.full_to_swa_index_mapping is not draft.full_to_swa_index_mapping:
            raise _DraftStateMismatch(
                "SWA index mapping (target and draft must share one)",
                id(pool.full_to_swa_index_mapping),
                id(draft.full_to_swa_index_mapping),
            )
        names = ("page_size", "sliding_window")
        state_type = StateType.SWA
    target_geo = tuple(getattr(pool, n) for n in names)
    draft_geo = tuple(getattr(draft, n) for n in names)
    if target_geo != draft_geo:
        raise _DraftStateMismatch(f"SWA geometry {names}", target_geo, draft_geo)
    infos = draft.get_unified_swa_ring_buf_infos() if unified else draft.get_state_buf_infos()
    if infos[0]:
        append_state_component(kv_args, state_type, *infos)
