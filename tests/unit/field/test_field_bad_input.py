"""Bad inputs to the field-facing names: a typed error naming the argument, nothing changed.

Each case calls one name of the SGLang surface with one bad argument and
checks three things: the error is the project's typed error *and* the
builtin an SGLang-style caller catches (TypeError for a wrong type,
ValueError for a bad value), its message names the argument, and the state
the call could have touched (metadata rows, the request, the KV args, the
staging handler and the kept consensus tables, the input arrays) is the same
before and after. Negative controls show the snapshots see a change.
"""

from __future__ import annotations

import copy
import types
from http import HTTPStatus
from typing import Any

import attrs
import numpy as np
import pytest
import torch

import field.step.consensus as consensus
import field.utils as fu
from buffers.errors import BadArgument, BadArgumentType, BuffersError
from field.conn.kv_args import KVArgs
from field.data.buffers import get_dsv4_c128_state_indices, page_indices_to_cp_rank_page_indices
from lifecycle.testing import ScriptedPoller
from transport.errors import TransportError
from transport.topology import Topology, TopologyError

# -- snapshots ---------------------------------------------------------------


def rows(meta: fu.MetadataBuffers) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in meta.tensors.items()}


def same_rows(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def state_of(obj: Any) -> dict[str, Any]:
    return copy.deepcopy(vars(obj))


def expect(error: type[BaseException], builtin: type[Exception], call: Any, *names: str) -> str:
    """``call()`` raises ``error``, which is also ``builtin``, naming each of ``names``."""
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, builtin)
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not named in: {message}"
    return message


@pytest.fixture
def meta() -> fu.MetadataBuffers:
    m = fu.MetadataBuffers(4, 16, torch.float32)
    m.set_buf(first_token_req(room=77, slot=1, token=9))  # a row that must survive
    return m


def first_token_req(room: int, slot: int, token: int | None) -> Any:
    return types.SimpleNamespace(
        metadata_buffer_index=slot,
        output_ids=[] if token is None else [token],
        return_logprob=False,
        hidden_states_tensor=None,
        bootstrap_room=room,
    )


# -- set_buf -----------------------------------------------------------------


def test_set_buf_of_no_request_names_req_and_writes_nothing(meta):
    before = rows(meta)
    expect(BadArgumentType, TypeError, lambda: meta.set_buf(None), "req")
    assert same_rows(before, rows(meta))


def test_set_buf_of_a_request_with_no_output_ids_names_them_and_writes_nothing(meta):
    before = rows(meta)
    req = first_token_req(room=78, slot=1, token=None)  # the slot holds room 77's row
    message = expect(BadArgument, ValueError, lambda: meta.set_buf(req), "req.output_ids")
    assert "first output token" in message
    assert same_rows(before, rows(meta))
    assert meta.room_of(1) == 77


def test_negative_control_a_valid_set_buf_changes_the_snapshot(meta):
    before = rows(meta)
    meta.set_buf(first_token_req(room=78, slot=1, token=5))
    assert not same_rows(before, rows(meta))


# -- MetadataBuffers.write ---------------------------------------------------


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (("1", 78, {"output_ids": [5]}), "metadata slot"),
        ((1, "78", {"output_ids": [5]}), "room"),
        ((1, 78, "output_ids=5"), "metadata values"),
        ((1, 78, {"output_ids": "5"}), "values['output_ids']"),
        ((1, 78, {"cached_tokens": [3], "output_ids": "five"}), "values['output_ids']"),
    ],
)
def test_write_with_a_string_names_it_and_writes_nothing(meta, args, name):
    before = rows(meta)
    expect(BadArgumentType, TypeError, lambda: meta.write(*args), name)
    assert same_rows(before, rows(meta))


# -- the CP and shard page helpers --------------------------------------------


class Manager:
    def __init__(self, rank: int = 0, size: int = 2) -> None:
        self.attn_cp_rank, self.attn_cp_size = rank, size


PAGES = np.arange(10, 18, dtype=np.int64)


@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize(
    ("args", "error", "builtin", "name"),
    [
        ((None, PAGES, slice(0, 8)), BadArgumentType, TypeError, "kv_mgr"),
        ((object(), PAGES, slice(0, 8)), BadArgumentType, TypeError, "kv_mgr"),
        (("mgr", PAGES, None), BadArgumentType, TypeError, "index_slice"),
        (("mgr", PAGES, (0, 8)), BadArgumentType, TypeError, "index_slice"),
        (("mgr", PAGES, slice(0, 8, 2)), BadArgument, ValueError, "index_slice"),
        (("mgr", PAGES, slice(0, 8, -1)), BadArgument, ValueError, "index_slice"),
        (("mgr", PAGES, slice(6, 2)), BadArgument, ValueError, "index_slice"),
        (("mgr", PAGES, slice(0.0, 8)), BadArgumentType, TypeError, "index_slice.start"),
        (("mgr", PAGES.astype(float), slice(0, 8)), BadArgumentType, TypeError, "kv_indices"),
        (("mgr", PAGES.reshape(2, 4), slice(0, 2)), BadArgumentType, TypeError, "kv_indices"),
        (("mgr", PAGES, slice(0, 8), 8.0), BadArgumentType, TypeError, "total_pages"),
        (("mgr", PAGES, slice(0, 8), "8"), BadArgumentType, TypeError, "total_pages"),
    ],
)
def test_filter_kv_indices_for_cp_rank_refuses_by_name(cp_size, args, error, builtin, name):
    mgr = Manager(0, cp_size)
    call_args = tuple(mgr if isinstance(a, str) and a == "mgr" else a for a in args)
    kept = [a.copy() if isinstance(a, np.ndarray) else a for a in call_args]
    expect(error, builtin, lambda: fu.filter_kv_indices_for_cp_rank(*call_args), name)
    for a, b in zip(call_args, kept):
        assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a is b
    assert vars(mgr) == {"attn_cp_rank": 0, "attn_cp_size": cp_size}


def test_filter_kv_indices_for_cp_rank_of_a_manager_with_a_float_size_names_it():
    expect(
        BadArgumentType,
        TypeError,
        lambda: fu.filter_kv_indices_for_cp_rank(Manager(0, 2.0), PAGES, slice(0, 8)),  # type: ignore[arg-type]
        "attn_cp_size",
    )


def test_valid_cp_filter_calls_answer_as_before():
    """Integer bounds of any kind, a step of 1 and an open slice are all still fine."""
    got, kept = fu.filter_kv_indices_for_cp_rank(Manager(1, 2), PAGES, slice(np.int64(0), 8, 1))
    assert got.tolist() == [14, 15, 16, 17] and kept == slice(4, 8)
    ids, whole = fu.filter_kv_indices_for_cp_rank(Manager(0, 1), PAGES, slice(None, None))
    assert ids is PAGES and whole == slice(None, None)
    got, kept = fu.filter_kv_indices_for_cp_rank(Manager(0, 2), PAGES[:0], slice(0, 0))
    assert got.size == 0 and kept == slice(0, 0)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((PAGES.astype(np.float64), 8, 0, 2), "page_indices"),
        ((PAGES.reshape(2, 4), 8, 0, 2), "page_indices"),
        ((PAGES.reshape(2, 4), 8, 0, 1), "page_indices"),  # checked at CP size 1 too
        ((PAGES, 8.0, 0, 2), "total_pages"),
        ((PAGES, 8, 0.0, 2), "cp_rank"),
        ((PAGES, 8, 0, 2.0), "cp_size"),
        ((PAGES, 8, 0, "2"), "cp_size"),
    ],
)
def test_cp_page_filter_refuses_floats_and_2d_pages_by_name(args, name):
    kept = args[0].copy()
    expect(BadArgumentType, TypeError, lambda: page_indices_to_cp_rank_page_indices(*args), name)
    assert np.array_equal(args[0], kept)


@pytest.mark.parametrize(
    ("index_slice", "error", "builtin"),
    [
        (None, BadArgumentType, TypeError),
        (slice(0, 8, 2), BadArgument, ValueError),
        ([0, 8], BadArgumentType, TypeError),
    ],
)
def test_filter_kv_indices_for_shard_rank_refuses_a_missing_or_stepped_slice(
    index_slice, error, builtin
):
    """None used to raise AttributeError from inside the function."""
    kept = PAGES.copy()
    call = lambda: fu.filter_kv_indices_for_shard_rank(  # noqa: E731
        kv_indices=PAGES, index_slice=index_slice, shard_rank=0, shard_size=2
    )
    expect(error, builtin, call, "index_slice")
    assert np.array_equal(PAGES, kept)


# -- get_dsv4_c128_state_indices ---------------------------------------------


@pytest.mark.parametrize("bad", [1.5, 3.0, "3"])
@pytest.mark.parametrize("name", ["req_pool_idx", "seq_len", "ring_size"])
def test_c128_state_indices_refuse_a_float_or_a_string_by_name(name, bad):
    kw: dict[str, Any] = {"req_pool_idx": 2, "seq_len": 3, "ring_size": 256}
    kw[name] = bad
    expect(
        BadArgumentType,
        TypeError,
        lambda: get_dsv4_c128_state_indices(
            kw["req_pool_idx"], kw["seq_len"], online=False, ring_size=kw["ring_size"]
        ),
        name,
    )


def test_c128_state_indices_of_valid_integers_answer_as_before():
    assert get_dsv4_c128_state_indices(np.int64(2), 3, online=False, ring_size=256).tolist() == [4]
    assert get_dsv4_c128_state_indices(2, 3, online=True, ring_size=256).tolist() == [2]
    assert get_dsv4_c128_state_indices(2, 256, online=False, ring_size=256).size == 0
    with pytest.raises(AssertionError):  # the field's own check, kept
        get_dsv4_c128_state_indices(2, 3, online=False, ring_size=200)


# -- prepare_abort -----------------------------------------------------------


def abortable() -> Any:
    return types.SimpleNamespace(
        return_logprob=True, input_token_logprobs_val=[0.5], input_top_logprobs_val=[[0.1]]
    )


def test_prepare_abort_of_no_request_names_req():
    expect(BadArgumentType, TypeError, lambda: fu.prepare_abort(None, "gone"), "req")


@pytest.mark.parametrize(
    ("code", "error", "builtin"),
    [
        ("400", BadArgumentType, TypeError),
        (400.0, BadArgumentType, TypeError),
        (True, BadArgumentType, TypeError),
        (99, BadArgument, ValueError),
        (600, BadArgument, ValueError),
    ],
)
def test_prepare_abort_with_a_bad_status_code_names_it_and_leaves_the_request(code, error, builtin):
    req = abortable()
    before = state_of(req)
    expect(error, builtin, lambda: fu.prepare_abort(req, "gone", code), "status_code")
    assert state_of(req) == before


def test_negative_control_a_valid_abort_changes_the_request():
    req = abortable()
    before = state_of(req)
    fu.prepare_abort(req, "gone", HTTPStatus.SERVICE_UNAVAILABLE)
    assert state_of(req) != before
    assert req.finished_reason.status_code == 503 and req.input_token_logprobs_val == []


# -- setup_state_kv_args -----------------------------------------------------


def test_setup_state_kv_args_of_no_kv_args_names_it_and_reads_no_pool():
    class Pool:
        pd_pool_kinds = frozenset({"swa"})
        calls = 0

        def get_state_buf_infos(self):
            Pool.calls += 1
            return [1], [2], [3]

    expect(BadArgumentType, TypeError, lambda: fu.setup_state_kv_args(None, Pool()), "kv_args")
    assert Pool.calls == 0


# -- get_kv_class -------------------------------------------------------------


@pytest.mark.parametrize(
    ("class_type", "error", "builtin"),
    [
        ("nope", BadArgument, ValueError),
        (None, BadArgumentType, TypeError),
        (3, BadArgumentType, TypeError),
    ],
)
def test_get_kv_class_of_an_unknown_class_type_names_it(monkeypatch, class_type, error, builtin):
    import field.conn.backends as backends

    loaded: list[str] = []
    monkeypatch.setattr(backends, "get_backend", lambda name: loaded.append(name))
    message = expect(
        error,
        builtin,
        lambda: fu.get_kv_class(fu.TransferBackend.FAKE, class_type),
        "class_type",
    )
    assert "KVClassType.MANAGER" in message  # what to pass instead
    assert loaded == []  # refused before any backend was loaded


def test_get_kv_class_still_takes_a_class_types_value():
    assert fu.get_kv_class("fake", "manager") is fu.get_kv_class(
        fu.TransferBackend.FAKE, fu.KVClassType.MANAGER
    )


# -- KVArgs.to_core -----------------------------------------------------------


@pytest.mark.parametrize("rank", ["0", 1.5, True, None])
def test_kv_args_to_core_refuses_a_rank_that_is_not_an_integer(rank):
    args = KVArgs()
    args.engine_rank = rank  # type: ignore[assignment]
    before = state_of(args)
    expect(BuffersError, TypeError, args.to_core, "engine_rank")
    assert state_of(args) == before


def test_kv_args_to_core_still_takes_any_integer_rank():
    args = KVArgs()
    for rank in (3, np.int32(3), torch.tensor(3)):
        args.engine_rank = rank  # type: ignore[assignment]
        core = args.to_core()
        assert core.engine_rank == 3 and type(core.engine_rank) is int


# -- poll_and_all_reduce_with_staging -----------------------------------------


def test_staging_consensus_of_no_requests_names_decode_reqs_and_advances_nothing(world_of_one):
    class Handler:
        def __init__(self) -> None:
            self.calls = 0

        def is_done(self, dr: Any) -> bool:
            self.calls += 1
            return False

        def advance_scatter(self, dr: Any) -> None:
            self.calls += 1

    handler, poller = Handler(), ScriptedPoller(4)
    sessions = {k: list(v) for k, v in consensus._sessions.items()}
    expect(
        BadArgumentType,
        TypeError,
        lambda: fu.poll_and_all_reduce_with_staging(None, handler, world_of_one, None, [poller]),
        "decode_reqs",
    )
    assert handler.calls == 0
    assert {k: list(v) for k, v in consensus._sessions.items()} == sessions


# -- Topology.heads ------------------------------------------------------------


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize(
    ("role", "builtin"), [("decoder", ValueError), ("", ValueError), (None, TypeError)]
)
def test_topology_heads_of_an_unknown_side_names_role(mla, role, builtin):
    topo = Topology(2, 4, kv_heads=4, mla=mla)
    before = attrs.asdict(topo)
    message = expect(TopologyError, builtin, lambda: topo.heads(role, 0), "role")
    assert "'prefill' or 'decode'" in message
    assert isinstance(TopologyError("x"), TransportError)
    assert attrs.asdict(topo) == before
    assert list(topo.heads("decode", 1)) == ([0] if mla else [1])
