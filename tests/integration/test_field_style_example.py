"""examples/field_style_loop.py: engine-style prefill and decode loops on compat
names only, on the fake backend, and on Mooncake and NIXL over 127.0.0.1."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]
ROOT = Path(__file__).parents[2]


def run(backend):
    env = dict(os.environ, GLOG_minloglevel="2")
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "field_style_loop.py"), "--backend", backend],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


def test_fake_backend():
    proc = run("fake")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "prefill: 24 sent, 0 failed, 24 rows read back, 0 rows leaked" in proc.stdout
    assert "decode: 24 committed, 0 failed, 0 unfinished, 0 rows leaked" in proc.stdout


@pytest.mark.network
@pytest.mark.parametrize(("backend", "package"), [("mooncake", "mooncake"), ("nixl", "nixl_cu12")])
def test_real_backend_moves_every_byte_and_row(backend, package):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"pd-lifecycle[{backend}] not installed")
    proc = run(backend)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "decode: 24 committed, 0 failed, 0 unfinished, 0 rows leaked" in proc.stdout
    # 24 requests of 1..5 pages, 2 layers of 256 bytes each
    pages = sum(1 + room % 5 for room in range(1001, 1025))
    assert f"verified: {pages * 2 * 256} KV bytes and 24 metadata rows, 0 differ" in proc.stdout
