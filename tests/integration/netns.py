"""Several hosts on one machine: network namespaces joined by veth pairs.

``hosts(n)`` creates ``n`` namespaces, host ``i`` with ``192.0.2.(i+1)/24``
(the documentation range, which exists only inside them) on an interface
``pdl<i>``, plus ``lo``. Two hosts share one veth pair; three or more hang
off a bridge in a namespace of its own. Nothing is added to the machine's
own namespace. Every ``ip`` call is bounded in time, and the namespaces are
deleted on the way out (their processes killed first), also when the body
raises; namespaces left by a test process that no longer exists are
removed on the way in.

Needs root and iproute2's ``ip``; :func:`unavailable` says why not.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

PREFIX = "pdl"
SUBNET = "192.0.2"
IP_TIMEOUT = 10.0


@dataclass(frozen=True)
class Host:
    ns: str
    addr: str
    ifname: str

    def cmd(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.ns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_all(self) -> list[int]:
        """SIGKILL every process in this host, as if it lost power."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT, check=False
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install -y iproute2)"
    probe = f"{PREFIX}{os.getpid()}probe"
    proc = _ip("netns", "add", probe, check=False)
    if proc.returncode != 0:
        return f"`ip netns add` is refused here: {proc.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _ours() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def _remove_orphans() -> None:
    """Delete namespaces a killed test run left behind (its pid is in the name)."""
    for ns in _ours():
        m = re.match(rf"{PREFIX}(\d+)", ns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _delete(ns)


def _delete(ns: str) -> None:
    Host(ns, "", "").kill_all()
    _ip("netns", "del", ns, check=False)


@contextlib.contextmanager
def hosts(n: int = 2) -> Iterator[list[Host]]:
    if not 2 <= n <= 8:
        raise ValueError(f"hosts(n): n must be 2-8, got {n}")
    _remove_orphans()
    tag = f"{PREFIX}{os.getpid()}"
    made: list[str] = []
    try:
        result = []
        for i in range(n):
            ns = f"{tag}h{i}"
            _ip("netns", "add", ns)
            made.append(ns)
            result.append(Host(ns, f"{SUBNET}.{i + 1}", f"pdl{i}"))
        if n == 2:
            a, b = result
            _ip(
                *f"-n {a.ns} link add {a.ifname} type veth peer name {b.ifname} netns {b.ns}".split()
            )
        else:
            switch = f"{tag}sw"
            _ip("netns", "add", switch)
            made.append(switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for i, h in enumerate(result):
                port = f"port{i}"
                _ip(
                    *f"-n {h.ns} link add {h.ifname} type veth peer name {port} netns {switch}".split()
                )
                _ip("-n", switch, "link", "set", port, "master", "br0")
                _ip("-n", switch, "link", "set", port, "up")
        for h in result:
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("-n", h.ns, "link", "set", "lo", "up")
            _ip("-n", h.ns, "link", "set", h.ifname, "up")
        yield result
    finally:
        for ns in reversed(made):
            _delete(ns)
