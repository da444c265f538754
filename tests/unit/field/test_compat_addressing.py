"""The address the field-shaped Mooncake and NIXL managers advertise: found as the
core connector finds it (the field's overrides first), checked before anything starts."""

import types

import pytest

import transport.addressing as addressing
from field.conn.mooncake import MooncakeKVManager
from field.conn.nixl import NixlKVManager
from transport.addressing import AddressError

pytestmark = pytest.mark.timeout(30)

ENV = ("SGLANG_HOST_IP", "HOST_IP", "SGLANG_LOCAL_IP_NIC", "PDLIFE_HOST")
ENV += ("GLOO_SOCKET_IFNAME", "MASTER_ADDR")


@pytest.fixture(autouse=True)
def no_address_settings(monkeypatch):
    for var in ENV:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def backend(monkeypatch):
    """A registry entry that records the managers built (none: nothing started)."""
    built = []

    def manager(core_args, config):
        built.append(config)
        return types.SimpleNamespace(kv_args=core_args, config=config)

    monkeypatch.setattr(
        "field.conn.mooncake.get_backend", lambda name: types.SimpleNamespace(manager=manager)
    )
    return built


@pytest.fixture
def routes(monkeypatch):
    """The route lookup, answering 10.9.8.7 and recording what it was asked."""
    asked = []

    def route_source(target, setting="MASTER_ADDR"):
        asked.append((target, setting))
        return "10.9.8.7"

    monkeypatch.setattr(addressing, "route_source", route_source)
    return asked


def server_args(**kw):
    return types.SimpleNamespace(disaggregation_bootstrap_port=8998, host="0.0.0.0", **kw)


def build(cls, sa=None):
    return cls(types.SimpleNamespace(engine_rank=0), "prefill", sa or server_args())


@pytest.mark.parametrize("cls", [MooncakeKVManager, NixlKVManager])
def test_advertises_the_discovered_address_not_server_args_host(cls, backend, routes):
    m = build(cls, server_args(disaggregation_bootstrap_host="10.9.0.1"))
    # the route to the bootstrap store picks the address (the field's default route
    # does the same job); server_args.host is where the HTTP server listens
    assert routes == [("10.9.0.1", "server_args.disaggregation_bootstrap_host")]
    assert m.local_ip == "10.9.8.7"
    (config,) = backend
    assert (config.hostname, config.store_host, config.store_port) == ("10.9.8.7", "10.9.0.1", 8998)


@pytest.mark.parametrize("cls", [MooncakeKVManager, NixlKVManager])
def test_a_discovery_that_fails_raises_address_error_and_starts_nothing(cls, backend, monkeypatch):
    def no_route(target, setting="MASTER_ADDR"):
        raise AddressError(setting, target, "no route from this host", "Check the routes")

    monkeypatch.setattr(addressing, "route_source", no_route)
    with pytest.raises(AddressError, match=r"server_args\.host='0\.0\.0\.0': no route"):
        build(cls)
    assert backend == []  # no engine, no store client, no thread


def test_the_fields_explicit_override_wins_and_is_checked(backend, routes, monkeypatch):
    monkeypatch.setenv("HOST_IP", "192.0.2.1")  # second in line: SGLANG_HOST_IP wins
    monkeypatch.setenv("SGLANG_HOST_IP", " 127.0.0.1 ")
    assert build(MooncakeKVManager).local_ip == "127.0.0.1"
    assert routes == []  # no discovery when the address is given
    monkeypatch.setenv("SGLANG_HOST_IP", "192.0.2.1")  # TEST-NET-1: not this host's
    with pytest.raises(AddressError, match=r"SGLANG_HOST_IP='192\.0\.2\.1': is not an address"):
        build(MooncakeKVManager)
    assert [c.hostname for c in backend] == ["127.0.0.1"]  # the second never started


def test_the_fields_interface_setting_names_itself_when_wrong(backend, routes, monkeypatch):
    monkeypatch.setenv("SGLANG_LOCAL_IP_NIC", "lo")
    assert build(NixlKVManager).local_ip == "127.0.0.1"
    monkeypatch.setenv("SGLANG_LOCAL_IP_NIC", "no-such-nic0")
    with pytest.raises(AddressError, match=r"SGLANG_LOCAL_IP_NIC='no-such-nic0'"):
        build(NixlKVManager)
    assert len(backend) == 1 and routes == []


def test_the_cores_own_settings_still_apply(backend, routes, monkeypatch):
    monkeypatch.setenv("PDLIFE_HOST", "127.0.0.1")
    assert build(MooncakeKVManager).local_ip == "127.0.0.1"
    assert routes == []


def test_register_to_bootstrap_has_nothing_left_to_do_and_teardown_closes(backend, routes):
    m = build(MooncakeKVManager)
    closed = []
    m.core.close = lambda: closed.append(True)
    m.register_to_bootstrap()  # published when built
    m.teardown()
    assert closed == [True]
