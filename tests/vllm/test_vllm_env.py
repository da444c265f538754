"""The vLLM env holds the real vLLM 0.34.0 on torch 2.14.1, and the modules a
connector needs import.

Run through `make vllm-test` (in .venv-vllm); see conftest.py.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from pathlib import Path

import pytest

VERSION = "0.34.0"
TORCH = "2.14.1"
# module -> the names a connector (and its tests) use from it
MODULES = {
    "vllm": ["SamplingParams"],
    "vllm.config": ["VllmConfig", "KVTransferConfig"],
    "vllm.distributed.kv_transfer.kv_connector.v1.base": [
        "KVConnectorBase_V1",
        "KVConnectorMetadata",
        "KVConnectorRole",
    ],
    "vllm.distributed.kv_transfer.kv_connector.factory": ["KVConnectorFactory"],
    "vllm.v1.core.sched.scheduler": ["Scheduler"],
    "vllm.v1.core.kv_cache_manager": ["KVCacheManager", "KVCacheBlocks"],
    "vllm.v1.outputs": ["KVConnectorOutput", "ModelRunnerOutput"],
    "vllm.v1.request": ["Request", "RequestStatus"],
    "vllm.distributed.kv_transfer.kv_connector.utils": ["KVOutputAggregator"],
    "vllm.sampling_params": ["SamplingParams"],
}


def test_vllm_is_0_34_0_from_site_packages() -> None:
    import vllm

    assert vllm.__version__ == VERSION
    assert metadata.version("vllm") == VERSION
    # the installed package, not tests/vllm (a folder of the same name on sys.path)
    assert Path(vllm.__file__).parent.parent.name == "site-packages"


def test_torch_is_2_14_1_and_runs_on_the_cpu() -> None:
    import torch

    assert metadata.version("torch") == TORCH
    assert torch.__version__.startswith(TORCH)
    assert (torch.ones(2) + 1).tolist() == [2.0, 2.0]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_imports_with_the_names_a_connector_uses(name: str) -> None:
    module = importlib.import_module(name)
    missing = [n for n in MODULES[name] if not hasattr(module, n)]
    assert missing == []


def test_a_missing_name_is_seen() -> None:
    """Negative control for the check above: a name vLLM does not define is reported."""
    module = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
    assert not hasattr(module, "KVConnectorBase_V2")


def test_the_hub_is_off() -> None:
    """No test may fetch from the Hugging Face hub (conftest.py turns it off)."""
    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE
