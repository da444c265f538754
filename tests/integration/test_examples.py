"""The examples run and say what the docs say they say."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
ROOT = Path(__file__).parents[2]


def test_scheduler_loop_example():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "scheduler_loop.py")],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "room 104: failed: aborted on rank 0" in out
    assert "room 105: first token 105 (step 4)" in out  # held by the user gate until step 4
    assert out.count("first token") == 4
