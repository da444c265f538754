"""A failed collective names a same-host peer whose process is gone.

A peer's sockets close as it starts to exit, before its process is reaped, so
a survivor can see the reset while the peer still looks alive. The collective
looks again for a bounded time instead of reading the process table once.
"""

from __future__ import annotations

import socket
import subprocess
import sys

from lifecycle.drive.collective import TorchCollective


class _Store:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key].encode()


def _collective(pids: dict[int, int], host: str | None = None) -> TorchCollective:
    coll = TorchCollective.__new__(TorchCollective)  # no process group needed here
    here = host or socket.gethostname()
    coll._store = _Store({f"pdlife/pid/{r}": f"{here} {pid}" for r, pid in pids.items()})
    coll._peers = (0, *pids)
    coll._rank = 0
    return coll


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)


def test_a_peer_that_finishes_exiting_while_we_look_is_named():
    peer = _child("import sys; sys.stdin.read()")  # alive until its stdin closes
    try:
        coll = _collective({1: peer.pid})
        assert coll.dead_peers() == ()  # alive: a single look names no one
        assert peer.stdin is not None
        peer.stdin.close()  # now it exits, at a time of its own choosing
        assert coll.dead_peers(wait=60.0) == (1,)
    finally:
        peer.kill()
        peer.wait()


def test_a_live_peer_is_never_named_and_the_wait_is_bounded():
    peer = _child("import sys; sys.stdin.read()")
    try:
        coll = _collective({1: peer.pid})
        assert coll.dead_peers(wait=0.05) == ()
    finally:
        peer.kill()
        peer.wait()


def test_peers_on_other_hosts_are_not_waited_for():
    coll = _collective({1: 1}, host="elsewhere.invalid")
    assert coll.dead_peers(wait=3600.0) == ()  # returns at once: nothing to watch


def test_without_a_store_no_one_is_named():
    coll = _collective({})
    coll._store = None
    assert coll.dead_peers(wait=3600.0) == ()
