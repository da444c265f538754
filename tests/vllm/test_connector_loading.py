"""vLLM's real Scheduler loads a connector class by module path and asks it about
each request: the path this project's vLLM connector will take.

Run through `make vllm-test` (in .venv-vllm); see conftest.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_probe_connector
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus
from vllm_engine import (
    BLOCK_SIZE,
    make_request,
    make_scheduler,
    make_vllm_config,
    transfer_output,
    write_tiny_model,
)
from vllm_probe_connector import ProbeConnector, ProbeMetadata

PROBE = ("ProbeConnector", "vllm_probe_connector")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def test_the_factory_loads_our_class_by_module_path(model_dir: Path) -> None:
    config = make_vllm_config(model_dir, *PROBE)
    assert config.kv_transfer_config is not None
    cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    assert cls is ProbeConnector
    assert cls.__module__ == vllm_probe_connector.__name__


def test_a_module_path_without_the_class_is_refused(model_dir: Path) -> None:
    """Negative control: vLLM looks the class up in the module it was given, as
    soon as the config is built."""
    with pytest.raises(AttributeError, match="NoSuchConnector not found in vllm_probe_connector"):
        make_vllm_config(model_dir, "NoSuchConnector", PROBE[1])


def test_the_scheduler_asks_our_connector_about_a_new_request(model_dir: Path) -> None:
    scheduler = make_scheduler(make_vllm_config(model_dir, *PROBE))
    connector = scheduler.connector
    assert type(connector) is ProbeConnector
    assert connector.role is KVConnectorRole.SCHEDULER
    assert connector.calls == []  # nothing asked before a request is scheduled

    scheduler.add_request(make_request("r1", num_tokens=20))
    out = scheduler.schedule()

    assert connector.calls == [
        ("get_num_new_matched_tokens", "r1", 0),
        ("update_state_after_alloc", "r1", 0),
    ]
    assert out.num_scheduled_tokens == {"r1": 20}  # nothing external: all computed here
    assert isinstance(out.kv_connector_metadata, ProbeMetadata)
    assert out.kv_connector_metadata.request_ids == ["r1"]


def test_an_async_load_holds_the_request_until_the_workers_report_it(model_dir: Path) -> None:
    """The connector claims a block of the prompt, loaded between steps: the
    scheduler allocates for it, parks the request, and computes only the rest
    once a worker's output lists the request as received (update_state_after_alloc
    comes twice: for the loaded blocks, then for the blocks of the rest)."""
    extra = {"matched_tokens": BLOCK_SIZE, "load_async": True}
    scheduler = make_scheduler(make_vllm_config(model_dir, *PROBE, extra=extra))
    connector = scheduler.connector
    assert isinstance(connector, ProbeConnector)
    request = make_request("r1", num_tokens=20)
    scheduler.add_request(request)

    first = scheduler.schedule()
    assert connector.calls == [
        ("get_num_new_matched_tokens", "r1", 0),
        ("update_state_after_alloc", "r1", BLOCK_SIZE),
    ]
    assert first.num_scheduled_tokens == {}
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS

    # a step whose workers finished nothing leaves it parked
    scheduler.update_from_output(first, transfer_output())
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {}
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS

    scheduler.update_from_output(second, transfer_output(finished_recving={"r1"}))
    assert request.num_computed_tokens == BLOCK_SIZE  # the loaded block counts as computed
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"r1": 20 - BLOCK_SIZE}
    assert request.status is RequestStatus.RUNNING
    # not asked again once the load is in; told of the blocks for the rest
    assert connector.calls[2:] == [("update_state_after_alloc", "r1", 0)]
