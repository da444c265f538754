"""The two field releases' call shapes for senders and receivers (see
:mod:`field.release`): a sender constructor's optional arguments and a
receiver ``init`` call, named by the release in force and checked."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from buffers.errors import BadArgumentType
from field._checks import integer, optional_integer, page_indices
from field.release import UNSET, FieldSignatureError, SignatureByRelease, bind_positional

__all__ = ["SENDER_SIGNATURE", "sender_options", "receiver_init"]

_P = inspect.Parameter


def _signature(*spec: tuple[str, Any]) -> inspect.Signature:
    return inspect.Signature(
        [_P(name, _P.POSITIONAL_OR_KEYWORD, default=default) for name, default in spec]
    )


#: the senders' constructor, per release (what :func:`inspect.signature` shows)
SENDER_SIGNATURE = SignatureByRelease(
    {
        "seed": _signature(
            ("mgr", _P.empty),
            ("bootstrap_addr", _P.empty),
            ("bootstrap_room", _P.empty),
            ("dest_tp_ranks", None),
            ("pp_rank", None),
        ),
        "0.5.23": _signature(
            ("mgr", _P.empty),
            ("bootstrap_addr", _P.empty),
            ("bootstrap_room", _P.empty),
            ("req_has_disagg_prefill_dp_rank", False),
        ),
    }
)

_SENDER_SHAPES = {
    "seed": ("dest_tp_ranks", "pp_rank"),
    "0.5.23": ("req_has_disagg_prefill_dp_rank",),
}


def sender_options(
    where: str,
    args: tuple[Any, ...],
    dest_tp_ranks: Any = UNSET,
    pp_rank: Any = UNSET,
    req_has_disagg_prefill_dp_rank: Any = UNSET,
) -> dict[str, Any]:
    """A sender constructor's optional arguments, positional ones named by the
    release: ``dest_tp_ranks``, ``pp_rank`` and ``req_has_disagg_prefill_dp_rank``."""
    _, given = bind_positional(
        where,
        ("mgr", "bootstrap_addr", "bootstrap_room"),
        args,
        _SENDER_SHAPES,
        {
            "dest_tp_ranks": dest_tp_ranks,
            "pp_rank": pp_rank,
            "req_has_disagg_prefill_dp_rank": req_has_disagg_prefill_dp_rank,
        },
    )
    has_dp = given.get("req_has_disagg_prefill_dp_rank", False)
    if not isinstance(has_dp, (bool, np.bool_)):
        raise BadArgumentType(
            "req_has_disagg_prefill_dp_rank",
            has_dp,
            "a bool (under the seed release the fourth positional argument is "
            "dest_tp_ranks: set PDLIFE_FIELD_RELEASE=seed for that call shape)",
        )
    dest = given.get("dest_tp_ranks")
    if dest is not None:
        dest = [integer("dest_tp_ranks[]", r, 0) for r in dest]
    return {
        "dest_tp_ranks": dest,
        "pp_rank": optional_integer("pp_rank", given.get("pp_rank"), 0),
        "req_has_disagg_prefill_dp_rank": bool(has_dp),
    }


_RECEIVER_INIT_SHAPES = {
    "seed": ("kv_indices", "aux_index", "state_indices"),
    "0.5.23": ("prefill_dp_rank",),
}
_DP_HINT = (
    " (under the 0.5.23 release init takes the prefill DP rank and the pages go to "
    "send_metadata; set PDLIFE_FIELD_RELEASE=seed for init(kv_indices, aux_index))"
)
_PAGES_HINT = (
    " (under the seed release init takes the pages; set PDLIFE_FIELD_RELEASE=0.5.23 "
    "for init(prefill_dp_rank) followed by send_metadata)"
)


def receiver_init(args: tuple[Any, ...], keywords: dict[str, Any]) -> dict[str, Any]:
    """A receiver ``init`` call's arguments, checked: either
    ``{"prefill_dp_rank": int}`` (0.5.23) or ``{"kv_indices": array,
    "aux_index": ..., "state_indices": ...}`` (the seed)."""
    current, given = bind_positional("init()", (), args, _RECEIVER_INIT_SHAPES, keywords)
    seed_names = [n for n in ("kv_indices", "aux_index", "state_indices") if n in given]
    if "prefill_dp_rank" in given and seed_names:
        raise FieldSignatureError(
            "init()",
            f"got prefill_dp_rank and {', '.join(seed_names)}: the first is 0.5.23's init, "
            "the others the seed's",
            ("prefill_dp_rank",) if current == "0.5.23" else _RECEIVER_INIT_SHAPES["seed"],
            current,
        )
    if "prefill_dp_rank" in given:
        return {
            "prefill_dp_rank": integer("prefill_dp_rank", given["prefill_dp_rank"], 0, _DP_HINT)
        }
    if "kv_indices" not in given:
        missing = "kv_indices" if seed_names or current == "seed" else "prefill_dp_rank"
        raise FieldSignatureError(
            "init()",
            f"missing required argument {missing!r}",
            _RECEIVER_INIT_SHAPES[current],
            current,
        )
    return {
        "kv_indices": page_indices("kv_indices", given["kv_indices"], _PAGES_HINT),
        "aux_index": optional_integer("aux_index", given.get("aux_index"), -1),
        "state_indices": given.get("state_indices"),
    }
