"""``pdlife bench``'s field pairs against the real SGLang 0.5.23: each pair
gives the same statuses on the same requests (the check the bench runs before
timing them), a pair that does not is caught, and a bench run here reports
gated against gated and ungated against ungated side by side."""

from __future__ import annotations

import pytest
import torch

from buffers import MetadataLayout
from lifecycle import TorchCollective
from pdlife.bench.cases import gated_queue
from pdlife.bench.field_cases import (
    check_agreement,
    field_calls,
    field_queue,
    field_stepper,
    gated_stepper,
    staged_view,
)

N = 31  # not a multiple of 3: every third of the queue is exercised unevenly
LAYOUT = MetadataLayout(hidden_size=16, hidden_dtype=torch.float32, max_top_logprobs=16)


def _pairs(group):
    fc = field_calls()
    assert fc.why == "" and fc.poll is not None and fc.staged is not None
    coll = TorchCollective(group)
    ungated, gated, reqs, meta = field_queue(N)
    ours_field, ours_gated = field_stepper(0, N), gated_stepper(0, gated, reqs, meta)
    stepper, backend, core_meta, rooms = gated_queue(0, N, LAYOUT)
    s_pollers, s_reqs, s_left, s_meta = staged_view(backend, core_meta, rooms)
    pairs = [
        ("ours_field", lambda: ours_field.step(coll), "field", lambda: fc.poll(ungated, group)),
        (
            "ours_gated",
            lambda: ours_gated.step(coll),
            "field_gated",
            lambda: fc.poll(gated, group, decode_reqs=reqs, metadata_buffers=meta),
        ),
        (
            "ours",
            lambda: stepper.step(coll),
            "field_staged",
            lambda: fc.staged(s_reqs, s_left, group, metadata_buffers=s_meta, pollers=s_pollers),
        ),
    ]
    bare = {
        "field_gated": lambda: fc.poll(gated, group),
        "field_staged": lambda: fc.poll(s_pollers, group),
    }
    return pairs, bare, (gated, reqs, meta, backend)


def test_each_pair_agrees_and_its_gate_holds_requests(world_of_one):
    pairs, bare, (gated, reqs, meta, backend) = _pairs(world_of_one)
    for _ in range(3):  # as in the bench: repeated calls, nothing moves
        check_agreement(pairs, bare)
    # what the gated pairs agree on: everything held at Transferring, though
    # two thirds poll Success; the rows of the transferring third have landed
    assert pairs[1][3]() == [3] * N and bare["field_gated"]().count(4) == N - (N + 2) // 3
    assert (meta.bootstrap_room[0::3, 0] != 0).all() and (meta.bootstrap_room[1::3, 0] == 0).all()
    assert pairs[2][3]() == [3] * N and int((backend.scatter_left > 0).sum()) == N // 3


def test_a_pair_that_does_not_do_the_same_work_is_caught(world_of_one):
    pairs, bare, (gated, reqs, meta, _) = _pairs(world_of_one)
    coll = TorchCollective(world_of_one)
    # our step without its metadata gate passes what SGLang's gate holds
    ungated_ours = gated_stepper(0, gated, reqs, None)
    wrong = [("ours_gated", lambda: ungated_ours.step(coll), *pairs[1][2:])]
    with pytest.raises(RuntimeError, match="ours_gated and field_gated disagree"):
        check_agreement(wrong, bare)
    # a gated call whose rows have all landed holds nothing: no comparison
    landed = torch.tensor(range(9001, 9001 + N), dtype=meta.bootstrap_room.dtype)
    meta.bootstrap_room[:, 0] = landed
    with pytest.raises(RuntimeError, match="field_gated's gate held no request"):
        check_agreement([pairs[1]], bare)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_bench_run_reports_gated_and_ungated_side_by_side():
    from pdlife.bench.report import format_table
    from pdlife.bench.step import run_bench

    res = run_bench((64,), reps=3, t_reps=2)
    assert "field_skipped" not in res
    row = res["sizes"]["64"]
    assert {"field", "field_gated", "field_staged", "ours_gated", "ours_field"} < set(row)
    like = ("field_gated/ours_gated", "field/ours_field", "field_staged/ours")
    assert all(row["ratios"][k] > 0 for k in (*like, "field_staged/hooks_floor"))
    assert "field like for like" in format_table(res)
