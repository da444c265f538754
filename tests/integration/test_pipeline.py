"""Pipeline parallelism on 4 gloo ranks (2 stages x TP 2): the first stage
agrees, every stage applies the same statuses, reasons and origins; a later
stage whose list differs is caught there; the drop-in's prefill PP helper
gives every stage PP rank 0's list."""

import pytest

from lifecycle.testing.spawn import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

ROOMS = [11, 12, 13, 14, 15, 16]
# stage 0's polls per TP rank (the MIN is agreed); stage 1's are never reduced
POLLS = {0: [4, 3, 0, 2, 4, 1], 1: [4, 4, 4, 1, 2, 1]}


def _groups(rank):
    import torch.distributed as dist

    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return tp[rank // 2], pp[rank % 2], rank // 2, rank % 2


def _steps(rank, world, extra_room):
    from lifecycle import KVPoll, RequestTable, Stepper, TorchCollective
    from lifecycle.drive.pipeline import PipelineForward
    from lifecycle.testing import StatusBoard

    tp, pp, stage, tp_rank = _groups(rank)
    rooms = ROOMS + ([99] if extra_room and rank == 2 else [])
    table = RequestTable(rank=rank)
    table.extend(rooms)
    board = StatusBoard()
    values = POLLS[tp_rank] if stage == 0 else [4] * len(ROOMS)
    for room, v in zip(ROOMS, values):
        board.set([room], KVPoll(v))
    first = TorchCollective(tp) if stage == 0 else None
    coll = PipelineForward(first, pp, stage, 2, rank=tp_rank, world_size=2)
    stepper = Stepper(table, rank=tp_rank, poller=board)
    try:
        result = stepper.step(coll)
    except Exception as e:
        coll.close()
        return ("error", type(e).__name__)
    coll.close()
    return (
        result.statuses.tolist(),
        [(f.room, int(f.reason), f.origin) for f in result.failures()],
    )


def test_every_stage_applies_the_first_stages_agreement():
    out = run_ranks(_steps, 4, False, timeout=120)
    want = [min(a, b) for a, b in zip(POLLS[0], POLLS[1])]
    assert all(o[0] == want for o in out), out
    assert out[0][1] == out[1][1] == out[2][1] == out[3][1]
    assert [f[0] for f in out[0][1]] == [13]  # failed on stage 0, TP rank 0
    assert out[3][1][0][2] == 0  # the origin is stage 0's rank, on every stage


def test_a_later_stage_whose_list_differs_is_caught_there():
    out = run_ranks(_steps, 4, True, timeout=120, allow_errors=True)
    assert out[2] == ("error", "CollectiveMismatch")
    assert out[0][0] == out[1][0] == out[3][0]  # the others agree as before


def _prefill_pp(rank, world):
    from field.step.pp import poll_and_all_reduce_prefill_pp

    class Sender:
        def __init__(self, room, value):
            self.bootstrap_room, self.value = room, value

        def poll(self):
            return self.value

        def poll_pp_consensus(self):
            return self.value

    tp, pp, stage, tp_rank = _groups(rank)
    values = POLLS[tp_rank] if stage == 0 else [0] * len(ROOMS)
    senders = [Sender(r, v) for r, v in zip(ROOMS, values)]
    works: list = []
    got = [poll_and_all_reduce_prefill_pp(senders, tp, tp, pp, stage, 2, works) for _ in range(3)]
    for w in works:
        getattr(w, "work", w).wait()
    return got


def test_the_prefill_pp_helper_gives_every_stage_pp_rank_0s_list():
    out = run_ranks(_prefill_pp, 4, timeout=120)
    want = [min(a, b) for a, b in zip(POLLS[0], POLLS[1])]
    assert all(calls == [want] * 3 for calls in out), out
