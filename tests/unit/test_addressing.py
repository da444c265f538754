"""Where the advertised host and the store address come from, and the
errors a wrong one gives (loopback only; the not-this-host case runs inside
network namespaces in tests/integration/test_multihost.py)."""

import socket

import pytest

from transport.addressing import (
    AddressError,
    advertised_host,
    check_local,
    check_store_reachable,
    interface_address,
    route_source,
    store_address,
)
from transport.errors import TransportError


def closed_port() -> socket.socket:
    """A socket bound and not listening: a connection to its port is refused,
    and no other process can take the port while it is held."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


def test_store_address_from_torchrun_env():
    assert store_address({}) == ("127.0.0.1", 0)
    assert store_address({"MASTER_ADDR": "192.0.2.3", "MASTER_PORT": "29500"}) == (
        "192.0.2.3",
        29500,
    )


@pytest.mark.parametrize("port", ["http", "-1", "70000"])
def test_a_bad_master_port_names_the_setting(port):
    with pytest.raises(AddressError, match=rf"MASTER_PORT='{port}': is not a port number"):
        store_address({"MASTER_PORT": port})


def test_precedence_explicit_then_env_then_interface_then_route():
    env = {"PDLIFE_HOST": "127.0.0.1", "GLOO_SOCKET_IFNAME": "no-such-if0"}
    assert advertised_host("localhost", env=env) == "127.0.0.1"  # explicit wins, resolved
    # the variable wins over the interface (which would raise)
    assert advertised_host(env=env) == "127.0.0.1"
    with pytest.raises(AddressError, match="GLOO_SOCKET_IFNAME='no-such-if0'"):
        advertised_host(env={"GLOO_SOCKET_IFNAME": "no-such-if0"})
    assert advertised_host(env={"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
    assert advertised_host(env={"MASTER_ADDR": "127.0.0.1"}) == "127.0.0.1"
    assert advertised_host(env={}) == "127.0.0.1"


def test_gloo_interface_list_takes_the_first():
    assert advertised_host(env={"GLOO_SOCKET_IFNAME": "lo,eth9"}) == "127.0.0.1"


def test_route_source_on_loopback():
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert interface_address("lo") == "127.0.0.1"


def test_a_missing_interface_lists_the_ones_there():
    with pytest.raises(AddressError) as e:
        interface_address("no-such-if0")
    assert "no such network interface" in str(e.value)
    assert "lo" in str(e.value).split("Interfaces here:")[1]


def test_check_local_accepts_this_hosts_address():
    assert check_local("127.0.0.1", "hostname") == "127.0.0.1"


def test_check_local_names_a_foreign_address(monkeypatch):
    # the real not-on-this-host case runs in namespaces; here the kernel's
    # answer is stood in for, so no address outside loopback is touched
    import errno

    def refuse(self, addr):
        raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")

    monkeypatch.setattr(socket.socket, "bind", refuse)
    with pytest.raises(AddressError) as e:
        check_local("127.0.0.1", "PDLIFE_HOST")
    assert str(e.value).startswith("PDLIFE_HOST='127.0.0.1': is not an address of this host")
    assert e.value.setting == "PDLIFE_HOST"


def test_an_unreachable_store_is_one_typed_error():
    held = closed_port()
    port = held.getsockname()[1]
    with held, pytest.raises(TransportError) as e:
        check_store_reachable("127.0.0.1", port, "MooncakeConfig.store_host", timeout=2)
    assert isinstance(e.value, AddressError)
    msg = str(e.value)
    assert msg.startswith(
        f"MooncakeConfig.store_host='127.0.0.1:{port}': the store does not answer"
    )
    assert "Connection refused" in msg


def test_a_reachable_store_passes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        check_store_reachable("127.0.0.1", s.getsockname()[1])


def test_a_store_starting_alongside_is_waited_for_only_when_asked(monkeypatch):
    import threading
    import time as _time

    # bound but not listening: refused, and the port stays ours all along
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    tries = []
    real = socket.create_connection

    def counted(*a, **kw):
        tries.append(a)
        return real(*a, **kw)

    with monkeypatch.context() as mp:
        mp.setattr(socket, "create_connection", counted)
        with pytest.raises(AddressError, match="Connection refused"):
            check_store_reachable("127.0.0.1", port, "X.store_host")
    assert len(tries) == 1  # an answer, not a wait

    def start_late():
        _time.sleep(0.5)
        server.listen()

    th = threading.Thread(target=start_late)
    th.start()
    try:
        check_store_reachable("127.0.0.1", port, "X.store_host", wait=10)
    finally:
        th.join()
        server.close()
