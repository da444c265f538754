"""vllm_connector.agreement on real gloo ranks: every TP worker reports the same
requests ended in the same step, each failure with the agreed reason and the
rank it came from; each once; a worker whose request list differs raises on
every worker instead of hanging."""

import pytest

from lifecycle.testing.spawn import RankError, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _worker(rank, world, diverge, agree=True):
    from lifecycle import FailureReason, KVPoll, Role, SingleRank, TorchCollective
    from lifecycle.errors import CollectiveMismatch
    from lifecycle.testing import StatusBoard
    from vllm_connector.agreement import WorkerAgreement

    board = StatusBoard(default=KVPoll.Transferring)
    w = WorkerAgreement(rank, board, TorchCollective() if agree else SingleRank())
    for i, rid in enumerate(["a", "b", "c", "d"]):
        w.add(rid, 100 + i, handle_index=i, role=Role.RECEIVER)
    out = [w.step()]  # every transfer still in flight: nothing ended
    board.status[100] = KVPoll.Success  # a: done on every worker
    if rank == world - 1:  # b: this worker's transfer failed; the others finished it
        board.status[101] = KVPoll.Failed
        board.reasons[101] = FailureReason.TRANSFER_ERROR
    else:
        board.status[101] = KVPoll.Success
    if rank == 0:  # c: done here only, so not done
        board.status[102] = KVPoll.Success
    if rank == 0:  # d: rank 0's scheduler gave up on it
        w.abort("d")
    out.append(w.step())
    for room in (101, 102):
        board.status[room] = KVPoll.Success
    out.append(w.step())  # c ends now; a and b were reported already
    if diverge:
        if rank == 0:
            w.add("late", 200, handle_index=9, role=Role.RECEIVER)
        try:
            w.step()
        except CollectiveMismatch as e:
            out.append(("mismatch", str(e)[:200]))
        else:
            out.append(("no error", None))
    view = []
    for e in out:
        if isinstance(e, tuple):
            view.append(e[0])
        else:
            view.append(
                (
                    sorted(e.succeeded),
                    {k: (f.reason.name, f.origin) for k, f in e.failed.items()},
                )
            )
    return view, len(w)


@pytest.mark.parametrize("world", [2, 3])
def test_every_worker_reports_the_same_ends_with_reason_and_origin(world):
    results = run_ranks(_worker, world, False, timeout=90)
    views = [v for v, _ in results]
    assert all(v == views[0] for v in views), views
    first, second, third = views[0]
    assert first == ([], {})
    # a everywhere; b failed on the last worker: failed on all, naming it; d aborted
    # on rank 0 only: aborted on all, naming rank 0; c held by the workers not done
    assert second == (
        ["a"],
        {"b": ("TRANSFER_ERROR", world - 1), "d": ("ABORTED", 0)},
    )
    assert third == (["c"], {})
    assert all(left == 0 for _, left in results)


def test_negative_control_workers_that_answer_alone_disagree():
    """Each worker answering from its own view (no reduce), as a count-based
    aggregation hears them: the views differ, and the test above would see it."""
    results = run_ranks(_worker, 2, False, False, timeout=90)
    views = [v for v, _ in results]
    assert views[0] != views[1]
    assert views[0][1][0] == ["a", "b", "c"]  # rank 0 alone: b and c done here


def test_a_worker_whose_list_differs_raises_on_every_worker():
    results = run_ranks(_worker, 2, True, timeout=90)
    assert [v[-1] for v, _ in results] == ["mismatch", "mismatch"]


def test_a_hang_is_not_the_answer():
    """Negative control of the harness: a worker that never steps makes the
    others' run fail within the timeout instead of blocking."""
    with pytest.raises(RankError):
        run_ranks(_stuck, 2, timeout=20)


def _stuck(rank, world):
    from lifecycle import KVPoll, Role, TorchCollective
    from lifecycle.testing import StatusBoard
    from vllm_connector.agreement import WorkerAgreement

    w = WorkerAgreement(rank, StatusBoard(default=KVPoll.Transferring), TorchCollective())
    w.add("a", 1, handle_index=0, role=Role.RECEIVER)
    if rank == 0:
        raise RuntimeError("this worker died before its step")
    w.step()
