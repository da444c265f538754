"""A prefill engine of TP n in processes of its own, laid out as vLLM runs one.

- The engine's process holds vLLM's real Scheduler (the connector's scheduler
  side). Each step it hands every worker the scheduler output (vLLM's
  executor broadcasts it pickled; here, one queue per worker), takes each
  worker's ModelRunnerOutput back and merges them with vLLM's own
  ``KVOutputAggregator`` (expected count: the connector's, else the world
  size) before ``Scheduler.update_from_output``.
- Each worker process initialises vLLM's distributed state on the CPU (gloo,
  a ``file://`` rendezvous: no port) and its TP group, holds its share of the
  KV heads (``HEADS // n``, rank r the r-th share), and has vLLM build its
  ``PdLifecycleConnector`` (``ensure_kv_transfer_initialized``: role WORKER,
  its agreement step over vLLM's TP group) and drive it each step through
  the model runner's own connector driver (``get_kv_connector``:
  ``pre_forward``, ``finish_forward``, ``post_forward``, ``no_forward``).
  The model itself is mocked: a step's "forward" writes seeded bytes into
  each newly scheduled request's blocks, this rank's heads of a tensor every
  rank draws alike, puts (rank, what it wrote) on ``filled``, and samples one
  token per request.
"""

from __future__ import annotations

import os
import queue
import time
import zlib

import numpy as np
import torch
from pd_engines import BLOCKS, DIM, HEADS, MODULE
from vllm_engine import (
    BLOCK_SIZE,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
    model_output,
)

LAYERS = 2


def engine_config(model, role, port, backend, liveness, policy="fail", tp=1):
    """The VllmConfig of one engine (built once, in the test, and handed to each
    of the engine's processes, as vLLM's executor hands its workers the engine's)."""
    extra = {
        "store_port": port,
        "backend": backend,
        "namespace": f"t{port}",
        **liveness,
    }
    cfg = make_vllm_config(
        model, "PdLifecycleConnector", MODULE, extra, kv_role=role, tensor_parallel_size=tp
    )
    cfg.kv_transfer_config.kv_load_failure_policy = policy
    return cfg


def forward_bytes(request_id, blocks, rank, tp):
    """What the forward of ``request_id`` writes in its ``blocks`` on TP rank
    ``rank``: per layer, keys and values of every head drawn from the request's
    seed, this rank's heads kept."""
    g = torch.Generator().manual_seed(zlib.crc32(request_id.encode()))
    share = HEADS // tp
    out = {}
    for i in range(LAYERS):
        full = torch.randn((2, len(blocks), BLOCK_SIZE, HEADS, DIM), generator=g)
        out[f"layers.{i}"] = full[..., rank * share : (rank + 1) * share, :].to(torch.float16)
    return out


def whole_heads(parts):
    """The bytes of every head from each rank's share ({rank: {layer: array}}),
    ranks in order: what a decode engine of TP 1 must hold."""
    ranks = sorted(parts)
    return {n: np.concatenate([parts[r][n] for r in ranks], axis=-2) for n in parts[ranks[0]]}


def prefill_worker(cfg, rank, init_file, inbox, outbox, filled):
    """One TP worker of the prefill engine (see the module); ends on ``None``."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.kv_transfer import kv_transfer_state as kvt
    from vllm.v1.worker.gpu.kv_connector import get_kv_connector

    from vllm_connector.connector import PdLifecycleConnector

    tp = cfg.parallel_config.tensor_parallel_size
    with set_current_vllm_config(cfg):
        ps.init_distributed_environment(
            world_size=tp,
            rank=rank,
            local_rank=rank,
            distributed_init_method=f"file://{init_file}",
            backend="gloo",
        )
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    caches = {
        f"layers.{i}": torch.zeros((2, BLOCKS, BLOCK_SIZE, HEADS // tp, DIM), dtype=torch.float16)
        for i in range(LAYERS)
    }
    # as vLLM's worker does: the engine id agreed over the TP group, the class
    # loaded by its module path (role WORKER), the caches registered by the
    # model runner's connector driver, which then calls the connector each step
    kvt.ensure_kv_transfer_initialized(cfg, make_kv_cache_config(cfg, BLOCKS))
    assert isinstance(kvt.get_kv_transfer_group(), PdLifecycleConnector)
    driver = get_kv_connector(cfg, caches)
    try:
        while (so := inbox.get()) is not None:
            if not so.num_scheduled_tokens:
                outbox.put(driver.no_forward(so))
                continue
            driver.pre_forward(so)
            for new in so.scheduled_new_reqs:  # the forward
                blocks = list(new.block_ids[0])
                for name, kv in forward_bytes(new.req_id, blocks, rank, tp).items():
                    caches[name][:, blocks] = kv
                filled.put((rank, {n: t[:, blocks].numpy().copy() for n, t in caches.items()}))
            driver.finish_forward()
            outbox.put(model_output(so, driver.post_forward(so.finished_req_ids)))
    finally:
        kvt.ensure_kv_transfer_shutdown()
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


def prefill_engine(cfg, inboxes, outboxes, out, stop, hold):
    """The prefill engine's scheduler process: request ``c1`` (32 tokens, to be
    decoded elsewhere) stepped until it finishes, its params put on ``out``;
    then it serves decode until ``stop`` (``hold``: answer and never step
    again, an engine about to lose a worker)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

    sched = make_scheduler(cfg, num_blocks=BLOCKS)
    merge = KVOutputAggregator.from_connector(sched.connector, len(inboxes))

    def answer(box):  # a worker's output for the step (a hang: the test's wait gives up)
        while not stop.is_set():
            try:
                return box.get(timeout=0.1)
            except queue.Empty:
                pass
        raise TimeoutError("prefill engine: the test ended before a worker's output for the step")

    def step():
        so = sched.schedule()
        for box in inboxes:  # (vLLM's executor broadcasts it pickled too)
            box.put(so)
        outs = [answer(box) for box in outboxes]
        return sched.update_from_output(so, merge.aggregate(outs))

    pool = sched.kv_cache_manager.block_pool
    try:
        before = pool.get_num_free_blocks()
        sched.add_request(
            make_request(
                "c1", 2 * BLOCK_SIZE, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
            )
        )
        eco = step()
        out.put(next(o for e in eco.values() for o in e.outputs).kv_transfer_params)
        held = True
        while not stop.is_set():
            time.sleep(0.002)
            if not hold:
                step()
                if held and not sched.requests:  # every worker reported the send: freed
                    held = False
                    out.put(("freed", pool.get_num_free_blocks(), before))
    finally:
        for box in inboxes:
            box.put(None)
