"""A vLLM engine of each side for the end-to-end tests: vLLM's real Scheduler
and one worker's PdLifecycleConnector over CPU KV caches, the model runner
mocked (one sampled token per scheduled request). Module-level, so a spawned
process can build one too."""

from __future__ import annotations

import time

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
)

MODULE = "vllm_connector.connector"
BLOCKS, HEADS, DIM = 64, 2, 16
#: liveness where a test kills a process: its peers see it dead within 0.15 s
#: (a live one stalled that long on a loaded machine is taken for dead too,
#: which ends the load the same way)
QUICK = {"heartbeat_interval": 0.05, "heartbeat_misses": 3}
#: where no process dies: only a peer silent for 30 s is dead, so a load's
#: success does not hang on how busy the machine is
PATIENT = {"heartbeat_interval": 0.5, "heartbeat_misses": 60}


class Engine:
    """One vLLM engine: its scheduler and one worker's connector with CPU caches."""

    def __init__(self, model, role, port, backend, policy="fail", **extra):
        from vllm_connector.connector import PdLifecycleConnector

        extra = {"store_port": port, "backend": backend, "namespace": f"t{port}", **extra}
        self.cfg = make_vllm_config(model, "PdLifecycleConnector", MODULE, extra, kv_role=role)
        self.cfg.kv_transfer_config.kv_load_failure_policy = policy  # (read by the scheduler)
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


def prefill_process(model, port, backend, out, stop, hold_blocks, liveness):
    """A prefill engine in its own process: one request, its params and its
    blocks' bytes put on ``out``; then it serves decode until ``stop`` is set,
    saying on ``out`` when the request's blocks are freed
    (``hold_blocks``: fill the blocks, answer, and never step again: a process
    about to die; ``liveness``: its heartbeat settings)."""
    p = Engine(model, "kv_producer", port, backend, **liveness)
    before = p.sched.kv_cache_manager.block_pool.get_num_free_blocks()
    req = make_request(
        "c1", 2 * BLOCK_SIZE, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    p.sched.add_request(req)
    eco = p.step()
    params = next(o for e in eco.values() for o in e.outputs).kv_transfer_params
    src = params["remote_block_ids"][0]
    g = torch.Generator().manual_seed(5)
    for t in p.caches.values():
        t[:, src] = torch.randn(t[:, src].shape, generator=g).to(t.dtype)
    out.put((params, {n: t[:, src].numpy().copy() for n, t in p.caches.items()}))
    held = True
    while not stop.is_set():
        time.sleep(0.002)
        if not hold_blocks:
            p.step()
            if held and not p.sched.requests:  # the send reported: the blocks freed
                held = False
                out.put(
                    ("freed", p.sched.kv_cache_manager.block_pool.get_num_free_blocks(), before)
                )
    p.worker.shutdown()


def decode_process(model, port, backend, inbox, out, policy, liveness):
    """A decode engine in its own process: the request with prefill's params
    (taken from ``inbox`` once the engine is up), stepped until it runs or
    ends; its status, its blocks' bytes and the failures its worker's
    connector agreed (reason, recovery decision) on ``out``."""
    d = Engine(model, "kv_consumer", port, backend, policy, **liveness)
    failures = []
    agreement = d.worker.worker.agreement
    agreed = agreement.step

    def recorded():  # (what the connector tells vLLM holds no reason: read it here)
        ended = agreed()
        failures.extend((f.reason.name, f.action.name) for f in ended.failed.values())
        return ended

    agreement.step = recorded
    params = inbox.get()
    req = make_request("c1-d", 2 * BLOCK_SIZE, max_tokens=2, kv_transfer_params=params)
    d.sched.add_request(req)
    dst = None
    while req.status != RequestStatus.RUNNING:  # (a hang: the test's wait gives up)
        time.sleep(0.002)
        d.step()
        if dst is None and d.sched.requests.get("c1-d") is not None:
            blocks = d.sched.kv_cache_manager.get_block_ids("c1-d")
            dst = list(blocks[0]) if blocks and blocks[0] else None
        if req.is_finished():
            break
    held = {n: t[:, dst[:2]].numpy().copy() for n, t in d.caches.items()} if dst else {}
    out.put((req.status.name, int(req.num_computed_tokens), held, failures))
    d.worker.shutdown()
