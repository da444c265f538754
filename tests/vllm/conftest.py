"""Tests against the real vLLM 0.34.0, in .venv-vllm.

They run through `make vllm-test`, which builds that venv first (`make
vllm-env`) and sets HF_HUB_OFFLINE=1; the main suite does not collect them
(pyproject's testpaths). In any other Python the run stops before collecting
them (the test modules import vllm), with one line saying so: nothing is
skipped, and pytest exits non-zero.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings

import pytest

# No test here may reach for the Hugging Face hub (CI has no route to it): the
# model is a local config.json. Set before vLLM or huggingface_hub is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# vLLM caches what it learns of a model's class under ~/.cache/vllm; the run
# keeps its own, so it neither writes there nor leans on an earlier run's
CACHE_ROOT = tempfile.mkdtemp(prefix="vllm-test-cache-")
os.environ["VLLM_CACHE_ROOT"] = CACHE_ROOT
# and the IPC sockets of a TP group's message queue (vLLM leaves them behind
# in /tmp otherwise), removed with it
os.environ["VLLM_RPC_BASE_PATH"] = CACHE_ROOT


def _vllm_missing() -> str | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # `import vllm` alone would succeed anywhere: without the real
            # package, Python takes this folder (tests/vllm, on sys.path as
            # tests' child) for a namespace package of that name
            from vllm import __version__  # noqa: F401
    except Exception as exc:
        return (
            f"vllm is not importable in {sys.executable} ({type(exc).__name__}: {exc}); "
            "these tests need .venv-vllm: run `make vllm-env` (or `make vllm-test`, "
            "which builds it and runs them there)"
        )
    return None


VLLM_MISSING = _vllm_missing()


def pytest_configure(config: pytest.Config) -> None:
    if VLLM_MISSING is not None:
        raise pytest.UsageError(VLLM_MISSING)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(CACHE_ROOT, ignore_errors=True)
