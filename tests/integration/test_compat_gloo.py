"""The field's consensus helpers on 2 real gloo ranks: a decode queue whose
metadata rows land (set_buf) at different steps on each rank, and a staging
handler that needs several scatter calls, different on each rank. Every rank
must get the same answer at every step, and Success only once every rank is ready."""

import pytest

from lifecycle.testing.spawn import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

STEPS = 7
N = 6  # request 4 fails on rank 1; request 5 is a warm-up on the fake path


def backend_success_at(i, rank):
    return 1 + (i + rank) % 3


def row_lands_at(i, rank):
    return 1 + (2 * i + 3 * rank) % 4


def scatter_calls_needed(i, rank):
    return 1 + (i + 2 * rank) % 4


def _decode_queue(rank, world):
    import types

    import torch
    import torch.distributed as dist

    from field.data.metadata import MetadataBuffers
    from field.step.consensus import poll_and_all_reduce
    from lifecycle.testing import ScriptedPoller

    group = dist.new_group([0, 1], backend="gloo")
    server_args = types.SimpleNamespace(disaggregation_transfer_backend="mooncake")
    meta = MetadataBuffers(8, 16, torch.float32)
    reqs = []
    for i in range(N):
        host = "2.2.2.2" if i == 5 else "10.0.0.7"
        req = types.SimpleNamespace(
            bootstrap_room=1000 + i,
            bootstrap_host=host,
            metadata_buffer_index=7 - i,
            output_ids=[50 + i],
            return_logprob=False,
            hidden_states_tensor=None,
        )
        reqs.append(types.SimpleNamespace(req=req, metadata_buffer_index=7 - i))
    pollers = [ScriptedPoller(3) for _ in range(N)]
    history, violations = [], []
    for step in range(STEPS):
        for i, dr in enumerate(reqs):
            if i != 5 and step == row_lands_at(i, rank):
                meta.set_buf(dr.req)  # this rank's copy of the row has landed
            pollers[i].value = 4 if step >= backend_success_at(i, rank) else 3
        if rank == 1 and step >= 2:
            pollers[4].value = 0
        agreed = poll_and_all_reduce(pollers, group, reqs, meta, server_args)
        for i, v in enumerate(agreed):
            if v == 4 and i != 5 and int(meta.get_buf(7 - i)[-1][0]) != 1000 + i:
                violations.append((step, i))  # Success before this rank's row landed
        history.append(agreed)
    return {"history": history, "violations": violations}


def _staging(rank, world):
    import types

    import torch.distributed as dist

    from field.step.consensus import poll_and_all_reduce_with_staging
    from lifecycle.testing import ScriptedPoller

    group = dist.new_group([0, 1], backend="gloo")

    class Handler:
        def __init__(self):
            self.calls = {}

        def is_done(self, dr):
            return self.calls.get(dr.i, 0) >= scatter_calls_needed(dr.i, rank)

        def advance_scatter(self, dr):
            self.calls[dr.i] = self.calls.get(dr.i, 0) + 1

    reqs = []
    for i in range(4):
        receiver = ScriptedPoller(4)
        receiver.require_staging = i != 3
        req = types.SimpleNamespace(bootstrap_room=2000 + i, bootstrap_host="10.0.0.7")
        reqs.append(
            types.SimpleNamespace(i=i, req=req, kv_receiver=receiver, metadata_buffer_index=i)
        )
    handler = Handler()
    history = [poll_and_all_reduce_with_staging(reqs, handler, group) for _ in range(STEPS)]
    return {"history": history, "calls": handler.calls}


def test_decode_queue_agrees_at_every_step():
    results = run_ranks(_decode_queue, 2, timeout=100)
    assert results[0]["history"] == results[1]["history"]
    for r in results:
        assert r["violations"] == []
    history = results[0]["history"]
    for i in range(N):
        if i == 4:
            continue
        ready = max(
            max(backend_success_at(i, r), row_lands_at(i, r) if i != 5 else 0) for r in (0, 1)
        )
        assert [h[i] for h in history] == [3] * ready + [4] * (STEPS - ready), i
    assert [h[4] for h in history][2:] == [0] * (STEPS - 2)


def test_staging_queue_agrees_at_every_step():
    results = run_ranks(_staging, 2, timeout=100)
    assert results[0]["history"] == results[1]["history"]
    history = results[0]["history"]
    for i in range(3):
        need = max(scatter_calls_needed(i, r) for r in (0, 1))
        assert [h[i] for h in history] == [3] * (need - 1) + [4] * (STEPS - need + 1), i
    assert [h[3] for h in history] == [4] * STEPS  # no staging required: never held
    for rank, r in enumerate(results):
        assert r["calls"] == {i: scatter_calls_needed(i, rank) for i in range(3)}
    assert max(scatter_calls_needed(i, r) for i in range(3) for r in (0, 1)) >= 3
