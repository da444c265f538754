"""Per-request senders and receivers with the field's call shapes, over a
backend's own handles (the ``KVSender`` / ``KVReceiver`` shapes of :mod:`transport.protocols`).

They are :class:`~field.conn.base.BaseKVSender` and
:class:`~field.conn.base.BaseKVReceiver` subclasses. The two field releases
(see :mod:`field.release`) build and drive them differently; both are
accepted, and where a positional argument means different things the
release decides (the shapes are in :mod:`field.conn.shapes`):

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

A cached prefix, as in 0.5.23: decode passes ``send_metadata`` only the pages
after its first ``decode_prefix_len`` tokens; the prefill sender reports
Bootstrapping until every decode rank said where to write, then
``pop_decode_prefix_len()`` gives that prefix (in tokens) once. A prefill that
popped it inits and sends only the pages after it; one that did not (the
seed's engines) hands every page over, and the prefix pages are skipped.

Neither has ``clear`` in the seed: the backend's slot is given back when the
object is collected, or at once by calling ``clear()``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from numpy.typing import ArrayLike

from buffers.errors import BadArgument
from field._checks import integer, optional_integer, page_indices
from field.conn.base import BaseKVReceiver, BaseKVSender, KVTransferDestination, KVTransferMetric
from field.conn.shapes import receiver_init
from field.release import UNSET
from lifecycle.status import KVPoll
from transport.connector.core.legs import rows_of

__all__ = ["FieldSender", "FieldReceiver"]


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


class FieldSender(_Handle, BaseKVSender):
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
        #: the core's KV args (page size, row bytes), when the backend has them
        self._core_args = getattr(getattr(core, "manager", None), "kv_args", None)
        self._first_page = 0  # pages of a popped decode prefix: never handed over
        self._prefix_popped = False
        self._metric = KVTransferMetric()
        self._started: float | None = None
        self._pages = 0  # pages handed to send()
        self._state_bytes = 0  # bytes of the state rows handed to send()
        self._skip: int | None = None  # decode's prefix pages, once known

    def poll(self) -> KVPoll:
        """As 0.5.23's senders: Bootstrapping until every decode rank said where
        to write (so the prefix is known), then the backend's status."""
        status = KVPoll(self.core.poll())
        if status == KVPoll.WaitingForInput and self._prefix_pages() is None:
            return KVPoll.Bootstrapping
        m = self._metric
        if status == KVPoll.Success and m.transfer_latency_s is None:
            self._prefix_pages()  # kept for the metric: the backend forgets it on clear()
            if self._started is not None:
                m.transfer_latency_s = time.perf_counter() - self._started
        return status

    def _prefix_pages(self) -> int | None:
        """Decode's cached prefix in pages, None until every decode rank told it
        (0 for a backend that moves no data)."""
        if self._skip is None:
            self._skip = getattr(self.core, "decode_prefix_pages", 0)
        return self._skip

    def poll_pp_consensus(self) -> KVPoll:
        """The same as :meth:`poll` (this rank is the only pipeline stage)."""
        return self.poll()

    def pop_decode_prefix_len(self) -> int:
        """Tokens of this request decode holds already (whole pages), the first time
        it is asked once every decode rank said where to write; 0 before that
        and after. A prefill that popped a prefix inits and sends only the
        pages after it, as in 0.5.23."""
        pages = self._prefix_pages()
        if self._prefix_popped or pages is None or self._core_args is None:
            return 0
        self._prefix_popped = True
        self._first_page = int(pages)
        return self._first_page * int(self._core_args.page_size)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """How many pages will follow (after a popped prefix) and which metadata
        row carries the first token."""
        n = integer("num_kv_indices", num_kv_indices, 0)
        aux = optional_integer("aux_index", aux_index, -1)
        if self._first_page:
            self.core.init(n, aux, first_page=self._first_page)
        else:
            self.core.init(n, aux)

    def send(
        self, kv_indices: ArrayLike, state_indices: Any = None, num_kv_tokens: int | None = None
    ) -> None:
        """One chunk of pages (the last chunk's send also ships the metadata row).
        ``num_kv_tokens`` (0.5.23) is accepted and not needed: pages are whole here."""
        pages = page_indices("kv_indices", kv_indices)
        self.core.send(pages, state_indices)
        if self._started is None and (pages.size or state_indices is not None):
            self._started = time.perf_counter()
        self._pages += pages.size
        a = self._core_args
        if state_indices is not None and a is not None and a.state:
            # the backend took them: one row list per state component
            room = int(self.bootstrap_room or 0)
            rows = rows_of(room, state_indices, len(a.state), "state_indices") or []
            self._state_bytes += sum(r.size * sum(c.item_lens) for r, c in zip(rows, a.state))

    def get_transfer_metric(self) -> KVTransferMetric:
        """Latency from the first chunk handed over to the Success poll, and the
        bytes this rank handed over that decode did not hold already: pages
        after decode's cached prefix, and state rows. ``alloc_latency_s`` is
        None (not measured)."""
        a = self._core_args
        if a is not None:
            held = max((self._prefix_pages() or 0) - self._first_page, 0)
            kv = max(self._pages - held, 0) * sum(a.kv_item_lens)
            self._metric.transfer_total_bytes = int(kv + self._state_bytes)
        return self._metric

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """A chunk with pages, and always the last one (it carries the state rows)."""
        return num_pages > 0 or bool(last_chunk)

    def mark_prefill_complete(self) -> None:
        """Nothing to publish: decode allocates before prefill runs here (0.5.23's
        common senders do nothing either without that allocation policy)."""

    def get_max_transfer_tokens(self) -> int | None:
        return None


class FieldReceiver(_Handle, BaseKVReceiver):
    """Decode side of one request.

    Under the seed the handshake starts when it is built (with
    ``prefill_dp_rank``, 0 when None); under 0.5.23 it starts at
    ``init(prefill_dp_rank)``, or when built if ``prefill_dp_rank`` is given
    to the constructor (a keyword the field's receivers do not have).
    """

    #: tokens per page (a cached prefix must be whole pages); the backend's
    page_size = 1

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
        destination: Any = KVTransferDestination.DEVICE,
    ) -> None:
        """Where prefill must write: these pages, the request's pages after its
        first ``decode_prefix_len`` tokens (a whole number of pages decode
        holds already, which are not sent), this metadata row. Only device
        destinations are supported."""
        value = getattr(destination, "value", destination)
        if value not in (None, "device"):
            raise BadArgument(
                "destination", destination, "the device (host destinations are not supported)"
            )
        pages = page_indices("kv_indices", kv_indices)
        aux = optional_integer("aux_index", aux_index, -1)
        prefix = optional_integer("decode_prefix_len", decode_prefix_len, 0)
        if prefix and prefix % self.page_size:
            raise BadArgument(
                "decode_prefix_len",
                decode_prefix_len,
                f"a multiple of the page size {self.page_size} (only whole cached pages "
                "are skipped; round the prefix down to a page)",
            )
        self._send_metadata(pages, aux, state_indices, prefix)

    def is_abort_release_safe(self) -> bool:
        """True once no write for this request can land any more (it ended, or every
        prefill rank said it stopped writing): its pages may then be reused."""
        return bool(getattr(self.core, "drained", True))

    def _send_metadata(
        self, kv_indices: Any, aux_index: int | None, state_indices: Any, prefix: int | None
    ) -> None:
        self.core.send_metadata(
            kv_indices, -1 if aux_index is None else aux_index, state_indices, prefix or 0
        )
