"""The step on real gloo ranks (spawned processes on 127.0.0.1)."""

import numpy as np
import pytest

from lifecycle.testing.spawn import RankError, run_ranks
from support.status import F, S, T, W

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _random_run(rank, world, seed, steps):
    from lifecycle import FailureReason, RequestTable, StepConfig, Stepper, TorchCollective
    from lifecycle.drive.collective import CountingCollective
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
        cap, before = stepper.capacity, coll.reduces
        res = stepper.step(coll)
        _, local, _ = stepper.last_local
        out.append(
            (
                res.rooms.tolist(),
                res.statuses.tolist(),
                res.reasons.tolist(),
                res.origins.tolist(),
                local.tolist(),
                res.active.tolist(),
                int(res.failed.size > 0),
                coll.reduces - before,
                cap,
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
        rooms, statuses, reasons, origins, _, active, _, _, _ = views[0]
        for v in views[1:]:
            assert v[:4] == (rooms, statuses, reasons, origins), f"ranks disagree at step {step}"
        locals_ = np.array([v[4] for v in views]).reshape(world, -1)
        if locals_.size:
            agreed = [statuses[i] for i in active]
            assert agreed == np.minimum.reduce(locals_, axis=0).tolist()
    # one all-reduce per step, plus one small origin fetch on a step where
    # several ranks failed rows and one of them failed more than its failure
    # slots hold (a single failing rank is named by the header; lists that
    # fit name their ranks in the slots)
    from lifecycle.core.packing import slots_per_region

    failure_steps = sum(v[6] for v in per_rank[0])
    assert 0 < failure_steps < 25
    fetches = slot_steps = 0
    for step in range(25):
        counts = [pr[step][4].count(F) for pr in per_rank]
        cap = per_rank[0][step][8]
        fetch = sum(c > 0 for c in counts) > 1 and max(counts) > slots_per_region(cap)
        assert [pr[step][7] for pr in per_rank] == [1 + fetch] * world, f"step {step}"
        fetches += fetch
        slot_steps += sum(c > 0 for c in counts) > 1 and not fetch
    assert slot_steps > 0  # the seed gives steps whose origins come from the slots
    assert [r[1] for r in results] == [25 + fetches] * world


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
        out[name] = (res.statuses.tolist(), res.origins.tolist(), list(board.status.values()))
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
    from lifecycle import RequestTable, Stepper, TorchCollective
    from lifecycle.drive.collective import CountingCollective
    from lifecycle.testing import StatusBoard

    table = RequestTable()
    coll = CountingCollective(TorchCollective())
    stepper = Stepper(table, rank, poller=StatusBoard())  # all pending: no origin fetch
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
    from field.step.consensus import (
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


# -- hooks, guards and diagnosis on real ranks -----------------------------------------


def _hook_raises_on_one_rank(rank, world):
    from lifecycle import FailureReason, RequestTable, Stepper, TorchCollective
    from lifecycle.errors import HookError
    from lifecycle.testing import StatusBoard

    class Gate:
        name = "flaky"

        def closed(self, rooms, idx):
            if rank == world - 1:
                raise RuntimeError("gate broke on one rank")
            return np.zeros(rooms.size, dtype=bool)

    class Faults:
        def inject(self, ctx):
            if rank == 0 and ctx.step == 3:
                raise ValueError("plan broke")
            return np.zeros(ctx.rooms.size, dtype=bool)

    table, board = RequestTable(), StatusBoard()
    table.extend([1, 2, 3, 4])
    board.set([1, 2, 3, 4], T)
    board.set([2], S)
    stepper = Stepper(table, rank, poller=board, gates=[Gate()], faults=Faults())
    coll = TorchCollective()
    out = []
    for it in range(1, 5):
        res = stepper.step(coll, tag=it)
        out.append(
            (
                res.statuses.tolist(),
                [(f.room, int(f.reason), f.origin) for f in res.failures()],
                sorted(res.exceptions),
                all(isinstance(e, HookError) for e in res.exceptions.values()),
            )
        )
        table.remove_many(res.rooms[(res.statuses == F) | (res.statuses == S)])
        if it == 1:
            table.add(5)
            board.set([5], T)
    return out, int(FailureReason.HOOK_ERROR)


def test_a_hook_raising_on_one_rank_fails_its_rows_everywhere_and_the_group_keeps_stepping():
    results = run_ranks(_hook_raises_on_one_rank, 3, timeout=90)
    hook = results[0][1]
    views = [r[0] for r in results]
    for step in range(4):
        assert len({repr(v[step][:2]) for v in views}) == 1, f"ranks disagree at step {step}"
    # step 1: the gate on rank 2 raised for room 2 (the only one at Success)
    assert views[0][0][1] == [(2, hook, 2)]
    assert views[2][0][2:] == ([2], True) and views[0][0][2] == []
    # step 3: rank 0's fault hook raised: every live row fails, origin rank 0
    assert sorted(f[0] for f in views[0][2][1]) == [1, 3, 4, 5]
    assert {(f[1], f[2]) for f in views[0][2][1]} == {(hook, 0)}
    assert views[0][3][0] == []  # nothing left, still stepping


def _capacity_and_config(rank, world, what):
    from lifecycle import CollectiveMismatch, RequestTable, StepConfig, Stepper, TorchCollective
    from lifecycle.testing import StatusBoard

    table, board = RequestTable(), StatusBoard()
    table.extend(range(1, 201))
    if what == "capacity":
        cfg = StepConfig(initial_capacity=[1, 4096, 300][rank])
    else:  # stuck_after on one rank only: it alone would wait in the diagnosis gather
        cfg = StepConfig(stuck_after=1) if rank == 1 else StepConfig()
    stepper = Stepper(table, rank, poller=board, config=cfg)
    out = []
    for _ in range(3):
        try:
            res = stepper.step(TorchCollective())
            out.append(("ok", res.statuses.size, stepper.capacity))
        except CollectiveMismatch as e:
            out.append(("mismatch", e.differs))
    return out


def test_different_initial_capacity_is_agreed_on_gloo():
    results = run_ranks(_capacity_and_config, 3, "capacity", timeout=90)
    assert results[0] == results[1] == results[2]
    assert all(r[0] == "ok" and r[1] == 200 and r[2] >= 4096 for r in results[0])


def test_stuck_after_on_one_rank_raises_everywhere_instead_of_hanging():
    results = run_ranks(_capacity_and_config, 2, "stuck", timeout=90)
    for r in results:
        assert r == [("mismatch", ("step configuration",))] * 3


def _iteration_skew(rank, world):
    from lifecycle import CollectiveMismatch, RequestTable, Stepper, TorchCollective
    from lifecycle.testing import StatusBoard

    table = RequestTable()
    table.extend([1, 2])
    stepper = Stepper(table, rank, poller=StatusBoard(), queue="bootstrap")
    coll = TorchCollective()
    it, out = 0, []
    for _ in range(3):
        it += 1
        if rank == 1 and it == 2:
            it -= 1  # its loop retried an iteration after a caught error
        try:
            stepper.step(coll, tag=it)
            out.append("ok")
        except CollectiveMismatch as e:
            out.append(e.differs)
    return out


def test_a_rank_one_iteration_behind_raises_on_every_rank():
    results = run_ranks(_iteration_skew, 2, timeout=60)
    for r in results:
        assert r[0] == "ok"
        assert r[1] == ("tag",)


def _diagnosed(rank, world):
    from lifecycle import RequestTable, Stepper, TorchCollective
    from lifecycle.testing import StatusBoard

    table, board = RequestTable(), StatusBoard()
    table.extend([10, 20, 30])
    board.set([10, 20, 30], S)
    if rank == 1:
        board.set([20], W)  # rank 1 holds room 20 back
    if rank == 2:
        board.set([30], T)
    stepper = Stepper(table, rank, poller=board)
    coll = TorchCollective()
    stepper.step(coll)
    return [(r.room, int(r.status), r.holders, [(k, int(s)) for k, s in r.local]) for r in
            stepper.diagnose(coll)]  # fmt: skip


def test_diagnose_names_the_ranks_holding_each_request_back():
    results = run_ranks(_diagnosed, 3, timeout=60)
    assert results[0] == results[1] == results[2]
    assert results[0] == [
        (20, W, (1,), [(0, S), (1, W), (2, S)]),
        (30, T, (2,), [(0, S), (1, S), (2, T)]),
    ]


def _dies_among_three(rank, world):
    import os

    from lifecycle import RankFailure, RequestTable, Stepper, TorchCollective
    from lifecycle.testing import StatusBoard

    table = RequestTable()
    table.add(1)
    stepper = Stepper(table, rank, poller=StatusBoard())
    coll = TorchCollective()
    stepper.step(coll)
    if rank == 2:
        os._exit(3)
    try:
        stepper.step(coll)
    except RankFailure as e:
        got = e.dead, str(e)
    else:
        got = "no error"
    # a survivor that returned would exit, and the other, still looking for
    # the dead, would find it gone too: each stays until both have looked
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    store.set(f"looked/{rank}", "1")
    store.wait(["looked/0", "looked/1"])
    return got


def test_a_rank_killed_among_three_is_named():
    results = run_ranks(_dies_among_three, 3, timeout=90, allow_errors=True)
    assert isinstance(results[2], RankError)
    for dead, msg in results[:2]:
        assert dead == (2,), msg
        assert "[2]" in msg


def _compat_faults(rank, world):
    import os

    os.environ["SGLANG_TEST_DISAGG_FAILURE_PROB"] = "0.5"
    os.environ["PDLIFE_FAULT_SEED"] = "3"
    from field.step.consensus import poll_and_all_reduce
    from lifecycle.testing import ScriptedPoller

    out = []
    for _ in range(6):
        pollers = [ScriptedPoller(3) for _ in range(16)]
        out.append(tuple(v == 0 for v in poll_and_all_reduce(pollers, None)))
    return out


def test_compat_fault_injection_draws_anew_on_every_call():
    (calls,) = run_ranks(_compat_faults, 1, timeout=60)
    assert len(set(calls)) > 1, "the same queue positions failed on every call"
    assert all(any(c) for c in calls)


def _group_of_one(rank, world):
    import numpy as np

    from lifecycle import RequestTable, Stepper, TorchCollective
    from lifecycle.testing import StatusBoard

    table, board = RequestTable(), StatusBoard()
    table.extend([1, 2])
    board.set([1], S)
    board.set([2], F)
    coll = TorchCollective()
    # a group of one makes no round trip: the process group is never asked
    coll._pg = coll._dist = None
    res = Stepper(table, rank, poller=board).step(coll)
    gathered = coll.all_gather(np.array([7, 8], dtype=np.int32))
    return res.statuses.tolist(), res.origins.tolist(), gathered.tolist()


def test_a_group_of_one_reduces_without_a_round_trip():
    ((statuses, origins, gathered),) = run_ranks(_group_of_one, 1, timeout=60)
    assert statuses == [S, F]
    assert origins == [-1, 0]
    assert gathered == [[7, 8]]
