"""A connector whose engine copies memory inside the write call, for driving
the shared connector end to end in one process."""

import ctypes

from support.wait import wait_for
from transport.connector.graph import Phase
from transport.connector.hub import Connector


class CopyConnector(Connector):
    """Writes land inside the call, in order; ``fail_next`` set on a connector
    makes its next write fail (on that connector: no other test inherits it)."""

    fail_next = False

    def _start_engine(self):
        self.writes = []
        return {}

    def _write(self, info, src, dst, lens, notif):
        for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist()):
            ctypes.memmove(d, s, n)
        self.writes.append(lens.tolist())
        failed, self.fail_next = self.fail_next, False  # this connector only
        return -1 if failed else 1

    def _check(self, token):
        return token


def handshaken(*senders):
    """Every decode leg registered each of these prefill requests: the handshake
    is done. Prefill still reports Bootstrapping until every leg's page list is
    in (decode's scheduler has given the request its pages and metadata row)."""
    return all(s.manager._phase(s._req) == Phase.Handshaken for s in senders)


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
