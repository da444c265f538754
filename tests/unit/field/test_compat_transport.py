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


def test_fake_sender_waits_for_input_until_all_pages_are_sent():
    s = sender()
    assert s.poll() == KVPoll.WaitingForInput  # polled before init: handshake is instant
    s.init(10, aux_index=0)
    for chunk, expect in (([0, 1, 2, 3], 2), ([4, 5, 6, 7], 2), ([8, 9], 4)):
        s.send(np.array(chunk, dtype=np.int32))
        assert s.poll() == expect
    assert s.has_sent and s.conclude_state == KVPoll.Success
    s.abort()
    assert s.poll() == KVPoll.Success  # latched


def test_fake_sender_repeated_polls_never_conclude():
    s = sender()
    s.init(3, 5)
    assert {s.poll() for _ in range(1000)} == {KVPoll.WaitingForInput}
    assert s.conclude_state is None and not s.has_sent


def test_fake_sender_zero_pages_and_send_without_init():
    s = sender()
    s.init(0, 0)
    assert s.poll() == KVPoll.Success  # fully cached: no send will come
    assert s.should_send_kv_chunk(0, last_chunk=True)
    assert not s.should_send_kv_chunk(0, last_chunk=False)
    assert s.should_send_kv_chunk(3, last_chunk=False)
    t = sender()
    t.send(np.array([0, 1]))
    assert t.poll() == KVPoll.Success


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


def test_fake_sender_works_with_any_manager():
    # the field pairs fake senders with a real backend's manager for warm-up requests
    for mgr in (None, types.SimpleNamespace()):
        s = get_kv_class("fake", "sender")(mgr, "", 0, dest_tp_ranks=[0], pp_rank=0)
        s.init(4, aux_index=0)
        s.send([0, 1, 2, 3])
        assert s.poll() == KVPoll.Success


def test_fake_abort_and_failure_exception():
    s = sender()
    s.abort()
    assert s.conclude_state == KVPoll.Failed and s.poll() == KVPoll.Failed
    with pytest.raises(TransferFailed, match=r"Fake KVSender Exception.*aborted"):
        s.failure_exception()
    with pytest.raises(TransferFailed, match="Fake KVSender Exception"):
        sender().failure_exception()  # the field's fake always raises


def test_fake_receiver():
    receiver_class = get_kv_class(TransferBackend.FAKE, KVClassType.RECEIVER)
    r = receiver_class(manager("decode"), "fake_addr:1234", bootstrap_room=7)
    assert r.require_staging is False
    assert r.poll() == KVPoll.WaitingForInput
    r.init(np.array([3, 4]), aux_index=1, state_indices=None)
    assert r.poll() == KVPoll.Success and r.conclude_state == KVPoll.Success
    with pytest.raises(TransferFailed, match="Fake KVReceiver Exception"):
        r.failure_exception()
    a = receiver_class(None, "fake_addr:1234")
    a.abort()
    assert a.poll() == KVPoll.Failed


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
