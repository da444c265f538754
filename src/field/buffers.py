"""The field's metadata, page and state helpers, by their own names and call shapes.

Each name here keeps the field's parameters, defaults and return conventions
and delegates to the typed core of :mod:`buffers`; the core keeps its own,
stricter API (room-checked frees, position-based CP filtering, frozen KV args).
Where a name here is deliberately stricter than the field it says so in its
docstring; docs/compat.md has the whole table.

Pools are recognised by what they declare, never by importing an engine: a
pool may list its kinds in ``pd_pool_kinds`` (e.g. ``{"swa"}``); otherwise the
names of its classes are read (an engine's ``BaseSWAKVPool`` subclass counts
as "swa" without this package importing that engine).
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import numpy as np
import torch
from numpy.typing import NDArray

from buffers.allocator import SlotAllocator
from buffers.errors import DoubleFree, LayoutError, SlotOutOfRange
from buffers.kv_args import StateType
from buffers.metadata import MetadataBuffers as _CoreMetadataBuffers
from buffers.metadata import MetadataLayout
from buffers.pages import C128, cp_filter_chunk, cp_split, ring_state_page
from field.engine import DisaggregationMode, FinishAbort, record_abort
from field.state import append_state_component, is_mla_backend, setup_state_kv_args

__all__ = [
    "DisaggregationMode",
    "MetadataBuffers",
    "ReqToMetadataIdxAllocator",
    "StateType",
    "append_state_component",
    "filter_kv_indices_for_cp_rank",
    "get_dsv4_c128_state_indices",
    "is_aborted",
    "is_mla_backend",
    "page_indices_to_cp_rank_page_indices",
    "prepare_abort",
    "setup_state_kv_args",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# metadata slots and rows
# ---------------------------------------------------------------------------


class ReqToMetadataIdxAllocator:
    """``size`` metadata slots handed out first in, first out; ``alloc`` returns
    None when none is free (the request waits). ``size=0`` is an always-empty pool.

    Stricter than the field: freeing a slot that is already free raises
    :class:`~buffers.errors.DoubleFree` and freeing one outside the pool raises
    :class:`~buffers.errors.SlotOutOfRange`, and neither changes anything (the
    field would queue the slot twice, and two live requests would share a row).
    """

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"ReqToMetadataIdxAllocator size must be >= 0, got {size}")
        self.size = size
        self._pool = SlotAllocator(size) if size else None
        self._next_owner = 1  # the core tracks an owner per slot; each alloc is its own

    def available_size(self) -> int:
        return self._pool.available if self._pool is not None else 0

    def alloc(self) -> int | None:
        if self._pool is None:
            return None
        slot = self._pool.alloc(self._next_owner)
        if slot is not None:
            self._next_owner += 1
        return slot

    def free(self, free_index: int) -> None:
        if self._pool is None:
            raise SlotOutOfRange(int(free_index), 0)
        slot = int(free_index)
        owner = self._pool.owner_of(slot)  # raises SlotOutOfRange first
        if owner is None:
            err = DoubleFree(slot, 0)
            err.args = (
                f"metadata slot {slot} freed but it is already free: a double free would "
                "let two live requests share one row. Free a slot exactly once, when its "
                "request leaves the last queue.",
            )
            raise err
        self._pool.free(slot, owner)


@attrs.frozen
class _FieldLayout(MetadataLayout):
    """The field allows rows narrower than the 64-byte RDMA minimum (small
    hidden sizes in tests); keep them, say so in the log."""

    def validate(self) -> None:
        try:
            super().validate()
        except LayoutError as e:
            if any(spec.width < 1 for spec in self.fields):
                raise
            logger.info("metadata layout kept as the field builds it: %s", e)


class MetadataBuffers(_CoreMetadataBuffers):
    """The field's metadata rows: one CPU tensor per field, as attributes, in
    the order of ``get_buf_infos``; also a :class:`buffers.MetadataBuffers`,
    so the core's gate, ``read`` and ``clear_room`` work on it too.

    ``custom_mem_pool`` is kept as an attribute; rows stay on the CPU.
    """

    output_ids: torch.Tensor
    cached_tokens: torch.Tensor
    output_token_logprobs_val: torch.Tensor
    output_token_logprobs_idx: torch.Tensor
    output_top_logprobs_val: torch.Tensor
    output_top_logprobs_idx: torch.Tensor
    output_topk_p: torch.Tensor
    output_topk_index: torch.Tensor
    output_hidden_states: torch.Tensor
    bootstrap_room: torch.Tensor

    def __init__(
        self,
        size: int,
        hidden_size: int,
        hidden_states_dtype: torch.dtype,
        max_top_logprobs_num: int = 128,
        custom_mem_pool: Any = None,
    ) -> None:
        layout = _FieldLayout(
            hidden_size=hidden_size,
            hidden_dtype=hidden_states_dtype,
            max_top_logprobs=max_top_logprobs_num,
        )
        super().__init__(size, layout)
        self.custom_mem_pool = custom_mem_pool
        for name, tensor in self.tensors.items():
            setattr(self, name, tensor)

    def get_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """(data pointers, total bytes, bytes of one row), one entry per tensor."""
        return self.buf_infos()

    def get_buf(self, idx: int) -> tuple[torch.Tensor, ...]:
        """Copies of row ``idx`` of every tensor, in ``get_buf_infos`` order."""
        self._check(int(idx))
        return tuple(self.tensors[spec.name][idx].clone() for spec in self.layout.fields)

    def set_buf(self, req: Any) -> None:
        """Write ``req``'s first-token row at ``req.metadata_buffer_index``; its
        room goes last (0 when it has none, so no reader takes the row as landed).

        Unlike the field, the whole row is written: what the request does not
        set (no logprobs, no hidden state) is zeroed, not left from the slot's
        previous owner."""
        slot = int(req.metadata_buffer_index)
        # every field is written, the unset ones as zeros: a reused slot must not
        # hand its previous owner's logprobs or hidden state to the next reader
        values: dict[str, Any] = {
            spec.name: () for spec in self.layout.fields if spec.name != "bootstrap_room"
        }
        values |= {
            "output_ids": [int(req.output_ids[0])],
            "cached_tokens": [
                int(getattr(req, "cached_tokens", 0) or 0),
                int(getattr(req, "cached_tokens_device", 0) or 0),
                int(getattr(req, "cached_tokens_host", 0) or 0),
                int(getattr(req, "cached_tokens_storage", 0) or 0),
                *_multimodal_counts(req),
            ],
        }
        if getattr(req, "return_logprob", False):
            lp = getattr(req, "logprob", None) or req
            for name in ("output_token_logprobs_val", "output_token_logprobs_idx"):
                src = getattr(lp, name, None)
                if src:
                    values[name] = [src[0]]
            for name in ("output_top_logprobs_val", "output_top_logprobs_idx"):
                src = getattr(lp, name, None)
                if src:
                    values[name] = list(src[0])
        hidden = getattr(req, "hidden_states_tensor", None)
        if hidden is not None:
            values["output_topk_p"] = req.output_topk_p
            values["output_topk_index"] = req.output_topk_index
            values["output_hidden_states"] = hidden
        room = getattr(req, "bootstrap_room", None)
        if room:
            self.write(slot, int(room), values)
        else:
            self.write_unclaimed(slot, values)


def _multimodal_counts(req: Any) -> tuple[int, int, int]:
    mm = getattr(req, "multimodal_inputs", None)
    if not mm:
        return 0, 0, 0
    image, audio, video = mm.compute_mm_token_counts()
    return int(image), int(audio), int(video)


# ---------------------------------------------------------------------------
# pages
# ---------------------------------------------------------------------------


def page_indices_to_cp_rank_page_indices(
    page_indices: NDArray[Any], total_pages: int, cp_rank: int, cp_size: int
) -> NDArray[Any]:
    """The request's global page ids whose *value* falls in CP rank ``cp_rank``'s
    share of ``[0, total_pages)`` shifted by the smallest id, in input order.

    This is the field's rule and assumes the request's pages are contiguous;
    :func:`buffers.cp_filter_pages` splits by position and stays right when
    they are not. ``cp_size <= 1`` returns ``page_indices`` itself.
    """
    if cp_size <= 1:
        return page_indices
    ids = np.asarray(page_indices)
    if ids.size == 0:
        return ids
    start, end = cp_split(total_pages, cp_size, cp_rank)
    first = int(ids.min())
    kept: NDArray[Any] = ids[(ids >= first + start) & (ids < first + end)]
    return kept


def filter_kv_indices_for_cp_rank(
    kv_mgr: Any, kv_indices: NDArray[Any], index_slice: slice, total_pages: int | None = None
) -> tuple[NDArray[Any], slice]:
    """A chunk's page ids (``kv_indices``, at request positions ``index_slice``)
    cut to CP rank ``kv_mgr.attn_cp_rank`` of ``kv_mgr.attn_cp_size``: the kept
    ids and their positions. Nothing kept: an empty array and an empty slice at
    the chunk start. ``cp_size <= 1`` returns the inputs unchanged."""
    total = len(kv_indices) if total_pages is None else int(total_pages)
    rank, size = int(kv_mgr.attn_cp_rank), int(kv_mgr.attn_cp_size)
    if size <= 1:
        return kv_indices, index_slice
    c0 = 0 if index_slice.start is None else int(index_slice.start)
    c1 = total if index_slice.stop is None else int(index_slice.stop)
    if c0 >= total:  # a chunk past the request's pages holds none of this rank's
        return kv_indices[:0], slice(c0, c0)
    positions, kept = cp_filter_chunk(slice(c0, min(c1, total)), total, size, rank)
    if positions.size == 0:
        return kv_indices[:0], slice(c0, c0)
    return kv_indices[int(positions[0]) : int(positions[-1]) + 1], kept


def get_dsv4_c128_state_indices(
    req_pool_idx: int, seq_len: int, *, online: bool, ring_size: int
) -> NDArray[np.int32]:
    """The compressed-state row (online) or ring page to ship, as an int32 array
    of 0 or 1 entries. A ring size that is not a multiple of 128 is an error."""
    if not online and seq_len % C128 and ring_size % C128:
        raise AssertionError(f"C128 ring_size must be 128-aligned, got {ring_size}")
    page = ring_state_page(int(seq_len), int(req_pool_idx), int(ring_size), online=online)
    if page is None:
        return np.empty(0, dtype=np.int32)
    return np.array([page], dtype=np.int32)


# ---------------------------------------------------------------------------
# aborts
# ---------------------------------------------------------------------------

_INPUT_LOGPROB_LISTS = (
    "input_token_logprobs_val",
    "input_token_logprobs_idx",
    "input_top_logprobs_val",
    "input_top_logprobs_idx",
    "input_token_ids_logprobs_val",
    "input_token_ids_logprobs_idx",
)


def prepare_abort(req: Any, error_message: str, status_code: int | None = None) -> None:
    """Mark ``req`` aborted with ``error_message``; with ``req.return_logprob``,
    empty its six input-logprob lists (under ``req.logprob`` where it has one).

    A missing status code becomes 500: our abort reason always carries one.
    """
    record_abort(req, error_message, 500 if status_code is None else int(status_code))
    if getattr(req, "return_logprob", False):
        holder = getattr(req, "logprob", None) or req
        for name in _INPUT_LOGPROB_LISTS:
            setattr(holder, name, [])


def _is_abort(reason: object) -> bool:
    return isinstance(reason, FinishAbort) or type(reason).__name__ == "FINISH_ABORT"


def is_aborted(req: Any) -> bool:
    """True when the request is finishing or finished with an abort (ours or the engine's)."""
    return _is_abort(getattr(req, "to_finish", None)) or _is_abort(
        getattr(req, "finished_reason", None)
    )
