"""The step on real gloo ranks (spawned processes on 127.0.0.1)."""

import numpy as np
import pytest

from lifecycle.testing.spawn import RankError, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

B, W, T, S, F = 1, 2, 3, 4, 0


def _random_run(rank, world, seed, steps):
    from lifecycle import (
        CountingCollective,
        FailureReason,
        RequestTable,
        StepConfig,
        Stepper,
        TorchCollective,
    )
    from lifecycle.testing import StatusBoard

    rng = np.random.default_rng([seed, rank])
    table = RequestTable()
    board = StatusBoard()
    coll = CountingCollective(TorchCollective())
    stepper = Stepper(table, rank, poller=board, config=StepConfig(initial_capacity=256))
    next_room = 1
    out = []
    for _ in range(steps):
        # identical admissions on every rank (shared seed), local statuses differ
        shared = np.random.default_rng([seed, 10_000 + len(out)])
        k = int(shared.integers(0, 8))
        table.extend(range(next_room, next_room + k))
        next_room += k
        rooms = table.rooms()
        cur = table.states()
        # local raw status: anywhere at or above the agreed one, sometimes Failed
        raw = np.maximum(cur, rng.integers(0, 5, rooms.size)).astype(int)
        raw[rng.random(rooms.size) < 0.03] = F
        board.status = dict(zip(rooms.tolist(), raw.tolist()))
        board.reasons = {r: FailureReason(int(rng.integers(0, 9))) for r in rooms.tolist()}
        res = stepper.step(coll)
        _, local, _ = stepper.last_local
        out.append(
            (
                res.rooms.tolist(),
                res.statuses.tolist(),
                res.reasons.tolist(),
                res.holders.tolist(),
                local.tolist(),
            )
        )
        done = res.rooms[(res.statuses == S) | (res.statuses == F)]
        table.remove_many(done)
    return out, coll.reduces


@pytest.mark.parametrize("world", [2, 4])
def test_agreement_every_step_and_agreed_is_min(world):
    results = run_ranks(_random_run, world, 7, 25, timeout=90)
    per_rank = [r[0] for r in results]
    for step in range(25):
        views = [pr[step] for pr in per_rank]
        rooms, statuses, reasons, holders, _ = views[0]
        for v in views[1:]:
            assert v[:4] == (rooms, statuses, reasons, holders), f"ranks disagree at step {step}"
        locals_ = np.array([v[4] for v in views]).reshape(world, -1)
        if locals_.size:
            assert statuses == np.minimum.reduce(locals_, axis=0).tolist()
    # exactly one all-reduce per step (capacity pre-sized)
    assert [r[1] for r in results] == [25] * world


def _one_failure(rank, world):
    from lifecycle import FailureReason, RequestTable, Stepper, TorchCollective
    from lifecycle.testing import StatusBoard

    table, board = RequestTable(), StatusBoard()
    table.extend([11, 12, 13])
    board.set([11, 12, 13], T)
    if rank == world - 1:
        board.set([12], F)
        board.reasons[12] = FailureReason.TRANSFER_ERROR
    res = Stepper(table, rank, poller=board).step(TorchCollective())
    return [(f.room, int(f.reason), f.origin) for f in res.failures()], res.statuses.tolist()


@pytest.mark.parametrize("world", [2, 4])
def test_failed_on_one_rank_is_failed_everywhere_with_reason_and_origin(world):
    from lifecycle import FailureReason

    for failures, statuses in run_ranks(_one_failure, world):
        assert failures == [(12, FailureReason.TRANSFER_ERROR, world - 1)]
        assert statuses == [T, F, T]


def _metadata_gated(rank, world):
    from buffers import MetadataBuffers
    from lifecycle import RequestTable, Stepper, TorchCollective
    from lifecycle.testing import StatusBoard

    meta = MetadataBuffers(4)
    table, board = RequestTable(), StatusBoard()
    table.add(77, metadata_slot=2)
    board.set([77], S)
    stepper = Stepper(table, rank, poller=board, metadata=meta if rank == 0 else None)
    coll = TorchCollective()
    first = stepper.step(coll).statuses.tolist()
    if rank == 0:
        meta.write(2, 77, {"output_ids": [1]})
    second = stepper.step(coll).statuses.tolist()
    return first, second


def test_metadata_gate_on_one_rank_holds_every_rank():
    for first, second in run_ranks(_metadata_gated, 2):
        assert first == [T]
        assert second == [S]


def _diverged(rank, world, how):
    from lifecycle import CollectiveMismatch, RequestTable, Stepper, TorchCollective

    table = RequestTable()
    rooms = list(range(1, 101))
    if rank == 1 and how == "reorder":
        rooms[3], rooms[4] = rooms[4], rooms[3]
    if rank == 1 and how == "shorter":
        rooms = rooms[:-1]
    if rank == 1 and how == "much_shorter":
        rooms = rooms[:5]
    table.extend(rooms)
    try:
        Stepper(table, rank).step(TorchCollective())
    except CollectiveMismatch as e:
        return ("mismatch", e.local_len, e.lens)
    return ("ok",)


@pytest.mark.parametrize("how", ["reorder", "shorter", "much_shorter"])
def test_diverged_lists_raise_on_every_rank_without_hanging(how):
    results = run_ranks(_diverged, 2, how, timeout=60)
    assert [r[0] for r in results] == ["mismatch", "mismatch"]
    assert results[0][2] == results[1][2]


def _tp_cp(rank, world, seed):
    import torch.distributed as dist

    from lifecycle import Hierarchical, RequestTable, Stepper, TorchCollective
    from lifecycle.testing import StatusBoard

    # 4 ranks: TP groups {0,1} {2,3}; CP groups {0,2} {1,3}
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    cp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    rng = np.random.default_rng([seed, rank])
    out = {}
    for name in ("hier", "flat"):
        table, board = RequestTable(), StatusBoard()
        rooms = list(range(1, 201))
        table.extend(rooms)
        board.status = dict(zip(rooms, rng.integers(0, 5, 200).tolist()))
        coll = (
            Hierarchical([TorchCollective(tp), TorchCollective(cp)])
            if name == "hier"
            else TorchCollective()
        )
        res = Stepper(table, rank, poller=board).step(coll)
        out[name] = (res.statuses.tolist(), res.holders.tolist(), list(board.status.values()))
    return out


def test_tp_then_cp_equals_flat_min():
    results = run_ranks(_tp_cp, 4, 3, timeout=90)
    # both runs drew different local values; each must equal the MIN over all 4 ranks
    for name in ("hier", "flat"):
        locals_ = np.array([r[name][2] for r in results])
        expect = np.minimum.reduce(locals_, axis=0).tolist()
        for r in results:
            assert r[name][0] == expect
            assert r[name][1] == results[0][name][1]


def _counted(rank, world):
    from lifecycle import CountingCollective, RequestTable, Stepper, TorchCollective

    table = RequestTable()
    coll = CountingCollective(TorchCollective())
    stepper = Stepper(table, rank)
    counts = []
    for k in (10, 200, 0, 5):  # 200 outgrows the initial capacity once
        table.extend(range(len(table) * 1000 + 1, len(table) * 1000 + 1 + k))
        before = coll.reduces
        stepper.step(coll)
        counts.append(coll.reduces - before)
    return counts


def test_one_all_reduce_per_step_except_collective_growth():
    for counts in run_ranks(_counted, 2):
        assert counts == [1, 2, 1, 1]


def _dies(rank, world):
    import os

    from lifecycle import RankFailure, RequestTable, Stepper, TorchCollective

    table = RequestTable()
    table.add(1)
    stepper = Stepper(table, rank)
    stepper.step(TorchCollective())
    if rank == 1:
        os._exit(3)
    try:
        stepper.step(TorchCollective())
    except RankFailure as e:
        return "rank failure: " + str(e)
    return "no error"


def test_dead_peer_becomes_a_typed_error_not_a_hang():
    results = run_ranks(_dies, 2, timeout=60, allow_errors=True)
    assert isinstance(results[1], RankError)
    assert results[0].startswith("rank failure")


def _compat(rank, world):
    import types

    import torch.distributed as dist

    from buffers import MetadataBuffers
    from lifecycle.compat import (
        last_failures,
        poll_and_all_reduce,
        poll_and_all_reduce_attn_cp_tp_group,
    )
    from lifecycle.testing import ScriptedPoller

    out = {}
    pollers = [ScriptedPoller(v) for v in (4, 3, 2, 4)]
    for i, p in enumerate(pollers):
        p.bootstrap_room = 100 + i
    if rank == 1:
        pollers[3].value = 0
        pollers[1].error = RuntimeError("backend hiccup")
    out["flat"] = poll_and_all_reduce(pollers, None)
    out["failures"] = [(f.room, int(f.reason), f.origin) for f in last_failures()]
    # metadata gate through decode_reqs: rank 0's row for room 100 has not landed
    meta = MetadataBuffers(4)
    if rank == 1:
        meta.write(0, 100, {"output_ids": [1]})
    reqs = [
        types.SimpleNamespace(
            req=types.SimpleNamespace(bootstrap_room=100, bootstrap_host="10.0.0.1"),
            metadata_buffer_index=0,
        ),
    ]
    args = types.SimpleNamespace(disaggregation_transfer_backend="mooncake")
    out["gated"] = poll_and_all_reduce([ScriptedPoller(4)], None, reqs, meta, args)
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2] if world == 4 else None
    cp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2] if world == 4 else None
    if world == 4:
        vals = [4, 4, 4]
        vals[rank % 3] = rank  # a different low value on each rank
        out["cp_tp"] = poll_and_all_reduce_attn_cp_tp_group(
            [ScriptedPoller(v) for v in vals], cp, tp
        )
    return out


def test_compat_functions_keep_the_field_shape():
    from lifecycle import FailureReason

    results = run_ranks(_compat, 4, timeout=90)
    for r in results:
        assert r["flat"] == [4, 0, 2, 0]
        assert sorted(r["failures"]) == [
            (101, FailureReason.LOCAL_EXCEPTION, 1),
            (103, FailureReason.UNKNOWN, 1),
        ]
        assert r["gated"] == [3]  # held at Transferring by rank 0, 2 and 3's empty rows
        assert r["cp_tp"] == [0, 1, 2]  # MIN over all four ranks
