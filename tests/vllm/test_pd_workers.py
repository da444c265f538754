"""PdLifecycleConnector end to end in one process: vLLM's real Scheduler on
each side, each side's worker connector over a real transfer engine on
loopback (CPU KV caches), the model runner mocked; every byte checked."""

from __future__ import annotations

import time

import pytest
import torch
from pd_engines import Engine, transfer
from vllm_engine import write_tiny_model

from lifecycle.testing.spawn import store_server


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


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
