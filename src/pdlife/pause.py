"""Stop this whole process for a while, as a long GC pause or a starved host
would: every thread (the scheduler's, the connector's, the engine's) stops,
so its heartbeats stop too. A child process resumes it."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

__all__ = ["pause_process"]

logger = logging.getLogger(__name__)

# The child waits until this process is stopped before it starts the clock, so a
# SIGCONT can never come before the SIGSTOP (which would stop it for good).
_RESUMER = """
import os, signal, sys, time
pid, seconds = int(sys.argv[1]), float(sys.argv[2])

def stat():
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], fields[19]  # state, start time (the pid is not reused unseen)

try:
    state, born = stat()
    deadline = time.monotonic() + 30
    while state not in ("T", "t") and time.monotonic() < deadline:
        time.sleep(0.001)
        state, _ = stat()
    time.sleep(seconds)
    if stat()[1] == born:  # still the process that asked
        os.kill(pid, signal.SIGCONT)
except OSError:
    pass  # it is gone (killed while stopped): nothing to resume
"""


def pause_process(seconds: float) -> None:
    """Stop this process for ``seconds`` (Linux: the resumer reads ``/proc``)."""
    me = os.getpid()
    resumer = subprocess.Popen(
        [sys.executable, "-c", _RESUMER, str(me), repr(float(seconds))],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.kill(me, signal.SIGSTOP)
    try:
        resumer.wait(timeout=5)  # it ends once it has resumed us
    except subprocess.TimeoutExpired:
        logger.debug("the resumer of a pause has not ended; left to the system")
