"""Prefill and decode engines in processes of their own (vLLM's real Scheduler
each, PdLifecycleConnector's workers over Mooncake and NIXL on loopback):

- TP 1 -> 1: every byte arrives, and prefill frees the request's blocks once
  sent;
- TP 2 -> 1: a prefill engine of a scheduler process and two worker
  processes in vLLM's own TP group (gloo), each holding half the KV heads;
  decode (TP 1, every head) holds every byte of each rank's heads in the
  heads that rank holds, and prefill frees the blocks once both workers
  reported the send;
- a prefill killed while its blocks wait for decode (the process, or one of
  its two TP workers) ends decode's load for a dead peer, as
  ``kv_load_failure_policy`` says, never a hang.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from fleet import Fleet
from pd_engines import PATIENT, QUICK, decode_process, prefill_process
from pd_tp import engine_config, prefill_engine, prefill_worker, whole_heads
from vllm_engine import write_tiny_model

from lifecycle.testing.spawn import store_server

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def start_prefill(fleet, out, model, port, backend, tp, hold, init_file, liveness):
    """Prefill's processes, answering on ``out``; (its params, the bytes it
    wrote for the request, the process a kill takes down: the engine at TP 1,
    the last worker at TP 2)."""
    if tp == 1:
        victim = fleet.start(prefill_process, model, port, backend, out, fleet.stop, hold, liveness)
        return (*fleet.take(out, "prefill's params"), victim)
    cfg = engine_config(model, "kv_producer", port, backend, liveness, tp=tp)
    inboxes, outboxes = [fleet.queue() for _ in range(tp)], [fleet.queue() for _ in range(tp)]
    filled = fleet.queue()
    workers = [
        fleet.start(prefill_worker, cfg, r, init_file, inboxes[r], outboxes[r], filled)
        for r in range(tp)
    ]
    fleet.start(prefill_engine, cfg, inboxes, outboxes, out, fleet.stop, hold)
    params = fleet.take(out, "prefill's params")
    parts = dict(fleet.take(filled, "a prefill worker's forward") for _ in range(tp))
    return params, whole_heads(parts), workers[-1]


@attrs.frozen
class Run:
    status: str  # decode's request's status once it runs or ends
    computed: int  # its num_computed_tokens
    held: dict  # layer -> the bytes of its blocks at decode
    want: dict  # layer -> the bytes prefill wrote in the request's blocks (every head)
    #: prefill, once its request's blocks are freed: [free blocks, free blocks before
    #: the request]; None when prefill was killed
    freed: list | None
    #: the failures decode's worker connector agreed: (reason, recovery decision)
    failures: list


def run_pair(model, tmp_path, backend="mooncake", tp=1, kill_prefill=False, policy="fail"):
    store = store_server()
    liveness = QUICK if kill_prefill else PATIENT
    with Fleet() as fleet:
        to_decode, from_decode, from_prefill = fleet.queue(), fleet.queue(), fleet.queue()
        fleet.start(
            decode_process, model, store.port, backend, to_decode, from_decode, policy, liveness
        )
        params, want, victim = start_prefill(
            fleet,
            from_prefill,
            model,
            store.port,
            backend,
            tp,
            kill_prefill,
            str(tmp_path / "tp-init"),
            liveness,
        )
        assert params["tp_size"] == tp
        if kill_prefill:
            fleet.kill(victim)  # its blocks are held for decode: the transfer had begun
        to_decode.put(params)
        status, computed, held, failures = fleet.take(from_decode, "decode's verdict")
        freed = None
        if not kill_prefill and status == "RUNNING":
            what, *freed = fleet.take(from_prefill, "prefill freeing the request's blocks")
            assert what == "freed"
    return Run(status, computed, held, want, freed, failures)


def assert_every_byte(held, want):
    assert set(held) == set(want) and want
    for name in want:
        assert held[name].shape == want[name].shape, name
        assert np.array_equal(held[name], want[name]), name


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_every_byte_arrives_between_two_processes(model, tmp_path, backend):
    run = run_pair(model, tmp_path, backend)
    assert run.status == "RUNNING" and run.computed >= 31  # loaded, not recomputed
    assert run.failures == []
    assert_every_byte(run.held, run.want)
    assert run.freed[0] == run.freed[1]  # prefill freed the request's blocks once sent


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_tp2_prefill_to_tp1_decode_moves_every_head(model, tmp_path, backend):
    """Decode's heads are prefill rank 0's heads then rank 1's, byte for byte;
    prefill frees the request's blocks once both workers reported the send
    (vLLM's aggregator counting two)."""
    run = run_pair(model, tmp_path, backend, tp=2)
    assert run.status == "RUNNING" and run.computed >= 31 and run.failures == []
    assert_every_byte(run.held, run.want)
    assert run.freed[0] == run.freed[1]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(
    ("policy", "ends", "decided"),
    [("fail", "FINISHED_ERROR", "FAIL"), ("recompute", "RUNNING", "RECOMPUTE")],
)
def test_a_killed_prefill_ends_decodes_load_as_the_policy_says(
    model, tmp_path, tp, policy, ends, decided
):
    """Prefill killed (TP 1: its process; TP 2: one of its two workers, the
    other alive) while its blocks wait for decode: decode's load fails for a
    dead peer, never waiting for the dead rank, and ends as the policy says."""
    run = run_pair(model, tmp_path, tp=tp, kill_prefill=True, policy=policy)
    assert run.status == ends
    assert run.failures == [("PEER_DEAD", decided)]
    if ends == "RUNNING":  # recomputed here: nothing of prefill's bytes
        for name in run.want:
            assert not np.array_equal(run.held[name], run.want[name]), name
