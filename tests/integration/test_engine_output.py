"""What `pdlife simulate` prints is its own: the transfer engines' lines
(Mooncake's glog, NIXL's and UCX's loggers) go to each rank's engine log, and
reach the terminal only with --verbose. Every byte-moving run of the suite
checks the first half (conftest's ``simulate``); here, the engine logs and
the other half, the negative control of that check."""

import subprocess
import sys

import pytest
from engines import FOREIGN, engine_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.network, pytest.mark.timeout(240)]


def test_engine_lines_reach_the_terminal_only_when_asked_for(tmp_path, backend):
    cmd = [sys.executable, "-m", "pdlife", "simulate", "--backend", backend, "--verbose"]
    cmd += ["--requests", "8", "--out", str(tmp_path / "loud")]
    loud = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=engine_env())
    assert loud.returncode == 0, loud.stdout + loud.stderr[-3000:]
    assert FOREIGN.findall(loud.stdout + loud.stderr)  # asked for, they do show
