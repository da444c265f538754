"""An engine that copies memory inside the write call, for driving the shared
connector end to end in one process. It implements the Engine protocol of
transport.engine structurally: it subclasses nothing."""

import ctypes

from support.wait import wait_for
from transport.connector.core import liveness
from transport.connector.core.graph import Phase
from transport.connector.hub import Connector


class CopyEngine:
    """Writes land inside the call, in order; ``fail_next`` set on an engine
    makes its next write fail (on that engine: no other test inherits it)."""

    NOTIFIES = False

    def __init__(self):
        self.writes = []  # each write's lengths, in order
        self.fail_next = False

    def start(self, regions, host):
        return {}

    def connect(self, peer, info):
        pass

    def write(self, info, src, dst, lens, note):
        for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist()):
            ctypes.memmove(d, s, n)
        self.writes.append(lens.tolist())
        failed, self.fail_next = self.fail_next, False  # this engine only
        return -1 if failed else 1

    def check(self, token):
        return token

    def forget(self, token):
        pass

    def notified(self):
        return []

    def stop(self):
        pass


def timeouts(connector, now):
    """Run ``connector``'s timeouts as of ``now`` (a deadline, by hand); its
    thread performs what they cause."""
    with connector.lock:
        liveness.timeouts(connector.core, now)
    connector.wake()


class CopyConnector(Connector):
    """A connector driving ``engine`` (default: a new CopyEngine), built as a
    backend's manager is: ``CopyConnector(kv_args, config)``."""

    def __init__(self, kv_args, config, engine=None):
        super().__init__(kv_args, config, CopyEngine() if engine is None else engine)


def copy_connector(engine_cls):
    """A manager class building a CopyConnector on a new ``engine_cls()``."""

    def build(kv_args, config):
        return CopyConnector(kv_args, config, engine_cls())

    return build


def handshaken(*senders):
    """Every decode leg registered each of these prefill requests: the handshake
    is done. Prefill still reports Bootstrapping until every leg's page list is
    in (decode's scheduler has given the request its pages and metadata row)."""
    return all(s.manager.phase_of(s._req) == Phase.Handshaken for s in senders)


def refused_for_layout(prefill, decode, room, says):
    """Decode refuses ``room`` for a layout misfit (a TopologyError saying ``says``)
    and prefill is told: (the prefill sender, the decode receiver), both Failed."""
    from lifecycle import KVPoll
    from transport.topology import TopologyError

    s = prefill.sender(room)
    r = decode.receiver(room)
    r.init()
    wait_for(lambda: r.poll() == KVPoll.Failed, "refused")
    assert isinstance(decode.last_error, TopologyError)
    assert says in str(decode.last_error)
    wait_for(lambda: s.poll() == KVPoll.Failed, "prefill told")
    return s, r
