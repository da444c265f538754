"""Process groups for tests of functions that take one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[Any]:
    """A one-rank gloo group in this process (the compat and consensus helpers take process groups)."""
    import torch.distributed as dist

    from lifecycle.testing.spawn import store_server

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", store=store_server(), rank=0, world_size=1, timeout=timedelta(seconds=20)
    )
    yield dist.group.WORLD
    dist.destroy_process_group()
