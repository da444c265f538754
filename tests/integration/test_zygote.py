"""The tests' zygote (zygote.py) serves commands from a child of its own, and
a command past its timeout goes with every rank it started."""

import os
import subprocess
import time
from pathlib import Path

import pytest
import zygote

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def test_a_command_runs_in_a_child_of_the_zygote(tmp_path):
    out = tmp_path / "one"
    proc = zygote.run(
        "simulate",
        "--backend",
        "fake",
        "--quiet",
        "--no-timeline",
        "--requests",
        "2",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "result: OK" in proc.stdout
    assert zygote._zygote is not None and zygote._zygote.alive()  # served, not run afresh
    # a bad flag: one line on the child's standard error, exit code 2
    bad = zygote.run("simulate", "--seed", "-1", "--out", str(tmp_path / "bad"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    # the environment asked for is the child's
    env = {**os.environ, "SGLANG_TEST_DISAGG_FAILURE_PROB": "2"}
    odd = zygote.run("simulate", "--backend", "fake", "--out", str(tmp_path / "env"), env=env)
    assert odd.returncode == 2 and "SGLANG_TEST_DISAGG_FAILURE_PROB" in odd.stderr, odd.stderr


def _session(sid):
    """The live processes of session ``sid`` (a zombie is dead already: one
    whose new parent does not reap it, as a container's first process may not,
    holds nothing)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # (state, ppid, pgrp, session, ...)
            found.append(int(stat.parent.name))
    return found


def test_a_command_past_its_timeout_is_killed_with_its_ranks(tmp_path):
    out = tmp_path / "soak"
    args = ("simulate", "--backend", "fake", "--quiet", "--no-timeline", "--soak", "60")
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        # 10 s: a 1-request run starts, runs and ends in under 3 s on 2 loaded cores
        zygote.run(*args, "--out", str(out), timeout=10)
    assert time.monotonic() - t0 < 60  # not the soak's own end
    assert list((out / "trace").glob("rank*.jsonl"))  # the ranks had started
    z = zygote._zygote
    assert z is not None and z.alive() and z.pid > 0
    # the child and every rank it forked: gone
    deadline = time.monotonic() + 20
    while _session(z.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session(z.pid) == []
