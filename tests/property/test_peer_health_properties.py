"""Peer health on random agreed event sequences: ranks fed the same events
agree; no peer stays blacklisted; choose avoids a cooling peer whenever it
can. Each property is also shown to catch a plausible wrong implementation:
hypothesis finds a counterexample for it from the same strategies."""

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from lifecycle import FailureReason, KVPoll
from lifecycle.recovery import PeerHealth, PeerPolicy, PeerState
from lifecycle.result import StepResult
from lifecycle.rules.peers import ADMITS, KERNEL

R = FailureReason
PEERS = st.integers(0, 3)
ops = st.lists(
    st.one_of(
        # the agreed outcome of a request routed to peer; True: it is the peer's probe
        st.tuples(st.just("outcome"), PEERS, st.sampled_from(list(R)), st.booleans()),
        st.tuples(st.just("tick"), st.integers(0, 30)),
        st.tuples(st.just("choose"), st.lists(PEERS, min_size=1, max_size=4, unique=True)),
    ),
    max_size=60,
)
policies = st.builds(
    PeerPolicy,
    threshold=st.integers(1, 4),
    cooldown=st.integers(0, 20),
    backoff=st.integers(1, 3),
    max_cooldown=st.integers(20, 80),
)
SMALL = PeerPolicy(threshold=2, cooldown=8, backoff=2, max_cooldown=32)


def check_choice(before: dict, after: dict, candidates: list[int], chosen: int) -> None:
    """(c): an open peer in its cooldown only when no candidate admits traffic;
    a probe only to a half-open peer, so never a second one in flight."""
    state = {p: before[p].state if p in before else PeerState.HEALTHY for p in candidates}
    assert chosen in candidates
    if any(s in ADMITS for s in state.values()):
        assert state[chosen] in ADMITS, (state, chosen)
    for p in candidates:
        if p != chosen or state[p] is not PeerState.HALF_OPEN:
            assert after[p].probe == (before[p].probe if p in before else None)


def run(ranks: list[PeerHealth], sequence) -> None:
    """Feed every rank the same agreed events; after each, (a) they agree:
    same answers, views, fingerprints; and every change is a declared edge."""
    for i, op in enumerate(sequence):
        room = 1000 + i
        if op[0] == "outcome":
            _, peer, reason, is_probe = op
            out = []
            for h in ranks:
                v = h.view().get(peer)
                r = v.probe if is_probe and v is not None and v.probe is not None else room
                out.append(h.observe(peer, reason, room=r))
            changes = [c for c in out if c is not None]
        elif op[0] == "tick":
            out = [h.tick(op[1]) for h in ranks]
            changes = [c for cs in out for c in cs]
        else:
            before = ranks[0].view()
            out = [h.choose(op[1], room) for h in ranks]
            check_choice(before, ranks[0].view(), op[1], out[0])
            changes = []
        for c in changes:
            assert KERNEL.dest[KERNEL.trigger_id[c.trigger], int(c.src)] == int(c.dst)
        assert all(o == out[0] for o in out), (op, out)
        assert all(h.view() == ranks[0].view() for h in ranks)
        assert len({h.fingerprint() for h in ranks}) == 1


def heal(h: PeerHealth, peer: int, room: int) -> None:
    """(b): max_cooldown steps and one successful request routed to ``peer``
    (its probe, if one is in flight) leave it healthy."""
    h.tick(h.policy.max_cooldown)
    v = h.view().get(peer)
    if v is not None and v.state is PeerState.PROBING:
        room = v.probe
    else:
        assert h.choose([peer], room) == peer
    h.observe(peer, R.NONE, room=room)
    assert h.state(peer) is PeerState.HEALTHY, h.view()[peer]


@given(policy=policies, sequence=ops)
def test_ranks_fed_the_same_agreed_events_agree(policy, sequence):
    run([PeerHealth(policy), PeerHealth(policy), PeerHealth(policy)], sequence)


@given(policy=policies, sequence=ops, peer=PEERS)
def test_no_peer_is_blacklisted_for_good(policy, sequence, peer):
    h = PeerHealth(policy)
    run([h], sequence)
    heal(h, peer, room=1)
    run([h], sequence)  # and again, with whatever backoff it carries now
    heal(h, peer, room=2)


@given(policy=policies, sequence=ops)
def test_observe_result_is_observe_in_queue_order(policy, sequence):
    batch, one = PeerHealth(policy), PeerHealth(policy)
    outcomes = [op for op in sequence if op[0] == "outcome"]
    for h in (batch, one):
        run([h], [op for op in sequence if op[0] != "outcome"])
    rooms = np.arange(1, len(outcomes) + 1, dtype=np.uint64)
    fails = [reason is not R.NONE for _, _, reason, _ in outcomes]
    n = len(outcomes)
    result = StepResult(
        step=1,
        queue="q",
        rooms=rooms,
        statuses=np.array([KVPoll.Failed if f else KVPoll.Success for f in fails], np.int8),
        reasons=np.array([int(reason) for _, _, reason, _ in outcomes], np.int8),
        origins=np.zeros(n, np.int32),
        active=np.arange(n, dtype=np.int64),
        changed=np.arange(n, dtype=np.int64),
        previous=np.full(n, KVPoll.Transferring, np.int8),
        triggers=np.zeros(n, np.int16),
        dwell=np.zeros(n),
    )
    peer_of = {i + 1: peer for i, (_, peer, _, _) in enumerate(outcomes)}
    got = batch.observe_result(result, peer_of)
    want = [
        one.observe(peer_of[room], reason, room=room)
        for room, (_, _, reason, _) in zip(range(1, n + 1), outcomes)
    ]
    assert list(got) == [c for c in want if c is not None]
    assert batch.view() == one.view()


# -- each property fails on a plausible wrong implementation ------------------


class LocalClock(PeerHealth):
    """Cooldowns on each rank's own clock: a rank whose clock runs fast lets
    the probe through before another rank does."""

    def __init__(self, policy: PeerPolicy, rate: int) -> None:
        super().__init__(policy)
        self.rate = rate

    def tick(self, steps: int = 1):
        return super().tick(steps * self.rate)


class NeverCools(PeerHealth):
    """A failed peer is never tried again (the bug SGLang's probe fixed)."""

    def tick(self, steps: int = 1):
        self._now += steps
        return ()


@attrs.frozen
class Unbounded(PeerPolicy):
    """The backoff without its bound."""

    def cooldown_after(self, opens: int) -> int:
        return self.cooldown * self.backoff ** (opens - 1)


class FirstCandidate(PeerHealth):
    """Routing that ignores health (keeps the books, routes to the first)."""

    def choose(self, candidates, room):
        super().choose(candidates, room)
        return candidates[0]


def fails(check) -> bool:
    try:
        check()
    except AssertionError:
        return True
    return False


NEGATIVE = settings(
    max_examples=2000,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
    deadline=None,
)


def test_agreement_catches_rank_local_time():
    find(
        ops,
        lambda seq: fails(lambda: run([LocalClock(SMALL, 1), LocalClock(SMALL, 2)], seq)),
        settings=NEGATIVE,
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: NeverCools(SMALL),
        lambda: PeerHealth(Unbounded(threshold=1, cooldown=4, max_cooldown=4)),
    ],
    ids=["never-cools", "unbounded-backoff"],
)
def test_healing_catches_a_blacklist(make):
    def blacklists(seq) -> bool:
        h = make()
        run([h], seq)
        return fails(lambda: heal(h, 0, room=1))

    find(ops, blacklists, settings=NEGATIVE)


def test_choice_catches_routing_that_ignores_health():
    find(ops, lambda seq: fails(lambda: run([FirstCandidate(SMALL)], seq)), settings=NEGATIVE)
