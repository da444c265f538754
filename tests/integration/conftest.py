import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest


def simulate(out: Path, backend: str, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """Run `pdlife simulate` in a fresh interpreter; returns the process and summary.json."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdlife",
            "simulate",
            "--backend",
            backend,
            "--quiet",
            "--out",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    return proc, json.loads((out / "summary.json").read_text())


@pytest.fixture
def run_sim(tmp_path):
    def run(backend, name, *args):
        out = tmp_path / name
        proc, summary = simulate(out, backend, *args)
        return proc, summary, out

    return run


_MODULE = {"mooncake": "mooncake", "nixl": "nixl_cu12"}


def unusable(backend):
    """Why a byte-moving backend cannot run here, or None. A missing system library
    (libibverbs.so.1 for Mooncake) raises ImportError or OSError on import."""
    if importlib.util.find_spec(_MODULE[backend]) is None:
        return f"pd-lifecycle[{backend}] not installed"
    try:
        importlib.import_module("mooncake.engine" if backend == "mooncake" else "nixl_cu12")
    except (ImportError, OSError) as e:
        return (
            f"{backend} engine not usable here ({e}); install Debian's libibverbs1 "
            "(`apt-get install libibverbs1`, or `make install` as root)"
        )
    return None


@pytest.fixture(params=["mooncake", "nixl"])
def backend(request):
    """Each byte-moving backend in turn (skipped where it cannot run)."""
    why = unusable(request.param)
    if why is not None:
        pytest.skip(why)
    return request.param


@pytest.fixture(params=["fake", "mooncake", "nixl"])
def any_backend(request):
    """The fake backend, then each byte-moving one (skipped where it cannot run)."""
    why = None if request.param == "fake" else unusable(request.param)
    if why is not None:
        pytest.skip(why)
    return request.param
