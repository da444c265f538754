"""The field's metadata row layouts per release: which fields, in which order, of what shape."""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

import attrs
import torch

from buffers.errors import (
    BadArgument,
    LayoutError,
)
from buffers.metadata import FieldSpec, MetadataLayout, MetadataRecord

#: the rows' fields in the field's order; the optional ones are present only when built
_SAMPLING_MASK = (
    "output_token_sampling_mask_len",
    "output_token_sampling_mask_idx",
    "output_token_sampling_logprobs",
)
_DSA = "output_dsa_topk_indices"
_CHECKSUM = "kv_checksum"

#: what ``get_buf`` returns, per release (absent optional fields are None)
_STANDARD = MetadataRecord.STANDARD  # the core's nine row fields, in the field's order
GET_BUF_FIELDS: dict[str, tuple[str, ...]] = {
    "seed": (*_STANDARD, "bootstrap_room"),
    # 0.5.23: the sampling mask after the top logprobs, DSA indices before the room
    "0.5.23": (*_STANDARD[:6], *_SAMPLING_MASK, *_STANDARD[6:], _DSA, "bootstrap_room"),
}

SAMPLING_MASK_VAR = "SGLANG_ENABLE_DISAGG_SAMPLING_MASK"

logger = logging.getLogger(__name__)


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
