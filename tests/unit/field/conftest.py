import os
from datetime import timedelta

import pytest


@pytest.fixture(scope="module")
def world_of_one():
    """A one-rank gloo group in this process (the compat helpers take process groups)."""
    import torch.distributed as dist

    from lifecycle.testing.spawn import store_server

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        store=store_server(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=20),
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_fault_env(monkeypatch):
    for var in (
        "SGLANG_TEST_DISAGG_FAILURE_PROB",
        "DISAGGREGATION_TEST_FAILURE_PROB",
        "PDLIFE_FAULT_SEED",
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
    ):
        monkeypatch.delenv(var, raising=False)
