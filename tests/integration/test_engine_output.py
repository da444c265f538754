"""What `pdlife simulate` prints is its own: the transfer engines' lines
(Mooncake's glog, NIXL's and UCX's loggers) go to each rank's engine log,
and reach the terminal only with --verbose."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.network, pytest.mark.timeout(240)]

#: a line an engine wrote: glog (I/W/E/F, date, time), its pre-init notice, NIXL, UCX
FOREIGN = re.compile(
    r"^[IWEF]\d{4} \d\d:\d\d:\d\d|Logging before InitGoogleLogging|NIXL (INFO|WARN)|\bUCX\b",
    re.MULTILINE,
)


def _run(tmp_path, backend, *extra):
    out = tmp_path / ("verbose" if extra else "quiet")
    cmd = [sys.executable, "-m", "pdlife", "simulate", "--backend", backend, "--out", str(out)]
    cmd += ["--requests", "8", *extra]
    env = {k: v for k, v in os.environ.items() if not k.endswith("LOG_LEVEL")}
    env.pop("GLOG_minloglevel", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc, out


def test_engine_lines_stay_off_the_terminal_unless_verbose(tmp_path, backend):
    proc, out = _run(tmp_path, backend)
    printed = proc.stdout + proc.stderr  # the progress bar included
    assert not FOREIGN.findall(printed), printed
    assert "result: OK" in proc.stdout
    logs = sorted((out / "ranks").glob("*.engine.log"))
    assert len(logs) == 4  # one per rank, where the engines' lines went
    # negative control: asked for, the engines' own lines do show
    loud, _ = _run(tmp_path, backend, "--verbose")
    assert FOREIGN.findall(loud.stdout + loud.stderr)
