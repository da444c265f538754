"""PdLifecycleConnector on vLLM's real Scheduler, both sides, one process: the
remote prefill/decode lifecycle with the workers' reports mocked as vLLM's own
tests mock them."""

from __future__ import annotations

import pytest
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm_engine import (
    BLOCK_SIZE,
    make_request,
    make_scheduler,
    make_vllm_config,
    model_output,
    transfer_output,
    write_tiny_model,
)

MODULE = "vllm_connector.connector"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def prefill(model, rid="cmpl-1"):
    """vLLM's prefill scheduler with this connector; the request finished, its
    blocks held: (scheduler, request, params for decode, free blocks before)."""
    s = make_scheduler(
        make_vllm_config(
            model, "PdLifecycleConnector", MODULE, {"store_port": 4000}, kv_role="kv_producer"
        )
    )
    req = make_request(
        rid, 2 * BLOCK_SIZE, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    s.add_request(req)
    free0 = s.kv_cache_manager.block_pool.get_num_free_blocks()
    out = s.schedule()
    eco = s.update_from_output(out, model_output(out))
    params = next(o for e in eco.values() for o in e.outputs).kv_transfer_params
    return s, req, params, free0


def decode(model, policy="fail"):
    cfg = make_vllm_config(
        model, "PdLifecycleConnector", MODULE, {"store_port": 4000}, kv_role="kv_consumer"
    )
    cfg.kv_transfer_config.kv_load_failure_policy = policy
    return make_scheduler(cfg)


def free(s):
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def test_prefill_holds_blocks_then_frees_them_when_sent(model):
    s, req, params, free0 = prefill(model)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert params["do_remote_prefill"] is True and params["remote_request_id"] == "cmpl-1"
    assert len(params["remote_block_ids"][0]) == 2
    assert free(s) < free0  # held for decode
    out = s.schedule()
    assert list(out.kv_connector_metadata.meta.sends) == ["cmpl-1"]
    s.update_from_output(out, transfer_output(finished_sending={"cmpl-1"}))
    assert free(s) == free0


def test_decode_waits_for_the_load_then_runs(model):
    _, _, params, _ = prefill(model)
    s = decode(model)
    req = make_request("cmpl-1-d", 2 * BLOCK_SIZE, max_tokens=4, kv_transfer_params=params)
    s.add_request(req)
    out = s.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    load = out.kv_connector_metadata.meta.loads["cmpl-1-d"]
    assert load.remote.block_ids == tuple(tuple(g) for g in params["remote_block_ids"])
    assert len(load.block_ids[0]) == 2 and load.room == params["pdlife_room"]
    s.update_from_output(out, transfer_output())  # still loading
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    out = s.schedule()
    s.update_from_output(out, transfer_output(finished_recving={"cmpl-1-d"}))
    out = s.schedule()
    assert req.status == RequestStatus.RUNNING
    assert req.num_computed_tokens >= 2 * BLOCK_SIZE - 1  # the loaded prompt is not recomputed


def test_decode_aborted_while_loading_frees_its_blocks_only_when_drained(model):
    _, _, params, _ = prefill(model)
    s = decode(model)
    free0 = free(s)
    req = make_request("cmpl-2-d", 2 * BLOCK_SIZE, kv_transfer_params=params)
    s.add_request(req)
    out = s.schedule()
    s.update_from_output(out, transfer_output())
    s.finish_requests("cmpl-2-d", RequestStatus.FINISHED_ABORTED)
    assert free(s) < free0  # a write may still land: held
    out = s.schedule()
    assert dict(out.kv_connector_metadata.meta.aborts) == {"cmpl-2-d": params["pdlife_room"]}
    s.update_from_output(out, transfer_output(finished_sending={"cmpl-2-d"}))
    assert free(s) == free0


def test_a_failed_load_fails_the_request_with_policy_fail(model):
    from vllm.v1.outputs import KVConnectorOutput

    _, _, params, _ = prefill(model)
    s = decode(model, "fail")
    req = make_request("cmpl-3-d", 2 * BLOCK_SIZE, kv_transfer_params=params)
    s.add_request(req)
    out = s.schedule()
    blocks = out.kv_connector_metadata.meta.loads["cmpl-3-d"].block_ids[0]
    failed = ModelRunnerOutput.with_kv_conn_output_only(
        KVConnectorOutput(
            finished_recving={"cmpl-3-d"},
            failed_recving={"cmpl-3-d"},
            invalid_block_ids=set(blocks),
        )
    )
    s.update_from_output(out, failed)
    s.schedule()
    assert req.status == RequestStatus.FINISHED_ERROR
