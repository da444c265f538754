"""``python -m pdlife ...`` for the tests, forked from a process that has
imported torch and the simulator once.

A fresh interpreter spends about 2 s of CPU importing torch and pdlife before
a simulator run starts; a short run's own work is less than that. Each pytest
worker starts one zygote: a single-threaded Python process that imports them
and loads no transfer engine (``pdlife.run.launch.forkable`` holds there),
then forks one child per command. The child is what a fresh process would be
for the command: its own session (so a timeout kills it and every rank it
forked), the environment, directory and argument list asked for, standard
output and error in files (an engine's own lines included, written by its
native code straight to the descriptors), and the exit code ``main`` returns.

What differs from a fresh interpreter: the modules are imported already, so
a variable read at start-up or on import (``PYTHONHASHSEED``, ``PYTHONPATH``,
``LD_*``, what torch reads as it loads) is the zygote's, not the one asked
for, and every child has the zygote's string-hash seed. A command that needs
such a variable, and a test of reproducibility across processes (one side),
runs in a fresh interpreter (``fresh=True``).
Where the zygote cannot start or has died, a fresh interpreter runs the
command: the verdict never depends on it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

#: the zygote's own program: read a request per line on standard input, fork,
#: write {"pid"} then, once the child is reaped, {"rc"}
PROGRAM = r"""
import json, os, sys, traceback
import torch, torch.distributed  # noqa: F401
import pdlife.cli, pdlife.run.simulate, pdlife.run.launch  # noqa: F401
if not pdlife.run.launch.forkable():
    print(json.dumps({"error": "not forkable"}), flush=True)
    sys.exit(0)
print(json.dumps({"ready": os.getpid()}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:  # the child's setting up: a failure here is the zygote's, said as 1
            os.setsid()
            fd_in = os.open(os.devnull, os.O_RDONLY)
            fd_out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            fd_err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            for fd, target in ((fd_in, 0), (fd_out, 1), (fd_err, 2)):
                os.dup2(fd, target)
                os.close(fd)
            os.environ.clear()
            os.environ.update(req["env"])
            os.chdir(req["cwd"])
            sys.argv = ["pdlife", *req["argv"]]
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        # then as `python -m pdlife` ends: through the interpreter's own exit
        # (atexit handlers, threads joined, buffers flushed), with main's code
        raise SystemExit(pdlife.cli.main(req["argv"]))
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class Zygote:
    """One per pytest worker (see :func:`run`)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PROGRAM],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        first = self.proc.stdout.readline() if self.proc.stdout else ""
        self.ok = first.startswith('{"ready"')
        #: the last child's pid, which is also its session's id
        self.pid = 0
        self._expire: Callable[[], None] = lambda: None

    def alive(self) -> bool:
        return self.ok and self.proc.poll() is None

    def close(self) -> None:
        """Let it go (a child it runs is in a session of its own, left be)."""
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()
        self.proc.kill()
        self.proc.wait()

    def expire(self) -> None:
        """End the command running now as its timeout would (for a test)."""
        self._expire()

    def run(
        self, argv: list[str], env: dict[str, str], timeout: float
    ) -> tuple[int, str, str] | None:
        """The child's exit code, output and error; None when the zygote died
        before it could say (the caller then runs the command afresh)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with tempfile.TemporaryDirectory(prefix="zygote") as d:
            out, err = Path(d) / "out", Path(d) / "err"
            req = {"argv": argv, "env": env, "cwd": os.getcwd(), "stdout": str(out)}
            req["stderr"] = str(err)
            fired = threading.Event()
            pid = 0
            try:
                self.proc.stdin.write(json.dumps(req) + "\n")
                self.proc.stdin.flush()
                reply = self.proc.stdout.readline()
                if not reply:  # the zygote died before it forked
                    self.ok = False
                    return None
                pid = self.pid = json.loads(reply)["pid"]
                # the child's own session: on a timeout it goes with every rank
                # it forked (expire(): the same, at once)
                self._expire = functools.partial(_kill_session, pid, fired)
                timer = threading.Timer(timeout, self._expire)
                timer.start()
                try:
                    line = self.proc.stdout.readline()
                finally:
                    timer.cancel()
                if not line:  # the zygote died: its child and the ranks go too
                    _kill_session(pid)
                    self.ok = False
                    return None
                rc = json.loads(line)["rc"]
            except BaseException:
                # (pytest-timeout's alarm, ^C, a reply that is not one): whatever
                # the zygote says next would come out of turn, so it goes, and
                # the child with it; the next command starts a new zygote
                if pid:
                    _kill_session(pid)
                self.ok = False
                self.close()
                raise
            text = out.read_text(errors="replace"), err.read_text(errors="replace")
        if fired.is_set() and rc == -signal.SIGKILL:
            raise subprocess.TimeoutExpired(["pdlife", *argv], timeout, *text)
        return rc, text[0], text[1]


def _kill_session(pid: int, fired: threading.Event | None = None) -> None:
    if fired is not None:
        fired.set()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):  # (before its setsid: no group yet)
        os.kill(pid, signal.SIGKILL)


_zygote: Zygote | None = None
_lock = threading.Lock()
#: a zygote that could not start is not tried again by this process
_unable = False


def run(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 240, fresh: bool = False
) -> subprocess.CompletedProcess[str]:
    """``python -m pdlife *argv`` as ``subprocess.run(..., capture_output=True,
    text=True)`` would run it: in a child of the zygote, or in a fresh
    interpreter when ``fresh`` or when no zygote can serve."""
    global _zygote, _unable
    env = dict(os.environ if env is None else env)
    if not fresh and not _unable and _lock.acquire(blocking=False):
        try:
            if _zygote is None or not _zygote.alive():
                if _zygote is not None:
                    _zygote.close()
                _zygote = Zygote()
                _unable = not _zygote.alive()
            done = _zygote.run(list(argv), env, timeout) if _zygote.alive() else None
            if done is not None:
                return subprocess.CompletedProcess(["pdlife", *argv], *done)
        finally:
            _lock.release()
    return subprocess.run(
        [sys.executable, "-m", "pdlife", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
