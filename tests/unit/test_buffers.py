import functools
import itertools
import operator

import numpy as np
import pytest
import torch

from buffers import (
    MIN_ROW_BYTES,
    DoubleFree,
    GeometryMismatch,
    KVArgs,
    LayoutError,
    MetadataBuffers,
    MetadataLayout,
    NotQuarantined,
    SlotAllocator,
    SlotNotOwned,
    SlotOutOfRange,
    SlotQuarantined,
    StateComponent,
    StateType,
    check_draft_geometry,
    collect_state,
    cp_filter_chunk,
    cp_filter_pages,
    cp_split,
    ring_state_page,
)

SMALL = MetadataLayout(hidden_size=16, hidden_dtype=torch.float32, max_top_logprobs=16)


# -- allocator ------------------------------------------------------------------
def test_fifo_reuse_and_exhaustion():
    a = SlotAllocator(3)
    assert [a.alloc(r) for r in (11, 12, 13)] == [0, 1, 2]
    assert a.alloc(14) is None  # waiting is normal
    a.free(1, 12)
    a.free(0, 11)
    assert a.alloc(15) == 1
    assert a.alloc(16) == 0
    assert (a.in_use, a.available) == (3, 0)
    assert a.owner_of(1) == 15


def test_misuse_is_typed_and_changes_nothing():
    meta = MetadataBuffers(2, SMALL)
    a = SlotAllocator(2, meta)
    s = a.alloc(7)
    meta.write(s, 7, {"output_ids": [1]})
    with pytest.raises(SlotNotOwned, match="belongs to room=7"):
        a.free(s, 8)
    assert meta.room_of(s) == 7  # not zeroed by the refused free
    a.free(s, 7)
    assert meta.room_of(s) == 0  # zeroed by the real one
    with pytest.raises(DoubleFree, match="slot 0"):
        a.free(s, 7)
    with pytest.raises(SlotOutOfRange):
        a.free(5, 7)
    with pytest.raises(SlotOutOfRange):
        a.owner_of(-1)
    assert (a.in_use, a.available) == (0, 2)


def test_quarantine_holds_a_slot_until_released():
    meta = MetadataBuffers(1, SMALL)
    a = SlotAllocator(1, meta)
    s = a.alloc(9)
    a.free(s, 9, quarantine=True)
    assert a.alloc(10) is None
    assert (a.in_use, a.available, a.quarantined) == (0, 0, 1)
    with pytest.raises(SlotQuarantined):
        a.free(s, 9)
    meta.write(s, 9, {"output_ids": [3]})  # a late remote write lands meanwhile
    a.release(s)
    assert meta.room_of(s) == 0
    with pytest.raises(NotQuarantined):
        a.release(s)
    assert a.alloc(10) == s


# -- metadata rows ------------------------------------------------------------------
def test_default_layout_matches_the_field():
    lay = MetadataLayout()
    widths = {f.name: (f.width, f.dtype) for f in lay.fields}
    assert widths["output_ids"] == (16, torch.int32)
    assert widths["output_top_logprobs_val"] == (128, torch.float32)
    assert widths["output_topk_index"] == (16, torch.int64)
    assert widths["output_hidden_states"] == (4096, torch.bfloat16)
    assert widths["bootstrap_room"][0] == 8
    assert [f.name for f in lay.fields][-1] == "bootstrap_room"
    assert all(f.row_bytes >= MIN_ROW_BYTES for f in lay.fields)


def test_narrow_rows_are_refused():
    with pytest.raises(LayoutError, match="64-byte minimum"):
        MetadataBuffers(2, MetadataLayout(hidden_size=8, hidden_dtype=torch.float32))
    with pytest.raises(LayoutError, match="output_top_logprobs"):
        MetadataBuffers(2, MetadataLayout(max_top_logprobs=4))


def test_buf_infos_address_every_row():
    m = MetadataBuffers(5, SMALL)
    ptrs, lens, items = m.buf_infos()
    assert len(ptrs) == len(lens) == len(items) == len(SMALL.fields)
    for spec, ptr, ln, item in zip(SMALL.fields, ptrs, lens, items):
        t = m.tensors[spec.name]
        assert (ptr, ln, item) == (t.data_ptr(), t.nbytes, t[0].nbytes)
        assert t[3].data_ptr() == ptr + 3 * item


def test_write_read_copies_and_room_last():
    m = MetadataBuffers(4, SMALL)
    m.write(2, 2**64 - 3, {"output_ids": [42, 43], "cached_tokens": [1]})
    rec = m.read(2)
    assert rec.first_token == 42
    assert rec.bootstrap_room == 2**64 - 3
    rec.output_ids[0] = 0  # a copy: the row is untouched
    assert m.read(2).first_token == 42
    with pytest.raises(LayoutError, match="room 0"):
        m.write(1, 0, {})
    with pytest.raises(LayoutError, match="unknown"):
        m.write(1, 5, {"bogus": [1]})
    with pytest.raises(LayoutError, match="do not fit"):
        m.write(1, 5, {"output_ids": list(range(17))})
    assert m.room_of(1) == 0


def test_landed_and_corrupt_vectorised():
    m = MetadataBuffers(4, SMALL)
    m.write(0, 100, {})
    m.write(1, 999, {})
    slots = np.array([0, 1, 2])
    rooms = np.array([100, 101, 102], dtype=np.uint64)
    landed, corrupt = m.landed(slots, rooms)
    assert landed.tolist() == [True, False, False]
    assert corrupt.tolist() == [False, True, False]


def test_int64_fallback_for_rooms():
    lay = MetadataLayout(
        hidden_size=16, hidden_dtype=torch.float32, max_top_logprobs=16, room_dtype=torch.int64
    )
    m = MetadataBuffers(2, lay)
    m.write(1, 2**64 - 1, {})
    assert m.room_of(1) == 2**64 - 1
    assert m.landed(np.array([1]), np.array([2**64 - 1], dtype=np.uint64))[0].tolist() == [True]


# -- pages ------------------------------------------------------------------------------
def test_cp_split_covers_everything_once():
    for total in range(0, 30):
        for n in range(1, 6):
            spans = [cp_split(total, n, r) for r in range(n)]
            assert spans[0][0] == 0
            assert spans[-1][1] == total
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert cp_split(10, 3, 0) == (0, 4)
    assert cp_split(2, 4, 3) == (2, 2)  # fewer pages than ranks: high ranks get nothing
    with pytest.raises(ValueError, match="rank 4"):
        cp_split(10, 4, 4)


def test_cp_filter_pages_is_positional_so_non_contiguous_pages_work():
    contiguous = np.arange(50, 60)
    assert cp_filter_pages(contiguous, 3, 1).tolist() == [54, 55, 56]
    scattered = np.array([7, 3, 90, 12, 44, 1, 8])
    parts = [cp_filter_pages(scattered, 3, r).tolist() for r in range(3)]
    assert (
        functools.reduce(operator.iadd, parts, []) == scattered.tolist()
    )  # every page owned by exactly one rank


def test_cp_filter_chunk():
    idx, sl = cp_filter_chunk(slice(2, 8), 12, 3, 1)  # rank 1 owns 4..8
    assert (idx.tolist(), sl) == ([2, 3, 4, 5], slice(4, 8))
    idx, sl = cp_filter_chunk(slice(0, 3), 12, 3, 2)  # nothing: empty slice at the chunk start
    assert (idx.tolist(), sl) == ([], slice(0, 0))
    with pytest.raises(ValueError, match="forward slice"):
        cp_filter_chunk(slice(5, 3), 12, 3, 0)


def test_ring_state_page():
    assert ring_state_page(0, 3, 512) is None
    assert ring_state_page(256, 3, 512) is None
    assert ring_state_page(300, 3, 512, online=True) == 3
    assert ring_state_page(300, 3, 512) == 3 * 4 + (299 % 512) // 128
    assert ring_state_page(700, 1, 512) == 4 + (699 % 512) // 128
    with pytest.raises(ValueError, match="multiple of 128"):
        ring_state_page(5, 0, 100)


# -- KV args and state components ------------------------------------------------------
def comp(t=StateType.MAMBA, n=2, item=64, split=None):
    return StateComponent(t, [1000 * i for i in range(n)], [item * 10] * n, [item] * n, split)


def test_state_components_validate_and_append_in_order():
    with pytest.raises(LayoutError, match="parallel"):
        StateComponent(StateType.SWA, [1, 2], [64], [64, 64])
    with pytest.raises(LayoutError, match="whole number"):
        StateComponent(StateType.SWA, [1], [100], [64])
    kv = KVArgs(0, [1], [4096], [64])
    kv2 = kv.with_state(comp(StateType.MAMBA)).with_state(comp(StateType.SWA_RING))
    assert [c.type for c in kv2.state] == [StateType.MAMBA, StateType.SWA_RING]
    with pytest.raises(LayoutError):
        KVArgs(0, [1, 2], [4096], [64])


def test_pools_describe_their_own_state():
    class Mamba:
        def state_components(self):
            return [comp(StateType.MAMBA)]

    class Plain:
        pass

    assert [c.type for c in collect_state(Plain(), Mamba(), Mamba())] == [StateType.MAMBA] * 2


def test_draft_geometry_mismatch_names_both_sides():
    check_draft_geometry([comp()], [comp()])
    with pytest.raises(GeometryMismatch, match=r"target .*128.*draft .*64"):
        check_draft_geometry([comp(item=128)], [comp(item=64)])
    with pytest.raises(GeometryMismatch, match="number of state components"):
        check_draft_geometry([comp()], [])
