"""field.data.buffers: the field's allocator, metadata rows, page filters, state and aborts."""

import types

import numpy as np
import pytest
import torch

import field.data.buffers as compat
import field.step.abort
from buffers import DoubleFree, GeometryMismatch, SlotOutOfRange
from buffers import MetadataBuffers as CoreMetadataBuffers
from field.data.buffers import (
    ReqToMetadataIdxAllocator,
    filter_kv_indices_for_cp_rank,
    get_dsv4_c128_state_indices,
    page_indices_to_cp_rank_page_indices,
)
from field.data.metadata import MetadataBuffers
from field.data.state import append_state_component, is_mla_backend, setup_state_kv_args
from field.data.state_types import StateType
from field.engine import DisaggregationMode, FinishAbort
from field.step.abort import is_aborted, prepare_abort


def test_exports_exactly_the_field_names():
    """The module exports the field names it defines; the field's metadata, state
    and abort names come from their own modules, and the modules that stand for
    the engine's (field.utils, field.conn.base) offer each of those."""
    import field.conn.base
    import field.utils

    own = [
        "ReqToMetadataIdxAllocator",
        "filter_kv_indices_for_cp_rank",
        "get_dsv4_c128_state_indices",
        "page_indices_to_cp_rank_page_indices",
    ]
    assert sorted(compat.__all__) == sorted(own)
    elsewhere = {
        "DisaggregationMode": DisaggregationMode,
        "MetadataBuffers": MetadataBuffers,
        "StateType": StateType,
        "append_state_component": append_state_component,
        "is_aborted": is_aborted,
        "is_mla_backend": is_mla_backend,
        "prepare_abort": prepare_abort,
        "setup_state_kv_args": setup_state_kv_args,
    }
    # StateType is offered by field.conn.base, as the engine's base.conn has it
    face = {n: field.conn.base if n == "StateType" else field.utils for n in elsewhere}
    assert all(n in m.__all__ for n, m in face.items())
    assert all(getattr(face[n], n) is v for n, v in elsewhere.items())


# -- allocator ----------------------------------------------------------------


def test_allocator_is_fifo_and_waits_when_empty():
    a = ReqToMetadataIdxAllocator(3)
    assert (a.size, a.available_size()) == (3, 3)
    assert [a.alloc(), a.alloc()] == [0, 1]
    a.free(0)
    assert [a.alloc(), a.alloc(), a.alloc()] == [2, 0, None]  # freed slot goes to the back
    assert a.available_size() == 0
    a.free(1)
    assert a.alloc() == 1


def test_allocator_of_size_zero_is_always_empty():
    a = ReqToMetadataIdxAllocator(0)
    assert (a.size, a.available_size(), a.alloc()) == (0, 0, None)
    with pytest.raises(SlotOutOfRange):
        a.free(0)


def test_allocator_refuses_a_double_free_and_changes_nothing():
    # deliberately stricter than the field, which would queue slot 0 twice
    a = ReqToMetadataIdxAllocator(2)
    slot = a.alloc()
    a.free(slot)
    with pytest.raises(DoubleFree, match="already free"):
        a.free(slot)
    assert a.available_size() == 2
    assert [a.alloc(), a.alloc(), a.alloc()] == [1, 0, None]


def test_allocator_refuses_a_slot_outside_the_pool():
    a = ReqToMetadataIdxAllocator(2)
    with pytest.raises(SlotOutOfRange):
        a.free(5)
    assert a.available_size() == 2
    with pytest.raises(ValueError, match=">= 0"):
        ReqToMetadataIdxAllocator(-1)


@pytest.mark.parametrize("bad", [1.7, 1.0, True, False, np.bool_(True), "1", None])
def test_allocator_free_refuses_a_non_integer_and_frees_nothing(bad):
    from buffers import errors

    a = ReqToMetadataIdxAllocator(3)
    live = [a.alloc(), a.alloc()]  # slots 0 and 1 in use
    with pytest.raises(errors.BadArgumentType, match="free_index") as info:
        a.free(bad)
    assert isinstance(info.value, TypeError)  # wrong type: also a TypeError
    assert repr(bad) in str(info.value)
    assert a.available_size() == 1  # nothing freed
    assert [a.alloc(), a.alloc()] == [2, None]  # neither live slot came back
    for slot in live:
        a.free(np.int64(slot))  # both are still owned and free cleanly (numpy ints too)
    assert a.available_size() == 2


@pytest.mark.parametrize("bad", [2.5, "3", True])
def test_allocator_size_must_be_an_integer(bad):
    from buffers import errors

    with pytest.raises(errors.BadArgumentType, match="size") as info:
        ReqToMetadataIdxAllocator(bad)
    assert isinstance(info.value, TypeError)


# -- metadata rows --------------------------------------------------------------
# (release-specific layouts, signatures and the 0.5.23 additions: test_compat_metadata_releases.py)

EXPECTED = [
    ("output_ids", 16, torch.int32),
    ("cached_tokens", 16, torch.int32),
    ("output_token_logprobs_val", 16, torch.float32),
    ("output_token_logprobs_idx", 16, torch.int32),
    ("output_top_logprobs_val", 20, torch.float32),
    ("output_top_logprobs_idx", 20, torch.int32),
    ("output_topk_p", 16, torch.float32),
    ("output_topk_index", 16, torch.int64),
    ("output_hidden_states", 8, torch.bfloat16),
    ("bootstrap_room", 8, None),
]
#: where each value sits in get_buf's tuple, per release
ROW = {
    "seed": {name: k for k, (name, _, _) in enumerate(EXPECTED)},
    "0.5.23": {
        name: k
        for k, name in enumerate(
            [
                "output_ids",
                "cached_tokens",
                "output_token_logprobs_val",
                "output_token_logprobs_idx",
                "output_top_logprobs_val",
                "output_top_logprobs_idx",
                "output_token_sampling_mask_len",
                "output_token_sampling_mask_idx",
                "output_token_sampling_logprobs",
                "output_topk_p",
                "output_topk_index",
                "output_hidden_states",
                "output_dsa_topk_indices",
                "bootstrap_room",
            ]
        )
    },
}


@pytest.fixture
def meta(field_release):
    # keywords mean the same under both releases
    return MetadataBuffers(4, 8, torch.bfloat16, max_top_logprobs_num=20)


def named(meta, row):
    """get_buf's tuple by field name, under the release the buffers follow."""
    return {name: row[k] for name, k in ROW[meta.field_release].items()}


def test_tensors_shapes_dtypes_and_buf_infos(meta):
    assert isinstance(meta, CoreMetadataBuffers)  # the core's gate and read work on it
    ptrs, lens, items = meta.get_buf_infos()
    assert len(ptrs) == len(lens) == len(items) == len(EXPECTED)
    for k, (name, width, dtype) in enumerate(EXPECTED):
        t = getattr(meta, name)
        assert t.shape == (4, width) and t.device.type == "cpu"
        if dtype is not None:
            assert t.dtype == dtype
        assert (ptrs[k], lens[k], items[k]) == (t.data_ptr(), t.nbytes, t[0].nbytes)
    assert meta.bootstrap_room.dtype in (getattr(torch, "uint64", torch.int64), torch.int64)
    assert MetadataBuffers(2, 4096, torch.float16).output_top_logprobs_val.shape == (2, 128)
    assert MetadataBuffers(1, 8, torch.float32, custom_mem_pool="pool").custom_mem_pool == "pool"


def req(**kw):
    base = dict(
        metadata_buffer_index=1,
        output_ids=[42, 43],
        cached_tokens=5,
        cached_tokens_device=1,
        cached_tokens_host=2,
        cached_tokens_storage=3,
        multimodal_inputs=None,
        return_logprob=False,
        hidden_states_tensor=None,
        bootstrap_room=777,
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_set_buf_without_logprobs_or_hidden_states(meta):
    meta.set_buf(req())
    row = named(meta, meta.get_buf(1))
    assert len(meta.get_buf(1)) == len(ROW[meta.field_release])
    assert row["output_ids"][:2].tolist() == [42, 0]  # only the first output token
    assert row["cached_tokens"][:8].tolist() == [5, 1, 2, 3, 0, 0, 0, 0]
    for name, _, _ in EXPECTED[2:9]:  # logprobs, top-k and hidden untouched (zero)
        assert not row[name].any()
    assert int(row["bootstrap_room"][0]) == 777 and not row["bootstrap_room"][1:].any()


def test_set_buf_with_logprobs_from_the_request_or_its_logprob_holder(meta):
    values = dict(
        output_token_logprobs_val=[-0.25, -9.0],
        output_token_logprobs_idx=[42, 1],
        output_top_logprobs_val=[[-0.25, -1.5, -2.0], [-9.0]],
        output_top_logprobs_idx=[[42, 7, 9], [1]],
    )
    for r in (
        req(return_logprob=True, **values),
        req(return_logprob=True, logprob=types.SimpleNamespace(**values)),
    ):
        meta.set_buf(r)
        row = named(meta, meta.get_buf(1))
        assert row["output_token_logprobs_val"][:2].tolist() == [-0.25, 0.0]
        assert row["output_token_logprobs_idx"][:2].tolist() == [42, 0]
        assert row["output_top_logprobs_val"][:4].tolist() == [-0.25, -1.5, -2.0, 0.0]
        assert row["output_top_logprobs_idx"][:4].tolist() == [42, 7, 9, 0]


def test_set_buf_skips_empty_logprob_sources(meta):
    meta.set_buf(
        req(
            return_logprob=True,
            output_token_logprobs_val=[],
            output_token_logprobs_idx=None,
            output_top_logprobs_val=[],
            output_top_logprobs_idx=[],
        )
    )
    row = named(meta, meta.get_buf(1))
    assert all(not row[name].any() for name, _, _ in EXPECTED[2:6])


def test_set_buf_with_hidden_states_and_multimodal_counts(meta):
    mm = types.SimpleNamespace(compute_mm_token_counts=lambda: (11, 12, 13))
    hidden = torch.arange(8, dtype=torch.float32)
    meta.set_buf(
        req(
            hidden_states_tensor=hidden,
            output_topk_p=torch.tensor([0.5, 0.25, 0.125]),
            output_topk_index=torch.tensor([3, 4, 5]),
            multimodal_inputs=mm,
        )
    )
    row = named(meta, meta.get_buf(1))
    assert row["cached_tokens"][4:7].tolist() == [11, 12, 13]
    assert row["output_topk_p"][:4].tolist() == [0.5, 0.25, 0.125, 0.0]
    assert row["output_topk_index"][:4].tolist() == [3, 4, 5, 0]
    assert row["output_hidden_states"].float().tolist() == hidden.tolist()


def test_set_buf_without_a_room_leaves_the_row_unclaimed(meta):
    meta.set_buf(req(bootstrap_room=777))
    meta.set_buf(req(bootstrap_room=None, output_ids=[5]))
    row = named(meta, meta.get_buf(1))
    assert int(row["output_ids"][0]) == 5 and int(row["bootstrap_room"][0]) == 0


def test_get_buf_returns_copies(meta):
    meta.set_buf(req())
    row = meta.get_buf(1)
    row[0][0] = -1
    row[-1][0] = 0
    assert int(meta.output_ids[1, 0]) == 42 and meta.room_of(1) == 777
    meta.set_buf(req(output_ids=[9]))  # a later owner of the slot
    assert int(row[0][0]) == -1


def test_get_buf_checks_the_slot(meta):
    with pytest.raises(SlotOutOfRange):
        meta.get_buf(4)


# -- pages ---------------------------------------------------------------------


def test_cp_page_filter_passes_the_input_through_at_cp_size_one():
    ids = np.array([3, 4, 5])
    assert page_indices_to_cp_rank_page_indices(ids, 3, 0, 1) is ids
    assert page_indices_to_cp_rank_page_indices(ids, 3, 0, 0) is ids


def test_cp_page_filter_of_nothing_is_empty():
    got = page_indices_to_cp_rank_page_indices(np.array([], dtype=np.int64), 0, 1, 4)
    assert got.size == 0


@pytest.mark.parametrize(
    ("total", "size", "shares"),
    [
        (8, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
        (2, 4, [[0], [1], [], []]),
    ],
)
def test_cp_page_filter_splits_with_the_remainder_first(total, size, shares):
    ids = np.arange(total)
    for rank, share in enumerate(shares):
        assert page_indices_to_cp_rank_page_indices(ids, total, rank, size).tolist() == share


def test_cp_page_filter_shifts_by_the_smallest_id_and_keeps_input_order():
    ids = np.array([105, 100, 103, 101, 104, 102])
    got = [page_indices_to_cp_rank_page_indices(ids, 6, r, 3).tolist() for r in range(3)]
    assert got == [[100, 101], [103, 102], [105, 104]]


def cp(rank, size):
    return types.SimpleNamespace(attn_cp_rank=rank, attn_cp_size=size)


def test_chunk_filter_at_cp_size_one_returns_the_inputs():
    ids, sl = np.array([5, 6, 7, 8]), slice(0, 4)
    got_ids, got_sl = filter_kv_indices_for_cp_rank(cp(0, 1), ids, sl)
    assert got_ids is ids and got_sl is sl


def test_chunk_filter_cuts_a_chunk_to_the_rank():
    # request of 5 pages split 3 + 2; this chunk holds request pages 2..4
    chunk = np.array([42, 9, 88])
    ids, sl = filter_kv_indices_for_cp_rank(cp(1, 2), chunk, slice(2, 5), total_pages=5)
    assert ids.tolist() == [9, 88] and sl == slice(3, 5)
    ids, sl = filter_kv_indices_for_cp_rank(cp(0, 2), chunk, slice(2, 5), total_pages=5)
    assert ids.tolist() == [42] and sl == slice(2, 3)


def test_chunk_filter_defaults():
    # total_pages defaults to the chunk's length; open slice ends are 0 and total
    ids, sl = filter_kv_indices_for_cp_rank(cp(1, 2), np.array([0, 1, 2, 3]), slice(None, None))
    assert ids.tolist() == [2, 3] and sl == slice(2, 4)


def test_chunk_filter_with_nothing_for_the_rank_is_empty_at_the_chunk_start():
    ids, sl = filter_kv_indices_for_cp_rank(cp(1, 2), np.array([7, 8]), slice(0, 2), total_pages=6)
    assert ids.size == 0 and sl == slice(0, 0)
    ids, sl = filter_kv_indices_for_cp_rank(cp(0, 2), np.array([7]), slice(9, 10), total_pages=6)
    assert ids.size == 0 and sl == slice(9, 9)


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        ((7, 0, True, 1), []),
        ((7, 256, True, 1), []),
        ((7, 257, True, 1), [7]),
        ((7, 256, False, 128), []),
        ((7, 129, False, 256), [15]),
        ((2, 1, False, 384), [6]),
    ],
)
def test_c128_state_indices(args, expect):
    idx, seq, online, ring = args
    got = get_dsv4_c128_state_indices(idx, seq, online=online, ring_size=ring)
    assert got.dtype == np.int32 and got.tolist() == expect


def test_c128_ring_size_must_be_128_aligned():
    with pytest.raises(AssertionError, match="128-aligned, got 200"):
        get_dsv4_c128_state_indices(1, 5, online=False, ring_size=200)
    # only asked when a ring page is needed, as in the field
    assert get_dsv4_c128_state_indices(1, 128, online=False, ring_size=200).size == 0


# -- modes ------------------------------------------------------------------------


def test_disaggregation_mode_and_engine_type():
    assert {m.name: m.value for m in DisaggregationMode} == {
        "NULL": "null",
        "PREFILL": "prefill",
        "DECODE": "decode",
    }
    to = DisaggregationMode.to_engine_type
    assert [to("prefill"), to("decode"), to("null"), to("anything")] == [
        "prefill",
        "decode",
        "unified",
        "unified",
    ]


# -- state components -----------------------------------------------------------------


def bag():
    return types.SimpleNamespace(
        state_types=[],
        state_data_ptrs=[],
        state_data_lens=[],
        state_item_lens=[],
        state_dim_per_tensor=[],
    )


def test_append_state_component():
    kv = bag()
    append_state_component(kv, StateType.MAMBA, [1, 2], [3, 4], [5, 6], [7])
    append_state_component(kv, StateType.SWA, [8], [9], [10])
    assert kv.state_types == [StateType.MAMBA, StateType.SWA]
    assert kv.state_data_ptrs == [[1, 2], [8]]
    assert kv.state_data_lens == [[3, 4], [9]]
    assert kv.state_item_lens == [[5, 6], [10]]
    assert kv.state_dim_per_tensor == [[7], []]


def pool(kind_class, infos=([10], [100], [10]), **kw):
    cls = type(kind_class, (), {})
    p = cls()
    p.get_state_buf_infos = lambda: tuple(list(x) for x in infos)
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def components(kv):
    return [(t, p) for t, p in zip(kv.state_types, kv.state_data_ptrs)]


def test_setup_resets_and_dispatches_swa_with_ring_and_c128():
    kv = bag()
    kv.state_types.append(StateType.DSA)  # reset first
    p = pool(
        "BaseSWAKVPool",
        _unified_kv=True,
        get_unified_swa_ring_buf_infos=lambda: ([20], [200], [20]),
        get_c128_state_buf_infos=lambda: ([30], [300], [30]),
    )
    setup_state_kv_args(kv, p)
    assert components(kv) == [
        (StateType.SWA, [10]),
        (StateType.SWA_RING, [20]),
        (StateType.C128_STATE, [30]),
    ]
    assert kv.is_hybrid_mla_backend is False


def test_setup_hybrid_linear_is_mamba_with_dims():
    kv = bag()
    mla = type("MLATokenToKVPool", (), {})()
    p = pool("HybridLinearKVPool", full_kv_pool=mla, get_state_dim_per_tensor=lambda: [4, 8])
    setup_state_kv_args(kv, p)
    assert components(kv) == [(StateType.MAMBA, [10])]
    assert kv.state_dim_per_tensor == [[4, 8]] and kv.is_hybrid_mla_backend is True


def test_setup_dsa_with_a_dsa_draft_and_npu_mla():
    kv = bag()
    setup_state_kv_args(kv, pool("DSATokenToKVPool"), pool("DSATokenToKVPool", ([11], [110], [11])))
    assert components(kv) == [(StateType.DSA, [10, 11])]
    kv = bag()
    kv.kv_data_ptrs = [1, 2, 3, 4]
    setup_state_kv_args(kv, pool("NPUMLATokenToKVPool", layer_num=2), total_kv_layers=2)
    assert components(kv) == [] and (kv.kv_buf_groups, kv.total_kv_layers) == (2, 2)


def test_setup_minimax_sparse():
    kv = bag()
    p = pool("MiniMaxSparseKVPool", index_kv_pool=None, index_k_pool=object())
    p.get_index_k_state_buf_infos = lambda: ([40], [400], [40])
    setup_state_kv_args(kv, p)
    assert components(kv) == [(StateType.MINIMAX_INDEX_K, [40])]
    p.index_kv_pool = object()
    with pytest.raises(NotImplementedError):
        setup_state_kv_args(bag(), p)


def test_setup_adds_mamba_from_the_request_pool_when_none_was_added():
    kv = bag()
    req_pool = types.SimpleNamespace(get_state_buf_infos=lambda: ([50], [500], [50]))
    setup_state_kv_args(kv, object(), req_to_token_pool=req_pool)
    assert components(kv) == [(StateType.MAMBA, [50])]
    kv = bag()
    setup_state_kv_args(
        kv,
        object(),
        req_to_token_pool=types.SimpleNamespace(get_state_buf_infos=lambda: ([], [], [])),
    )
    assert components(kv) == []


def test_setup_declared_kinds_win_over_class_names():
    kv = bag()
    p = pool("Anything", pd_pool_kinds={"swa"})
    setup_state_kv_args(kv, p)
    assert components(kv) == [(StateType.SWA, [10])]


def dsv4(unified, infos, **geo):
    base = dict(compression_ratios=[0], _unified_kv=unified, page_size=64, sliding_window=128)
    base.update(geo)
    p = pool("DeepSeekV4TokenToKVPool", infos, **base)
    p.get_unified_swa_ring_buf_infos = lambda: infos
    return p


def test_setup_dsv4_draft_rides_as_its_own_component():
    mapping = object()
    target = dsv4(
        False, ([10], [100], [10]), compression_ratios=[4, 128], full_to_swa_index_mapping=mapping
    )
    draft = dsv4(False, ([60], [600], [60]), full_to_swa_index_mapping=mapping)
    kv = bag()
    setup_state_kv_args(kv, target, draft)
    assert components(kv) == [(StateType.SWA, [10]), (StateType.SWA, [60])]


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"compression_ratios": [4]}, "SWA-only"),
        ({"sliding_window": 256}, "geometry"),
        ({"full_to_swa_index_mapping": object()}, "index mapping"),
        ({"_unified_kv": True}, "unified-KV mode"),
    ],
)
def test_setup_dsv4_draft_geometry_checks_name_both_sides(change, what):
    mapping = object()
    target = dsv4(False, ([10], [100], [10]), full_to_swa_index_mapping=mapping)
    draft = dsv4(False, ([60], [600], [60]), full_to_swa_index_mapping=mapping)
    for k, v in change.items():
        setattr(draft, k, v)
    with pytest.raises(GeometryMismatch, match=what) as err:
        setup_state_kv_args(bag(), target, draft)
    assert isinstance(err.value, RuntimeError)  # the field's exception type too
    assert "target" in str(err.value) and "draft" in str(err.value)


def test_setup_dsv4_unified_draft_is_a_ring_component():
    geo = dict(unified_swa_window=128, unified_swa_ring_size=256, unified_swa_pages=4)
    target = dsv4(True, ([10], [100], [10]), **geo)
    draft = dsv4(True, ([70], [700], [70]), **geo)
    kv = bag()
    setup_state_kv_args(kv, target, draft)
    assert components(kv)[-1] == (StateType.SWA_RING, [70])
    draft.unified_swa_pages = 8
    with pytest.raises(GeometryMismatch, match="geometry"):
        setup_state_kv_args(bag(), target, draft)


def test_is_mla_backend():
    assert is_mla_backend(type("MLATokenToKVPool", (), {})())
    assert is_mla_backend(type("DeepSeekV4TokenToKVPool", (), {})())
    assert not is_mla_backend(type("MHATokenToKVPool", (), {})())
    assert is_mla_backend(types.SimpleNamespace(pd_pool_kinds={"mla"}))


# -- aborts ---------------------------------------------------------------------------


def test_prepare_abort_sets_the_reason_and_empties_input_logprobs():
    lp = types.SimpleNamespace(**{n: [1.0] for n in field.step.abort._INPUT_LOGPROB_LISTS})
    r = types.SimpleNamespace(return_logprob=True, logprob=lp, to_finish=None, finished_reason=None)
    assert not is_aborted(r)
    prepare_abort(r, "peer died", 503)
    assert r.finished_reason == FinishAbort("peer died", 503)
    assert all(getattr(lp, n) == [] for n in field.step.abort._INPUT_LOGPROB_LISTS)
    assert is_aborted(r)


def test_prepare_abort_keeps_logprobs_without_return_logprob():
    lp = types.SimpleNamespace(input_token_logprobs_val=[1.0])
    r = types.SimpleNamespace(return_logprob=False, logprob=lp)
    prepare_abort(r, "bye")
    assert r.finished_reason.status_code == 500  # ours always carries a code
    assert lp.input_token_logprobs_val == [1.0]


def test_is_aborted_reads_to_finish_and_engine_reasons():
    engine_abort = type("FINISH_ABORT", (), {})()
    assert is_aborted(types.SimpleNamespace(to_finish=engine_abort, finished_reason=None))
    assert is_aborted(types.SimpleNamespace(to_finish=None, finished_reason=engine_abort))
    other = type("FINISH_LENGTH", (), {})()
    assert not is_aborted(types.SimpleNamespace(to_finish=other, finished_reason=None))


def test_set_buf_on_a_reused_slot_leaves_nothing_of_the_previous_owner(meta):
    # stricter than the field, which only overwrites the entries the new request sets
    meta.set_buf(
        req(
            return_logprob=True,
            output_token_logprobs_val=[-0.5],
            output_token_logprobs_idx=[42],
            output_top_logprobs_val=[[-0.5]],
            output_top_logprobs_idx=[[42]],
            hidden_states_tensor=torch.ones(8),
            output_topk_p=torch.tensor([1.0]),
            output_topk_index=torch.tensor([3]),
        )
    )
    meta.set_buf(req(bootstrap_room=778, output_ids=[9]))
    row = named(meta, meta.get_buf(1))
    assert all(not row[name].any() for name, _, _ in EXPECTED[2:9])
    assert int(row["output_ids"][0]) == 9 and int(row["bootstrap_room"][0]) == 778


def test_engine_type():
    from field.engine import DisaggregationMode, engine_type

    assert engine_type("prefill") == "prefill"
    assert engine_type(DisaggregationMode.DECODE) == "decode"
    assert engine_type("null") == engine_type(None) == engine_type("other") == "unified"
