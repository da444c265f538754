"""The field's ``MetadataBuffers``: the seed's and 0.5.23's constructors and rows over the core buffers."""

from __future__ import annotations

import logging
from typing import Any, overload

import numpy as np
import torch

from buffers.errors import (
    BadArgument,
    BadArgumentType,
    LayoutError,
    RowOverflow,
)
from buffers.metadata import MetadataBuffers as _CoreMetadataBuffers
from field._checks import integer, required, uint64
from field.data.rows import (
    _CHECKSUM,
    _DSA,
    _LEADING,
    _REQUIRED,
    _SAMPLING_MASK,
    _SHAPES,
    GET_BUF_FIELDS,
    SAMPLING_MASK_VAR,
    _FieldLayout,
    _parameters,
    _sampling_mask_enabled,
)
from field.release import UNSET, SignatureByRelease, bind_positional

logger = logging.getLogger(__name__)


def _as_signed(word: int) -> int:
    """A 64-bit unsigned word as the int64 the row's tensor holds."""
    return word - (1 << 64) if word >= 1 << 63 else word


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
        checksum is not part of the row (:meth:`set_kv_checksum`).

        No request (None) or one without output ids raises
        :class:`~buffers.errors.BadArgumentType` (a TypeError), and empty
        output ids :class:`~buffers.errors.BadArgument` (a ValueError): the row
        carries the first output token, so call this once it is sampled."""
        first = _first_token(req)
        slot = req.metadata_buffer_index
        self._check(slot)
        values: dict[str, Any] = {
            spec.name: ()
            for spec in self.layout.fields
            if spec.name not in ("bootstrap_room", _CHECKSUM)
        }
        values |= {
            "output_ids": [first],
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
_REQ = "a request with metadata_buffer_index and output_ids (its sampled tokens)"


def _first_token(req: Any) -> int:
    """The request's first output token, after checking there is one."""
    required("req", req, _REQ)
    ids = getattr(req, "output_ids", None)
    try:
        count = len(ids)  # type: ignore[arg-type]
    except TypeError:
        raise BadArgumentType("req.output_ids", ids, f"a sequence of token ids ({_REQ})") from None
    if count == 0:
        raise BadArgument(
            "req.output_ids",
            ids,
            "at least one token: the row carries the first output token, so write it "
            "once that token is sampled",
        )
    return int(ids[0])  # type: ignore[index]


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
