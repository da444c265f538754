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

import inspect
import logging
import operator
import os
from typing import Any, overload

import attrs
import numpy as np
import torch
from numpy.typing import NDArray

from buffers.allocator import SlotAllocator
from buffers.errors import (
    BadArgument,
    BadArgumentType,
    DoubleFree,
    LayoutError,
    RowOverflow,
    SlotOutOfRange,
)
from buffers.kv_args import StateType
from buffers.metadata import FieldSpec, MetadataLayout
from buffers.metadata import MetadataBuffers as _CoreMetadataBuffers
from buffers.pages import C128, cp_filter_chunk, cp_split, ring_state_page
from field._checks import integer, uint64
from field.engine import DisaggregationMode, FinishAbort, record_abort
from field.release import UNSET, SignatureByRelease, bind_positional
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
# argument checks
# ---------------------------------------------------------------------------


def _as_signed(word: int) -> int:
    """The same 64 bits as a signed integer (uint64 tensors are written through an int64 view)."""
    return word - (1 << 64) if word >= 1 << 63 else word


# ---------------------------------------------------------------------------
# metadata slots and rows
# ---------------------------------------------------------------------------


class ReqToMetadataIdxAllocator:
    """``size`` metadata slots handed out first in, first out; ``alloc`` returns
    None when none is free (the request waits). ``size=0`` is an always-empty pool.

    Stricter than the field: ``free`` takes an integer slot of this pool that
    is in use, else it raises and changes nothing. A bool or a float
    (``free(True)``, ``free(1.7)``) raises :class:`~buffers.errors.BadArgumentType`
    (also a TypeError); a slot outside the pool
    :class:`~buffers.errors.SlotOutOfRange`; a slot that is already free
    :class:`~buffers.errors.DoubleFree`. The field would queue any of them,
    and later hand one row to two live requests (or a non-slot to one).
    """

    def __init__(self, size: int) -> None:
        self.size = integer("ReqToMetadataIdxAllocator size", size, 0)
        self._pool = SlotAllocator(self.size) if self.size else None
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
        if isinstance(free_index, (bool, np.bool_)):
            raise BadArgumentType(
                "free_index", free_index, f"a slot number in 0..{self.size - 1}, not a bool"
            )
        try:
            slot = operator.index(free_index)
        except TypeError:
            raise BadArgumentType(
                "free_index", free_index, f"an integer slot number in 0..{self.size - 1}"
            ) from None
        if self._pool is None or not 0 <= slot < self.size:
            raise SlotOutOfRange(slot, self.size)
        owner = self._pool.owner_of(slot)
        if owner is None:
            err = DoubleFree(slot, 0)
            err.args = (
                f"metadata slot {slot} freed but it is already free: a double free would "
                "let two live requests share one row. Free a slot exactly once, when its "
                "request leaves the last queue.",
            )
            raise err
        self._pool.free(slot, owner)


#: the rows' fields in the field's order; the optional ones are present only when built
_SAMPLING_MASK = (
    "output_token_sampling_mask_len",
    "output_token_sampling_mask_idx",
    "output_token_sampling_logprobs",
)
_DSA = "output_dsa_topk_indices"
_CHECKSUM = "kv_checksum"

#: what ``get_buf`` returns, per release (absent optional fields are None)
GET_BUF_FIELDS: dict[str, tuple[str, ...]] = {
    "seed": (
        "output_ids",
        "cached_tokens",
        "output_token_logprobs_val",
        "output_token_logprobs_idx",
        "output_top_logprobs_val",
        "output_top_logprobs_idx",
        "output_topk_p",
        "output_topk_index",
        "output_hidden_states",
        "bootstrap_room",
    ),
    "0.5.23": (
        "output_ids",
        "cached_tokens",
        "output_token_logprobs_val",
        "output_token_logprobs_idx",
        "output_top_logprobs_val",
        "output_top_logprobs_idx",
        *_SAMPLING_MASK,
        "output_topk_p",
        "output_topk_index",
        "output_hidden_states",
        _DSA,
        "bootstrap_room",
    ),
}

SAMPLING_MASK_VAR = "SGLANG_ENABLE_DISAGG_SAMPLING_MASK"


def _sampling_mask_enabled() -> bool:
    raw = os.environ.get(SAMPLING_MASK_VAR)
    if raw is None:
        return False
    word = raw.strip().lower()
    if word in ("true", "1", "yes", "y"):
        return True
    if word in ("false", "0", "no", "n"):
        return False
    raise BadArgument(SAMPLING_MASK_VAR, raw, "one of true/1/yes/y or false/0/no/n")


@attrs.frozen
class _FieldLayout(MetadataLayout):
    """The field's rows: the core's ten fields, plus, when asked for, the
    sampling-mask rows (after the top logprobs), the DSA top-k indices (after
    the hidden state, unwritten entries -1) and the KV checksum (after the room).

    The field allows rows narrower than the 64-byte RDMA minimum (small hidden
    sizes in tests); they are kept and logged."""

    sampling_mask_tokens: int = 0  # 0: no sampling-mask rows
    dsa_topk_dim: int = 0  # 0: no DSA top-k rows
    kv_checksum: bool = False

    @property
    def fields(self) -> tuple[FieldSpec, ...]:
        base = {spec.name: spec for spec in super().fields}
        order: list[FieldSpec] = [
            base[name]
            for name in (
                "output_ids",
                "cached_tokens",
                "output_token_logprobs_val",
                "output_token_logprobs_idx",
                "output_top_logprobs_val",
                "output_top_logprobs_idx",
            )
        ]
        if self.sampling_mask_tokens:
            n = self.sampling_mask_tokens
            order += [
                FieldSpec(_SAMPLING_MASK[0], 16, torch.int32),
                FieldSpec(_SAMPLING_MASK[1], n, torch.int32),
                FieldSpec(_SAMPLING_MASK[2], n, torch.float32),
            ]
        order += [base["output_topk_p"], base["output_topk_index"], base["output_hidden_states"]]
        if self.dsa_topk_dim:
            order.append(FieldSpec(_DSA, self.dsa_topk_dim, torch.int32, fill=-1))
        order.append(base["bootstrap_room"])
        if self.kv_checksum:
            order.append(FieldSpec(_CHECKSUM, 8, self.room_dtype))
        return tuple(order)

    def validate(self) -> None:
        try:
            super().validate()
        except LayoutError as e:
            if any(spec.width < 1 for spec in self.fields):
                raise
            logger.info("metadata layout kept as the field builds it: %s", e)


def _parameters(*spec: tuple[str, Any]) -> inspect.Signature:
    """A signature from (name, default) pairs; a name starting with ``*`` is keyword-only."""
    params = [
        inspect.Parameter(
            name.lstrip("*"),
            inspect.Parameter.KEYWORD_ONLY
            if name.startswith("*")
            else inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=default,
        )
        for name, default in spec
    ]
    return inspect.Signature(params)


_REQUIRED = inspect.Parameter.empty
_LEADING = ("size", "hidden_size", "hidden_states_dtype")
#: the constructor's positional parameters after the leading three, per release
_SHAPES = {
    "seed": ("max_top_logprobs_num", "custom_mem_pool"),
    "0.5.23": (
        "max_sampling_mask_tokens",
        "max_top_logprobs_num",
        "custom_mem_pool",
        "output_dsa_topk_indices_dim",
    ),
}


class MetadataBuffers(_CoreMetadataBuffers):
    """The field's metadata rows: one CPU tensor per field, as attributes, in
    the order of ``get_buf_infos``; also a :class:`buffers.MetadataBuffers`,
    so the core's gate, ``read`` and ``clear_room`` work on it too.

    Built with either release's call (see :mod:`field.release`)::

        MetadataBuffers(size, hidden_size, hidden_states_dtype,
                        max_sampling_mask_tokens, max_top_logprobs_num=128,
                        custom_mem_pool=None, output_dsa_topk_indices_dim=0,
                        *, kv_checksum_enabled=False)                # 0.5.23
        MetadataBuffers(size, hidden_size, hidden_states_dtype,
                        max_top_logprobs_num=128, custom_mem_pool=None)   # seed

    Keywords mean the same under both; the fourth and fifth positional
    arguments are read by the release in force when the buffers are built.
    Optional rows: the sampling-mask rows (under 0.5.23, when
    ``SGLANG_ENABLE_DISAGG_SAMPLING_MASK`` is true), the DSA top-k indices
    (``output_dsa_topk_indices_dim > 0``) and the KV checksum
    (``kv_checksum_enabled``); an absent one's attribute is None.

    Stricter or looser than the field, on purpose: ``max_sampling_mask_tokens``
    may be omitted (it sizes only the sampling-mask rows, and is required
    when they are built); arguments are checked, a wrong one raises a typed
    error naming it; ``custom_mem_pool`` is kept as an attribute and the rows
    stay on the CPU.
    """

    __signature__ = SignatureByRelease(
        {
            "seed": _parameters(
                ("size", _REQUIRED),
                ("hidden_size", _REQUIRED),
                ("hidden_states_dtype", _REQUIRED),
                ("max_top_logprobs_num", 128),
                ("custom_mem_pool", None),
            ),
            "0.5.23": _parameters(
                ("size", _REQUIRED),
                ("hidden_size", _REQUIRED),
                ("hidden_states_dtype", _REQUIRED),
                ("max_sampling_mask_tokens", _REQUIRED),
                ("max_top_logprobs_num", 128),
                ("custom_mem_pool", None),
                ("output_dsa_topk_indices_dim", 0),
                ("*kv_checksum_enabled", False),
            ),
        }
    )

    output_ids: torch.Tensor
    cached_tokens: torch.Tensor
    output_token_logprobs_val: torch.Tensor
    output_token_logprobs_idx: torch.Tensor
    output_top_logprobs_val: torch.Tensor
    output_top_logprobs_idx: torch.Tensor
    output_token_sampling_mask_len: torch.Tensor | None
    output_token_sampling_mask_idx: torch.Tensor | None
    output_token_sampling_logprobs: torch.Tensor | None
    output_topk_p: torch.Tensor
    output_topk_index: torch.Tensor
    output_hidden_states: torch.Tensor
    output_dsa_topk_indices: torch.Tensor | None
    bootstrap_room: torch.Tensor
    kv_checksum: torch.Tensor | None

    @overload
    def __init__(
        self,
        size: int,
        hidden_size: int,
        hidden_states_dtype: torch.dtype,
        max_sampling_mask_tokens: int,
        max_top_logprobs_num: int = 128,
        custom_mem_pool: Any = None,
        output_dsa_topk_indices_dim: int = 0,
        *,
        kv_checksum_enabled: bool = False,
    ) -> None: ...

    @overload
    def __init__(
        self,
        size: int,
        hidden_size: int,
        hidden_states_dtype: torch.dtype,
        max_top_logprobs_num: int = 128,
        custom_mem_pool: Any = None,
    ) -> None: ...

    def __init__(
        self,
        size: int,
        hidden_size: int,
        hidden_states_dtype: torch.dtype,
        *args: Any,
        max_sampling_mask_tokens: Any = UNSET,
        max_top_logprobs_num: Any = UNSET,
        custom_mem_pool: Any = UNSET,
        output_dsa_topk_indices_dim: Any = UNSET,
        kv_checksum_enabled: bool = False,
    ) -> None:
        current, given = bind_positional(
            "MetadataBuffers()",
            _LEADING,
            args,
            _SHAPES,
            {
                "max_sampling_mask_tokens": max_sampling_mask_tokens,
                "max_top_logprobs_num": max_top_logprobs_num,
                "custom_mem_pool": custom_mem_pool,
                "output_dsa_topk_indices_dim": output_dsa_topk_indices_dim,
            },
        )
        # check every argument before building anything
        integer("MetadataBuffers size", size, 1)
        hidden = integer("hidden_size", hidden_size, 1)
        if not isinstance(hidden_states_dtype, torch.dtype):
            raise BadArgumentType(
                "hidden_states_dtype", hidden_states_dtype, "a torch.dtype (e.g. torch.bfloat16)"
            )
        top = integer("max_top_logprobs_num", given.get("max_top_logprobs_num", 128), 1)
        dsa = integer("output_dsa_topk_indices_dim", given.get("output_dsa_topk_indices_dim", 0), 0)
        if not isinstance(kv_checksum_enabled, (bool, np.bool_)):
            raise BadArgumentType("kv_checksum_enabled", kv_checksum_enabled, "a bool")
        # the seed has no sampling-mask rows; under 0.5.23 the variable turns them on
        sampling = current != "seed" and _sampling_mask_enabled()
        mask_tokens = given.get("max_sampling_mask_tokens")
        if mask_tokens is not None:
            mask_tokens = integer("max_sampling_mask_tokens", mask_tokens, 0)
        if sampling and not mask_tokens:
            raise BadArgument(
                "max_sampling_mask_tokens",
                mask_tokens,
                f"an integer >= 1 when {SAMPLING_MASK_VAR} is on (it sizes the sampling-mask "
                "rows); pass the server's sampling_mask_max_tokens",
            )
        layout = _FieldLayout(
            hidden_size=hidden,
            hidden_dtype=hidden_states_dtype,
            max_top_logprobs=top,
            sampling_mask_tokens=int(mask_tokens or 0) if sampling else 0,
            dsa_topk_dim=dsa,
            kv_checksum=bool(kv_checksum_enabled),
        )
        super().__init__(size, layout)
        #: the release whose conventions these buffers follow (read when built)
        self.field_release = current
        self.custom_mem_pool = given.get("custom_mem_pool")
        self.output_dsa_topk_indices_dim = dsa
        self.enable_sampling_mask = sampling
        for name in (*_SAMPLING_MASK, _DSA, _CHECKSUM):
            setattr(self, name, None)
        for name, tensor in self.tensors.items():
            setattr(self, name, tensor)

    def get_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """(data pointers, total bytes, bytes of one row), one entry per tensor
        that was built, in the field's order."""
        return self.buf_infos()

    def get_buf(self, idx: int) -> tuple[torch.Tensor | None, ...]:
        """Copies of row ``idx``: 14 values under 0.5.23 (None for an optional
        row that was not built), 10 under the seed (see ``GET_BUF_FIELDS``).
        The KV checksum is read with :meth:`get_kv_checksum`."""
        self._check(idx)
        out: list[torch.Tensor | None] = []
        for name in GET_BUF_FIELDS[self.field_release]:
            tensor = getattr(self, name)
            out.append(None if tensor is None else tensor[idx].clone())
        return tuple(out)

    def set_buf(self, req: Any) -> None:
        """Write ``req``'s first-token row at ``req.metadata_buffer_index``; its
        room goes last (0 when it has none, so no reader takes the row as landed).

        Every value is checked before anything is written: a top-logprobs
        list longer than the row raises :class:`~buffers.errors.RowOverflow`
        (a RuntimeError, as in the field), and so does any other value too
        long for its row. Unlike the field, the whole row is written: what
        the request does not set (no logprobs, no hidden state) goes back to
        its empty value, not left from the slot's previous owner. The KV
        checksum is not part of the row (:meth:`set_kv_checksum`)."""
        slot = req.metadata_buffer_index
        self._check(slot)
        values: dict[str, Any] = {
            spec.name: ()
            for spec in self.layout.fields
            if spec.name not in ("bootstrap_room", _CHECKSUM)
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
                    self._check_top_logprobs(name, len(values[name]))
        if getattr(req, "return_sampling_mask", False):
            values |= self._sampling_mask_values(req)
        hidden = getattr(req, "hidden_states_tensor", None)
        if hidden is not None:
            values["output_topk_p"] = req.output_topk_p
            values["output_topk_index"] = req.output_topk_index
            values["output_hidden_states"] = hidden
            if self.output_dsa_topk_indices is not None:
                dsa = getattr(req, "output_dsa_topk_indices", None)
                if dsa is not None:
                    values[_DSA] = dsa
        room = getattr(req, "bootstrap_room", None)
        if room:
            self.write(slot, int(room), values)
        else:
            self.write_unclaimed(slot, values)

    def _check_top_logprobs(self, name: str, count: int) -> None:
        width = self.output_top_logprobs_val.shape[1]
        if count > width:
            raise RowOverflow(
                name,
                count,
                width,
                f"top_logprobs_num {count} exceeds the disaggregation metadata capacity "
                f"{width} ({name}); lower the request's top_logprobs_num or build "
                f"MetadataBuffers with max_top_logprobs_num >= {count}. Nothing was written.",
            )

    def _sampling_mask_values(self, req: Any) -> dict[str, Any]:
        if not self.enable_sampling_mask:
            raise BadArgument(
                "req.return_sampling_mask",
                req.return_sampling_mask,
                f"False: these buffers have no sampling-mask rows (set {SAMPLING_MASK_VAR}=1 "
                "before building them, under the 0.5.23 release)",
            )
        chunk = req.sampling_mask_rows.view()
        token_ids = np.asarray(chunk.token_ids)
        return {
            _SAMPLING_MASK[0]: [len(token_ids)],
            _SAMPLING_MASK[1]: token_ids,
            _SAMPLING_MASK[2]: np.asarray(chunk.logprobs),
        }

    # -- KV checksum (0.5.23) -------------------------------------------------

    def _checksum_words(self, method: str) -> torch.Tensor:
        if self.kv_checksum is None:
            raise LayoutError(
                f"MetadataBuffers.{method}: these buffers have no KV checksum rows; build "
                "them with kv_checksum_enabled=True on both prefill and decode"
            )
        return self.kv_checksum.view(torch.int64)

    def set_kv_checksum(self, req: Any, digest: int, signature: int) -> None:
        """Store the KV digest and the layout signature it was taken under in
        row ``req.metadata_buffer_index`` (words 0 and 1 of its checksum row)."""
        words = self._checksum_words("set_kv_checksum")
        slot = req.metadata_buffer_index
        self._check(slot)
        d, s = uint64("digest", digest), uint64("signature", signature)
        words[slot, 0] = _as_signed(d)
        words[slot, 1] = _as_signed(s)

    def get_kv_checksum(self, idx: int) -> tuple[int, int]:
        """``(digest, signature)`` of row ``idx``; ``(0, 0)`` means none was written."""
        words = self._checksum_words("get_kv_checksum")
        self._check(idx)
        digest, signature = words[idx, :2].tolist()
        return int(digest) & _U64, int(signature) & _U64

    def clear_slot(self, idx: int) -> None:
        """Make row ``idx`` read as "not written yet" for its next owner: its
        room (and its KV checksum, when there is one) back to 0."""
        self._check(idx)
        self.clear_room(idx)
        if self.kv_checksum is not None:
            self.kv_checksum[idx].zero_()


_U64 = (1 << 64) - 1


def _multimodal_counts(req: Any) -> tuple[int, int, int]:
    """Image, audio and video prompt tokens: the request's own
    ``get_mm_token_counts()`` (0.5.23), else its ``multimodal_inputs``' (the seed)."""
    counts = getattr(req, "get_mm_token_counts", None)
    if callable(counts):
        image, audio, video = counts()
        return int(image), int(audio), int(video)
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
