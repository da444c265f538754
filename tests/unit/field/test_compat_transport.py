"""field.conn.backends: get_kv_class and the classes it returns, built the field's way."""

import importlib.util
import types

import numpy as np
import pytest
import torch

import field.conn.backends as compat
from buffers import KVArgs as CoreKVArgs
from buffers import LayoutError, StateType
from field.conn.backends import KVClassType, TransferBackend, get_kv_class
from lifecycle import FailureReason, KVPoll
from transport import BackendUnavailable, TransferFailed

HAS_MOONCAKE = importlib.util.find_spec("mooncake") is not None


def test_exports_exactly_the_field_names():
    assert sorted(compat.__all__) == ["KVClassType", "TransferBackend", "get_kv_class"]
    assert {b.name: b.value for b in TransferBackend} == {
        "MOONCAKE": "mooncake",
        "MORI": "mori",
        "NIXL": "nixl",
        "ASCEND": "ascend",
        "FAKE": "fake",
    }
    assert [k.value for k in KVClassType] == [
        "kvargs",
        "manager",
        "sender",
        "receiver",
        "bootstrap_server",
    ]


def test_fake_classes_and_no_bootstrap_server():
    for kind in (KVClassType.KVARGS, KVClassType.MANAGER, KVClassType.SENDER, KVClassType.RECEIVER):
        assert isinstance(get_kv_class(TransferBackend.FAKE, kind), type)
    assert get_kv_class(TransferBackend.FAKE, KVClassType.BOOTSTRAP_SERVER) is None


@pytest.mark.parametrize("name", ["carrier-pigeon", "FAKE", None])
def test_unknown_backend_is_a_value_error(name):
    with pytest.raises(ValueError, match=f"^Unsupported transfer backend: {name}"):
        get_kv_class(name, KVClassType.SENDER)


def test_backend_named_by_string_or_another_enum():
    other = types.SimpleNamespace(value="fake")
    assert get_kv_class("fake", "sender") is get_kv_class(other, KVClassType.SENDER)


@pytest.mark.parametrize("backend", [TransferBackend.MORI, TransferBackend.ASCEND])
def test_hardware_backends_say_what_they_need(backend):
    with pytest.raises(BackendUnavailable, match=r"hardware|GPUs|NPUs"):
        get_kv_class(backend, KVClassType.MANAGER)


def test_nixl_classes_exist_or_name_what_to_install():
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailable, match="nixl"):
            get_kv_class(TransferBackend.NIXL, KVClassType.SENDER)
        return
    sender = get_kv_class(TransferBackend.NIXL, KVClassType.SENDER)
    assert sender.__name__ == "NixlKVSender"
    assert get_kv_class(TransferBackend.NIXL, KVClassType.BOOTSTRAP_SERVER) is not None


@pytest.mark.skipif(not HAS_MOONCAKE, reason="pd-lifecycle[mooncake] not installed")
def test_mooncake_classes():
    for kind in KVClassType:
        assert isinstance(get_kv_class(TransferBackend.MOONCAKE, kind), type)


def test_mooncake_missing_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_mooncake(name, *a, **kw):
        if name.startswith("mooncake"):
            raise ImportError("No module named 'mooncake'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mooncake)
    with pytest.raises(BackendUnavailable, match=r"pd-lifecycle\[mooncake\]"):
        get_kv_class(TransferBackend.MOONCAKE, KVClassType.MANAGER)


# -- KVArgs ---------------------------------------------------------------------


def test_kv_args_built_empty_then_filled():
    kv_args_class = get_kv_class(TransferBackend.FAKE, KVClassType.KVARGS)
    a = kv_args_class()
    kv = torch.zeros((8, 64), dtype=torch.uint8)
    a.engine_rank = 1
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = [kv.data_ptr()], [kv.nbytes], [64]
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [5], [640], [64]
    a.state_types = [StateType.MAMBA]
    a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [[9]], [[256]], [[128]]
    a.state_dim_per_tensor = [[2]]
    a.page_size = 16
    core = a.to_core()
    assert isinstance(core, CoreKVArgs)
    assert (core.engine_rank, core.kv_item_lens, core.page_size) == (1, (64,), 16)
    assert core.state[0].type is StateType.MAMBA and core.state[0].split_dims == (2,)
    a.kv_item_lens = []
    with pytest.raises(LayoutError, match="parallel"):
        a.to_core()


#: every field of 0.5.23's KVArgs, and its default where it has one
KVARGS_0523 = {
    "engine_rank": None,
    "kv_data_ptrs": None,
    "kv_data_lens": None,
    "kv_item_lens": None,
    "kv_layer_ids": None,
    "kv_cache_dtype_str": None,
    "kv_layout": ("default", None),
    "host_kv_data_ptrs": ("default", None),
    "host_kv_data_lens": ("default", None),
    "host_kv_item_lens": ("default", None),
    "host_state_data_ptrs": ("default", None),
    "host_state_data_lens": ("default", None),
    "host_state_item_lens": ("default", None),
    "aux_data_ptrs": None,
    "aux_data_lens": None,
    "aux_item_lens": None,
    "state_types": None,
    "state_data_ptrs": None,
    "state_data_lens": None,
    "state_item_lens": None,
    "state_layer_ids": None,
    "state_dim_per_tensor": None,
    "state_slice_outer_counts": None,
    "is_hybrid_mla_backend": None,
    "state_conv_shard_groups": None,
    "swa_kv_cache_layout": None,
    "ib_device": None,
    "gpu_id": None,
    "kv_head_num": None,
    "total_kv_head_num": None,
    "page_size": None,
    "system_dp_rank": None,
    "rust_http_port": None,
    "pp_rank": None,
    "prefill_start_layer": None,
    "prefill_end_layer": None,
    "mla_compression_ratios": None,
    "kv_buf_groups": None,
    "hidden_kv_layers": None,
    "draft_kv_layers": None,
    "num_draft_entries": ("default", 0),
}


def test_kv_args_has_every_0523_field_and_its_defaults():
    kv_args_class = get_kv_class(TransferBackend.FAKE, KVClassType.KVARGS)
    a = kv_args_class()  # no arguments, as in 0.5.23
    for name, default in KVARGS_0523.items():
        assert name in kv_args_class.__annotations__, name
        assert hasattr(a, name), name
        if default is not None:
            assert getattr(a, name) == default[1], name
            assert getattr(kv_args_class, name) == default[1], name  # a class default too
    # the seed's fields that 0.5.23 dropped are kept for seed engines
    assert (a.ib_traffic_class, a.decode_tp_size, a.prefill_pp_size) == (None, 1, 1)
    # filled the 0.5.23 way, it still converts to the core's
    kv = torch.zeros((8, 64), dtype=torch.uint8)
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = [kv.data_ptr()], [kv.nbytes], [64]
    a.kv_layer_ids, a.kv_cache_dtype_str, a.total_kv_head_num = [0], "bfloat16", 8
    a.page_size = 4
    assert (a.to_core().kv_item_lens, a.to_core().page_size) == ((64,), 4)


def test_kv_args_lists_are_not_shared_between_instances():
    kv_args_class = get_kv_class(TransferBackend.FAKE, KVClassType.KVARGS)
    a, b = kv_args_class(), kv_args_class()
    a.kv_layer_ids.append(3)
    a.state_slice_outer_counts.append([1])
    assert b.kv_layer_ids == [] and b.state_slice_outer_counts == []


# -- the fake connector ----------------------------------------------------------


def manager(mode="prefill"):
    manager_class = get_kv_class(TransferBackend.FAKE, KVClassType.MANAGER)
    kv_args_class = get_kv_class(TransferBackend.FAKE, KVClassType.KVARGS)
    return manager_class(kv_args_class(), mode, types.SimpleNamespace())


def sender(mgr="default", room=42):
    sender_class = get_kv_class(TransferBackend.FAKE, KVClassType.SENDER)
    return sender_class(manager() if mgr == "default" else mgr, "fake_addr:1234", room)


def test_fake_manager_takes_the_field_arguments():
    m = get_kv_class("fake", "manager")(
        args="a", disaggregation_mode="decode", server_args="s", is_mla_backend=True
    )
    assert (m.kv_args, m.disaggregation_mode, m.server_args, m.is_mla_backend) == (
        "a",
        "decode",
        "s",
        True,
    )


# The fake sender behaves the same under both releases (0.5.23's fake connector;
# COMPAT.md asks the seed's to match the field's current one): WaitingForInput
# until a send, Success at the next poll; init only arms the waiting timeout.


def test_fake_sender_concludes_at_the_first_send_whatever_init_said(field_release):
    s = sender()
    assert s.poll() == KVPoll.WaitingForInput  # polled before init: handshake is instant
    s.init(3, aux_index=0)
    assert s.poll() == KVPoll.WaitingForInput
    s.send(np.array([0], dtype=np.int32))  # one page of three
    assert s.conclude_state is None  # concluded by the next poll, as in the field
    assert s.poll() == KVPoll.Success
    assert s.has_sent and s.conclude_state == KVPoll.Success
    s.send(np.array([1, 2], dtype=np.int32))  # later chunks change nothing
    assert s.poll() == KVPoll.Success


def test_fake_sender_after_init_0_waits_for_the_send(field_release):
    s = sender()
    s.init(0, 0)  # fully cached: the last (empty) chunk is still sent
    assert {s.poll() for _ in range(100)} == {KVPoll.WaitingForInput}
    assert s.conclude_state is None and not s.has_sent
    assert s.should_send_kv_chunk(0, last_chunk=True)
    s.send(np.array([], dtype=np.int32))
    assert s.poll() == KVPoll.Success


def test_fake_sender_abort_after_success_is_failed(field_release):
    s = sender()
    s.init(1, 0)
    s.send(np.array([0]))
    assert s.poll() == KVPoll.Success
    s.abort()
    assert s.poll() == KVPoll.Failed and s.conclude_state == KVPoll.Failed
    with pytest.raises(TransferFailed, match=r"Fake KVSender Exception.*aborted"):
        s.failure_exception()
    s.send(np.array([0]))
    assert s.poll() == KVPoll.Failed  # Failed stays


def test_fake_sender_repeated_polls_never_conclude():
    s = sender()
    s.init(3, 5)
    assert {s.poll() for _ in range(1000)} == {KVPoll.WaitingForInput}
    assert s.conclude_state is None and not s.has_sent


def test_fake_sender_send_without_init_and_chunk_rule():
    t = sender()
    t.send(np.array([0, 1]))
    assert t.poll() == KVPoll.Success
    assert not t.should_send_kv_chunk(0, last_chunk=False)
    assert t.should_send_kv_chunk(3, last_chunk=False)


def test_fake_sender_waiting_timeout_starts_at_the_first_poll_after_init():
    s = sender()
    for _ in range(5):
        s.poll()
    assert s.waiting_since is None  # no deadline before init (the bootstrap timeout covers it)
    s.init(1, 0)
    assert s.waiting_since is None  # queueing and prefill time are not charged
    assert s.poll() == KVPoll.WaitingForInput
    assert s.waiting_since is not None
    s.waiting_since -= s.waiting_timeout + 1
    assert s.poll() == KVPoll.Failed
    assert s.conclude_state == KVPoll.Failed
    assert s.core.failure_reason() == FailureReason.WAITING_TIMEOUT
    s.send(np.array([0]))  # too late: Failed latches
    assert s.poll() == KVPoll.Failed


def test_fake_sender_timeout_is_read_when_built(monkeypatch):
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "600")
    s = sender()
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "1")
    assert s.waiting_timeout == 600
    s.init(1, 0)
    s.poll()
    s.waiting_since -= 599
    assert s.poll() == KVPoll.WaitingForInput
    s.waiting_since -= 2
    assert s.poll() == KVPoll.Failed
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SGLANG_DISAGGREGATION_WAITING_TIMEOUT"):
        sender()


def test_fake_sender_times_out_once_the_timeout_has_passed_not_after(monkeypatch):
    # 0.5.23: still waiting when elapsed >= timeout is Failed
    monkeypatch.setattr("field.conn.fake.time.monotonic", lambda: 1000.0)
    s = sender()
    s.init(1, 0)
    s.poll()
    s.waiting_since = 1000.0 - s.waiting_timeout
    assert s.poll() == KVPoll.Failed


def test_fake_sender_works_with_any_manager():
    # the field pairs fake senders with a real backend's manager for warm-up requests
    for mgr in (None, types.SimpleNamespace()):
        s = get_kv_class("fake", "sender")(mgr, "", 0, dest_tp_ranks=[0], pp_rank=0)
        s.init(4, aux_index=0)
        s.send([0, 1, 2, 3])
        assert s.poll() == KVPoll.Success


def test_fake_sender_built_the_way_0523s_prefill_builds_it(field_release):
    # keywords mean the same under both releases
    s = get_kv_class("fake", "sender")(
        mgr=manager(),
        bootstrap_addr="10.0.0.1:8998",
        bootstrap_room=5,
        req_has_disagg_prefill_dp_rank=True,
    )
    assert s.req_has_disagg_prefill_dp_rank is True and s.bootstrap_room == 5
    assert s.poll_pp_consensus() == KVPoll.WaitingForInput
    s.mark_prefill_complete()
    assert s.pop_decode_prefix_len() == 0 and s.get_max_transfer_tokens() is None


def test_fake_sender_fourth_positional_argument_by_release(field_release):
    from buffers.errors import BadArgumentType

    sender_class = get_kv_class("fake", "sender")
    if field_release == "seed":
        s = sender_class(manager(), "a", 6, [0, 1], 2)
        assert (s.dest_tp_ranks, s.pp_rank) == ([0, 1], 2)
        with pytest.raises(TypeError, match="positional"):
            sender_class(manager(), "a", 6, [0], 0, True)
    else:
        assert sender_class(manager(), "a", 6, True).req_has_disagg_prefill_dp_rank is True
        with pytest.raises(BadArgumentType, match=r"req_has_disagg_prefill_dp_rank.*seed"):
            sender_class(manager(), "a", 6, [0])
        with pytest.raises(TypeError, match="positional"):
            sender_class(manager(), "a", 6, [0], 0)


def test_fake_sender_signature_follows_the_release(field_release):
    import inspect

    params = list(inspect.signature(get_kv_class("fake", "sender")).parameters)
    tail = (
        ["dest_tp_ranks", "pp_rank"]
        if field_release == "seed"
        else ["req_has_disagg_prefill_dp_rank"]
    )
    assert params == ["mgr", "bootstrap_addr", "bootstrap_room", *tail]


def test_fake_abort_and_failure_exception():
    s = sender()
    s.abort()
    assert s.conclude_state == KVPoll.Failed and s.poll() == KVPoll.Failed
    with pytest.raises(TransferFailed, match=r"Fake KVSender Exception.*aborted"):
        s.failure_exception()
    with pytest.raises(TransferFailed, match="Fake KVSender Exception"):
        sender().failure_exception()  # the field's fake always raises


def receiver(room=7):
    receiver_class = get_kv_class(TransferBackend.FAKE, KVClassType.RECEIVER)
    return receiver_class(manager("decode"), "fake_addr:1234", bootstrap_room=room)


def test_fake_receiver_init_by_release(field_release):
    r = receiver()
    assert r.require_staging is False
    if field_release == "seed":
        assert r.poll() == KVPoll.WaitingForInput  # the handshake is instant
        r.init(np.array([3, 4]), aux_index=1, state_indices=None)  # where to write
    else:
        assert r.poll() == KVPoll.Bootstrapping  # until init(prefill_dp_rank)
        r.init(0)  # not "zero pages": the prefill DP rank
        assert r.poll() == KVPoll.WaitingForInput and r.conclude_state is None
        assert {r.poll() for _ in range(100)} == {KVPoll.WaitingForInput}
        r.send_metadata(np.array([3, 4]), 1, None, decode_prefix_len=0)
        assert r.has_sent_metadata
    assert r.conclude_state is None  # concluded by the next poll, as in the field
    assert r.poll() == KVPoll.Success and r.conclude_state == KVPoll.Success
    with pytest.raises(TransferFailed, match="Fake KVReceiver Exception"):
        r.failure_exception()


def test_fake_receiver_0523_signatures():
    import inspect

    receiver_class = get_kv_class(TransferBackend.FAKE, KVClassType.RECEIVER)
    params = inspect.signature(receiver_class.send_metadata).parameters
    assert [(p.name, p.default) for p in list(params.values())[1:]] == [
        ("kv_indices", inspect.Parameter.empty),
        ("aux_index", None),
        ("state_indices", None),
        ("decode_prefix_len", None),
    ]
    r = receiver()
    r.init(prefill_dp_rank=2)  # by keyword, under any release
    assert r.prefill_dp_rank == 2 and r.poll() == KVPoll.WaitingForInput
    assert r.abort_notified is False
    r.ensure_abort_notified(force_arm=True)  # nothing to notify


def test_fake_receiver_0523_refuses_the_seeds_init(v0523):
    from buffers.errors import BadArgumentType

    r = receiver()
    with pytest.raises(BadArgumentType, match=r"prefill_dp_rank.*send_metadata"):
        r.init(np.array([3, 4]))
    with pytest.raises(TypeError, match="positional"):
        r.init(np.array([3, 4]), 1)
    assert r.poll() == KVPoll.Bootstrapping  # nothing changed


def test_fake_receiver_seed_refuses_a_rank_for_pages(seed):
    from buffers.errors import BadArgumentType

    r = receiver()
    with pytest.raises(BadArgumentType, match=r"kv_indices.*0\.5\.23"):
        r.init(0)
    assert r.poll() == KVPoll.WaitingForInput


def test_fake_receiver_abort_after_success_is_failed(field_release):
    r = receiver()
    r.init(prefill_dp_rank=0)
    r.send_metadata([1], 0)
    assert r.poll() == KVPoll.Success
    r.abort()
    assert r.poll() == KVPoll.Failed
    a = get_kv_class("fake", "receiver")(None, "fake_addr:1234")
    a.abort()
    assert a.poll() == KVPoll.Failed


def test_fake_receiver_send_metadata_before_init_waits_for_init(v0523):
    r = receiver()
    r.send_metadata([1, 2], 0)
    assert r.poll() == KVPoll.Bootstrapping
    r.init(0)
    assert r.poll() == KVPoll.Success


def test_handles_give_their_slot_back():
    m = manager()
    s = sender(m)
    free_before = len(m.core._free)
    s.clear()
    assert len(m.core._free) == free_before + 1


def test_a_field_manager_takes_its_tp_size_from_the_server_args():
    from field.conn.mooncake import _tp_size

    assert _tp_size(types.SimpleNamespace(tp_size=4), 3, "mooncake") == 4
    assert _tp_size(types.SimpleNamespace(), 0, "mooncake") == 1  # a lone rank
    # a guess per rank would publish different group sizes from one group
    with pytest.raises(ValueError, match=r"tp_size is not set.*engine rank 2"):
        _tp_size(types.SimpleNamespace(), 2, "nixl")
