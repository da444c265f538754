import numpy as np
import pytest

from field.conn.backends import KVClassType, TransferBackend, get_kv_class
from lifecycle import FailureReason, KVPoll, RequestTable, SingleRank, Stepper
from transport import BackendUnavailable, TransferFailed, UnknownBackend, get_backend
from transport.backends.fake import FakeManager


def test_unknown_backend_lists_known():
    with pytest.raises(UnknownBackend, match=r"fake, mooncake, mori, nixl"):
        get_backend("carrier-pigeon")


@pytest.mark.parametrize("value", [None, 3, b"fake", ["fake"]], ids=repr)
def test_a_backend_name_that_is_not_a_string_is_an_unknown_backend(value):
    """get_backend(None) raised AttributeError ('NoneType' has no 'lower')."""
    from transport import TransportError

    with pytest.raises(UnknownBackend) as e:
        get_backend(value)
    assert isinstance(e.value, TransportError)
    assert e.value.name == value
    msg = str(e.value)
    assert f"got {value!r} ({type(value).__name__})" in msg
    assert "known backends: ascend, fake, mooncake, mori, nixl" in msg


@pytest.mark.parametrize("name", ["mori", "ascend"])
def test_hardware_backends_say_what_they_need(name):
    with pytest.raises(BackendUnavailable, match=r"hardware|GPUs|NPUs"):
        get_backend(name)


def test_missing_package_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **kw):
        if name.startswith("nixl"):
            raise ImportError("No module named 'nixl'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(BackendUnavailable, match=r"pd-lifecycle\[nixl\]"):
        get_backend("nixl")


def test_compat_get_kv_class():
    # field-shaped classes over our fake backend (tests/unit/compat has the details)
    manager = get_kv_class(TransferBackend.FAKE, KVClassType.MANAGER)(None, "prefill", None)
    assert isinstance(manager.core, FakeManager)


def test_fake_sender_semantics():
    m = FakeManager(capacity=2)
    s = m.sender(5)
    assert s.poll() == KVPoll.WaitingForInput
    s.init(num_pages=3, metadata_slot=0)
    assert s.poll() == KVPoll.Transferring
    s.send([1, 2])
    assert s.poll() == KVPoll.Transferring
    s.send([3])
    assert s.poll() == KVPoll.Success
    s.abort()
    assert s.poll() == KVPoll.Success  # latched
    z = m.sender(6)
    z.init(0, None)
    assert z.poll() == KVPoll.Success
    grow = [m.sender(10 + i) for i in range(5)]  # grows past capacity
    assert {g.poll() for g in grow} == {KVPoll.WaitingForInput}


def test_fake_receiver_semantics_and_abort():
    m = FakeManager()
    r = m.receiver(9)
    assert r.poll() == KVPoll.Bootstrapping
    r.init()
    assert r.poll() == KVPoll.WaitingForInput
    r.abort()
    assert r.poll() == KVPoll.Failed
    assert r.failure_reason() == FailureReason.ABORTED
    with pytest.raises(TransferFailed, match="room=9"):
        r.failure_exception()
    r.send_metadata([1], 0)
    assert r.poll() == KVPoll.Failed


def test_fake_manager_is_a_batch_poller_for_the_step():
    m = FakeManager()
    table = RequestTable()
    recvs = [m.receiver(room) for room in (1, 2, 3)]
    table.extend([1, 2, 3], handle_indices=[r.index for r in recvs])
    stepper = Stepper(table, 0, poller=m)
    recvs[0].init()
    recvs[1].init()
    recvs[1].send_metadata([4], 0)
    recvs[2].abort()
    res = stepper.step(SingleRank())
    assert res.statuses.tolist() == [2, 4, 0]
    assert res.failures()[0].reason == FailureReason.ABORTED
    np.testing.assert_array_equal(res.succeeded, [2])


def test_a_cleared_fake_handle_does_not_alias_the_next_request():
    m = FakeManager(capacity=1)
    old = m.sender(1)
    old.abort()
    old.clear()
    new = m.sender(2)
    assert new.index == old.index  # the slot is reused...
    assert old.poll() == KVPoll.Failed  # ...but the stale handle keeps its own answer
    assert old.failure_reason() == FailureReason.ABORTED
    old.abort()  # and cannot move the request that took its slot
    old.init(3, None)
    old.send([1, 2, 3])
    assert new.poll() == KVPoll.WaitingForInput
    new.init(1, None)
    assert new.poll() == KVPoll.Transferring


def test_status_written_by_another_thread_during_growth_is_kept(monkeypatch):
    import threading

    import transport.status_arrays as sa

    arrays = sa.StatusArrays(capacity=2)
    idx = arrays.take(int(KVPoll.Bootstrapping))
    arrays.take(int(KVPoll.Bootstrapping))
    real = np.concatenate
    writer = threading.Thread(
        target=arrays.set, args=(idx, int(KVPoll.Failed), FailureReason.PEER_DEAD)
    )

    def concatenate_then_write(*a, **kw):
        out = real(*a, **kw)
        if not writer.is_alive() and writer.ident is None:
            writer.start()  # an engine thread writes right after the old array was copied
            writer.join(0.3)  # a lock makes it wait for the growth instead
        return out

    monkeypatch.setattr(sa.np, "concatenate", concatenate_then_write)
    arrays.take(int(KVPoll.Bootstrapping))  # grows
    writer.join(5)
    assert arrays.status[idx] == KVPoll.Failed
    assert arrays.reason[idx] == FailureReason.PEER_DEAD


def test_registry_reports_nixl_available_when_installed():
    pytest.importorskip("nixl_cu12", reason="pd-lifecycle[nixl] not installed")
    from field.conn.nixl import NixlKVManager, NixlKVReceiver, NixlKVSender
    from transport.backends.nixl import NixlManager

    b = get_backend("nixl")
    assert b.manager is NixlManager
    # the field-shaped classes drive the NIXL backend underneath
    assert get_kv_class(TransferBackend.NIXL, KVClassType.MANAGER) is NixlKVManager
    assert get_kv_class(TransferBackend.NIXL, KVClassType.SENDER) is NixlKVSender
    assert get_kv_class(TransferBackend.NIXL, KVClassType.RECEIVER) is NixlKVReceiver
    assert NixlKVManager.BACKEND == "nixl"


def test_sglang_40125_duplicate_room_is_refused_and_both_sides_survive():
    """SGLang #40125 on the fake backend, which keeps no state per room (each
    handle has its own slot, so a room used twice cannot cross requests
    there): the scheduler's RequestTable refuses the second live request with
    the room on prefill and on decode, with a DuplicateRequest (a
    LifecycleError) and nothing changed; the scheduler releases the refused
    handle, the first request completes, later ones too."""
    from lifecycle.errors import DuplicateRequest, LifecycleError

    sides = {}
    for role, make in (("prefill", "sender"), ("decode", "receiver")):
        m, table = FakeManager(), RequestTable(rank=0)
        sides[role] = (m, table, Stepper(table, 0, poller=m), getattr(m, make))

    def admit(role, room):
        m, table, _, make = sides[role]
        h = make(room)
        try:
            table.add(room, handle=h, handle_index=h.index)
        except DuplicateRequest:
            h.clear()  # refused: give its slot back
            raise
        return h

    def done(role):
        _, table, stepper, _ = sides[role]
        return stepper.step(SingleRank()).succeeded.tolist()

    s, r = admit("prefill", 40125), admit("decode", 40125)
    for role in ("prefill", "decode"):
        m, table, _, _ = sides[role]
        before = (table.rooms().tolist(), table.state[: len(table)].tolist(), len(m._free))
        with pytest.raises(DuplicateRequest) as e:
            admit(role, 40125)
        assert isinstance(e.value, LifecycleError)
        assert "room=40125" in str(e.value) and "rank 0" in str(e.value)
        after = (table.rooms().tolist(), table.state[: len(table)].tolist(), len(m._free))
        assert after == before
    r.init()
    s.init(2, 0)
    s.send([1, 2])
    r.send_metadata([3, 4], 0)
    assert (done("prefill"), done("decode")) == ([40125], [40125])
    s2, r2 = admit("prefill", 40126), admit("decode", 40126)
    r2.init()
    s2.init(1, 1)
    s2.send([5])
    r2.send_metadata([6], 1)
    assert (done("prefill"), done("decode")) == ([40126], [40126])
