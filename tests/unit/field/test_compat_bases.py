"""field.conn.base: 0.5.23's base connector classes, and ours built on them."""

import dataclasses
import inspect
import types

import numpy as np
import pytest

import field.conn.base as base
from field.conn.base import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVTransferDestination,
    KVTransferMetric,
)
from field.conn.fake import FakeKVManager, FakeKVReceiver, FakeKVSender
from field.conn.mooncake import (
    MooncakeKVBootstrapServer,
    MooncakeKVManager,
    MooncakeKVReceiver,
    MooncakeKVSender,
)
from field.conn.nixl import NixlKVBootstrapServer, NixlKVManager, NixlKVReceiver, NixlKVSender
from lifecycle import KVPoll

E = inspect.Parameter.empty
DEVICE = "device"  # KVTransferDestination.DEVICE, compared by value

# Written down from SGLang 0.5.23's sglang/srt/disaggregation/base/conn.py:
# per class, each method's parameters after self as (name, default), E for none,
# and whether the method is abstract there.
BASES_0523 = {
    BaseKVManager: {
        "__init__": (
            [
                ("args", E),
                ("disaggregation_mode", E),
                ("server_args", E),
                ("is_mla_backend", False),
            ],
            True,
        ),
        "should_verify_kv_checksum": ([("bootstrap_addr", E)], False),
        "register_to_bootstrap": ([], True),
        "teardown": ([], False),
    },
    BaseKVSender: {
        "__init__": (
            [
                ("mgr", E),
                ("bootstrap_addr", E),
                ("bootstrap_room", E),
                ("req_has_disagg_prefill_dp_rank", False),
            ],
            True,
        ),
        "init": ([("num_kv_indices", E), ("aux_index", None)], True),
        "send": ([("kv_indices", E), ("state_indices", None), ("num_kv_tokens", None)], True),
        "mark_prefill_complete": ([], False),
        "pop_decode_prefix_len": ([], False),
        "get_max_transfer_tokens": ([], False),
        "should_send_kv_chunk": ([("num_pages", E), ("last_chunk", E)], False),
        "get_transfer_metric": ([], True),
        "poll": ([], True),
        "failure_exception": ([], True),
        "clear": ([], False),
        "abort": ([], False),
    },
    BaseKVReceiver: {
        "is_abort_release_safe": ([], False),
        "__init__": (
            [("mgr", E), ("bootstrap_addr", E), ("bootstrap_room", None)],
            True,
        ),
        "init": ([("prefill_dp_rank", E)], True),
        "send_metadata": (
            [
                ("kv_indices", E),
                ("aux_index", None),
                ("state_indices", None),
                ("decode_prefix_len", None),
                ("destination", DEVICE),
            ],
            True,
        ),
        "poll": ([], True),
        "failure_exception": ([], True),
        "clear": ([], False),
        "abort": ([], False),
    },
    BaseKVBootstrapServer: {"__init__": ([("host", E), ("port", E)], True)},
}
MANAGER_FLAGS_0523 = {
    "enable_deferred_decode_kv_release": False,
    "supports_host_destination": False,
    "supports_role_switch": False,
    "supports_deferred_decode_kv_release": False,
}


def _params(fn):
    out = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        default = getattr(p.default, "value", p.default)  # an enum default by value
        out.append((p.name, default))
    return out


def test_exports_the_0523_names():
    assert sorted(base.__all__) == sorted(
        [
            "KVPoll",
            "KVArgs",
            "StateType",
            "KVTransferMetric",
            "KVTransferDestination",
            "BaseKVManager",
            "BaseKVSender",
            "BaseKVReceiver",
            "BaseKVBootstrapServer",
        ]
    )
    # the core's KVPoll and the field's KVArgs bag, not copies
    assert base.KVPoll is KVPoll
    assert base.KVArgs is __import__("field.conn.kv_args", fromlist=["KVArgs"]).KVArgs
    assert {p.name: int(p) for p in base.KVPoll} == {
        "Failed": 0,
        "Bootstrapping": 1,
        "WaitingForInput": 2,
        "Transferring": 3,
        "Success": 4,
    }
    assert {d.name: d.value for d in KVTransferDestination} == {"DEVICE": "device", "HOST": "host"}
    assert KVTransferDestination.HOST == "host"  # a str enum, as there
    assert [(f.name, f.default) for f in dataclasses.fields(KVTransferMetric)] == [
        ("transfer_latency_s", None),
        ("alloc_latency_s", None),
        ("transfer_total_bytes", None),
    ]


@pytest.mark.parametrize("cls", list(BASES_0523))
def test_every_base_is_abstract(cls):
    args = {BaseKVBootstrapServer: ("127.0.0.1", 1)}.get(cls, ())
    with pytest.raises(TypeError, match="abstract"):
        cls(*args)


@pytest.mark.parametrize("cls", list(BASES_0523))
def test_every_0523_method_with_its_signature_and_abstractness(cls):
    want = BASES_0523[cls]
    assert cls.__abstractmethods__ == {m for m, (_, abstract) in want.items() if abstract}
    for name, (params, _) in want.items():
        assert _params(getattr(cls, name)) == params, f"{cls.__name__}.{name}"


def test_manager_flags_and_the_receivers_property_as_in_0523():
    for flag, value in MANAGER_FLAGS_0523.items():
        assert getattr(BaseKVManager, flag) is value, flag
    assert isinstance(BaseKVReceiver.__dict__["supports_host_destination"], property)


class _Sender(BaseKVSender):
    def __init__(self, *a):
        pass

    init = send = get_transfer_metric = poll = failure_exception = lambda self, *a: None


class _Receiver(BaseKVReceiver):
    def __init__(self, *a):
        pass

    init = send_metadata = poll = failure_exception = lambda self, *a: None


class _Manager(BaseKVManager):
    def __init__(self, *a):
        pass

    def register_to_bootstrap(self):
        pass


def test_the_concrete_base_methods_answer_as_0523s():
    s, r, m = _Sender(), _Receiver(), _Manager()
    assert s.pop_decode_prefix_len() == 0 and s.get_max_transfer_tokens() is None
    assert not s.should_send_kv_chunk(0, True) and s.should_send_kv_chunk(2, False)
    assert s.clear() is None and s.abort() is None
    with pytest.raises(NotImplementedError):
        s.mark_prefill_complete()
    assert r.supports_host_destination is False and r.clear() is None and r.abort() is None
    with pytest.raises(NotImplementedError):
        r.is_abort_release_safe()
    assert m.should_verify_kv_checksum("10.0.0.1:8998") is True
    with pytest.raises(NotImplementedError, match="_Manager does not support PD role switch"):
        m.teardown()


OURS = {
    BaseKVManager: [FakeKVManager, MooncakeKVManager, NixlKVManager],
    BaseKVSender: [FakeKVSender, MooncakeKVSender, NixlKVSender],
    BaseKVReceiver: [FakeKVReceiver, MooncakeKVReceiver, NixlKVReceiver],
    BaseKVBootstrapServer: [MooncakeKVBootstrapServer, NixlKVBootstrapServer],
}


@pytest.mark.parametrize("bound", list(OURS))
def test_ours_subclass_the_bases_and_implement_every_abstract_method(bound):
    for cls in OURS[bound]:
        assert issubclass(cls, bound), cls
        assert not cls.__abstractmethods__, (cls, cls.__abstractmethods__)


@pytest.mark.parametrize("bound", [BaseKVSender, BaseKVReceiver, BaseKVManager])
def test_ours_take_every_0523_call_by_its_names(v0523, bound):
    """Every method of the base takes 0.5.23's arguments by name on our classes
    (the fake receiver's ``send_metadata`` has no ``destination``, as 0.5.23's fake)."""
    for cls in OURS[bound]:
        for name, (params, _) in BASES_0523[bound].items():
            method = cls if name == "__init__" else getattr(cls, name)
            names = [p for p, _ in params]
            if (cls, name) == (FakeKVReceiver, "send_metadata"):
                names.remove("destination")
            sig = inspect.signature(method)
            if name != "__init__":
                sig.bind(object(), **dict.fromkeys(names))
            else:
                sig.bind(**dict.fromkeys(names))


def test_the_fake_classes_instantiate_and_are_what_engines_check():
    args = types.SimpleNamespace()
    m = FakeKVManager(args, "prefill", types.SimpleNamespace())
    s = FakeKVSender(m, "fake_addr:1", 3)
    r = FakeKVReceiver(FakeKVManager(args, "decode", None), "fake_addr:1", 3)
    assert isinstance(m, BaseKVManager) and isinstance(s, BaseKVSender)
    assert isinstance(r, BaseKVReceiver)
    m.register_to_bootstrap()
    with pytest.raises(NotImplementedError):  # 0.5.23's fake has no teardown either
        m.teardown()
    assert s.get_transfer_metric() == KVTransferMetric()
    assert r.supports_host_destination is False
    assert r.is_abort_release_safe() is True  # nothing ever writes to a fake receiver
    s.send(np.array([1]))
    assert s.poll() == KVPoll.Success
