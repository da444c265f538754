"""The Mooncake engine's status call reads only a batch's first task and frees
the batch then: a multi-entry batch leaks (linear RSS growth measured on the
raw engine) and may count as landed early. The backend submits one entry per
batch and a write counts as landed only when every one of its batches has."""

import numpy as np
import pytest

try:
    import mooncake.engine  # noqa: F401
except (ImportError, OSError) as e:
    pytest.skip(f"Mooncake engine not usable here ({e})", allow_module_level=True)

from transport.backends.mooncake import MooncakeEngine


class Engine:
    def __init__(self, unreachable_after=None):
        self.submitted = []
        self.status = {}
        self.unreachable_after = unreachable_after

    def batch_transfer_async_write(self, endpoint, srcs, dsts, lens):
        if self.unreachable_after is not None and len(self.submitted) >= self.unreachable_after:
            return 0
        self.submitted.append((srcs, dsts, lens))
        bid = len(self.submitted)
        self.status[bid] = 0
        return bid

    def transfer_check_status(self, bid):
        return self.status[bid]


def manager(engine):
    m = MooncakeEngine()
    m.engine = engine  # the stub stands in for the TransferEngine
    return m


def arrays(*xs):
    return [np.asarray(x, dtype=np.int64) for x in xs]


def test_every_entry_is_its_own_batch_and_lands_only_with_all_of_them():
    m = manager(Engine())
    token = m.write({"endpoint": "127.0.0.1:1"}, *arrays([10, 20, 30], [11, 21, 31], [4, 4, 8]), 0)
    assert m.engine.submitted == [([10], [11], [4]), ([20], [21], [4]), ([30], [31], [8])]
    assert token.pending == [1, 2, 3]
    m.engine.status[1] = 1  # the first batch landing is not the write landing
    assert m.check(token) == 0
    assert token.pending == [2, 3]  # a finished id is never asked about again
    m.engine.status[2] = m.engine.status[3] = 1
    assert m.check(token) == 1
    m.forget(token)
    assert token.pending == []


def test_a_failed_batch_fails_the_write():
    m = manager(Engine())
    token = m.write({"endpoint": "e"}, *arrays([1, 2], [3, 4], [5, 6]), 0)
    m.engine.status[2] = -1
    assert m.check(token) == -1


def test_a_reused_batch_id_is_not_taken_for_an_old_result():
    """The engine frees a finished batch and may give its id to the next write:
    nothing about a finished id may be remembered across writes."""
    m = manager(Engine())
    first = m.write({"endpoint": "e"}, *arrays([1, 2], [3, 4], [5, 6]), 0)
    m.engine.status[1] = 1
    assert m.check(first) == 0  # batch 1 done, batch 2 still in flight
    m.engine.submitted.clear()  # the engine hands out id 1 again
    m.engine.status = {2: 0}
    second = m.write({"endpoint": "e"}, *arrays([7], [8], [9]), 0)
    assert second.pending == [1]
    assert m.check(second) == 0  # in flight, whatever the first write saw of id 1


def test_an_unreachable_peer_is_reported_once():
    m = manager(Engine(unreachable_after=1))
    assert m.write({"endpoint": "e"}, *arrays([1, 2], [3, 4], [5, 6]), 0) is None


def test_a_write_past_the_window_waits_for_room_instead_of_flooding_the_engine():
    # the engine's TCP lanes refuse submissions past their queue: a write of many
    # runs (head slices, one per token) is fed as earlier batches land
    m = manager(Engine())
    m.WINDOW = 4
    token = m.write({"endpoint": "e"}, *arrays(range(10), range(10), [1] * 10), 0)
    assert len(m.engine.submitted) == 4 and token.pending == [1, 2, 3, 4]
    other = m.write({"endpoint": "e"}, *arrays([50, 51], [60, 61], [1, 1]), 0)
    assert other.pending == [5]  # a full window still lets every write move
    m.engine.status.update({1: 1, 2: 1})
    assert m.check(token) == 0
    assert token.pending == [3, 4, 6]  # two landed: one more fits beside the other write
    for bid in range(1, 12):
        m.engine.status[bid] = 1
    while (got := m.check(token)) == 0:
        for bid in m.engine.status:
            m.engine.status[bid] = 1
    assert got == 1 and len(m.engine.submitted) == 11
    assert [s[0][0] for s in m.engine.submitted if s[0][0] < 50] == list(range(10))  # in order
    m.forget(token)
    assert m.check(other) == 0  # its second run goes out now
    for bid in m.engine.status:
        m.engine.status[bid] = 1
    assert m.check(other) == 1
    m.forget(other)
    assert m._inflight == 0
