import json

import numpy as np
import pytest

from lifecycle.errors import FaultPlanError
from lifecycle.faults import ProbabilisticFaults, from_env
from lifecycle.protocols import StepContext
from pdlife.cluster.plan import RankFaults
from pdlife.cluster.plan_doc import load_plan, parse_plan


def ctx(rooms, step=1):
    rooms = np.asarray(rooms, dtype=np.uint64)
    return StepContext(
        0, step, 0.0, rooms, np.ones(rooms.size, np.int8), np.zeros(rooms.size, np.int64)
    )


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"faults": [{"kind": "explode", "rank": 0, "request": 1}]}, r"faults\[0\]\.kind"),
        ({"faults": [{"kind": "fail", "request": 1}]}, r"faults\[0\]\.rank"),
        ({"faults": [{"kind": "fail", "rank": 0}]}, r"faults\[0\]"),
        ({"faults": [{"kind": "fail", "rank": 0, "request": 1, "room": 3}]}, r"faults\[0\]"),
        ({"faults": [{"kind": "fail", "rank": -1, "request": 1}]}, r"faults\[0\]\.rank"),
        (
            {"faults": [{"kind": "fail", "rank": 0, "request": 1, "steps": 2}]},
            r"faults\[0\]\.steps",
        ),
        ({"faults": [{"kind": "kill_rank", "rank": 0}]}, r"faults\[0\]\.step"),
        ({"faults": [{"kind": "pause_rank", "rank": 0, "seconds": 2}]}, r"faults\[0\]\.step"),
        ({"faults": [{"kind": "pause_rank", "rank": 0, "step": 3}]}, r"faults\[0\]\.seconds"),
        (
            {"faults": [{"kind": "pause_rank", "rank": 0, "step": 3, "seconds": 0}]},
            r"faults\[0\]\.seconds",
        ),
        (
            {"faults": [{"kind": "pause_rank", "rank": 0, "step": 3, "seconds": 1e9}]},
            r"faults\[0\]\.seconds",
        ),
        (
            {"faults": [{"kind": "pause_rank", "rank": 0, "step": 3, "seconds": True}]},
            r"faults\[0\]\.seconds",
        ),
        (
            {"faults": [{"kind": "pause_rank", "rank": 0, "request": 1, "step": 3, "seconds": 1}]},
            r"faults\[0\]",
        ),
        (
            {"faults": [{"kind": "fail", "rank": 0, "request": 1, "seconds": 1}]},
            r"faults\[0\]\.seconds",
        ),
        (
            {"faults": [{"kind": "fail", "rank": 0, "request": 1, "colour": 1}]},
            r"faults\[0\]\.colour",
        ),
        ({"probabilistic": {"prob": 1.5}}, r"probabilistic\.prob"),
        ({"probabilistic": {"prob": 0.1, "ranks": "all"}}, r"probabilistic\.ranks"),
        ({"seeds": 3}, "seeds"),
        ({"faults": {"kind": "fail"}}, "faults"),
    ],
)
def test_malformed_plans_name_the_field(doc, field):
    with pytest.raises(FaultPlanError, match=field):
        parse_plan(doc)


def test_validate_against_run():
    plan = parse_plan({"faults": [{"kind": "fail", "rank": 5, "request": 1}]})
    with pytest.raises(FaultPlanError, match=r"faults\[0\]\.rank"):
        plan.validate_against(world=4, requests=10)
    plan = parse_plan({"faults": [{"kind": "fail", "rank": 1, "request": 10}]})
    with pytest.raises(FaultPlanError, match=r"faults\[0\]\.request"):
        plan.validate_against(world=4, requests=10)


def test_json_and_toml_plans_load_the_same(tmp_path):
    doc = {
        "seed": 3,
        "probabilistic": {"prob": 0.25, "ranks": [1]},
        "faults": [{"kind": "delay", "rank": 1, "request": 2, "step": 4, "steps": 3}],
    }
    (tmp_path / "p.json").write_text(json.dumps(doc))
    (tmp_path / "p.toml").write_text(
        "seed = 3\n[probabilistic]\nprob = 0.25\nranks = [1]\n"
        '[[faults]]\nkind = "delay"\nrank = 1\nrequest = 2\nstep = 4\nsteps = 3\n'
    )
    assert load_plan(tmp_path / "p.json") == load_plan(tmp_path / "p.toml")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(FaultPlanError, match="not valid JSON"):
        load_plan(tmp_path / "bad.json")


def test_targeted_faults_fire_on_their_rank_room_and_steps():
    plan = parse_plan(
        {
            "faults": [
                {"kind": "fail", "rank": 1, "request": 0, "step": 2},
                {"kind": "delay", "rank": 1, "room": 20, "step": 3, "steps": 2},
                {"kind": "kill_rank", "rank": 1, "step": 9},
            ]
        }
    )
    rf = RankFaults(plan, 1, [10, 20])
    assert rf.inject(ctx([10, 20], step=1)).tolist() == [False, False]
    assert rf.inject(ctx([10, 20], step=2)).tolist() == [True, False]
    assert [rf.delayed(20, s) for s in (2, 3, 4, 5)] == [False, True, True, False]
    assert rf.kill_at(9)
    assert not rf.kill_at(8)
    other = RankFaults(plan, 0, [10, 20])
    assert not other.inject(ctx([10, 20], step=2)).any()


def test_probabilistic_faults_are_seeded_per_rank():
    a = [ProbabilisticFaults(0.3, seed=5, rank=1).inject(ctx(range(1, 200))) for _ in range(2)]
    assert (a[0] == a[1]).all()
    b = ProbabilisticFaults(0.3, seed=5, rank=2).inject(ctx(range(1, 200)))
    assert not (a[0] == b).all()
    assert 0.15 < a[0].mean() < 0.45
    with pytest.raises(FaultPlanError, match="prob"):
        ProbabilisticFaults(2.0)


def test_field_environment_variables_keep_working():
    assert from_env(env={}) is None
    hook = from_env(rank=2, env={"DISAGGREGATION_TEST_FAILURE_PROB": "0.5"})
    assert hook is not None
    assert hook.prob == 0.5
    assert hook.rank == 2
    hook = from_env(
        env={
            "SGLANG_TEST_DISAGG_FAILURE_PROB": "0.1",
            "DISAGGREGATION_TEST_FAILURE_PROB": "0.9",
            "PDLIFE_FAULT_SEED": "7",
        }
    )
    assert hook is not None
    assert (hook.prob, hook.seed) == (0.1, 7)
    with pytest.raises(FaultPlanError, match="SGLANG_TEST_DISAGG_FAILURE_PROB"):
        from_env(env={"SGLANG_TEST_DISAGG_FAILURE_PROB": "often"})
    for raw in ("2", "-0.5", "nan"):  # out of range: the variable is named, not "prob"
        with pytest.raises(FaultPlanError, match=r"DISAGGREGATION_TEST_FAILURE_PROB.*within"):
            from_env(env={"DISAGGREGATION_TEST_FAILURE_PROB": raw})


def states_ctx(rooms, states, step=1):
    rooms = np.asarray(rooms, dtype=np.uint64)
    return StepContext(
        0, step, 0.0, rooms, np.asarray(states, np.int8), np.zeros(rooms.size, np.int64)
    )


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"mode": "sometimes"}, "mode"),
        ({"faults": [{"kind": "fail", "rank": 0, "request": 1, "at": "Later"}]}, r"\.at"),
        ({"faults": [{"kind": "fail", "rank": 0, "request": 1, "at": 3}]}, r"\.at"),
        (
            {
                "faults": [
                    {"kind": "fail", "rank": 0, "request": 1, "at": "Transferring", "step": 2}
                ]
            },
            r"faults\[0\]",
        ),
        (
            {"faults": [{"kind": "drop_metadata", "rank": 0, "request": 1, "at": "Bootstrapping"}]},
            r"\.at",
        ),
        ({"faults": [{"kind": "kill_rank", "rank": 0, "step": 3, "at": "Transferring"}]}, r"\.at"),
    ],
)
def test_phase_fields_are_validated(doc, field):
    with pytest.raises(FaultPlanError, match=field):
        parse_plan(doc)


def test_phase_mode_plans_parse_in_both_formats(tmp_path):
    (tmp_path / "p.toml").write_text(
        'seed = 2\nmode = "phase"\n[probabilistic]\nprob = 0.05\n'
        '[[faults]]\nkind = "fail"\nrank = 1\nrequest = 4\nat = "Transferring"\n'
    )
    plan = load_plan(tmp_path / "p.toml")
    assert plan.mode == "phase"
    assert plan.faults[0].at == "Transferring"
    assert parse_plan({}).mode is None


def test_phase_draws_depend_on_the_request_alone():
    from pdlife.cluster.phase_draws import draw

    rooms = np.arange(1, 5001, dtype=np.uint64) * 7919
    a = draw(3, 1, 2, rooms)
    # asked in another order, or a few at a time, a request gets the same number
    assert (draw(3, 1, 2, rooms[::-1])[::-1] == a).all()
    assert (draw(3, 1, 2, rooms[100:110]) == a[100:110]).all()
    assert not (draw(3, 1, 3, rooms) == a).all()  # another rank
    assert not (draw(4, 1, 2, rooms) == a).all()  # another seed
    assert a.min() >= 0.0 and a.max() < 1.0
    assert abs(float((a < 0.05).mean()) - 0.05) < 0.01


def test_one_winner_per_request_earliest_phase_then_abort_then_lowest_rank():
    from pdlife.cluster.phase_draws import PHASES, phase_decisions
    from pdlife.cluster.plan_doc import FaultPlan

    rooms = np.arange(1, 20001, dtype=np.uint64)
    ds = phase_decisions(FaultPlan(seed=1, prob=0.2), 0.2, 9, 4, rooms)
    by_room = {}
    for d in ds:
        by_room.setdefault(d.room, []).append(d)
    assert {d.kind for d in ds} == {"fail", "abort"}
    assert {d.phase for d in ds} == set(PHASES)
    for got in by_room.values():
        winners = [d for d in got if d.wins]
        assert len(winners) == 1
        key = [(PHASES.index(d.phase), d.rank) for d in got]
        assert (PHASES.index(winners[0].phase), winners[0].rank) == min(key)
    # the same draws, asked for a subset of the requests
    sub = phase_decisions(FaultPlan(seed=1, prob=0.2), 0.2, 9, 4, rooms[:50])
    assert sub == [d for d in ds if d.room <= 50]


def test_a_phase_fault_fires_when_the_request_reaches_its_phase_even_by_a_jump():
    plan = parse_plan(
        {
            "mode": "phase",
            "faults": [
                {"kind": "fail", "rank": 0, "room": 10, "at": "Transferring"},
                {"kind": "fail", "rank": 0, "room": 20, "at": "WaitingForInput"},
                {"kind": "fail", "rank": 0, "room": 30, "at": "Transferring"},
            ],
        }
    )
    rf = RankFaults(plan, 0, [], mode="phase")
    w, s = 2, 4
    rooms, states = [10, 20, 30], [w, 1, w]
    # step 1: 10 and 30 are waiting, 20 bootstrapping: nothing has reached its phase
    assert rf.inject_phase(states_ctx(rooms, states, 1), np.array(states, np.int8)).tolist() == [
        False,
        False,
        False,
    ]
    # step 2: the backend reports 10 done at once (Waiting -> Success, Transferring
    # never observed), 20 waiting: both fire before either can finish
    obs = np.array([s, w, w], np.int8)
    assert rf.inject_phase(states_ctx(rooms, states, 2), obs).tolist() == [True, True, False]
    # a fault fires once
    assert not rf.inject_phase(states_ctx(rooms, states, 3), obs)[:2].any()
    assert rf.unfired() == ["fail on rank 0, room 30, at Transferring"]


def test_phase_winners_are_carried_out_by_their_rank_and_aborts_on_decode():
    from pdlife.cluster.phase_draws import phase_decisions
    from pdlife.cluster.plan_doc import FaultPlan

    plan = FaultPlan(seed=5, prob=0.3)
    rooms = list(range(1, 401))
    ds = phase_decisions(plan, 0.3, 5, 2, np.asarray(rooms, np.uint64))
    aborted = []
    fired = {}
    for rank in (0, 1):
        rf = RankFaults(plan, rank, rooms, mode="phase", world=2, abort_prob=0.3, abort_seed=5)
        rf.admit(rooms, aborts_here=rank == 1)
        obs = np.full(len(rooms), 4, np.int8)  # everything about to succeed
        hit = rf.inject_phase(states_ctx(rooms, [2] * len(rooms)), obs, aborted.append)
        fired[rank] = {r for r, h in zip(rooms, hit.tolist()) if h}
    want = {
        rank: {d.room for d in ds if d.wins and d.kind == "fail" and d.rank == rank}
        for rank in (0, 1)
    }
    assert fired == want
    assert sorted(aborted) == sorted(d.room for d in ds if d.wins and d.kind == "abort")
    assert fired[0] and fired[1] and aborted


def test_a_pause_fires_at_its_step_and_is_reported_if_it_never_came():
    plan = parse_plan({"faults": [{"kind": "pause_rank", "rank": 1, "step": 4, "seconds": 2.5}]})
    assert plan.faults[0].seconds == 2.5
    rf = RankFaults(plan, 1, [11])
    assert rf.pause_at(3) == 0.0
    assert rf.unfired() == ["pause_rank on rank 1 at step 4 (2.5 s)"]
    assert rf.pause_at(4) == 2.5
    assert rf.unfired() == []
    assert RankFaults(plan, 0, [11]).pause_at(4) == 0.0  # another rank's


def test_a_request_either_side_is_to_fail_is_held_until_it_ends_here():
    """holds(): this rank's own ``at`` fail until it fires; a rank of the other
    side's (targeted: the first attempt only; a phase-keyed winner: the attempt
    it was drawn for) until the request ends here (forget)."""
    from pdlife.cluster.phase_draws import phase_decisions
    from pdlife.cluster.plan_doc import FaultPlan

    plan = parse_plan(
        {
            "faults": [
                {"kind": "fail", "rank": 0, "room": 10, "at": "Transferring"},
                {"kind": "fail", "rank": 2, "room": 20, "at": "WaitingForInput"},
                {"kind": "delay", "rank": 2, "room": 30, "at": "WaitingForInput"},
            ]
        }
    )
    # prefill rank 0 of a 2 + 2 world
    rf = RankFaults(plan, 0, [], mode="phase", world=4, prefill_ranks=2)
    rf.admit([10, 20, 30, 40], aborts_here=False)
    assert [rf.holds(r) for r in (10, 20, 30, 40)] == [True, True, False, False]
    w, t = 2, 3
    assert rf.inject_phase(states_ctx([10], [w]), np.array([t], np.int8)).tolist() == [True]
    assert not rf.holds(10)  # fired here
    rf.forget(20)
    assert not rf.holds(20)  # ended here (decode's word)
    rf.admit([20], aborts_here=False, epoch=1)
    assert not rf.holds(20)  # a later attempt: the targeted fault fired in the first
    # decode rank 2 holds nothing for its own faults, prefill's targeted one it does
    d = RankFaults(plan, 2, [], mode="phase", world=4, prefill_ranks=2)
    d.admit([10, 20], aborts_here=True)
    assert d.peer_fail == {10}
    # without the sides known (prefill_ranks 0) nothing of another rank is held
    assert RankFaults(plan, 1, [], world=4).peer_fail == set()
    # phase-keyed winners of the other side are held on this one
    drawn = FaultPlan(seed=5, prob=0.3)
    rooms = list(range(1, 201))
    ds = phase_decisions(drawn, 0.0, 0, 4, np.asarray(rooms, np.uint64))
    p = RankFaults(drawn, 1, rooms, mode="phase", world=4, prefill_ranks=2)
    p.admit(rooms, aborts_here=False)
    want = {x.room for x in ds if x.wins and x.kind == "fail" and x.rank >= 2}
    assert want and p.peer_fail == want
    own = {x.room for x in ds if x.wins and x.kind == "fail" and x.rank == 1}
    assert {r for r in rooms if p.holds(r)} == want | own


def test_a_transfer_error_fires_once_its_phase_is_reached_and_is_held_until_then():
    """transfer_error: the rank's backend reports the request Failed (a transfer
    error), once, at the first poll after its phase was reached; its data is
    held back on this rank until then, and on the other side's ranks until the
    request ends there."""
    plan = parse_plan(
        {"faults": [{"kind": "transfer_error", "rank": 0, "room": 10, "at": "Transferring"}]}
    )
    rf = RankFaults(plan, 0, [], mode="phase", world=4, prefill_ranks=2)
    rf.admit([10, 11], aborts_here=False)
    assert (rf.holds(10), rf.holds(11)) == (True, False)
    w, t = 2, 3
    assert not rf.transfer_fails(10, 1)  # its phase not reached yet
    rf.inject_phase(states_ctx([10], [w]), np.array([t], np.int8))  # reached, at step 1
    assert rf.holds(10)  # not fired yet: held
    assert rf.transfer_fails(10, 1) and rf.fired == [(1, "transfer_error", 10)]
    assert not rf.holds(10) and not rf.transfer_fails(10, 2)  # once
    d = RankFaults(plan, 2, [], mode="phase", world=4, prefill_ranks=2)
    d.admit([10], aborts_here=True)
    assert d.holds(10)  # decode holds it for prefill's fault
    # step-keyed: it fires at its step if the request is live then; nothing is held
    stepped = parse_plan({"faults": [{"kind": "transfer_error", "rank": 0, "room": 10, "step": 3}]})
    rs = RankFaults(stepped, 0, [])
    assert not rs.holds(10) and not rs.transfer_fails(10, 2) and rs.transfer_fails(10, 3)


def test_a_staging_hold_is_active_for_its_steps_on_its_rank():
    plan = parse_plan(
        {"faults": [{"kind": "hold_staging", "rank": 1, "room": 20, "step": 3, "steps": 2}]}
    )
    rf = RankFaults(plan, 1, [])
    assert [rf.staging_held(20, s) for s in (2, 3, 4, 5)] == [False, True, True, False]
    assert not rf.gate_held(20, 3)  # the user gate is not the staging gate
    assert not RankFaults(plan, 0, []).staging_held(20, 3)


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (
            {"faults": [{"kind": "transfer_error", "rank": 0, "room": 1, "steps": 2}]},
            r"faults\[0\]\.steps",
        ),
        ({"faults": [{"kind": "hold_staging", "rank": 0, "steps": 2}]}, r"faults\[0\]"),
        (
            {"faults": [{"kind": "hold_staging", "rank": 0, "room": 1, "at": "Done"}]},
            r"faults\[0\]\.at",
        ),
    ],
)
def test_the_new_kinds_fields_are_validated(doc, field):
    with pytest.raises(FaultPlanError, match=field):
        parse_plan(doc)
