"""The address a field-shaped manager advertises to its peers.

0.5.23's managers advertise ``get_local_ip_auto()``: ``SGLANG_HOST_IP``, else
``HOST_IP``, else the address of the interface named by
``SGLANG_LOCAL_IP_NIC``, else the source address of the default route. Ours
keep the field's two overrides and then find the address the way the core
connector does (:func:`transport.addressing.advertised_host`):

1. ``SGLANG_HOST_IP``, else ``HOST_IP``: the explicit setting, checked to be
   an address of this host;
2. ``SGLANG_LOCAL_IP_NIC``: that interface's IPv4 address;
3. the core's discovery: ``PDLIFE_HOST``, the interface of
   ``GLOO_SOCKET_IFNAME``, the local address of the route to the bootstrap
   store (not to a public address: the store is what the peers share), else
   ``MASTER_ADDR``'s route, else 127.0.0.1.

Each step raises :class:`~transport.addressing.AddressError` naming the
setting and the address when it cannot work on this host, before anything is
started; the field would advertise it and fail at transfer time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from transport import addressing

__all__ = ["HOST_VARS", "NIC_VAR", "local_ip"]

#: the field's explicit overrides of the advertised address, first set wins
HOST_VARS = ("SGLANG_HOST_IP", "HOST_IP")
#: the field's interface whose address is advertised
NIC_VAR = "SGLANG_LOCAL_IP_NIC"


def local_ip(store_host: str, store_setting: str, env: Mapping[str, str] | None = None) -> str:
    """The IPv4 address this rank advertises; ``store_host`` is the bootstrap
    store's address, named ``store_setting`` in errors."""
    e = os.environ if env is None else env
    for var in HOST_VARS:
        value = (e.get(var) or "").strip()
        if value:
            return addressing.check_local(value, var)
    nic = (e.get(NIC_VAR) or "").strip()
    if nic:
        return addressing.interface_address(nic, NIC_VAR)
    return addressing.advertised_host(None, target=store_host, env=e, target_setting=store_setting)
