"""The tests' zygote (zygote.py) serves commands from a child of its own, and
a command past its timeout goes with every rank it started."""

import os
import signal
import subprocess
import threading
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


SOAK = ("simulate", "--backend", "fake", "--quiet", "--no-timeline", "--soak", "60")


def _gone(sid):
    """Whether session ``sid`` is gone, waiting a little for the kill to land."""
    deadline = time.monotonic() + 20
    while _session(sid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _session(sid) == []


def test_a_command_past_its_timeout_is_killed_with_its_ranks(tmp_path):
    # expire() is what the timer calls: here once the ranks are surely up
    out = tmp_path / "soak"
    caught = []

    def run():
        try:
            zygote.run(*SOAK, "--out", str(out), timeout=600)
        except BaseException as e:
            caught.append(e)

    t = threading.Thread(target=run)
    t.start()
    while t.is_alive() and len(list((out / "trace").glob("rank*.jsonl"))) < 4:
        time.sleep(0.1)  # (pytest-timeout bounds the wait)
    z = zygote._zygote
    assert z is not None and z.alive() and len(_session(z.pid)) == 5  # launcher + 4 ranks
    z.expire()
    t.join(30)
    assert [type(e) for e in caught] == [subprocess.TimeoutExpired]
    assert _gone(z.pid)
    assert z.alive()  # it serves the next command
    ok = zygote.run(
        "simulate", "--backend", "fake", "--requests", "1", "--out", str(tmp_path / "n")
    )
    assert ok.returncode == 0, ok.stderr


def test_the_timer_ends_a_command_that_outlives_its_timeout(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run(*SOAK, "--out", str(tmp_path / "soak"), timeout=2)
    assert time.monotonic() - t0 < 55  # the kill, not the soak's own end
    assert _gone(zygote._zygote.pid)


class Interrupted(Exception):
    pass


def test_a_wait_cut_short_leaves_no_answer_out_of_turn(tmp_path):
    # as pytest-timeout's alarm or ^C would: the signal's exception leaves
    # zygote.run while the child runs; the child goes, and the next command
    # gets its own answer from a new zygote, not the old child's exit code
    out = tmp_path / "soak"
    main = threading.get_ident()

    def interrupt():
        while len(list((out / "trace").glob("rank*.jsonl"))) < 4:
            time.sleep(0.1)
        signal.pthread_kill(main, signal.SIGUSR1)

    def handler(signum, frame):
        raise Interrupted

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(Interrupted):
            zygote.run(*SOAK, "--out", str(out), timeout=600)
    finally:
        signal.signal(signal.SIGUSR1, old)
    z = zygote._zygote
    assert z is not None and not z.alive()
    assert _gone(z.pid)
    bad = zygote.run("simulate", "--seed", "-1", "--out", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "--seed" in bad.stderr, bad.stderr
    assert zygote._zygote is not z and zygote._zygote.alive()
