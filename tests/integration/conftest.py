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
