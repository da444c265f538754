"""Prefill and decode engines in processes of their own (vLLM's real Scheduler
each, PdLifecycleConnector's workers over Mooncake and NIXL on loopback):

- TP 1 -> 1: every byte arrives;
- TP 2 -> 1: a prefill engine of a scheduler process and two worker
  processes in vLLM's own TP group (gloo), each holding half the KV heads;
  decode (TP 1, every head) holds every byte of each rank's heads in the
  heads that rank holds;
- a prefill killed while decode loads (the process, or one of its TP
  workers) ends decode's request with what ``kv_load_failure_policy`` says
  vLLM does next, never a hang.
"""

from __future__ import annotations

import numpy as np
import pytest
from pd_engines import decode_process, prefill_process
from pd_tp import Fleet, engine_config, prefill_engine, prefill_worker, take, whole_heads
from vllm_engine import write_tiny_model

from lifecycle.testing.spawn import store_server

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def start_prefill(fleet, model, port, backend, tp, hold, init_file):
    """Prefill's processes; (its params, the bytes it wrote for the request,
    the process a kill takes down: the engine at TP 1, the last worker at TP 2)."""
    out = fleet.queue()
    if tp == 1:
        victim = fleet.start(prefill_process, model, port, backend, out, fleet.stop, hold)
        return (*take(out, 1, "prefill's params")[0], victim)
    cfg = engine_config(model, "kv_producer", port, backend, tp=tp)
    inboxes, outboxes = [fleet.queue() for _ in range(tp)], [fleet.queue() for _ in range(tp)]
    filled = fleet.queue()
    workers = [
        fleet.start(prefill_worker, cfg, r, init_file, inboxes[r], outboxes[r], filled)
        for r in range(tp)
    ]
    fleet.start(prefill_engine, cfg, inboxes, outboxes, out, fleet.stop, hold)
    params = take(out, 1, "prefill's params")[0]
    parts = {rank: held for rank, _, held in take(filled, tp, "a prefill worker's forward")}
    return params, whole_heads(parts), workers[-1]


def run_pair(model, tmp_path, backend="mooncake", tp=1, kill_prefill=False, policy="fail"):
    store = store_server()
    with Fleet() as fleet:
        to_decode, from_decode = fleet.queue(), fleet.queue()
        fleet.start(decode_process, model, store.port, backend, to_decode, from_decode, policy)
        params, want, victim = start_prefill(
            fleet, model, store.port, backend, tp, kill_prefill, str(tmp_path / "tp-init")
        )
        assert params["tp_size"] == tp
        if kill_prefill:
            victim.kill()  # the request's blocks are held for decode: the transfer had begun
            victim.join(30)
        to_decode.put(params)
        status, computed, held = take(from_decode, 1, "decode's verdict")[0]
    return status, computed, held, want


def assert_every_byte(held, want):
    assert set(held) == set(want) and want
    for name in want:
        assert held[name].shape == want[name].shape, name
        assert np.array_equal(held[name], want[name]), name


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_every_byte_arrives_between_two_processes(model, tmp_path, backend):
    status, computed, held, want = run_pair(model, tmp_path, backend)
    assert status == "RUNNING" and computed >= 31  # the prompt was loaded, not recomputed
    assert_every_byte(held, want)


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_tp2_prefill_to_tp1_decode_moves_every_head(model, tmp_path, backend):
    """Decode's heads are prefill rank 0's heads then rank 1's, byte for byte."""
    status, computed, held, want = run_pair(model, tmp_path, backend, tp=2)
    assert status == "RUNNING" and computed >= 31
    assert_every_byte(held, want)


@pytest.mark.parametrize(("policy", "ends"), [("fail", "FINISHED_ERROR"), ("recompute", "RUNNING")])
def test_a_killed_prefill_ends_decodes_load_as_the_policy_says(model, tmp_path, policy, ends):
    status, computed, held, want = run_pair(model, tmp_path, kill_prefill=True, policy=policy)
    assert status == ends
    if ends == "RUNNING":  # recomputed here: nothing of prefill's bytes
        for name in want:
            assert not np.array_equal(held[name], want[name]), name


def test_a_killed_prefill_tp_worker_fails_decodes_load(model, tmp_path):
    """One of prefill's two TP workers killed, the other alive: decode's load
    still fails (under policy fail), never waits for the dead rank's heads."""
    status, _, _, _ = run_pair(model, tmp_path, tp=2, kill_prefill=True, policy="fail")
    assert status == "FINISHED_ERROR"
