"""The connector's protocol on a simulated network (transport.testing.simnet):
1-3 prefill ranks x 1-2 decode ranks (TP 1:1, 2->1, 1->2, 2->2, 3->1, 3->2),
staged or not, with and without digests, under lost, doubled, late and
reordered messages, writes that fail, never land or land corrupted, ranks
paused for a while or for ever, and schedulers that give up on a request.

Invariants, each with a negative control that switches its mechanism off:

- every request ends on every rank, and is cleared, within bounded virtual
  time (unless a rank stays paused for ever);
- no write lands in a decode page that belongs to another request or
  attempt, or to none (the fence, a paused writer that thaws included);
- decode says a request is drained only when no write of it can still land;
- where no message is lost, every rank of both sides ends a request alike;
- once every request is cleared, no slot or page is held;
- with digests on, a request whose bytes were corrupted in flight never ends
  Success on the decode rank holding them.

A failing example names its seed (``Plan(seed=...)``): ``Run(plan).go()``
replays it exactly.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.simrun import Plan, Run
from transport.connector.core import liveness
from transport.connector.core.decode import DecodeSide
from transport.connector.core.graph import Phase
from transport.connector.core.machine import ConnectorCore
from transport.connector.core.prefill import PrefillSide
from transport.testing.simnet import Faults

SHAPES = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (3, 2)]
#: about 0.3 s a run: the ci profile's 150 would take a minute; deep takes its own
DEEP = settings.default.max_examples > 150
EXAMPLES = settings.default.max_examples if DEEP else 60
#: CI replays the same plans every run (derandomized): rare plans that break an
#: invariant are open issues (docs/connector.md), found by the deep profile, which
#: draws new plans every run; a CI verdict must not depend on the draw


@st.composite
def plans(draw, faults=True):
    ptp, dtp = draw(st.sampled_from(SHAPES))
    digest = draw(st.booleans())
    f = Faults()
    if faults:
        f = Faults(
            drop=draw(st.sampled_from([0.0, 0.0, 0.05, 0.3])),
            duplicate=draw(st.sampled_from([0.0, 0.2])),
            delay=draw(st.sampled_from([(0.0002, 0.002), (0.0002, 0.2)])),
            write_delay=draw(st.sampled_from([(0.0002, 0.003), (0.0002, 0.5)])),
            write_fails=draw(st.sampled_from([0.0, 0.0, 0.2])),
            write_lost=draw(st.sampled_from([0.0, 0.0, 0.2])),
            corrupt=draw(st.sampled_from([0.0, 0.3])) if digest else 0.0,
        )
    pause = None
    if faults and draw(st.booleans()):
        role = draw(st.sampled_from(["prefill", "decode"]))
        rank = draw(st.integers(0, (ptp if role == "prefill" else dtp) - 1))
        pause = (
            role,
            rank,
            draw(st.sampled_from([0.001, 0.003, 0.01])),
            draw(st.sampled_from([0.05, 0.4, 2.5])),
        )
    abort = None
    if faults and draw(st.booleans()):
        abort = (
            draw(st.sampled_from(["prefill", "decode"])),
            0,
            draw(st.sampled_from([0.001, 0.004, 0.02])),
        )
    return Plan(
        seed=draw(st.integers(0, 2**32 - 1)),
        prefill_tp=ptp,
        decode_tp=dtp,
        requests=draw(st.integers(1, 3)),
        pages=draw(st.integers(1, 3)),
        digest=digest,
        staging=ptp != dtp and draw(st.booleans()),
        notifies=draw(st.booleans()),
        faults=f,
        pause=pause,
        abort=abort,
    )


def check(run, ended):
    """Every invariant of the module, as one list of what broke."""
    broke = []
    if not ended and not run.paused_forever:
        stuck = {k: h.poll() for k, h in run.handles.items() if not h.detached}
        broke.append(f"not every request ended in {run.plan.limit} s: {stuck}")
    broke += [f"fence: {v.what}" for v in run.net.fence.violations]
    broke += [
        f"decode rank {r} said room={m} drained with a write in flight"
        for r, m in run.drained_early
    ]
    if ended:
        broke += [f"leak: {x}" for x in run.leaks()]
    if run.net.dropped == 0 and not run.plan.faults.corrupt and not run.plan.pause:
        broke += [f"disagree: {x}" for x in run.disagreements()]
    if run.plan.digest:
        broke += [f"corrupted bytes ended Success: {x}" for x in run.corrupted_successes()]
    return broke


@settings(max_examples=EXAMPLES, deadline=None, derandomize=not DEEP)
@given(plans())
def test_the_protocol_keeps_its_invariants(plan):
    run = Run(plan)
    ended = run.go()
    assert check(run, ended) == [], plan


@settings(max_examples=15, deadline=None, derandomize=not DEEP)
@given(plans(faults=False))
def test_without_faults_every_request_succeeds_on_every_rank(plan):
    run = Run(plan)
    assert run.go(), plan
    assert check(run, True) == [], plan
    assert {o.status for o in run.outcome.values()} == {4}, plan  # KVPoll.Success


#: plans drawn at random that once broke an invariant, replayed every run
REGRESSIONS = {
    # decode's scheduler aborts; the word is lost and the writer paused past the
    # drain timeout: the pages must stay fenced although the reason is an abort
    "abort-unheard-by-a-paused-writer": Plan(
        seed=8695, requests=1, pages=3, digest=True, notifies=True,
        faults=Faults(drop=0.05, delay=(0.0002, 0.2), write_lost=0.2),
        pause=("prefill", 0, 0.01, 2.5), abort=("decode", 0, 0.004),
    ),
    # decode paused: prefill fails it while a write is in flight, then answers a
    # late copy of the register with "failed" (no write can land): decode drained
    # early. A failed request with writes in flight says so only once they drained
    "failed-said-with-a-write-in-flight": Plan(
        seed=8945, prefill_tp=2, requests=1, pages=2, digest=True, staging=True,
        faults=Faults(drop=0.05, duplicate=0.2, delay=(0.0002, 0.2),
                      write_delay=(0.0002, 0.5), write_lost=0.2),
        pause=("decode", 0, 0.01, 0.4),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_plans_that_once_broke_an_invariant_keep_it(name):
    run = Run(REGRESSIONS[name])
    assert check(run, run.go()) == []


def test_a_run_replays_from_its_seed():
    plan = Plan(seed=7, prefill_tp=2, faults=Faults(drop=0.1, duplicate=0.2, write_fails=0.2))
    a, b = Run(plan), Run(plan)
    a.go(), b.go()
    strip = {k: (o.status, o.reason) for k, o in a.outcome.items()}
    assert strip == {k: (o.status, o.reason) for k, o in b.outcome.items()}
    assert (a.net.now, a.net.sent, a.net.dropped) == (b.net.now, b.net.sent, b.net.dropped)


# -- negative controls: each mechanism switched off, and the invariant that catches it -----

#: a decode writer paused past the heartbeat window while its writes are still
#: on the wire: decode fails the request (peer dead) and must keep its pages
#: fenced, not hand them to another request, until the writer speaks again
PAUSED_WRITER = Plan(
    seed=3,
    requests=1,
    pages=2,
    faults=Faults(write_delay=(2.5, 2.6)),
    pause=("prefill", 0, 0.03, 3.0),
)


def test_control_the_fence_holds_a_paused_writers_pages():
    run = Run(PAUSED_WRITER)
    run.go()
    assert check(run, True) == []
    assert run.decode[0].core.stats["fenced"] >= 1


def test_negative_control_without_the_fence_a_thawed_writer_lands_in_released_pages(monkeypatch):
    monkeypatch.setattr(liveness, "silent_writers", lambda dead, req: set())
    run = Run(PAUSED_WRITER)
    run.go()
    broke = check(run, True)
    assert any(b.startswith("fence:") for b in broke), broke


def test_negative_control_drained_before_the_senders_stopped_is_caught(monkeypatch):
    def drain_at_once(self, req):
        if self.core.phase_of(req) in (Phase.Aborted, Phase.Fenced):  # no wait for the senders
            self.core.fire(req, "drain")

    monkeypatch.setattr(DecodeSide, "_drain_if_stopped", drain_at_once)
    run = Run(
        Plan(seed=11, requests=1, faults=Faults(write_delay=(0.3, 0.4)), abort=("decode", 0, 0.03))
    )
    run.go()
    assert any("drained with a write in flight" in b for b in check(run, True))


def test_negative_control_without_the_digest_corrupted_bytes_end_success():
    plan = Plan(seed=5, requests=2, faults=Faults(corrupt=1.0))
    run = Run(plan)
    run.go()
    assert run.corrupted_successes()  # digest off: nothing notices
    run = Run(Plan(seed=5, requests=2, digest=True, faults=Faults(corrupt=1.0)))
    run.go()
    assert run.corrupted_successes() == [] and check(run, True) == []


def test_negative_control_without_timeouts_a_lost_message_leaves_requests_for_ever(monkeypatch):
    monkeypatch.setattr(liveness, "timeouts", lambda m, now: None)
    run = Run(Plan(seed=2, requests=2, faults=Faults(drop=0.5), limit=6.0))
    ended = run.go()
    assert any(b.startswith("not every request ended") for b in check(run, ended))


def test_negative_control_a_release_that_keeps_its_slot_is_a_leak(monkeypatch):
    real = ConnectorCore.release
    monkeypatch.setattr(ConnectorCore, "release", lambda self, index: None)
    run = Run(Plan(seed=1, requests=2))
    assert run.go()
    assert any(b.startswith("leak:") for b in check(run, True))
    monkeypatch.setattr(ConnectorCore, "release", real)


def test_negative_control_a_prefill_that_ignores_decode_giving_up_disagrees(monkeypatch):
    monkeypatch.setattr(PrefillSide, "_aborted", lambda self, req, msg, peer: None)
    run = Run(
        Plan(
            seed=9, requests=1, faults=Faults(write_delay=(0.01, 0.02)), abort=("decode", 0, 0.004)
        )
    )
    run.go()
    assert any(b.startswith("disagree:") for b in check(run, True))


def test_an_abort_that_crosses_done_ends_the_sides_apart_and_is_a_race_not_a_disagreement():
    # decode's scheduler gives up after prefill succeeded and said "done", before
    # the word arrived: prefill ends Success, decode Failed (aborted), and prefill
    # handled no word of the abort before its Success. The deaf prefill of the
    # control above handles the abort first and is caught
    plan = Plan(seed=3, requests=1, faults=Faults(delay=(0.0002, 0.2)), abort=("decode", 0, 0.02))
    run = Run(plan)
    assert run.go()
    ends = {k[0]: (o.status, o.reason) for k, o in run.outcome.items()}
    assert ends == {"prefill": (4, -1), "decode": (0, 0)}  # Success; Failed, aborted
    assert run._raced(100) and check(run, True) == []


@pytest.mark.parametrize("seed", range(3))
def test_a_rank_paused_for_ever_leaves_only_its_own_requests_open(seed):
    run = Run(
        Plan(seed=seed, prefill_tp=2, requests=2, pause=("prefill", 1, 0.002, None), limit=6.0)
    )
    ended = run.go()
    assert not ended and check(run, ended) == []
