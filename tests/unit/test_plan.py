import json

import numpy as np
import pytest

from lifecycle import FaultPlanError
from lifecycle.faults import ProbabilisticFaults, from_env
from lifecycle.protocols import StepContext
from lifecycle.tools.plan import RankFaults, load_plan, parse_plan


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
