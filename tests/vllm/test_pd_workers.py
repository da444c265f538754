"""PdLifecycleConnector end to end in one process: vLLM's real Scheduler on
each side, each side's worker connector over a real transfer engine on
loopback (CPU KV caches), the model runner mocked; every byte checked."""

from __future__ import annotations

import time

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm_engine import (
    BLOCK_SIZE,
    make_request,
    make_scheduler,
    make_vllm_config,
    model_output,
    write_tiny_model,
)

from lifecycle.testing.spawn import store_server

MODULE = "vllm_connector.connector"
BLOCKS, HEADS, DIM = 64, 2, 16


class Engine:
    """One vLLM engine: its scheduler and one worker's connector with CPU caches."""

    def __init__(self, model, role, port, backend):
        from vllm_connector.connector import PdLifecycleConnector

        extra = {"store_port": port, "backend": backend, "namespace": f"t{port}"}
        self.cfg = make_vllm_config(model, "PdLifecycleConnector", MODULE, extra, kv_role=role)
        self.sched = make_scheduler(self.cfg, num_blocks=BLOCKS)
        self.caches = {
            f"layers.{i}": torch.zeros((2, BLOCKS, BLOCK_SIZE, HEADS, DIM), dtype=torch.float16)
            for i in range(2)
        }
        self.worker = PdLifecycleConnector(self.cfg, KVConnectorRole.WORKER, None)
        self.worker.register_kv_caches(self.caches)

    def step(self):
        """One scheduler step, the worker's connector run on its metadata."""
        out = self.sched.schedule()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        res = self.worker.get_transfer_results(set())
        self.worker.clear_connector_metadata()
        kv = KVConnectorOutput(
            finished_sending=res.finished_sending or None,
            finished_recving=res.finished_recving or None,
            failed_recving=res.failed_recving,
            invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
        )
        if out.num_scheduled_tokens:
            return self.sched.update_from_output(out, model_output(out, kv))
        return self.sched.update_from_output(out, ModelRunnerOutput.with_kv_conn_output_only(kv))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def transfer(p, d, rid, seed):
    """Request ``rid`` through prefill (its blocks filled with seeded bytes) and
    decode, until decode runs it: (prefill's blocks, decode's blocks, request)."""
    preq = make_request(
        rid, 2 * BLOCK_SIZE, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    p.sched.add_request(preq)
    eco = p.step()
    params = next(o for e in eco.values() for o in e.outputs).kv_transfer_params
    src = params["remote_block_ids"][0]
    g = torch.Generator().manual_seed(seed)
    for t in p.caches.values():  # what the prefill "computed" for the request's blocks
        t[:, src] = torch.randn(t[:, src].shape, generator=g).to(t.dtype)
    assert not torch.equal(
        p.caches["layers.0"][:, src], torch.zeros_like(p.caches["layers.0"][:, src])
    )
    dreq = make_request(f"{rid}-d", 2 * BLOCK_SIZE, max_tokens=2, kv_transfer_params=params)
    d.sched.add_request(dreq)
    dst = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and dreq.status != RequestStatus.RUNNING:
        time.sleep(0.002)
        p.step()
        d.step()
        if dst is None and d.sched.requests.get(dreq.request_id) is not None:
            blocks = d.sched.kv_cache_manager.get_block_ids(dreq.request_id)
            dst = list(blocks[0]) if blocks and blocks[0] else None
        assert not dreq.is_finished(), dreq.status
    assert dreq.status == RequestStatus.RUNNING, dreq.status
    return src, dst[:2], dreq


@pytest.fixture
def pd(model, request):
    store = store_server()
    backend = getattr(request, "param", "mooncake")
    p = Engine(model, "kv_producer", store.port, backend)
    d = Engine(model, "kv_consumer", store.port, backend)
    yield p, d
    p.worker.shutdown()
    d.worker.shutdown()


@pytest.mark.parametrize("pd", ["mooncake", "nixl"], indirect=True)
def test_a_request_moves_every_byte_from_prefill_to_decode(pd):
    p, d = pd
    src, dst, _ = transfer(p, d, "c1", seed=1)
    for name in p.caches:
        assert torch.equal(d.caches[name][:, dst], p.caches[name][:, src]), name
    # prefill frees its blocks once the send is reported
    for _ in range(200):
        time.sleep(0.002)
        p.step()
        if not p.sched.requests:
            break
    assert "c1" not in p.worker.worker.live and not p.sched.requests


def test_a_prefix_decode_holds_already_is_not_written(pd):
    """A second request with the same first block: decode's prefix cache holds
    it, so only the second block is loaded, and the shared block keeps its bytes."""
    p, d = pd
    _, dst1, _ = transfer(p, d, "c1", seed=1)
    shared = {n: t[:, dst1[0]].clone() for n, t in d.caches.items()}
    src2, dst2, req2 = transfer(p, d, "c2", seed=2)
    assert dst2[0] == dst1[0]  # the cached block, shared with c1
    for name in p.caches:
        assert torch.equal(d.caches[name][:, dst2[0]], shared[name]), name
        assert torch.equal(d.caches[name][:, dst2[1]], p.caches[name][:, src2[1]]), name
        assert not torch.equal(shared[name], p.caches[name][:, src2[0]])  # (c2's would differ)
