import numpy as np
import pytest

from lifecycle import KVPoll, RequestTable
from lifecycle.errors import DuplicateRequest, ReservedRoom, UnknownRequest


def test_add_remove_keeps_queue_order():
    t = RequestTable(capacity=2)
    t.extend([5, 6, 7, 8])
    t.remove(6)
    t.add(9)
    assert t.rooms().tolist() == [5, 7, 8, 9]
    assert len(t) == 4
    assert 6 not in t
    assert 9 in t


def test_slots_are_reused_after_compaction():
    t = RequestTable(capacity=4)
    t.extend([1, 2, 3, 4])
    t.remove_many([1, 2])
    t.extend([10, 11])
    assert t._cap == 4
    assert t.rooms().tolist() == [3, 4, 10, 11]


def test_duplicate_and_room_zero_are_refused_and_nothing_changes():
    t = RequestTable(rank=3)
    t.extend([1, 2])
    with pytest.raises(DuplicateRequest, match=r"room=2.*rank 3"):
        t.extend([7, 2])
    with pytest.raises(DuplicateRequest):
        t.extend([8, 8])
    with pytest.raises(ReservedRoom, match="fake=True"):
        t.add(0)
    assert t.rooms().tolist() == [1, 2]
    t.add(0, fake=True)
    assert t.info(0).fake


def test_unknown_room_and_remove_many_atomic():
    t = RequestTable()
    t.extend([1, 2])
    with pytest.raises(UnknownRequest, match="room=5"):
        t.remove(5)
    with pytest.raises(UnknownRequest):
        t.remove_many([1, 5])
    assert t.rooms().tolist() == [1, 2]


def test_columns_hold_state_and_info():
    t = RequestTable()
    t.add(42, state=KVPoll.WaitingForInput, metadata_slot=3)
    info = t.info(42)
    assert info.state == KVPoll.WaitingForInput
    assert info.metadata_slot == 3
    t.request_abort(42)
    assert t.abort_requested[t.slot_of(42)]


def test_large_rooms_roundtrip():
    t = RequestTable()
    big = 2**64 - 1
    t.add(big)
    assert t.rooms().dtype == np.uint64
    assert int(t.rooms()[0]) == big


def test_growth_preserves_everything():
    t = RequestTable(capacity=1)
    t.extend(range(1, 1001))
    t.remove_many(range(1, 1001, 2))
    assert t.rooms().tolist() == list(range(2, 1001, 2))


def test_adding_or_removing_nothing_changes_nothing_even_with_empty_columns():
    t = RequestTable()
    t.extend([1, 2])
    version = t.version
    # a scheduler calls these every iteration, often with nothing in them
    assert t.extend([], handle_indices=[], metadata_slots=[], epochs=[], fake=[]).size == 0
    assert t.extend(np.empty(0, dtype=np.uint64), handles=[]).size == 0
    assert t.remove_many([]) == 0
    assert t.version == version and t.rooms().tolist() == [1, 2]
    # an empty column for a non-empty batch is still refused
    with pytest.raises(Exception, match="handle_indices"):
        t.extend([3], handle_indices=[])
    assert t.rooms().tolist() == [1, 2]


def test_the_table_counts_its_retried_rows():
    t = RequestTable()
    t.extend([1, 2, 3], epochs=[0, 2, 1])
    assert t.epoched == 2
    t.remove(2)
    assert t.epoched == 1
    t.add(2, epoch=3)  # the retry joins again, an epoch on
    t.remove_many([1, 3])
    assert t.epoched == 1
    t.remove(2)
    assert t.epoched == 0
