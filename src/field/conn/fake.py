"""The field's fake connector (warm-up requests move no data), over our fake backend.

Sender, the same under both releases (0.5.23's fake connector; the seed's
matches it): WaitingForInput until the first ``send`` (any chunk: nothing is
transferred, so a chunk that never comes cannot change the outcome), then
Success at the next poll. ``init`` only arms the waiting timeout, whatever
the page count: ``init(0)`` is not a conclusion, a zero-page last chunk is
still sent (``should_send_kv_chunk``). The timeout: armed at the first poll
after ``init`` (queueing and prefill time are not charged), lasting
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` seconds (read when the sender is
built; 300 by default); a sender still waiting when it expires is Failed
(reason waiting timeout), so a request whose ``send`` never comes cannot pin
the prefill queue. No deadline before ``init``; repeated polls alone never
conclude a request.

Receiver, 0.5.23: Bootstrapping until ``init(prefill_dp_rank)``, then
WaitingForInput until ``send_metadata(...)``, then Success at the next poll.
Seed: WaitingForInput from the start (the handshake is instant) until
``init(kv_indices, aux_index, state_indices)``, then Success. Positional
arguments of ``init`` are read by the release in force when the receiver is
built (see :mod:`field.release`); keywords under either.

Both: ``abort`` makes it Failed, even after Success (as in the field); a
Failed one stays Failed. ``failure_exception`` always raises.

A fake sender or receiver may be built with any manager (the field pairs a
fake sender with a real backend's manager for warm-up requests): with one of
ours it uses that manager's statuses, otherwise a process-wide fake manager.
The statuses there follow this object's (an abort after Success is the one
change the backend's latched status does not take).
"""

from __future__ import annotations

import os
import time
from typing import Any

from numpy.typing import ArrayLike

from field._checks import integer, optional_integer, page_indices
from field.conn.base import BaseKVManager, KVTransferMetric
from field.conn.handles import FieldReceiver, FieldSender
from field.conn.kv_args import KVArgs
from field.conn.shapes import SENDER_SIGNATURE, sender_options
from field.release import UNSET
from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll
from transport.backends.fake import FakeManager
from transport.errors import TransferFailed
from transport.registry import get_backend

__all__ = ["FakeKVManager", "FakeKVSender", "FakeKVReceiver", "CLASSES", "WAITING_TIMEOUT_VAR"]

WAITING_TIMEOUT_VAR = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
_DEFAULT_WAITING_TIMEOUT = 300.0
_shared: FakeManager | None = None


def _waiting_timeout() -> float:
    raw = os.environ.get(WAITING_TIMEOUT_VAR, "")
    if raw == "":
        return _DEFAULT_WAITING_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"{WAITING_TIMEOUT_VAR} must be a number of seconds, got {raw!r}"
        ) from None
    if not value > 0:
        raise ValueError(f"{WAITING_TIMEOUT_VAR} must be > 0 seconds, got {raw!r}")
    return value


class FakeKVManager(BaseKVManager):
    """One per rank; holds the statuses of its fake senders and receivers.
    ``teardown`` is the base's (not supported, as for 0.5.23's fake)."""

    def __init__(
        self,
        args: Any,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.attn_cp_rank, self.attn_cp_size = 0, 1
        self.core: FakeManager = get_backend("fake").manager()

    def register_to_bootstrap(self) -> None:
        """Nothing to register: the fake path needs no rendezvous."""


def _statuses(mgr: Any) -> FakeManager:
    global _shared
    if isinstance(mgr, FakeKVManager):
        return mgr.core
    if _shared is None:
        _shared = FakeManager()
    return _shared


class _FakeHandle:
    """What the fake sender and receiver share: a concluded state of their own,
    mirrored into the backend's status arrays."""

    core: Any
    bootstrap_room: int | None
    _concluded: KVPoll | None
    _reason: FailureReason

    @property
    def conclude_state(self) -> KVPoll | None:
        """Success or Failed once a poll (or an abort) has concluded it, else None."""
        return self._concluded

    def _conclude(self, status: KVPoll, reason: FailureReason = FailureReason.NONE) -> KVPoll:
        self._concluded, self._reason = status, reason
        if not self.core.detached:
            self.core.manager.set(self.core.index, status, reason)
        return status

    def abort(self) -> None:
        self._conclude(KVPoll.Failed, FailureReason.ABORTED)

    def _failure(self, side: str) -> TransferFailed:
        if self._concluded == KVPoll.Failed:
            why = self._reason.label
        else:
            why = (self._concluded or KVPoll.WaitingForInput).name
        return TransferFailed(
            int(self.bootstrap_room or 0),
            f"Fake KV{side} Exception",
            f"{why}; the fake backend moves no data",
        )


class FakeKVSender(_FakeHandle, FieldSender):
    __signature__ = SENDER_SIGNATURE

    def __init__(
        self,
        mgr: Any,
        bootstrap_addr: str | None,
        bootstrap_room: int | None,
        *args: Any,
        dest_tp_ranks: Any = UNSET,
        pp_rank: Any = UNSET,
        req_has_disagg_prefill_dp_rank: Any = UNSET,
    ) -> None:
        options = sender_options(
            "FakeKVSender()",
            args,
            dest_tp_ranks=dest_tp_ranks,
            pp_rank=pp_rank,
            req_has_disagg_prefill_dp_rank=req_has_disagg_prefill_dp_rank,
        )
        timeout = _waiting_timeout()
        core = _statuses(mgr).sender(int(bootstrap_room or 0))
        super().__init__(core, mgr, bootstrap_addr, bootstrap_room, **options)
        self.waiting_timeout = timeout
        self.waiting_since: float | None = None
        self.inited = False
        self.has_sent = False
        self._concluded = None
        self._reason = FailureReason.NONE

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """Arms the waiting timeout; the page count does not conclude anything."""
        integer("num_kv_indices", num_kv_indices, 0)
        optional_integer("aux_index", aux_index, -1)
        self.inited = True

    def send(
        self, kv_indices: ArrayLike, state_indices: Any = None, num_kv_tokens: int | None = None
    ) -> None:
        """Any chunk counts: the next poll reports Success."""
        page_indices("kv_indices", kv_indices)
        self.has_sent = True

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """Send a chunk that has pages, and always the last one (even empty):
        the sender concludes only after a send."""
        return bool(last_chunk) or num_pages > 0

    def poll(self) -> KVPoll:
        if self._concluded is not None:
            return self._concluded
        if not self.has_sent:
            if self.inited:
                now = time.monotonic()
                if self.waiting_since is None:
                    self.waiting_since = now
                elif now - self.waiting_since >= self.waiting_timeout:
                    return self._conclude(KVPoll.Failed, FailureReason.WAITING_TIMEOUT)
            return KVPoll.WaitingForInput
        return self._conclude(KVPoll.Success)

    def poll_pp_consensus(self) -> KVPoll:
        """The same as :meth:`poll` (nothing to agree on across PP stages)."""
        return self.poll()

    def mark_prefill_complete(self) -> None:
        """Nothing to publish: no decode peer waits on a fake request."""

    def pop_decode_prefix_len(self) -> int:
        return 0

    def get_max_transfer_tokens(self) -> int | None:
        return None

    def get_transfer_metric(self) -> KVTransferMetric:
        """Nothing measured (nothing moves): every field None, as 0.5.23's fake."""
        return KVTransferMetric()

    def failure_exception(self) -> None:
        """Always raises (the field's fake has no transfer to report on)."""
        raise self._failure("Sender")


class FakeKVReceiver(_FakeHandle, FieldReceiver):
    def __init__(
        self,
        mgr: Any,
        bootstrap_addr: str | None,
        bootstrap_room: int | None = None,
        prefill_dp_rank: int | None = None,
    ) -> None:
        self._concluded = None
        self._reason = FailureReason.NONE
        self.has_sent_metadata = False
        self.abort_notified = False
        core = _statuses(mgr).receiver(int(bootstrap_room or 0))
        super().__init__(core, mgr, bootstrap_addr, bootstrap_room, prefill_dp_rank)

    @property
    def require_staging(self) -> bool:
        return False

    def poll(self) -> KVPoll:
        if self._concluded is not None:
            return self._concluded
        if not self.bootstrap_done:
            return KVPoll.Bootstrapping
        if not self.has_sent_metadata:
            return KVPoll.WaitingForInput
        return self._conclude(KVPoll.Success)

    def send_metadata(  # type: ignore[override]
        self,
        kv_indices: ArrayLike,
        aux_index: int | None = None,
        state_indices: Any = None,
        decode_prefix_len: int | None = None,
    ) -> None:
        """Where prefill would write; the next poll after ``init`` reports Success.
        ``decode_prefix_len`` is checked (an integer >= 0) and unused: nothing moves,
        and the fake sender's ``pop_decode_prefix_len()`` is 0, as in 0.5.23."""
        self._send_metadata(
            page_indices("kv_indices", kv_indices),
            optional_integer("aux_index", aux_index, -1),
            state_indices,
            optional_integer("decode_prefix_len", decode_prefix_len, 0),
        )

    def _send_metadata(
        self, kv_indices: Any, aux_index: int | None, state_indices: Any, prefix: int | None
    ) -> None:
        self.has_sent_metadata = True

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """No prefill rank holds a fake receiver's pages: nothing to notify."""

    def is_abort_release_safe(self) -> bool:
        """Always True: nothing is ever written to a fake receiver's pages."""
        return True

    def failure_exception(self) -> None:
        """Always raises (the field's fake has no transfer to report on)."""
        raise self._failure("Receiver")


#: what :func:`field.conn.backends.get_kv_class` hands out (no bootstrap server: none is needed)
CLASSES: dict[str, Any] = {
    "kvargs": KVArgs,
    "manager": FakeKVManager,
    "sender": FakeKVSender,
    "receiver": FakeKVReceiver,
}
