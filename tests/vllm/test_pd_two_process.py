"""Prefill and decode engines in processes of their own (vLLM's real Scheduler
each, PdLifecycleConnector's worker over Mooncake on loopback): every byte
arrives; a prefill process killed while decode loads ends decode's request
with what the recovery table says vLLM does next, never a hang."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
from pd_engines import decode_process, prefill_process
from vllm_engine import write_tiny_model

from lifecycle.testing.spawn import store_server

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def run_pair(model, kill_prefill, policy="fail"):
    ctx = mp.get_context("spawn")
    store = store_server()
    out_p, out_d, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    pre = ctx.Process(
        target=prefill_process, args=(model, store.port, "mooncake", out_p, stop, kill_prefill)
    )
    pre.start()
    try:
        params, want = out_p.get(timeout=120)
        if kill_prefill:
            pre.kill()  # its sender waits for decode's register: the transfer had begun
            pre.join(30)
        dec = ctx.Process(
            target=decode_process, args=(model, store.port, "mooncake", params, out_d, policy)
        )
        dec.start()
        status, computed, held = out_d.get(timeout=150)
        dec.join(30)
        return status, computed, held, want
    finally:
        stop.set()
        pre.join(30)
        if pre.is_alive():
            pre.kill()


def test_every_byte_arrives_between_two_processes(model):
    status, computed, held, want = run_pair(model, kill_prefill=False)
    assert status == "RUNNING" and computed >= 31  # the prompt was loaded, not recomputed
    for name in want:
        assert np.array_equal(held[name], want[name]), name


@pytest.mark.parametrize(("policy", "ends"), [("fail", "FINISHED_ERROR"), ("recompute", "RUNNING")])
def test_a_killed_prefill_ends_decodes_load_as_the_policy_says(model, policy, ends):
    status, computed, held, want = run_pair(model, kill_prefill=True, policy=policy)
    assert status == ends
    if ends == "RUNNING":  # recomputed here: nothing of prefill's bytes
        for name in want:
            assert not np.array_equal(held[name], want[name]), name
