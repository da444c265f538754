"""A pytest plugin that runs vLLM 0.34.0's own scheduler-level connector tests
with ``PdLifecycleConnector`` in place of the connector they name.

``make vllm-upstream-test`` fetches vLLM's source release (pinned by its
sha256; the tests are not part of this repository), unpacks the test files
listed in :data:`FILES` beside its ``utils.py``, and runs them with this
plugin. The plugin changes three things and nothing in the tests' bodies:

* every ``create_vllm_config`` the tests call names this connector (module
  path ``vllm_connector.connector``) where they named ``NixlConnector``;
  a test that then swaps the connector for a mock of its own still does so
  (those tests check vLLM's reaction to a connector's report);
* the model is a local ``config.json`` of a tiny OPT (the tests name
  ``facebook/opt-125m``, and CI has no route to the hub), and no tokenizer is
  loaded;
* the tests that differ by design are marked expected to fail, strictly
  (:data:`DIFFERENCES`: the test, and why); one that passes fails the run, so
  the table cannot go stale. docs/vllm.md lists the same table.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

#: the files of tests/v1/kv_connector/unit that run (the scheduler-level ones)
FILES = (
    "test_remote_decode_lifecycle.py",
    "test_remote_prefill_lifecycle.py",
    "test_kv_load_failure_recovery.py",
    "test_output_aggregator.py",
    "test_error_propagation.py",
    "test_invalid_blocks_correctness.py",
)

CONNECTOR = "PdLifecycleConnector"
MODULE_PATH = "vllm_connector.connector"
#: what the scheduler side needs of the extra config (it moves no bytes)
EXTRA = {"backend": "mooncake"}

_HMA = (
    "the test turns vLLM's hybrid KV cache manager on (several KV cache groups: Mamba "
    "state, sliding windows, block sizes per group); PdLifecycleConnector does not "
    "implement SupportsHMA, and vLLM refuses such a connector while the manager is on"
)

#: test (file::name, parameters stripped) -> why this connector differs
DIFFERENCES: Mapping[str, str] = {
    "test_remote_prefill_lifecycle.py::test_p_side_chunked_prefill_mamba": _HMA,
    "test_remote_prefill_lifecycle.py::test_async_load_reserves_blocks_for_promotion_margin": _HMA,
    "test_remote_prefill_lifecycle.py::test_async_load_does_not_double_reserve_mamba_spec_blocks": (
        _HMA
    ),
}

#: per test, the connector classes vLLM built during it
_BUILT: dict[str, set[str]] = {}

# an OPT small enough to describe, never to run (vLLM reads only the config)
TINY_OPT = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 64,
    "word_embed_proj_dim": 64,
    "ffn_dim": 128,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "do_layer_norm_before": True,
    "torch_dtype": "float16",
}

_MODEL_DIR: Path | None = None

# vLLM caches what it learns of a model under VLLM_CACHE_ROOT: the run keeps
# its own (set before vLLM is imported)
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-upstream-cache-"))


def _model_dir() -> Path:
    global _MODEL_DIR
    if _MODEL_DIR is None:
        _MODEL_DIR = Path(tempfile.mkdtemp(prefix="pdlife-tiny-opt-"))
        (_MODEL_DIR / "config.json").write_text(json.dumps(TINY_OPT))
    return _MODEL_DIR


def _ours(create: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(create)
    def create_vllm_config(*args: Any, **kw: Any) -> Any:
        if kw.get("kv_connector", "NixlConnector") == "NixlConnector":
            kw["kv_connector"] = CONNECTOR
            kw["kv_connector_module_path"] = MODULE_PATH
            kw["kv_connector_extra_config"] = {
                **EXTRA,
                **(kw.get("kv_connector_extra_config") or {}),
            }
        return create(*args, **kw)

    return create_vllm_config


def _local_model(model_config: Callable[..., Any]) -> Callable[..., Any]:
    def ModelConfig(*args: Any, **kw: Any) -> Any:  # noqa: N802 (stands for the class)
        kw["model"] = str(_model_dir())
        kw["skip_tokenizer_init"] = True
        return model_config(*args, **kw)

    return ModelConfig


@pytest.fixture(autouse=True)
def _pdlife_connector(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    built = _BUILT.setdefault(request.node.nodeid, set())
    init = KVConnectorBase_V1.__init__

    def record(self: Any, *args: Any, **kw: Any) -> None:
        built.add(type(self).__name__)
        init(self, *args, **kw)

    monkeypatch.setattr(KVConnectorBase_V1, "__init__", record)
    module = request.module
    utils = __import__(module.__package__ + ".utils", fromlist=["utils"])
    if not hasattr(utils, "_pdlife_original"):
        utils._pdlife_original = utils.create_vllm_config
    ours = _ours(utils._pdlife_original)
    monkeypatch.setattr(utils, "create_vllm_config", ours)
    if hasattr(module, "create_vllm_config"):
        monkeypatch.setattr(module, "create_vllm_config", ours)
    monkeypatch.setattr(utils, "ModelConfig", _local_model(utils.ModelConfig))
    yield
    others = built - {CONNECTOR}
    if others:  # the swap missed: the test ran another connector
        pytest.fail(f"vLLM built {sorted(others)} in place of {CONNECTOR}")


def _key(item: pytest.Item) -> str:
    return f"{Path(str(item.fspath)).name}::{item.originalname if hasattr(item, 'originalname') else item.name}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        why = DIFFERENCES.get(_key(item))
        if why is not None:
            item.add_marker(pytest.mark.xfail(reason=why, strict=True))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_test: vLLM's own marker")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    ours = sum(1 for names in _BUILT.values() if CONNECTOR in names)
    terminalreporter.write_line(
        f"{CONNECTOR} was vLLM's connector in {ours} of {len(_BUILT)} tests "
        "(the others build no connector, or swap in a mock of their own)"
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _BUILT and not any(CONNECTOR in names for names in _BUILT.values()):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # nothing ran with this connector
