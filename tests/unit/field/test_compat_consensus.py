"""field.step.consensus: the field's consensus helpers, their call shapes and gates."""

import types

import numpy as np
import pytest
import torch

import field.step.consensus as compat
from field.data.metadata import MetadataBuffers
from field.step.consensus import (
    poll_and_all_reduce,
    poll_and_all_reduce_attn_cp_tp_group,
    poll_and_all_reduce_with_staging,
)
from field.step.gates import FAKE_BOOTSTRAP_HOST
from lifecycle import FailureReason
from lifecycle.testing import ScriptedPoller
from support.status import F, S, T, W


def test_exports_exactly_the_field_names():
    """The module exports the poll functions it defines; the fake bootstrap host
    is field.step.gates', and field.utils (which stands for the engine's module)
    offers all four."""
    import field.utils

    assert {*compat.__all__, "FAKE_BOOTSTRAP_HOST"} <= set(field.utils.__all__)
    assert field.utils.FAKE_BOOTSTRAP_HOST is FAKE_BOOTSTRAP_HOST
    assert sorted(compat.__all__) == [
        "poll_and_all_reduce",
        "poll_and_all_reduce_attn_cp_tp_group",
        "poll_and_all_reduce_with_staging",
    ]
    assert FAKE_BOOTSTRAP_HOST == "2.2.2.2"


def pollers(*values, rooms=None):
    out = [ScriptedPoller(v) for v in values]
    for p, r in zip(out, rooms or range(101, 101 + len(values))):
        p.bootstrap_room = r
    return out


def test_one_int_per_poller(world_of_one):
    got = poll_and_all_reduce(pollers(1, 2, 3, 4, 0), world_of_one)
    assert got == [1, 2, 3, 4, 0]
    assert all(type(v) is int for v in got)
    assert poll_and_all_reduce([], world_of_one) == []


def test_pollers_without_rooms_still_reduce(world_of_one):
    got = poll_and_all_reduce([ScriptedPoller(4), ScriptedPoller(2)], world_of_one)
    assert got == [4, 2]


def test_a_value_outside_kvpoll_fails_its_request(world_of_one):
    # stricter than the field, which would reduce 7 as if it were a status
    assert poll_and_all_reduce(pollers(7, 4), world_of_one) == [F, S]
    assert compat.last_failures()[0].reason == FailureReason.INVALID_STATUS


def test_a_poller_that_raises_fails_only_its_request(world_of_one):
    ps = pollers(4, 4)
    ps[0].error = RuntimeError("backend hiccup")
    assert poll_and_all_reduce(ps, world_of_one) == [F, S]
    (failure,) = compat.last_failures()
    assert (failure.room, failure.reason, failure.origin) == (101, FailureReason.LOCAL_EXCEPTION, 0)


# -- the metadata gate -------------------------------------------------------


def decode_req(room, slot, host="10.0.0.1"):
    req = types.SimpleNamespace(bootstrap_room=room, bootstrap_host=host)
    return types.SimpleNamespace(req=req, metadata_buffer_index=slot)


def first_token_req(room, slot, token):
    return types.SimpleNamespace(
        metadata_buffer_index=slot,
        output_ids=[token],
        return_logprob=False,
        hidden_states_tensor=None,
        bootstrap_room=room,
    )


@pytest.fixture
def meta():
    return MetadataBuffers(4, 16, torch.float32)


ARGS = types.SimpleNamespace(disaggregation_transfer_backend="mooncake")


def test_gate_holds_success_until_the_row_is_written(world_of_one, meta):
    reqs = [decode_req(101, 0), decode_req(102, 1)]
    meta.set_buf(first_token_req(101, 0, 7))
    got = poll_and_all_reduce(pollers(4, 4), world_of_one, reqs, meta, ARGS)
    assert got == [S, T]
    meta.set_buf(first_token_req(102, 1, 8))
    assert poll_and_all_reduce(pollers(4, 4), world_of_one, reqs, meta, ARGS) == [S, S]


def test_the_gate_runs_with_decode_reqs_and_buffers_as_in_0_5_23(world_of_one, meta):
    # 0.5.23's decode queue passes no server_args: the gate must still hold the row
    reqs = [decode_req(101, 0)]
    got = poll_and_all_reduce(pollers(4), world_of_one, decode_reqs=reqs, metadata_buffers=meta)
    assert got == [T]
    assert poll_and_all_reduce(pollers(4), world_of_one, decode_reqs=reqs) == [S]  # no buffers


def test_buffers_without_decode_reqs_are_refused_not_ignored(world_of_one, meta):
    with pytest.raises(TypeError, match="metadata_buffers was given without decode_reqs"):
        poll_and_all_reduce(pollers(4), world_of_one, metadata_buffers=meta)


def test_gate_never_hides_a_failure(world_of_one, meta):
    reqs = [decode_req(101, 0)]
    assert poll_and_all_reduce(pollers(0), world_of_one, reqs, meta, ARGS) == [F]


@pytest.mark.parametrize(
    ("host", "backend", "expect"),
    [
        (FAKE_BOOTSTRAP_HOST, "mooncake", S),  # warm-up request: no row is ever written
        (None, "fake", S),
        (None, "mooncake", T),
        ("10.0.0.1", "fake", T),
    ],
)
def test_fake_path_skips_the_gate(world_of_one, meta, host, backend, expect):
    args = types.SimpleNamespace(disaggregation_transfer_backend=backend)
    got = poll_and_all_reduce(pollers(4), world_of_one, [decode_req(101, 0, host)], meta, args)
    assert got == [expect]


def test_a_row_with_another_requests_room_fails_it(world_of_one, meta):
    # stricter than the field (which lets it through to be caught later): agreed now
    meta.set_buf(first_token_req(555, 0, 7))
    rooms = [np.int64(101)]  # numpy rooms count as rooms
    reqs = [decode_req(rooms[0], 0)]
    assert poll_and_all_reduce(pollers(4, rooms=rooms), world_of_one, reqs, meta, ARGS) == [F]
    assert compat.last_failures()[0].reason == FailureReason.METADATA_CORRUPT


def test_gate_reads_the_fields_own_buffers(world_of_one):
    # any object with a (size, k) bootstrap_room tensor works, e.g. the field's own class
    field_buffers = types.SimpleNamespace(bootstrap_room=torch.zeros((2, 8), dtype=torch.int64))
    reqs = [decode_req(101, 0), decode_req(102, 1)]
    field_buffers.bootstrap_room[1, 0] = 102
    assert poll_and_all_reduce(pollers(4, 4), world_of_one, reqs, field_buffers, ARGS) == [T, S]


def test_decode_reqs_must_match_pollers(world_of_one, meta):
    with pytest.raises(ValueError, match="2 entries for 1 pollers"):
        poll_and_all_reduce(pollers(4), world_of_one, [decode_req(1, 0)] * 2, meta, ARGS)


# -- failure injection --------------------------------------------------------


def test_failure_probability_is_read_on_every_call(world_of_one, monkeypatch):
    assert poll_and_all_reduce(pollers(4, 4), world_of_one) == [S, S]
    monkeypatch.setenv("SGLANG_TEST_DISAGG_FAILURE_PROB", "1")
    assert poll_and_all_reduce(pollers(4, 4), world_of_one) == [F, F]
    assert {f.reason for f in compat.last_failures()} == {FailureReason.INJECTED_FAULT}
    monkeypatch.delenv("SGLANG_TEST_DISAGG_FAILURE_PROB")
    monkeypatch.setenv("DISAGGREGATION_TEST_FAILURE_PROB", "1")  # the older name
    assert poll_and_all_reduce(pollers(4), world_of_one) == [F]
    monkeypatch.setenv("DISAGGREGATION_TEST_FAILURE_PROB", "0")
    assert poll_and_all_reduce(pollers(4), world_of_one) == [S]


def test_injected_faults_are_seeded_once_per_process(world_of_one, monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_DISAGG_FAILURE_PROB", "0.5")
    monkeypatch.setenv("PDLIFE_FAULT_SEED", "12345")
    monkeypatch.setattr(compat, "_fault_hooks", {})
    draws = [poll_and_all_reduce(pollers(*[4] * 64), world_of_one) for _ in range(3)]
    # a generator re-created on each call would repeat the same pattern every call
    assert draws[0] != draws[1] or draws[1] != draws[2]
    monkeypatch.setattr(compat, "_fault_hooks", {})
    again = [poll_and_all_reduce(pollers(*[4] * 64), world_of_one) for _ in range(3)]
    assert again == draws  # the same seed repeats the run


# -- the CP x TP form ----------------------------------------------------------


def test_cp_tp_form_takes_the_field_keywords(world_of_one):
    got = poll_and_all_reduce_attn_cp_tp_group(
        pollers(4, 2), attn_cp_cpu_group=world_of_one, attn_tp_cpu_group=world_of_one
    )
    assert got == [S, W]


# -- staging ------------------------------------------------------------------


class Handler:
    """Scatter of each staged request done after ``need`` advance_scatter calls."""

    def __init__(self, need, fail_room=None):
        self.need = need
        self.calls = {}
        self.fail_room = fail_room

    def is_done(self, dr):
        return self.calls.get(dr.req.bootstrap_room, 0) >= self.need

    def advance_scatter(self, dr):
        if dr.req.bootstrap_room == self.fail_room:
            raise RuntimeError("scatter kernel failed")
        self.calls[dr.req.bootstrap_room] = self.calls.get(dr.req.bootstrap_room, 0) + 1


def staged_req(room, slot, status, staging=True):
    dr = decode_req(room, slot)
    dr.kv_receiver = ScriptedPoller(status)
    dr.kv_receiver.require_staging = staging
    return dr


def test_staging_holds_success_until_the_scatter_is_done(world_of_one):
    h = Handler(need=3)
    reqs = [staged_req(101, 0, 4), staged_req(102, 1, 4, staging=False), staged_req(103, 2, 2)]
    seen = [poll_and_all_reduce_with_staging(reqs, h, world_of_one) for _ in range(4)]
    assert seen == [[T, S, W], [T, S, W], [S, S, W], [S, S, W]]
    assert h.calls == {101: 3, 103: 3}  # the unstaged request is never advanced
    assert all(dr.kv_receiver.polls == 4 for dr in reqs)


def test_staging_then_metadata_gate(world_of_one, meta):
    h = Handler(need=1)
    reqs = [staged_req(101, 0, 4)]
    assert poll_and_all_reduce_with_staging(reqs, h, world_of_one, meta) == [T]
    meta.set_buf(first_token_req(101, 0, 9))
    assert poll_and_all_reduce_with_staging(reqs, h, world_of_one, meta) == [S]
    # 0.5.23 gates whenever metadata_buffers is given, server_args or not
    assert poll_and_all_reduce_with_staging(
        [staged_req(102, 1, 4)], Handler(0), world_of_one, meta
    ) == [T]


def test_the_fifth_argument_is_pollers_in_0_5_23_and_server_args_in_the_seed(world_of_one, meta):
    from field.release import set_release

    meta.set_buf(first_token_req(101, 0, 9))
    reqs = [staged_req(101, 0, 2)]  # the receiver says WaitingForInput
    # 0.5.23: the fifth argument is the pollers, which are polled instead
    assert poll_and_all_reduce_with_staging(reqs, Handler(0), world_of_one, meta, pollers(4)) == [S]
    set_release("seed")
    try:
        got = poll_and_all_reduce_with_staging(reqs, Handler(0), world_of_one, meta, ARGS)
    finally:
        set_release(None)
    assert got == [W]


def test_a_failed_scatter_fails_its_request_as_in_0_5_23(world_of_one):
    class TimedOut(Handler):
        def is_failed(self, dr):
            return dr.req.bootstrap_room == 101

    reqs = [staged_req(101, 0, 4), staged_req(102, 1, 4), staged_req(103, 2, 4, staging=False)]
    assert poll_and_all_reduce_with_staging(reqs, TimedOut(need=5), world_of_one) == [F, T, S]


def test_a_staging_handler_that_raises_fails_only_its_request(world_of_one):
    h = Handler(need=2, fail_room=101)
    reqs = [staged_req(101, 0, 4), staged_req(102, 1, 4)]
    assert poll_and_all_reduce_with_staging(reqs, h, world_of_one) == [F, T]
    (failure,) = compat.last_failures()
    assert (failure.room, failure.reason) == (101, FailureReason.LOCAL_EXCEPTION)


def test_gate_reads_our_core_buffers_and_refuses_anything_else(world_of_one):
    from buffers import MetadataBuffers as CoreMetadataBuffers

    core = CoreMetadataBuffers(2)
    core.write(1, 102, {"output_ids": [1]})
    reqs = [decode_req(101, 0), decode_req(102, 1)]
    assert poll_and_all_reduce(pollers(4, 4), world_of_one, reqs, core, ARGS) == [T, S]
    with pytest.raises(TypeError, match="no bootstrap_room tensor"):
        poll_and_all_reduce(pollers(4, 4), world_of_one, reqs, object(), ARGS)


@pytest.mark.parametrize(
    "column",
    [
        lambda: np.zeros((2, 8), dtype=np.uint64),
        lambda: torch.zeros((2, 8), dtype=torch.int32),
        lambda: torch.zeros((2, 8), dtype=torch.int64)[:, ::2],  # a strided view
    ],
)
def test_gate_reads_room_columns_of_other_kinds(world_of_one, column):
    col = column()
    col[1, 0] = 102
    reqs = [decode_req(101, 0), decode_req(102, 1)]
    buffers = types.SimpleNamespace(bootstrap_room=col)
    assert poll_and_all_reduce(pollers(4, 4), world_of_one, reqs, buffers, ARGS) == [T, S]


def test_rooms_fall_back_to_the_pollers_own(world_of_one, meta):
    # the request carries no room, its poller does: the corrupt check still applies
    meta.set_buf(first_token_req(555, 0, 7))
    reqs = [decode_req(None, 0)]
    assert poll_and_all_reduce(pollers(4, rooms=[101]), world_of_one, reqs, meta, ARGS) == [F]
    # with no room anywhere only "written or not" can be checked, as in the field
    no_room = [ScriptedPoller(4)]
    assert poll_and_all_reduce(no_room, world_of_one, reqs, meta, ARGS) == [S]


def test_a_slot_outside_the_buffers_fails_its_request_instead_of_raising(world_of_one, meta):
    # raising here, between two collectives on one rank, would leave the others waiting
    meta.set_buf(first_token_req(101, 0, 7))
    reqs = [decode_req(101, 0), decode_req(102, 9)]
    assert poll_and_all_reduce(pollers(4, 4), world_of_one, reqs, meta, ARGS) == [S, F]
    assert compat.last_failures()[0].reason == FailureReason.METADATA_CORRUPT


def test_an_unreadable_room_column_fails_the_requests_it_gates(world_of_one):
    class Broken:
        def __len__(self):
            return 4

        def __getitem__(self, key):
            raise RuntimeError("device lost")

    reqs = [decode_req(101, 0)]
    buffers = types.SimpleNamespace(bootstrap_room=Broken())
    assert poll_and_all_reduce(pollers(4), world_of_one, reqs, buffers, ARGS) == [F]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda g: poll_and_all_reduce(5, g), "pollers: got .* expected a list"),
        (lambda g: poll_and_all_reduce("abc", g), "pollers: got .* expected a list"),
        (lambda g: poll_and_all_reduce(pollers(4), object()), "gloo_group must be"),
        (
            lambda g: poll_and_all_reduce(pollers(4), g, decode_reqs=7),
            "decode_reqs: got 7 .* expected a list",
        ),
        (
            lambda g: poll_and_all_reduce_with_staging([staged_req(101, 0, 4)], object(), g),
            "staging_handler .* has no is_done",
        ),
    ],
)
def test_wrong_types_name_the_argument_and_poll_nothing(world_of_one, call, match):
    with pytest.raises(TypeError, match=match):
        call(world_of_one)


def test_a_bad_metadata_index_fails_its_request_on_every_rank(world_of_one, meta):
    """-1, a negative index or None: the field would read row -1 or raise; here
    the request fails (metadata corrupt) and the others go on."""
    reqs = [decode_req(101, -1), decode_req(102, None), decode_req(103, -5), decode_req(104, 0)]
    meta.set_buf(first_token_req(104, 0, 7))
    got = poll_and_all_reduce(pollers(4, 4, 4, 4), world_of_one, reqs, meta)
    assert got == [F, F, F, S]
    assert {f.reason for f in compat.last_failures()} == {FailureReason.METADATA_CORRUPT}


class SetPoller:
    """A poller whose status the test sets between calls."""

    def __init__(self, room, status):
        self.bootstrap_room, self.status = room, status

    def poll(self):
        return self.status


def test_the_gate_reads_the_right_rows_after_a_request_leaves_the_middle(world_of_one, meta):
    # a request that concludes leaves the table; the engine drops it from its list:
    # the requests after it move up, and the gate must read their rows, not stale ones
    reqs = [decode_req(201, 0), decode_req(202, 1), decode_req(203, 2)]
    ps = [SetPoller(201, T), SetPoller(202, S), SetPoller(203, T)]
    meta.set_buf(first_token_req(202, 1, 5))
    assert poll_and_all_reduce(ps, world_of_one, reqs, meta, ARGS) == [T, S, T]
    reqs, ps = [reqs[0], reqs[2]], [ps[0], ps[2]]
    ps[1].status = S  # 203 concludes; its row (slot 2) has landed, 201's (slot 0) has not
    meta.set_buf(first_token_req(203, 2, 6))
    assert poll_and_all_reduce(ps, world_of_one, reqs, meta, ARGS) == [T, S]
    assert compat.last_failures() == []
    ps[0].status = S
    meta.set_buf(first_token_req(201, 0, 4))
    assert poll_and_all_reduce(ps, world_of_one, reqs, meta, ARGS) == [S, S]
