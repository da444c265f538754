"""Engine quirks the Mooncake backend must absorb, against a stub engine."""

import numpy as np
import pytest

try:  # a missing system library (libibverbs.so.1) raises ImportError or OSError
    import mooncake.engine  # noqa: F401
except (ImportError, OSError) as e:
    pytest.skip(
        f"Mooncake engine not usable here ({e}); install Debian's libibverbs1 "
        "(`apt-get install libibverbs1`, or `make install` as root) and pd-lifecycle[mooncake]",
        allow_module_level=True,
    )

from lifecycle import FailureReason, KVPoll
from transport.attempts import Attempts
from transport.backends.mooncake import MooncakeConfig, MooncakeEngine, MooncakeManager
from transport.connector.graph import Phase
from transport.connector.hub import SIDES
from transport.connector.legs import Request
from transport.layout import runs
from transport.status_arrays import StatusArrays


class StubEngine:
    def __init__(self, statuses=(), submit_id=7):
        self.statuses = list(statuses)
        self.submit_id = submit_id
        self.submitted = []

    def transfer_check_status(self, bid):
        return self.statuses.pop(0) if self.statuses else 0

    def batch_transfer_async_write(self, endpoint, srcs, dsts, lens):
        self.submitted.append((endpoint, srcs, dsts, lens))
        return self.submit_id


def bare_manager(engine, role="prefill"):
    m = object.__new__(MooncakeManager)  # no engine, no store: just the bookkeeping
    StatusArrays.__init__(m)
    m.engine = MooncakeEngine()
    m.engine.engine = engine  # the stub stands in for the TransferEngine
    m.NOTIFIES = MooncakeEngine.NOTIFIES
    m.config = MooncakeConfig(role=role, tp_rank=0, store_port=1)  # never reached
    m.attempts, m._peer_dead = Attempts(), set()
    m._reqs = m.attempts.reqs
    m.side = SIDES[role](m)
    m.stats = dict.fromkeys(
        ("bytes_written", "writes", "fenced", "unfenced", "stale", "stale_epoch"), 0
    )
    return m


def writing_request(m, room=9):
    req = Request(room=room, index=m.take(int(KVPoll.Transferring)))
    m.phase[req.index] = Phase.Writing
    m.attempts.add(room, 0, req)
    return req


def test_a_finished_batch_is_read_once_and_remembered():
    m = bare_manager(StubEngine(statuses=[0, 1]))  # the engine says "done" once, then 0 again
    from transport.backends.mooncake import _Batches

    token = _Batches("e", [])
    token.pending = [5]
    assert m.engine.check(token) == 0
    assert m.engine.check(token) == 1
    assert m.engine.check(token) == 1  # not read again: a second read would look "in progress"
    m.engine.forget(token)
    assert token.pending == []


def test_batch_id_zero_means_the_peer_is_unreachable():
    m = bare_manager(StubEngine(submit_id=0))
    req = writing_request(m)
    one = np.array([1])
    m._submit(req, {"endpoint": "127.0.0.1:1"}, (one, one * 2, one * 3), b"", None)
    assert m.status[req.index] == KVPoll.Failed
    assert m.reason[req.index] == FailureReason.PEER_DEAD
    assert m.phase[req.index] == Phase.Aborted  # quarantined until drained
    assert req.tokens == []
    assert req.reason == FailureReason.PEER_DEAD  # decode hears why once nothing is in flight


def test_failed_batch_is_a_transfer_error_and_latches():
    m = bare_manager(StubEngine(statuses=[-1]))
    req = writing_request(m)
    from transport.backends.mooncake import _Batches

    token = _Batches("e", [])
    token.pending = [3]
    req.tokens = [token]  # a write's token: its batches
    m._reap(req, store=None)
    assert m.status[req.index] == KVPoll.Failed
    assert m.reason[req.index] == FailureReason.TRANSFER_ERROR
    assert req.tokens == []
    m._fire(req, "complete")  # not declared from Aborted: nothing moves
    assert m.status[req.index] == KVPoll.Failed  # terminal states latch


def test_page_runs_coalesce_only_where_both_sides_are_contiguous():
    s, d, n = runs(np.array([4, 5, 6, 9, 10]), np.array([0, 1, 5, 6, 7]))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([4, 6, 9], [0, 5, 6], [2, 1, 2])
