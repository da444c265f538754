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
from support.cores import core_of, request_at
from transport.backends.mooncake import MooncakeEngine
from transport.connector.core.events import Write
from transport.connector.core.graph import Phase
from transport.connector.inflight import InFlight
from transport.layout import runs


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


def bare_engine(stub):
    e = MooncakeEngine()
    e.engine = stub  # the stub stands in for the TransferEngine
    return e


def handle(core, events, now=0.0):
    for ev in events:
        core.handle(ev, now)


def test_a_finished_batch_is_read_once_and_remembered():
    engine = bare_engine(StubEngine(statuses=[0, 1]))  # "done" once, then 0 again
    from transport.backends.mooncake import _Batches

    token = _Batches("e", [])
    token.pending = [5]
    assert engine.check(token) == 0
    assert engine.check(token) == 1
    assert engine.check(token) == 1  # not read again: a second read would look "in progress"
    engine.forget(token)
    assert token.pending == []


def test_batch_id_zero_means_the_peer_is_unreachable():
    m, flight = core_of(), InFlight(bare_engine(StubEngine(submit_id=0)))
    req = request_at(m, Phase.Writing)
    one = np.array([1])
    m.submit(req, 1, {"endpoint": "127.0.0.1:1"}, (one, one * 2, one * 3), b"")
    (write,) = m.take_effects()
    assert isinstance(write, Write) and req.tokens == [write.write]
    handle(m, [flight.issue(write)])  # the engine's "unreachable", handed back
    assert m.status[req.index] == KVPoll.Failed
    assert m.reason[req.index] == FailureReason.PEER_DEAD
    assert m.phase[req.index] == Phase.Aborted  # quarantined until drained
    assert req.tokens == []
    assert req.reason == FailureReason.PEER_DEAD  # decode hears why once nothing is in flight


def test_failed_batch_is_a_transfer_error_and_latches():
    stub = StubEngine(statuses=[-1], submit_id=3)
    m, flight = core_of(), InFlight(bare_engine(stub))
    req = request_at(m, Phase.Writing)
    one = np.array([1])
    m.submit(req, 1, {"endpoint": "e"}, (one, one * 2, one * 3), b"")
    (write,) = m.take_effects()
    assert flight.issue(write) is None and len(stub.submitted) == 1  # in flight
    handle(m, flight.reap())  # its batch failed
    assert m.status[req.index] == KVPoll.Failed
    assert m.reason[req.index] == FailureReason.TRANSFER_ERROR
    assert req.tokens == [] and flight.tokens == {}
    m.fire(req, "complete")  # not declared from Aborted: nothing moves
    assert m.status[req.index] == KVPoll.Failed  # terminal states latch


def test_page_runs_coalesce_only_where_both_sides_are_contiguous():
    s, d, n = runs(np.array([4, 5, 6, 9, 10]), np.array([0, 1, 5, 6, 7]))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([4, 6, 9], [0, 5, 6], [2, 1, 2])
