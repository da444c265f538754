"""The fake backend keeps the real backends' deadlines and never reports
Success while its peer is dead (SGLang PR #28652: a fake sender stuck in
WaitingForInput pinned its slot forever, no timeout applying to it)."""

import numpy as np
import pytest

from lifecycle import FailureReason, KVPoll
from support.clock import Clock
from support.status import B, W
from transport.backends.fake import FakeConfig, FakeManager
from transport.errors import ConfigError, ConfigTypeError


def _poll(m, *handles):
    idx = np.array([h.index for h in handles], dtype=np.int64)
    rooms = np.array([h.bootstrap_room for h in handles], dtype=np.uint64)
    return m.poll_many(rooms, idx).tolist(), m.failure_reasons(rooms, idx).tolist()


@pytest.mark.parametrize("deadlines", [True, False], ids=["deadlines", "negative-control"])
def test_sglang_28652_a_fake_request_past_its_deadline_fails_with_that_reason(deadlines):
    clock = Clock(100.0)
    cfg = FakeConfig(bootstrap_timeout=5.0, waiting_timeout=2.0, clock=clock) if deadlines else FakeConfig(clock=clock)  # fmt: skip
    m = FakeManager(config=cfg)
    stuck_sender = m.sender(1)  # WaitingForInput: never given its pages
    never_init = m.receiver(2)  # Bootstrapping
    waiting = m.receiver(3)
    waiting.init()
    clock.t += 1.5
    assert _poll(m, stuck_sender, never_init, waiting)[0] == [W, B, W]  # nothing late yet
    clock.t += 1.0  # 2.5 s: past the waiting deadline
    waiting.send_metadata([0], 0)  # (a request that moves on is not late)
    statuses, reasons = _poll(m, stuck_sender, never_init, waiting)
    if not deadlines:
        assert statuses == [KVPoll.WaitingForInput, KVPoll.Bootstrapping, KVPoll.Success]
        return
    assert statuses == [KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.Success]
    assert reasons[0] == FailureReason.WAITING_TIMEOUT
    clock.t += 3.0  # 5.5 s: past the bootstrap deadline
    statuses, reasons = _poll(m, never_init)
    assert (statuses, reasons) == ([KVPoll.Failed], [FailureReason.BOOTSTRAP_TIMEOUT])
    stuck_sender.clear()  # its slot is free again, for a request that starts afresh
    again = m.sender(4)
    assert again.index == stuck_sender.index and _poll(m, again)[0] == [W]


@pytest.mark.parametrize("watched", [True, False], ids=["peer-watched", "negative-control"])
def test_a_fake_request_never_succeeds_while_its_peer_is_dead(watched):
    up = [True]
    m = FakeManager(config=FakeConfig(peer_alive=(lambda: up[0]) if watched else None))
    s, r = m.sender(1), m.receiver(2)
    r.init()
    s.init(2)
    up[0] = False  # the other side dies
    s.send([0, 1])
    r.send_metadata([0, 1], 0)
    statuses, reasons = _poll(m, s, r)
    if watched:
        assert statuses == [KVPoll.Failed, KVPoll.Failed]
        assert reasons == [FailureReason.PEER_DEAD] * 2
    else:
        assert statuses == [KVPoll.Success, KVPoll.Success]
    live = m.sender(3)  # a live request is failed when polled, too
    assert _poll(m, live)[0] == ([KVPoll.Failed] if watched else [KVPoll.WaitingForInput])


@pytest.mark.parametrize(
    ("kw", "field", "error"),
    [
        (dict(bootstrap_timeout=-1.0), "bootstrap_timeout", ConfigError),
        (dict(waiting_timeout="5"), "waiting_timeout", ConfigTypeError),
        (dict(waiting_timeout=float("nan")), "waiting_timeout", ConfigError),
        (dict(peer_alive=True), "peer_alive", ConfigTypeError),
        (dict(clock=None), "clock", ConfigTypeError),
    ],
)
def test_fake_settings_are_refused_by_name(kw, field, error):
    with pytest.raises(error) as info:
        FakeConfig(**kw)
    assert f"FakeConfig.{field}" in str(info.value)
    with pytest.raises(ConfigTypeError, match="FakeConfig"):
        FakeManager(config={"waiting_timeout": 1.0})
