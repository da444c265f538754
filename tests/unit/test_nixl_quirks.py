"""How NIXL's answers map to our failure reasons, against a stub agent."""

import numpy as np
import pytest

pytest.importorskip("nixl_cu12", reason="pd-lifecycle[nixl] not installed")

from lifecycle import FailureReason, KVPoll
from support.cores import core_of, request_at
from transport.backends.nixl import NixlConfig, NixlEngine
from transport.connector.core.graph import Phase
from transport.connector.inflight import InFlight


class StubAgent:
    def __init__(self, state="DONE", post_raises=False, notifs=None):
        self.state, self.post_raises = state, post_raises
        self.notifs = notifs or {}
        self.released = []

    def get_xfer_descs(self, descs, mem_type):
        assert mem_type == "DRAM" and descs.shape[1] == 3
        return descs

    def initialize_xfer(self, op, src, dst, remote, notif):
        if self.post_raises:
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
        return ("xfer", notif)

    def transfer(self, handle, notif):
        return self.state

    def check_xfer_state(self, handle):
        return self.state

    def release_xfer_handle(self, handle):
        self.released.append(handle)

    def get_new_notifs(self):
        out, self.notifs = self.notifs, {}
        return out


def bare_engine(agent, role="prefill"):
    e = NixlEngine(NixlConfig(role=role, tp_rank=0, store_port=1))  # never reached
    e.agent = agent
    e._remotes, e._peer_of = {1: "peer-agent"}, {"peer-agent": 1}
    return e


def written(core, agent, req):
    """Submit one write for ``req`` and issue it on a NIXL engine over ``agent``."""
    one = np.array([4096])
    core.submit(req, 1, {"_peer": 1}, (one, one, one), b"")
    (write,) = core.take_effects()
    flight = InFlight(bare_engine(agent))
    now = flight.issue(write)
    if now is not None:
        core.handle(now, 0.0)
    return flight


def test_a_remote_that_is_gone_is_peer_dead():
    m = core_of()
    req = request_at(m, Phase.Writing)
    written(m, StubAgent(post_raises=True), req)
    assert (m.status[req.index], m.reason[req.index]) == (KVPoll.Failed, FailureReason.PEER_DEAD)
    assert m.phase[req.index] == Phase.Aborted


def test_a_transfer_in_error_state_is_a_transfer_error():
    agent = StubAgent(state="ERR")
    m = core_of()
    req = request_at(m, Phase.Writing)
    flight = written(m, agent, req)
    assert req.tokens  # posted; the error shows in the state
    for ev in flight.reap():
        m.handle(ev, 0.0)
    assert m.reason[req.index] == FailureReason.TRANSFER_ERROR
    assert agent.released == [("xfer", b"")]  # the handle is given back


def test_the_room_notification_completes_decode():
    notifs = {
        "peer-agent": [b"9:2", b"9", b"not-a-room", b"5:x", b"9:2:0:8", b"9:2:8", b"9:2:-1:3"],
        "stranger": [b"7:0"],
    }
    engine = bare_engine(StubAgent(notifs=notifs), role="decode")
    # (room, its attempt, the peer rank whose write landed, its pages: None for the last)
    assert engine.notified() == [(9, 2, 1, None), (9, 2, 1, (0, 8))]
    assert engine.notified() == []  # consumed once


def test_a_notification_that_never_comes_is_the_waiting_timeout():
    m = core_of("decode", notifies=True, waiting_timeout=1.0)
    req = request_at(m, Phase.Metadata, status=KVPoll.WaitingForInput, now=100.0)
    m.waited[req.index] = 100.0
    m.tick(100.5)
    assert m.status[req.index] == KVPoll.WaitingForInput  # not yet
    m.tick(101.5)
    assert (m.status[req.index], m.reason[req.index]) == (
        KVPoll.Failed,
        FailureReason.WAITING_TIMEOUT,
    )


@pytest.mark.parametrize("threads", [0, 3])
def test_the_agent_is_built_with_the_configured_worker_threads(monkeypatch, threads):
    # nixl_threads reaches the agent as its UCX backend's num_threads
    from nixl_cu12 import _api

    from transport.backends.nixl import make_agent

    seen = {}

    def fake_agent(name, cfg):
        seen.update(name=name, threads=cfg.num_threads)
        return "agent"

    monkeypatch.setattr(_api, "nixl_agent", fake_agent)
    assert make_agent("a", 250, threads) == "agent"
    assert (seen["name"], seen["threads"]) == ("a", threads)
    assert NixlConfig(role="prefill", tp_rank=0, store_port=1).nixl_threads == 4
