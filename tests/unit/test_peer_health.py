"""A prefill peer's health: k counted failures open it, a cooldown of agreed
steps keeps traffic away, one probe closes or reopens it (with a bounded
backoff); reasons that say nothing about the peer never count; bad arguments
are refused by name and change nothing."""

import re
from pathlib import Path

import attrs
import numpy as np
import pytest

from lifecycle import FailureReason, KVPoll, RequestTable, SingleRank, Stepper
from lifecycle.errors import InvalidArgument, InvalidRoom
from lifecycle.recovery import COUNTS, PeerHealth, PeerPolicy, PeerState, PeerView
from lifecycle.rules import peers as rules
from lifecycle.testing import StatusBoard

R = FailureReason
OK = R.NONE
H, SU, OP, HO, P = PeerState


TEN = PeerPolicy(threshold=3, cooldown=10)


def opened(policy=TEN, peer=1):
    h = PeerHealth(policy)
    for _ in range(policy.threshold):
        h.observe(peer, R.TRANSFER_ERROR)
    assert h.state(peer) is OP
    return h


def test_k_consecutive_counted_failures_open_a_peer_and_fewer_leave_it_suspect():
    h = PeerHealth(PeerPolicy(threshold=3))
    assert h.state(1) is H
    assert h.observe(1, R.PEER_DEAD).trigger == "strike"
    assert h.observe(1, R.WAITING_TIMEOUT).dst is SU
    assert h.view()[1].strikes == 2
    change = h.observe(1, R.CHECKSUM_MISMATCH)
    assert (change.trigger, change.src, change.dst) == ("trip", SU, OP)
    assert h.view()[1].until == PeerPolicy().cooldown  # opened at step 0


def test_threshold_one_opens_on_the_first_counted_failure():
    h = PeerHealth(PeerPolicy(threshold=1))
    assert h.observe(7, R.BOOTSTRAP_TIMEOUT).dst is OP


def test_a_success_resets_the_consecutive_count():
    h = PeerHealth(PeerPolicy(threshold=3))
    for _ in range(10):
        h.observe(1, R.TRANSFER_ERROR)
        h.observe(1, R.TRANSFER_ERROR)
        assert h.observe(1, OK).dst is H
    assert h.state(1) is H and h.view()[1].strikes == 0


@pytest.mark.parametrize("reason", sorted(set(R) - COUNTS - {OK}))
def test_a_reason_that_does_not_count_changes_nothing(reason):
    h = PeerHealth(PeerPolicy(threshold=1))
    h.observe(1, R.NONE)
    before = h.fingerprint()
    assert h.observe(1, reason) is None
    assert h.fingerprint() == before and h.state(1) is H


def test_aborted_and_hook_error_never_count_and_the_declaration_refuses_them():
    assert R.ABORTED not in COUNTS and R.HOOK_ERROR not in COUNTS
    for reason in (R.ABORTED, R.HOOK_ERROR):
        table = tuple(
            attrs.evolve(c, counts=True) if c.reason is reason else c for c in rules.COUNTED
        )
        with pytest.raises(AssertionError, match=reason.name):
            rules.check_declaration(counted=table)


def test_the_cooldown_is_counted_in_agreed_steps():
    h = opened(PeerPolicy(threshold=3, cooldown=10))
    assert h.tick(9) == ()
    assert h.choose([1, 2], room=5) == 2  # still cooling: avoided
    (change,) = h.tick()
    assert (change.trigger, change.dst, change.step) == ("cool", HO, 10)


def test_a_probe_success_closes_the_peer():
    h = opened()
    h.tick(10)
    assert h.choose([2, 1], room=42) == 1  # the half-open peer gets its probe first
    assert h.view()[1].probe == 42 and h.state(1) is P
    assert h.choose([2, 1], room=43) == 2  # one probe at a time
    assert h.observe(1, OK, room=43) is None  # not the probe: ignored
    change = h.observe(1, OK, room=42)
    assert (change.trigger, change.dst) == ("close", H)
    assert h.view()[1] == PeerView(1, H, until=10)


def test_a_probe_failure_reopens_with_a_bounded_backoff():
    policy = PeerPolicy(threshold=1, cooldown=4, backoff=3, max_cooldown=30)
    h = opened(policy)
    cooldowns = []
    for room in range(1, 6):
        start = h.now
        until = h.view()[1].until
        cooldowns.append(until - start)
        h.tick(until - start)
        assert h.choose([1], room=room) == 1 and h.state(1) is P
        assert h.observe(1, R.TRANSFER_ERROR, room=room).trigger == "reopen"
    assert cooldowns[0] == 4 and cooldowns[1:] == [12, 30, 30, 30]
    assert [policy.cooldown_after(n) for n in (1, 2, 3, 50)] == [4, 12, 30, 30]


def test_a_probe_that_ends_for_a_reason_that_does_not_count_frees_the_slot():
    h = opened()
    h.tick(10)
    h.choose([1], room=9)
    assert h.observe(1, R.ABORTED, room=9).trigger == "void"
    assert h.state(1) is HO
    assert h.choose([2, 1], room=10) == 1 and h.view()[1].probe == 10


def test_outcomes_of_requests_routed_before_the_trip_are_ignored():
    h = opened()
    before = h.fingerprint()
    assert h.observe(1, OK, room=3) is None and h.observe(1, R.PEER_DEAD, room=4) is None
    assert h.fingerprint() == before


def test_choose_never_refuses_and_picks_the_cooldown_that_ends_first():
    h = PeerHealth(PeerPolicy(threshold=1, cooldown=10))
    h.observe(1, R.PEER_DEAD)
    h.tick(3)
    h.observe(2, R.PEER_DEAD)  # ends at 13, peer 1 at 10
    assert h.choose([2, 1], room=1) == 1
    assert h.choose([2], room=2) == 2
    assert h.choose(np.array([2, 1]), room=3) == 1  # any iterable of ids, numpy's too
    assert h.state(1) is OP  # a forced request is not a probe


def test_healthy_and_suspect_share_a_tier_so_one_failure_does_not_drain_a_peer():
    h = PeerHealth()
    h.observe(1, R.TRANSFER_ERROR)
    assert h.state(1) is SU
    assert h.choose([1, 2], room=1) == 1


def test_a_real_steps_results_feed_it():
    table, board = RequestTable(), StatusBoard()
    stepper = Stepper(table, 0, poller=board)
    routes = {11: 1, 12: 1, 13: 2, 14: 1}
    for room in routes:
        table.add(room)
    board.set([11, 12, 14], KVPoll.Failed)
    board.reasons.update({11: R.TRANSFER_ERROR, 12: R.ABORTED, 14: R.PEER_DEAD})
    board.set([13], KVPoll.Success)
    h = PeerHealth(PeerPolicy(threshold=2))
    changes = h.observe_result(stepper.step(SingleRank()), routes)
    assert [(c.peer, c.room, c.trigger) for c in changes] == [(1, 11, "strike"), (1, 14, "trip")]
    assert h.state(1) is OP and h.state(2) is H


def test_the_declaration_is_complete_and_renders():
    rules.check_declaration()
    text = rules.diagram("mermaid")
    for e in rules.EDGES:
        for s in e.sources:
            assert f"{s.name} --> {e.dest.name}: {e.trigger}" in text
    assert "PROBING -> OPEN" in rules.diagram("dot")


def test_the_declaration_check_names_a_broken_table():
    no_cool = tuple(e for e in rules.EDGES if e.trigger != "cool")
    with pytest.raises(AssertionError, match="elapsed in OPEN"):
        rules.check_declaration(edges=no_cool)
    stuck = tuple(attrs.evolve(e, dest=OP) if e.trigger == "close" else e for e in rules.EDGES)
    with pytest.raises(AssertionError):
        rules.check_declaration(edges=stuck)
    both = (*rules.IGNORED, rules.Ignored(rules.Event.SUCCESS, (H,), "twice"))
    with pytest.raises(AssertionError, match="success in HEALTHY"):
        rules.check_declaration(ignored=both)


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"threshold": 0}, "PeerPolicy.threshold"),
        ({"threshold": True}, "PeerPolicy.threshold"),
        ({"cooldown": -1}, "PeerPolicy.cooldown"),
        ({"cooldown": 1.5}, "PeerPolicy.cooldown"),
        ({"backoff": 0}, "PeerPolicy.backoff"),
        ({"cooldown": 10, "max_cooldown": 5}, "PeerPolicy.max_cooldown"),
    ],
)
def test_a_bad_policy_is_refused_by_name(kwargs, what):
    with pytest.raises(InvalidArgument, match=what) as info:
        PeerPolicy(**kwargs)
    assert info.value.what == what


@pytest.mark.parametrize(
    ("call", "what", "error"),
    [
        (lambda h: h.observe("prefill-0", R.PEER_DEAD), "peer", InvalidArgument),
        (lambda h: h.observe(True, R.PEER_DEAD), "peer", InvalidArgument),
        (lambda h: h.observe(-1, R.PEER_DEAD), "peer", InvalidArgument),
        (lambda h: h.observe(1.0, R.PEER_DEAD), "peer", InvalidArgument),
        (lambda h: h.observe(1, 5), "outcome", InvalidArgument),
        (lambda h: h.observe(1, "transfer error"), "outcome", InvalidArgument),
        (lambda h: h.observe(1, KVPoll.Failed), "outcome", InvalidArgument),
        (lambda h: h.observe(1, OK, room=-3), "bootstrap room", InvalidRoom),
        (lambda h: h.tick(-1), "steps", InvalidArgument),
        (lambda h: h.tick(2.0), "steps", InvalidArgument),
        (lambda h: h.choose([], room=1), "candidates", InvalidArgument),
        (lambda h: h.choose(3, room=1), "candidates", InvalidArgument),
        (lambda h: h.choose({1: 2}, room=1), "candidates", InvalidArgument),
        (lambda h: h.choose([2, "x"], room=1), "candidates[1]", InvalidArgument),
        (lambda h: h.choose([2], room=None), "bootstrap room", InvalidRoom),
        (lambda h: h.observe_result(None, {}), "result", InvalidArgument),
        (lambda h: PeerHealth(policy={"threshold": 2}), "policy", InvalidArgument),
    ],
)
def test_a_bad_argument_is_refused_by_name_and_changes_nothing(call, what, error):
    h = opened()
    h.tick(10)
    h.choose([1], room=8)
    before, view = h.fingerprint(), h.view()
    with pytest.raises(error) as info:
        call(h)
    assert info.value.what == what and "Nothing was changed" in str(info.value)
    assert h.fingerprint() == before and h.view() == view


def test_a_bad_peer_in_a_step_result_changes_nothing():
    table, board = RequestTable(), StatusBoard()
    stepper = Stepper(table, 0, poller=board)
    table.add(1)
    table.add(2)
    board.set([1, 2], KVPoll.Failed)
    h = PeerHealth(PeerPolicy(threshold=1))
    before = h.fingerprint()
    with pytest.raises(InvalidArgument, match=r"peer_of\(2\)"):
        h.observe_result(stepper.step(SingleRank()), {1: 0, 2: "decode"})
    assert h.fingerprint() == before and h.view() == {}


def test_the_docs_diagram_is_the_declared_one_and_the_example_runs(capsys):
    text = (Path(__file__).parents[2] / "docs" / "recovery.md").read_text()
    (block,) = re.findall(r"```mermaid\n(.*?)```", text, flags=re.S)
    assert block == rules.diagram("mermaid")
    for code in re.findall(r"```python\n(.*?)```", text, flags=re.S):  # every example runs
        exec(compile(code, "recovery.md", "exec"), {})
    assert capsys.readouterr().out.splitlines() == ["[0, 0, 1, 1, 1, 0, 1, 1]", "OPEN"]
