"""The field's fake connector (warm-up requests move no data), over our fake backend.

Sender: WaitingForInput until every page it was told about has been sent
(``init(0)``: at once; ``send`` without ``init``: at the first send), then
Success. It never reports Transferring. Its waiting timeout, as in the field:
the deadline is armed at the first poll after ``init`` (queueing and prefill
time are not charged), lasts ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` seconds
(read when the sender is built; 300 by default), and a sender still waiting
after it is Failed (reason waiting timeout) so that a request whose ``send``
never comes cannot pin the prefill queue. Repeated polls alone never conclude
a request. Receiver: WaitingForInput until ``init``, then Success. ``abort``
makes either Failed; Success and Failed latch.

A fake sender or receiver may be built with any manager (the field pairs a
fake sender with a real backend's manager for warm-up requests): with one of
ours it uses that manager's statuses, otherwise a process-wide fake manager.
"""

from __future__ import annotations

import os
import time
from typing import Any

from field.conn.handles import FieldReceiver, FieldSender
from field.conn.kv_args import KVArgs
from lifecycle.reasons import FailureReason
from lifecycle.status import KVPoll
from transport.errors import TransferFailed
from transport.fake import FakeManager
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


class FakeKVManager:
    """One per rank; holds the statuses of its fake senders and receivers."""

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


def _fake_failure(side: str, handle: Any) -> TransferFailed:
    status = KVPoll(handle.core.poll())
    why = handle.core.failure_reason().label if status == KVPoll.Failed else status.name
    return TransferFailed(
        int(handle.bootstrap_room or 0),
        f"Fake KV{side} Exception",
        f"{why}; the fake backend moves no data",
    )


class FakeKVSender(FieldSender):
    def __init__(
        self,
        mgr: Any,
        bootstrap_addr: str | None,
        bootstrap_room: int | None,
        dest_tp_ranks: list[int] | None = None,
        pp_rank: int | None = None,
    ) -> None:
        core = _statuses(mgr).sender(int(bootstrap_room or 0))
        super().__init__(core, mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks, pp_rank)
        self.waiting_timeout = _waiting_timeout()
        self.waiting_since: float | None = None
        self.inited = False

    @property
    def has_sent(self) -> bool:
        """Every page it was told about has been sent."""
        return bool(self.core.poll() == KVPoll.Success) or (
            self.inited and self.core.manager.pages_left.get(self.core.index, 1) <= 0
        )

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        super().init(num_kv_indices, aux_index)
        self.inited = True

    @staticmethod
    def should_send_kv_chunk(num_pages: int, last_chunk: bool) -> bool:
        """Send a chunk that has pages, and always the last one (even empty)."""
        return bool(last_chunk) or num_pages > 0

    def poll(self) -> KVPoll:
        status = KVPoll(self.core.poll())
        if status.terminal:
            return status
        if self.inited:
            now = time.monotonic()
            if self.waiting_since is None:
                self.waiting_since = now
            elif now - self.waiting_since > self.waiting_timeout:
                self.core.manager.set(self.core.index, KVPoll.Failed, FailureReason.WAITING_TIMEOUT)
                return KVPoll.Failed
        return KVPoll.WaitingForInput

    def failure_exception(self) -> None:
        """Always raises (the field's fake has no transfer to report on)."""
        raise _fake_failure("Sender", self)


class FakeKVReceiver(FieldReceiver):
    def __init__(
        self,
        mgr: Any,
        bootstrap_addr: str | None,
        bootstrap_room: int | None = None,
        prefill_dp_rank: int | None = None,
    ) -> None:
        core = _statuses(mgr).receiver(int(bootstrap_room or 0))
        super().__init__(core, mgr, bootstrap_addr, bootstrap_room, prefill_dp_rank)

    def failure_exception(self) -> None:
        """Always raises (the field's fake has no transfer to report on)."""
        raise _fake_failure("Receiver", self)


#: what :func:`field.conn.backends.get_kv_class` hands out (no bootstrap server: none is needed)
CLASSES: dict[str, Any] = {
    "kvargs": KVArgs,
    "manager": FakeKVManager,
    "sender": FakeKVSender,
    "receiver": FakeKVReceiver,
}
