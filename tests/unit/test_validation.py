"""Bad input is a typed error and a refused call changes nothing."""

import numpy as np
import pytest
import torch

from buffers import BadArgument, MetadataBuffers, MetadataLayout, SlotAllocator, SlotOutOfRange
from lifecycle import KVPoll, RequestTable, Role, StepConfig, Stepper
from lifecycle.errors import InvalidArgument, InvalidRoom, LifecycleError

COLUMNS = (
    "room",
    "state",
    "role",
    "reason",
    "origin",
    "entered_step",
    "entered_time",
    "added_step",
    "fake",
    "abort_requested",
    "metadata_slot",
    "handle_index",
    "metadata_sent_at",
)


def snapshot(t: RequestTable):
    rows = t.order().copy()
    cols = {name: getattr(t, name)[rows].copy() for name in COLUMNS}
    return (
        t.rooms().tolist(),
        len(t),
        [t.slot_of(r) for r in t.rooms().tolist()],
        t.version,
        t.abort_count,
        t.terminal_count,
        cols,
    )


def same(a, b):
    assert a[:6] == b[:6]
    for name in a[6]:
        np.testing.assert_array_equal(a[6][name], b[6][name], err_msg=name)


BAD_ROOMS = [-1, 2**64, 1.7, "21", True, np.bool_(True), None, 2.0, [3], b"7", np.float64(3)]


@pytest.mark.parametrize("room", BAD_ROOMS, ids=repr)
def test_add_refuses_a_room_that_is_not_a_uint64_and_changes_nothing(room):
    t = RequestTable(rank=2)
    t.extend([5, 6])
    before = snapshot(t)
    with pytest.raises(InvalidRoom, match="rank 2"):
        t.add(room)
    same(before, snapshot(t))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"state": 9},
        {"state": -1},
        {"state": True},
        {"state": 2.0},
        {"state": "Success"},
        {"role": 2},
        {"role": False},
        {"role": "sender"},
        {"fake": "no"},
        {"fake": 1},
        {"metadata_slot": -2},
        {"metadata_slot": 1.5},
        {"metadata_slot": True},
        {"handle_index": -5},
        {"handle_index": "3"},
    ],
    ids=repr,
)
def test_add_refuses_bad_fields_and_changes_nothing(kwargs):
    t = RequestTable()
    t.extend([5, 6])
    before = snapshot(t)
    with pytest.raises(InvalidArgument):
        t.add(7, **kwargs)
    same(before, snapshot(t))


def test_many_rejections_leave_a_full_table_usable():
    t = RequestTable(capacity=64)
    bad = [-1, 2**64, 1.7, "21"]
    for i in range(100):
        with pytest.raises(LifecycleError):
            t.add(bad[i % 4])
        with pytest.raises(LifecycleError):
            t.add(1000 + i, state=9)
    t.extend(range(1, 65))  # no slot was lost to a refused call
    assert len(t) == 64 and t.rooms().tolist() == list(range(1, 65))


def test_numpy_integer_rooms_are_accepted_up_to_2_64_minus_1():
    t = RequestTable()
    t.add(np.uint64(2**64 - 1))
    t.add(np.int32(7))
    t.extend(np.array([2**63, 9], dtype=np.uint64))
    assert t.rooms().tolist() == [2**64 - 1, 7, 2**63, 9]
    t.remove(np.uint64(2**63))
    assert 2**63 not in t


def test_extend_refuses_float_and_negative_arrays_and_changes_nothing():
    t = RequestTable()
    t.add(1)
    before = snapshot(t)
    for arr in (np.array([2.0, 3.0]), np.array([4, -1]), np.array([True, False])):
        with pytest.raises(InvalidRoom):
            t.extend(arr)
    with pytest.raises(InvalidArgument):
        t.extend([2, 3], fake=[True])  # wrong length
    with pytest.raises(InvalidArgument):
        t.extend([2, 3], handles=[object()])
    same(before, snapshot(t))


def test_setters_refuse_bad_values_and_change_nothing():
    t = RequestTable()
    t.add(1)
    before = snapshot(t)
    with pytest.raises(InvalidArgument):
        t.set_metadata_slot(1, -3)
    with pytest.raises(InvalidArgument):
        t.set_handle_index(1, 2.5)
    with pytest.raises(InvalidArgument):
        t.mark_metadata_sent(1, float("nan"))
    with pytest.raises(InvalidRoom):
        t.request_abort(1.0)
    with pytest.raises(InvalidRoom):
        t.remove_many([1, "x"])
    same(before, snapshot(t))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_capacity": 2**40},
        {"initial_capacity": 0},
        {"initial_capacity": True},
        {"initial_capacity": 64.0},
        {"stuck_after": 0},
        {"stuck_after": 2.5},
        {"stuck_after": True},
        {"bootstrap_timeout": -1},
        {"bootstrap_timeout": float("inf")},
        {"bootstrap_timeout": float("nan")},
        {"bootstrap_timeout": "300"},
        {"waiting_timeout": True},
        {"invalid_status": "ignore"},
        {"invalid_status": ["fail"]},
    ],
    ids=repr,
)
def test_step_config_is_typed_and_bounded_up_front(kwargs):
    with pytest.raises(InvalidArgument):
        StepConfig(**kwargs)


def test_stepper_and_table_arguments_are_checked():
    t = RequestTable()
    with pytest.raises(InvalidArgument):
        RequestTable(capacity=2**40)
    with pytest.raises(InvalidArgument):
        RequestTable(rank=-1)
    with pytest.raises(InvalidArgument):
        Stepper(t, True)
    with pytest.raises(InvalidArgument):
        Stepper(t, 0, config={"stuck_after": 1})
    with pytest.raises(InvalidArgument):
        Stepper(t, 0, gates=[lambda rooms, idx: None])
    with pytest.raises(InvalidArgument):
        Stepper(t, 0, poller=object())
    with pytest.raises(InvalidArgument):
        Stepper(t, 0, queue=3)


# -- slot allocator -------------------------------------------------------------


def alloc_state(a: SlotAllocator):
    owners = [a.owner_of(s) for s in range(a.size)]
    return (a.available, a.in_use, a.quarantined, owners, a.live())


def test_alloc_takes_full_uint64_rooms():
    a = SlotAllocator(2)
    assert a.alloc(np.uint64(2**63)) == 0
    assert a.alloc(2**64 - 1) == 1
    assert a.live() == {0: 2**63, 1: 2**64 - 1}
    assert a.owner_of(0) == 2**63
    a.free(0, 2**63)
    a.free(1, np.uint64(2**64 - 1))
    assert a.available == 2 and a.in_use == 0


@pytest.mark.parametrize("room", [-1, -2, 0, 2**64, 1.5, "3", True, None], ids=repr)
def test_alloc_refuses_a_bad_room_before_taking_a_slot(room):
    a = SlotAllocator(2)
    before = alloc_state(a)
    with pytest.raises(BadArgument):
        a.alloc(room)
    assert alloc_state(a) == before
    assert a.alloc(5) == 0 and a.alloc(6) == 1


def test_ownership_is_kept_apart_from_the_free_and_quarantine_markers():
    a = SlotAllocator(3)
    s = a.alloc(1)
    a.free(s, 1, quarantine=True)
    assert a.quarantined == 1 and a.owner_of(s) is None
    # rooms that used to equal the markers cannot be confused with them
    for room in (2**64 - 1, 2**64 - 2):  # -1 and -2 as int64
        slot = a.alloc(room)
        assert a.owner_of(slot) == room
        a.free(slot, room)
    assert a.in_use == 0 and a.quarantined == 1


def test_free_and_release_refuse_bad_slots_and_change_nothing():
    a = SlotAllocator(2)
    a.alloc(9)
    before = alloc_state(a)
    for slot in (2, -1, 1.0, True, "0"):
        with pytest.raises((BadArgument, SlotOutOfRange)):
            a.free(slot, 9)
        with pytest.raises((BadArgument, SlotOutOfRange)):
            a.release(slot)
    with pytest.raises(BadArgument):
        a.free(0, -9)
    with pytest.raises(BadArgument):
        a.free(0, 9, quarantine="yes")
    assert alloc_state(a) == before
    for size in (0, 2**40, 2.0, True):
        with pytest.raises(BadArgument):
            SlotAllocator(size)


def test_metadata_slot_out_of_the_pool_is_a_typed_error():
    layout = MetadataLayout(hidden_size=16, hidden_dtype=torch.float32, max_top_logprobs=16)
    meta = MetadataBuffers(4, layout)
    with pytest.raises(SlotOutOfRange, match="slot 7"):
        meta.landed(np.array([0, 7]), np.array([1, 2], dtype=np.uint64))
    with pytest.raises(SlotOutOfRange):
        meta.landed(np.array([-1]), np.array([1], dtype=np.uint64))
    with pytest.raises(BadArgument):
        meta.read(1.0)
    with pytest.raises(BadArgument):
        meta.write(0, -5, {})
    assert meta.room_of(0) == 0


def test_role_enum_member_is_stored():
    t = RequestTable()
    t.add(3, role=Role.RECEIVER, state=KVPoll.WaitingForInput)
    assert t.info(3).role is Role.RECEIVER
