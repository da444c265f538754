"""Which addresses a rank uses: the store it joins and the host it advertises.

Nothing is assumed to be on 127.0.0.1. The store is torchrun's
(``MASTER_ADDR``/``MASTER_PORT``). The host a transfer engine advertises to
its peers comes, first match wins, from:

1. an explicit setting (e.g. ``MooncakeConfig.hostname``);
2. the ``PDLIFE_HOST`` environment variable;
3. the IPv4 address of the interface named by ``GLOO_SOCKET_IFNAME`` (the
   operator already chose it for the collectives);
4. the local address of the interface that routes to the store, found by
   connecting a UDP socket (the kernel picks the source; no packet is sent);
5. ``127.0.0.1`` when there is no store to route to.

A wrong address fails here, in milliseconds, with :class:`AddressError`
naming the address and the setting it came from, instead of as a connect
timeout half a minute later inside the engine or the store.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import time
from collections.abc import Mapping
from typing import Any

from transport.errors import TransportError

__all__ = [
    "AddressError",
    "HOST_ENV",
    "advertised_host",
    "check_local",
    "check_store_reachable",
    "engine_host",
    "interface_address",
    "route_source",
    "store_address",
]

HOST_ENV = "PDLIFE_HOST"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


class AddressError(TransportError):
    """A configured or discovered address that cannot work on this host."""

    def __init__(self, setting: str, address: str, why: str, fix: str) -> None:
        self.setting, self.address, self.why = setting, address, why
        super().__init__(f"{setting}={address!r}: {why}. {fix}")


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _resolve(host: str, setting: str) -> str:
    """An IPv4 address for ``host`` (a name is looked up once, here)."""
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except (socket.gaierror, UnicodeError) as e:
        raise AddressError(
            setting, host, f"does not resolve to an IPv4 address ({e})", "Give an IPv4 address"
        ) from None


def store_address(env: Mapping[str, str] | None = None) -> tuple[str, int]:
    """``(MASTER_ADDR, MASTER_PORT)``, defaulting to ``("127.0.0.1", 0)`` outside torchrun."""
    e = _env(env)
    host = e.get("MASTER_ADDR") or "127.0.0.1"
    raw = e.get("MASTER_PORT") or "0"
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise AddressError("MASTER_PORT", raw, "is not a port number", "Set 0-65535")
    return host, port


def check_local(host: str, setting: str) -> str:
    """``host`` as an IPv4 address, after checking it belongs to this host."""
    ip = _resolve(host, setting)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise AddressError(
                    setting,
                    host,
                    "is not an address of this host, so peers could not reach an engine "
                    "advertising it",
                    f"Use one of this host's addresses (`ip -4 addr`), or unset {setting} "
                    "to discover it",
                ) from None
            raise
    return ip


def interface_address(ifname: str, setting: str = "GLOO_SOCKET_IFNAME") -> str:
    """The IPv4 address of network interface ``ifname`` (Linux)."""
    try:
        socket.if_nametoindex(ifname)
    except OSError:
        names = ", ".join(n for _, n in socket.if_nameindex())
        raise AddressError(
            setting, ifname, "no such network interface here", f"Interfaces here: {names}"
        ) from None
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()))
        except OSError:
            raise AddressError(
                setting, ifname, "the interface has no IPv4 address", "Give it one, or name another"
            ) from None
    return socket.inet_ntoa(packed[20:24])


def route_source(target: str, setting: str = "MASTER_ADDR") -> str:
    """The local address this host would use to reach ``target`` (no packet is sent)."""
    ip = _resolve(target, setting)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))  # a UDP connect only asks the kernel for a route
        except OSError as e:
            raise AddressError(
                setting,
                target,
                f"no route from this host ({os.strerror(e.errno or 0) or e})",
                f"Check the address, this host's interfaces and routes (`ip route get {ip}`)",
            ) from None
        return str(s.getsockname()[0])


def advertised_host(
    explicit: str | None = None,
    *,
    target: str | None = None,
    env: Mapping[str, str] | None = None,
    setting: str = "hostname",
    target_setting: str = "store_host",
) -> str:
    """The address this rank advertises to its peers (see the module docstring).

    ``target`` is the address the route is looked up to (the store); without
    one, ``MASTER_ADDR`` when that is set. ``setting`` and ``target_setting``
    name where ``explicit`` and ``target`` came from, for the error message.
    """
    e = _env(env)
    if explicit:
        return check_local(explicit, setting)
    if e.get(HOST_ENV):
        return check_local(e[HOST_ENV], HOST_ENV)
    ifname = (e.get("GLOO_SOCKET_IFNAME") or "").split(",")[0].strip()
    if ifname:
        return interface_address(ifname)
    if not target and e.get("MASTER_ADDR"):
        target, target_setting = e["MASTER_ADDR"], "MASTER_ADDR"
    if target:
        return route_source(target, target_setting)
    return "127.0.0.1"


def check_store_reachable(
    host: str, port: int, setting: str = "MASTER_ADDR", timeout: float = 3.0, wait: float = 0.0
) -> None:
    """Raise :class:`AddressError` unless a TCP connect to the store succeeds.

    ``wait``: how long a refused connection is retried, for a store that is
    starting at the same time as this process (0: answer at once)."""
    ip = _resolve(host, setting)
    deadline = time.monotonic() + wait
    while True:
        try:
            with socket.create_connection((ip, port), timeout=timeout):
                return
        except ConnectionRefusedError:
            if time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            why = os.strerror(errno.ECONNREFUSED)
        except OSError as e:
            why = (
                "timed out"
                if isinstance(e, TimeoutError)
                else (os.strerror(e.errno or 0) or str(e))
            )
        raise AddressError(
            setting,
            f"{host}:{port}",
            f"the store does not answer ({why} after at most {max(timeout, wait):g} s)",
            "Check that the store (torchrun's node 0) is up, the address and port are right "
            "and the port is open between the hosts",
        ) from None


def engine_host(config: Any, name: str) -> str:
    """The host a transfer engine built from ``config`` (``hostname``,
    ``store_host``, ``store_port``) advertises, after checking it is on this
    host and that the store answers; ``name`` is the config's type in errors."""
    host = advertised_host(
        config.hostname,
        target=config.store_host,
        setting=f"{name}.hostname",
        target_setting=f"{name}.store_host",
    )
    check_store_reachable(
        config.store_host, config.store_port, f"{name}.store_host", wait=config.store_wait
    )
    return host
