"""field.data.metadata.MetadataBuffers under each field release: the constructors
(the seed's and 0.5.23's), get_buf and get_buf_infos, the 0.5.23 rows
(sampling mask, DSA top-k indices, KV checksum) and the checksum methods."""

import inspect
import types

import numpy as np
import pytest
import torch

from field.data.metadata import MetadataBuffers

UINT64 = getattr(torch, "uint64", torch.int64)

SEED_ROW = [
    "output_ids",
    "cached_tokens",
    "output_token_logprobs_val",
    "output_token_logprobs_idx",
    "output_top_logprobs_val",
    "output_top_logprobs_idx",
    "output_topk_p",
    "output_topk_index",
    "output_hidden_states",
    "bootstrap_room",
]
V0523_ROW = [
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


def request(**kw):
    base = dict(
        metadata_buffer_index=1,
        output_ids=[42],
        cached_tokens=5,
        cached_tokens_device=1,
        cached_tokens_host=2,
        cached_tokens_storage=3,
        get_mm_token_counts=lambda: (0, 0, 0),
        return_logprob=False,
        return_sampling_mask=False,
        hidden_states_tensor=None,
        bootstrap_room=777,
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


# -- constructors -------------------------------------------------------------------


def describe(signature):
    return [(p.name, p.kind.name, p.default) for p in signature.parameters.values()]


SIGNATURES = {
    "0.5.23": [
        ("size", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
        ("hidden_size", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
        ("hidden_states_dtype", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
        ("max_sampling_mask_tokens", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
        ("max_top_logprobs_num", "POSITIONAL_OR_KEYWORD", 128),
        ("custom_mem_pool", "POSITIONAL_OR_KEYWORD", None),
        ("output_dsa_topk_indices_dim", "POSITIONAL_OR_KEYWORD", 0),
        ("kv_checksum_enabled", "KEYWORD_ONLY", False),
    ],
    "seed": [
        ("size", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
        ("hidden_size", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
        ("hidden_states_dtype", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
        ("max_top_logprobs_num", "POSITIONAL_OR_KEYWORD", 128),
        ("custom_mem_pool", "POSITIONAL_OR_KEYWORD", None),
    ],
}


def test_the_signature_is_the_releases(field_release):
    assert describe(inspect.signature(MetadataBuffers)) == SIGNATURES[field_release]


def test_built_the_way_0523s_scheduler_builds_it(field_release):
    # keywords mean the same under both releases
    m = MetadataBuffers(
        8,
        hidden_size=16,
        hidden_states_dtype=torch.float32,
        max_sampling_mask_tokens=64,
        custom_mem_pool=None,
        output_dsa_topk_indices_dim=0,
        kv_checksum_enabled=False,
    )
    assert m.output_top_logprobs_val.shape == (8, 128)
    assert m.output_hidden_states.shape == (8, 16)
    assert m.kv_checksum is None and m.output_dsa_topk_indices is None


def test_positional_arguments_mean_what_they_mean_in_the_release(field_release):
    if field_release == "0.5.23":
        # the fourth is max_sampling_mask_tokens, not the top-logprobs width
        m = MetadataBuffers(4, 8, torch.float32, 32)
        assert m.output_top_logprobs_val.shape == (4, 128)
        assert m.output_top_logprobs_idx.shape == (4, 128)
        m = MetadataBuffers(4, 8, torch.float32, 32, 20, "pool", 6)
        assert m.output_top_logprobs_val.shape == (4, 20)
        assert m.custom_mem_pool == "pool"
        assert m.output_dsa_topk_indices.shape == (4, 6)
    else:
        m = MetadataBuffers(4, 8, torch.float32, 32, "pool")
        assert m.output_top_logprobs_val.shape == (4, 32)
        assert m.custom_mem_pool == "pool"
    assert m.field_release == field_release


def test_too_many_positional_arguments_or_one_given_twice_is_a_type_error(field_release):
    from field.release import FieldSignatureError

    extra = (32, 20, None, 0, "one too many") if field_release == "0.5.23" else (20, None, 0)
    with pytest.raises(FieldSignatureError, match=f"{field_release}.*positional") as info:
        MetadataBuffers(4, 8, torch.float32, *extra)
    assert isinstance(info.value, TypeError)
    name = "max_sampling_mask_tokens" if field_release == "0.5.23" else "max_top_logprobs_num"
    with pytest.raises(TypeError, match=f"multiple values for argument '{name}'"):
        MetadataBuffers(4, 8, torch.float32, 32, **{name: 16})


def test_max_sampling_mask_tokens_may_be_left_out_when_no_mask_rows_are_built(v0523):
    # 0.5.23 requires it; it only sizes the sampling-mask rows, so ours does not
    m = MetadataBuffers(2, 8, torch.float32)
    assert m.enable_sampling_mask is False and m.output_token_sampling_mask_idx is None


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(hidden_states_dtype="bf16"), "hidden_states_dtype"),
        (dict(hidden_size=8.5), "hidden_size"),
        (dict(max_top_logprobs_num="128"), "max_top_logprobs_num"),
        (dict(output_dsa_topk_indices_dim=1.5), "output_dsa_topk_indices_dim"),
        (dict(kv_checksum_enabled="yes"), "kv_checksum_enabled"),
        (dict(max_sampling_mask_tokens=2.0), "max_sampling_mask_tokens"),
    ],
)
def test_a_wrong_type_is_a_typed_error_naming_the_argument(v0523, kwargs, name):
    from buffers import errors

    args = dict(size=2, hidden_size=8, hidden_states_dtype=torch.float32) | kwargs
    with pytest.raises(errors.BadArgumentType, match=name) as info:
        MetadataBuffers(**args)
    assert isinstance(info.value, TypeError)


# -- get_buf / get_buf_infos ------------------------------------------------------


def test_get_buf_returns_14_values_in_0523s_order(v0523):
    m = MetadataBuffers(4, 8, torch.float32, 16)
    m.set_buf(request())
    row = m.get_buf(1)
    assert len(row) == 14
    by_name = dict(zip(V0523_ROW, row))
    # rows that were not built come back as None, as in 0.5.23
    for name in [*V0523_ROW[6:9], "output_dsa_topk_indices"]:
        assert by_name[name] is None
    assert int(by_name["output_ids"][0]) == 42
    assert int(by_name["bootstrap_room"][0]) == 777
    assert by_name["output_hidden_states"].shape == (8,)


def test_get_buf_returns_the_seeds_10_values(seed):
    m = MetadataBuffers(4, 8, torch.float32, output_dsa_topk_indices_dim=4)
    m.set_buf(request())
    row = m.get_buf(1)
    assert len(row) == 10
    assert int(row[0][0]) == 42 and int(row[9][0]) == 777


def full_0523(monkeypatch, **kw):
    monkeypatch.setenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", "1")
    return MetadataBuffers(
        4,
        8,
        torch.bfloat16,
        24,
        20,
        None,
        6,
        kv_checksum_enabled=True,
        **kw,
    )


def test_get_buf_infos_follows_0523s_tensors_and_order(v0523, monkeypatch):
    m = full_0523(monkeypatch)
    expected = [
        ("output_ids", (4, 16), torch.int32),
        ("cached_tokens", (4, 16), torch.int32),
        ("output_token_logprobs_val", (4, 16), torch.float32),
        ("output_token_logprobs_idx", (4, 16), torch.int32),
        ("output_top_logprobs_val", (4, 20), torch.float32),
        ("output_top_logprobs_idx", (4, 20), torch.int32),
        ("output_token_sampling_mask_len", (4, 16), torch.int32),
        ("output_token_sampling_mask_idx", (4, 24), torch.int32),
        ("output_token_sampling_logprobs", (4, 24), torch.float32),
        ("output_topk_p", (4, 16), torch.float32),
        ("output_topk_index", (4, 16), torch.int64),
        ("output_hidden_states", (4, 8), torch.bfloat16),
        ("output_dsa_topk_indices", (4, 6), torch.int32),
        ("bootstrap_room", (4, 8), UINT64),
        ("kv_checksum", (4, 8), UINT64),
    ]
    ptrs, lens, items = m.get_buf_infos()
    assert len(ptrs) == len(expected)
    for k, (name, shape, dtype) in enumerate(expected):
        t = getattr(m, name)
        assert (tuple(t.shape), t.dtype) == (shape, dtype), name
        assert (ptrs[k], lens[k], items[k]) == (t.data_ptr(), t.nbytes, t[0].nbytes), name
    assert len(m.get_buf(0)) == 14  # the checksum is read with get_kv_checksum


def test_the_seed_has_no_sampling_mask_rows_whatever_the_variable(seed, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", "1")
    m = MetadataBuffers(4, 8, torch.float32)
    assert m.enable_sampling_mask is False
    assert len(m.get_buf_infos()[0]) == 10


def test_sampling_mask_rows_need_their_width(v0523, monkeypatch):
    from buffers import errors

    monkeypatch.setenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", "true")
    with pytest.raises(errors.BadArgument, match="max_sampling_mask_tokens"):
        MetadataBuffers(4, 8, torch.float32)
    monkeypatch.setenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", "perhaps")
    with pytest.raises(ValueError, match="SGLANG_ENABLE_DISAGG_SAMPLING_MASK"):
        MetadataBuffers(4, 8, torch.float32, 16)


# -- set_buf ---------------------------------------------------------------------------


def test_set_buf_writes_the_sampling_mask(v0523, monkeypatch):
    m = full_0523(monkeypatch)
    chunk = types.SimpleNamespace(
        token_ids=np.array([5, 9, 11], dtype=np.int32),
        logprobs=np.array([-0.5, -1.0, -2.5], dtype=np.float32),
    )
    rows = types.SimpleNamespace(view=lambda: chunk)
    m.set_buf(request(return_sampling_mask=True, sampling_mask_rows=rows))
    row = dict(zip(V0523_ROW, m.get_buf(1)))
    assert int(row["output_token_sampling_mask_len"][0]) == 3
    assert row["output_token_sampling_mask_idx"][:4].tolist() == [5, 9, 11, 0]
    assert row["output_token_sampling_logprobs"][:4].tolist() == [-0.5, -1.0, -2.5, 0.0]


def test_a_sampling_mask_without_its_rows_is_refused(v0523):
    from buffers import errors

    m = MetadataBuffers(4, 8, torch.float32, 16)
    with pytest.raises(errors.BadArgument, match="return_sampling_mask"):
        m.set_buf(request(return_sampling_mask=True, sampling_mask_rows=None))
    assert m.room_of(1) == 0  # nothing written


def test_dsa_top_k_rows_start_at_minus_one_and_follow_the_hidden_state(v0523):
    m = MetadataBuffers(4, 8, torch.float32, 16, output_dsa_topk_indices_dim=4)
    assert (m.output_dsa_topk_indices == -1).all()
    spec = dict(
        hidden_states_tensor=torch.ones(8),
        output_topk_p=torch.tensor([1.0]),
        output_topk_index=torch.tensor([3]),
    )
    m.set_buf(request(output_dsa_topk_indices=torch.tensor([7, 8, 9, 10]), **spec))
    assert m.get_buf(1)[12].tolist() == [7, 8, 9, 10]
    m.set_buf(request(output_dsa_topk_indices=None, **spec))
    assert m.get_buf(1)[12].tolist() == [-1, -1, -1, -1]


def test_set_buf_reads_0523s_multimodal_counts(field_release):
    m = MetadataBuffers(4, 8, torch.float32, max_top_logprobs_num=16)
    m.set_buf(request(get_mm_token_counts=lambda: (4, 5, 6)))
    assert m.cached_tokens[1, :7].tolist() == [5, 1, 2, 3, 4, 5, 6]


def test_a_top_logprobs_row_one_too_long_is_also_a_runtime_error(field_release):
    from buffers import errors

    m = MetadataBuffers(4, 8, torch.float32, max_top_logprobs_num=16)
    m.set_buf(request(output_ids=[1]))
    too_long = types.SimpleNamespace(
        output_token_logprobs_val=[-0.5],
        output_token_logprobs_idx=[1],
        output_top_logprobs_val=[[-0.5] * 17],
        output_top_logprobs_idx=[[1] * 17],
    )
    with pytest.raises(RuntimeError, match=r"top_logprobs_num 17.*16") as info:
        m.set_buf(request(output_ids=[2], return_logprob=True, logprob=too_long))
    assert isinstance(info.value, errors.RowOverflow)
    assert isinstance(info.value, errors.LayoutError)
    assert int(m.output_ids[1, 0]) == 1  # nothing written
    assert m.room_of(1) == 777


def test_any_value_too_long_for_its_row_is_a_runtime_error(field_release):
    m = MetadataBuffers(4, 8, torch.float32, max_top_logprobs_num=16)
    with pytest.raises(RuntimeError, match="output_topk_p"):
        m.set_buf(
            request(
                hidden_states_tensor=torch.ones(8),
                output_topk_p=torch.ones(17),
                output_topk_index=torch.zeros(17, dtype=torch.int64),
            )
        )
    assert m.room_of(1) == 0


# -- KV checksum ---------------------------------------------------------------------


def test_kv_checksum_round_trip_and_clear_slot(v0523):
    m = MetadataBuffers(4, 8, torch.float32, 16, kv_checksum_enabled=True)
    assert m.get_kv_checksum(2) == (0, 0)  # none written
    big = (1 << 64) - 3
    r = request(metadata_buffer_index=2, bootstrap_room=99)
    m.set_kv_checksum(r, big, 0x1234)
    m.set_buf(r)  # writing the row leaves the checksum alone
    assert m.get_kv_checksum(2) == (big, 0x1234)
    assert m.room_of(2) == 99
    m.clear_slot(2)
    assert m.get_kv_checksum(2) == (0, 0) and m.room_of(2) == 0
    assert not m.bootstrap_room[2].any() and not m.kv_checksum[2].any()


def test_clear_slot_without_a_checksum_clears_the_room(field_release):
    m = MetadataBuffers(4, 8, torch.float32, max_top_logprobs_num=16)
    m.set_buf(request())
    m.clear_slot(1)
    assert m.room_of(1) == 0 and int(m.output_ids[1, 0]) == 42


def test_kv_checksum_methods_need_the_checksum_rows(v0523):
    from buffers import errors

    m = MetadataBuffers(4, 8, torch.float32, 16)
    with pytest.raises(errors.LayoutError, match="kv_checksum_enabled=True"):
        m.set_kv_checksum(request(), 1, 2)
    with pytest.raises(errors.LayoutError, match="kv_checksum_enabled=True"):
        m.get_kv_checksum(1)


@pytest.mark.parametrize(
    ("digest", "signature", "name"),
    [(-1, 0, "digest"), (1 << 64, 0, "digest"), (1, 2.5, "signature"), (True, 0, "digest")],
)
def test_kv_checksum_values_must_be_uint64(v0523, digest, signature, name):
    from buffers import errors

    m = MetadataBuffers(4, 8, torch.float32, 16, kv_checksum_enabled=True)
    with pytest.raises(errors.BadArgument, match=name):
        m.set_kv_checksum(request(), digest, signature)
    assert m.get_kv_checksum(1) == (0, 0)


def test_the_release_is_read_when_the_buffers_are_built(v0523):
    from field.release import set_release

    m = MetadataBuffers(4, 8, torch.float32, 16)
    set_release("seed")
    assert m.field_release == "0.5.23" and len(m.get_buf(0)) == 14


def test_the_cores_read_carries_the_extra_rows_by_name(v0523):
    m = MetadataBuffers(
        4, 8, torch.float32, 16, output_dsa_topk_indices_dim=3, kv_checksum_enabled=True
    )
    m.set_buf(request())
    m.set_kv_checksum(request(), 5, 6)
    record = m.read(1)
    assert record.first_token == 42 and record.bootstrap_room == 777
    assert record.extra["output_dsa_topk_indices"].tolist() == [-1, -1, -1]
    assert record.extra["kv_checksum"][:2].tolist() == [5, 6]
