"""The processes of one multi-process test, always reaped.

They are forked from a server that imported vLLM once (``PRELOAD``), before
any transfer engine or thread started: no process of a test pays again for
importing vLLM (about 5 s of CPU each on this machine) nor for tearing its
interpreter down. Each dies with the server (``PR_SET_PDEATHSIG``), and the
server with the test run, so even a run killed outright leaves none behind.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import queue
import signal
import sys
import time

#: what the fork server imports before forking any process of a test
PRELOAD = [
    "pd_tp",
    "vllm.distributed.parallel_state",
    "vllm.distributed.kv_transfer.kv_connector.utils",
]
#: seconds a test waits for one answer of a process: the only deadline of a
#: test's processes, generous (a first answer includes starting a transfer
#: engine; on a loaded machine that has taken a minute)
ANSWER_TIMEOUT = 180
PR_SET_PDEATHSIG = 1


def _child(target, args):
    if sys.platform == "linux":  # killed with the process that forked it
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    target(*args)


class Fleet:
    """The processes of one test (see the module): when the ``with`` block ends
    they are asked to stop (``stop``), given ``grace`` seconds, then killed."""

    def __init__(self, grace=5.0):
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)
        self.stop = self.ctx.Event()
        self.grace = grace
        self.procs = []
        self.queues = []
        #: processes the test killed on purpose
        self.killed = set()

    def queue(self):
        q = self.ctx.Queue()
        self.queues.append(q)
        return q

    def start(self, target, *args):
        name = target.__name__
        p = self.ctx.Process(target=_child, args=(target, args), daemon=True, name=name)
        p.start()
        self.procs.append(p)
        return p

    def kill(self, p):
        self.killed.add(p.pid)
        p.kill()
        p.join(30)

    def take(self, q, what):
        """The next answer on ``q``, or a failure naming ``what`` (and the process
        that died meanwhile, if one did)."""
        deadline = time.monotonic() + ANSWER_TIMEOUT
        while time.monotonic() < deadline:
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                dead = [
                    f"{p.name} (pid {p.pid}, exit code {p.exitcode})"
                    for p in self.procs
                    if p.exitcode not in (None, 0) and p.pid not in self.killed
                ]
                if dead:
                    raise AssertionError(f"{what}: a process died: {', '.join(dead)}") from None
        raise AssertionError(f"{what}: no answer within {ANSWER_TIMEOUT} s")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop.set()
        deadline = time.monotonic() + self.grace
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        for q in self.queues:  # nothing left to flush to a reader gone
            q.cancel_join_thread()
            q.close()
