"""Per-request senders and receivers with the field's call shapes, over a
backend's own handles (the ``KVSender`` / ``KVReceiver`` shapes of :mod:`transport.protocols`).

The two field releases (see :mod:`field.release`) build and drive them
differently; both are accepted, and where a positional argument means
different things the release decides:

- sender ``(mgr, bootstrap_addr, bootstrap_room, ...)``: the fourth and fifth
  positional arguments are ``dest_tp_ranks, pp_rank`` under the seed and
  ``req_has_disagg_prefill_dp_rank`` under 0.5.23. ``init(num_kv_indices,
  aux_index)`` and ``send(kv_indices, state_indices, num_kv_tokens)`` are
  the same in both;
- receiver ``(mgr, bootstrap_addr, bootstrap_room=None, prefill_dp_rank=None)``:
  under the seed the handshake starts when it is built and
  ``init(kv_indices, aux_index, state_indices)`` says where to write; under
  0.5.23 ``init(prefill_dp_rank)`` starts the handshake with that prefill DP
  rank and ``send_metadata(kv_indices, aux_index, state_indices,
  decode_prefix_len)`` says where to write. Keywords are read by name under
  either release.

Neither has ``clear`` in the field: the backend's slot is given back when the
object is collected, or at once by calling ``clear()``.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from buffers.errors import BadArgument, BadArgumentType
from field._checks import integer, optional_integer, page_indices
from field.release import UNSET, FieldSignatureError, SignatureByRelease, bind_positional
from lifecycle.status import KVPoll

__all__ = ["FieldSender", "FieldReceiver", "SENDER_SIGNATURE", "sender_options", "receiver_init"]

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


class _Handle:
    core: Any

    @property
    def conclude_state(self) -> KVPoll | None:
        """Success or Failed once the request has ended here, else None."""
        status = KVPoll(self.core.poll())
        return status if status.terminal else None

    def poll(self) -> KVPoll:
        return KVPoll(self.core.poll())

    def failure_exception(self) -> None:
        """Raise why this request failed (a :class:`~transport.errors.TransferFailed`)."""
        self.core.failure_exception()

    def abort(self) -> None:
        self.core.abort()

    def clear(self) -> None:
        """Give the backend's slot for this request back (also done on collection)."""
        self.core.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.core.clear()


class FieldSender(_Handle):
    """Prefill side of one request."""

    def __init__(
        self,
        core: Any,
        mgr: Any,
        bootstrap_addr: str | None,
        bootstrap_room: int | None,
        dest_tp_ranks: list[int] | None = None,
        pp_rank: int | None = None,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        self.core = core
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.dest_tp_ranks = dest_tp_ranks
        self.pp_rank = pp_rank
        self.req_has_disagg_prefill_dp_rank = req_has_disagg_prefill_dp_rank

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """How many pages will follow and which metadata row carries the first token."""
        n = integer("num_kv_indices", num_kv_indices, 0)
        self.core.init(n, optional_integer("aux_index", aux_index, -1))

    def send(
        self, kv_indices: ArrayLike, state_indices: Any = None, num_kv_tokens: int | None = None
    ) -> None:
        """One chunk of pages (the last chunk's send also ships the metadata row).
        ``num_kv_tokens`` (0.5.23) is accepted and not needed: pages are whole here."""
        self.core.send(page_indices("kv_indices", kv_indices), state_indices)


class FieldReceiver(_Handle):
    """Decode side of one request.

    Under the seed the handshake starts when it is built (with
    ``prefill_dp_rank``, 0 when None); under 0.5.23 it starts at
    ``init(prefill_dp_rank)``, or when built if ``prefill_dp_rank`` is given
    to the constructor (a keyword the field's receivers do not have).
    """

    @property
    def require_staging(self) -> bool:
        """Whether this request lands in staging (the backend decides once registered)."""
        return bool(getattr(self.core, "require_staging", False))

    def __init__(
        self,
        core: Any,
        mgr: Any,
        bootstrap_addr: str | None,
        bootstrap_room: int | None = None,
        prefill_dp_rank: int | None = None,
    ) -> None:
        from field.release import release

        self.core = core
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.prefill_dp_rank = optional_integer("prefill_dp_rank", prefill_dp_rank, 0)
        #: the release whose call shapes this receiver follows (read when built)
        self.field_release = release()
        self.bootstrap_done = False
        if self.field_release == "seed" or prefill_dp_rank is not None:
            self._bootstrap(self.prefill_dp_rank)

    def _bootstrap(self, prefill_dp_rank: int | None) -> None:
        if self.bootstrap_done:
            # None is rank 0, as for the backends
            if prefill_dp_rank is not None and prefill_dp_rank != (self.prefill_dp_rank or 0):
                raise BadArgument(
                    "prefill_dp_rank",
                    prefill_dp_rank,
                    f"{self.prefill_dp_rank or 0}, the prefill DP rank this receiver's "
                    "handshake started with (a receiver pairs with one prefill DP rank)",
                )
            return
        self.prefill_dp_rank = prefill_dp_rank
        self.bootstrap_done = True
        self.core.init(prefill_dp_rank)

    def init(
        self,
        *args: Any,
        kv_indices: Any = UNSET,
        aux_index: Any = UNSET,
        state_indices: Any = UNSET,
        prefill_dp_rank: Any = UNSET,
    ) -> None:
        """0.5.23: ``init(prefill_dp_rank)`` starts the handshake with that
        prefill DP rank. Seed: ``init(kv_indices, aux_index=None,
        state_indices=None)`` says where prefill must write (these pages,
        this metadata row). Positional arguments are read by the release."""
        call = receiver_init(
            args,
            {
                "kv_indices": kv_indices,
                "aux_index": aux_index,
                "state_indices": state_indices,
                "prefill_dp_rank": prefill_dp_rank,
            },
        )
        if "prefill_dp_rank" in call:
            self._bootstrap(call["prefill_dp_rank"])
            return
        self._bootstrap(self.prefill_dp_rank)
        self._send_metadata(call["kv_indices"], call["aux_index"], call["state_indices"], None)

    def send_metadata(
        self,
        kv_indices: ArrayLike,
        aux_index: int | None = None,
        state_indices: Any = None,
        decode_prefix_len: int | None = None,
        destination: Any = None,
    ) -> None:
        """Where prefill must write: these pages (after the first
        ``decode_prefix_len`` tokens, which decode holds already), this
        metadata row. Only device destinations are supported."""
        value = getattr(destination, "value", destination)
        if value not in (None, "device"):
            raise BadArgument(
                "destination", destination, "the device (host destinations are not supported)"
            )
        self._send_metadata(
            page_indices("kv_indices", kv_indices),
            optional_integer("aux_index", aux_index, -1),
            state_indices,
            optional_integer("decode_prefix_len", decode_prefix_len, 0),
        )

    def _send_metadata(
        self, kv_indices: Any, aux_index: int | None, state_indices: Any, prefix: int | None
    ) -> None:
        self.core.send_metadata(
            kv_indices, -1 if aux_index is None else aux_index, state_indices, prefix or 0
        )
