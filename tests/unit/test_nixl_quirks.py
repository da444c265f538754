"""How NIXL's answers map to our failure reasons, against a stub agent."""

import numpy as np
import pytest

pytest.importorskip("nixl_cu12", reason="pd-lifecycle[nixl] not installed")

from lifecycle import FailureReason, KVPoll
from transport.attempts import Attempts
from transport.backends.nixl import NixlConfig, NixlEngine, NixlManager
from transport.connector.graph import Phase
from transport.connector.hub import SIDES
from transport.connector.legs import DecodeRequest, PrefillRequest
from transport.status_arrays import StatusArrays


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


def bare_manager(agent, role="prefill", **cfg):
    m = object.__new__(NixlManager)  # no agent, no store: just the bookkeeping
    StatusArrays.__init__(m)
    m.config = NixlConfig(role=role, tp_rank=0, store_port=1, **cfg)  # never reached
    m.engine = NixlEngine(m.config)
    m.engine.agent = agent
    m.engine._remotes, m.engine._peer_of = {1: "peer-agent"}, {"peer-agent": 1}
    m.NOTIFIES = NixlEngine.NOTIFIES
    m.attempts, m._peer_dead = Attempts(), set()
    m._reqs = m.attempts.reqs
    m.side = SIDES[role](m)
    m.stats = dict.fromkeys(
        ("bytes_written", "writes", "fenced", "unfenced", "stale", "stale_epoch"), 0
    )
    return m


def request(m, phase, room=9):
    kind = PrefillRequest if m.config.role == "prefill" else DecodeRequest
    req = kind(room=room, index=m.take(int(KVPoll.Transferring)))
    m.phase[req.index] = phase
    m.attempts.add(room, 0, req)
    return req


def test_a_remote_that_is_gone_is_peer_dead():
    m = bare_manager(StubAgent(post_raises=True))
    req = request(m, Phase.Writing)
    one = np.array([4096])
    m._submit(req, {"_peer": 1}, (one, one, one), b"", None)
    assert (m.status[req.index], m.reason[req.index]) == (KVPoll.Failed, FailureReason.PEER_DEAD)
    assert m.phase[req.index] == Phase.Aborted


def test_a_transfer_in_error_state_is_a_transfer_error():
    agent = StubAgent(state="ERR")
    m = bare_manager(agent)
    req = request(m, Phase.Writing)
    one = np.array([4096])
    m._submit(req, {"_peer": 1}, (one, one, one), b"", None)
    assert req.tokens  # posted; the error shows in the state
    m._reap(req, store=None)
    assert m.reason[req.index] == FailureReason.TRANSFER_ERROR
    assert agent.released == [("xfer", b"")]  # the handle is given back


def test_the_room_notification_completes_decode():
    notifs = {
        "peer-agent": [b"9:2", b"9", b"not-a-room", b"5:x", b"9:2:0:8", b"9:2:8", b"9:2:-1:3"],
        "stranger": [b"7:0"],
    }
    m = bare_manager(StubAgent(notifs=notifs), role="decode")
    # (room, its attempt, the peer rank whose write landed, its pages: None for the last)
    assert m.engine.notified() == [(9, 2, 1, None), (9, 2, 1, (0, 8))]
    assert m.engine.notified() == []  # consumed once


def test_a_notification_that_never_comes_is_the_waiting_timeout():
    m = bare_manager(StubAgent(), role="decode", waiting_timeout=1.0)
    req = request(m, Phase.Metadata)
    m.status[req.index] = KVPoll.WaitingForInput
    m.waited[req.index] = 100.0
    m._timeouts(100.5, store=None)
    assert m.status[req.index] == KVPoll.WaitingForInput  # not yet
    m.mail = type("NoMail", (), {"send": lambda *a: None})()
    m._timeouts(101.5, store=None)
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
