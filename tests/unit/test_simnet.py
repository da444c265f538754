"""transport.testing.simnet: a killed rank stays silent for ever; its peers name it
dead and keep what it could still write into fenced."""

from lifecycle import FailureReason, KVPoll
from support.simrun import Plan, Run


def test_a_killed_prefill_rank_is_peer_dead_on_decode_and_nothing_lands_after():
    run = Run(Plan(seed=4, requests=1, pages=2))
    net, (prefill,), (decode,) = run.net, run.prefill, run.decode
    r = run.handles["decode", decode.rank, 100]
    assert net.run(lambda: (run.schedule(), r.poll() == KVPoll.WaitingForInput)[1], 1.0)
    net.kill(prefill)
    assert not run.go()  # neither side's request is ever cleared
    assert (r.poll(), r.failure_reason()) == (KVPoll.Failed, FailureReason.PEER_DEAD)
    assert r.fenced and not r.drained  # its writer may be paused, not dead: pages held
    assert decode.core.fenced() == (1, 2)
    assert net.fence.violations == [] and run.drained_early == []
