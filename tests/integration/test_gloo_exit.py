"""Tensors lent to gloo stay held until its threads let go, and a program
that steps and exits ends cleanly (real gloo ranks on 127.0.0.1).

gloo destroys a finished reduce's work object, and with it the references to
its tensors, on its own thread, which can be after ``wait()`` returns. A
tensor Python had dropped by then is released from that thread, which takes
the GIL; during interpreter finalization that ends the thread, and the
process aborts ("terminate called without an active exception")."""

import os
import subprocess
import sys
import textwrap

import pytest

from lifecycle.testing.spawn import run_ranks, store_server

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _lent_run(rank, world):
    import numpy as np
    from torch.distributed import distributed_c10d as c10d

    from lifecycle import TorchCollective
    from lifecycle.drive import lent

    store = c10d._get_default_store()
    coll = TorchCollective()
    buf = np.full(64, rank + 1, dtype=np.uint8)
    seen = {}
    if rank == 0:
        work = coll.start_all_reduce_min(buf)  # rank 1 joins only once told to
        (tensor,) = coll.lent_tensors()
        seen["held in flight"] = any(t is tensor for t in lent.outstanding())
        seen["left in flight"] = lent.settle(timeout=0)
        store.set("pdlife/test/go", "1")
        work.wait()
    else:
        store.wait(["pdlife/test/go"])
        coll.all_reduce_min(buf)
    seen["left after"] = lent.settle(timeout=30)
    seen["min"] = int(buf.max())
    # another buffer replaces the cached one; a gather lends its own tensors
    other = np.full(32, rank + 1, dtype=np.uint8)
    coll.all_reduce_min(other)
    rows = coll.all_gather(np.array([rank, 7], dtype=np.int32))
    seen["gathered"] = rows.tolist()
    seen["left at the end"] = lent.settle(timeout=30)
    seen["outstanding"] = len(lent.outstanding())
    return seen


def test_a_reduce_in_flight_holds_its_tensor_until_gloo_lets_go():
    first, second = run_ranks(_lent_run, 2)
    assert first["held in flight"] is True
    assert first["left in flight"] >= 1  # gloo holds it: a zero wait gives up
    for seen in (first, second):
        assert seen["left after"] == 0
        assert seen["min"] == 1
        assert seen["gathered"] == [[0, 7], [1, 7]]
        assert seen["left at the end"] == 0
        assert seen["outstanding"] == 0


_PROGRAM = textwrap.dedent(
    """
    import sys
    from datetime import timedelta

    import numpy as np
    import torch.distributed as dist
    from torch.distributed import TCPStore

    from lifecycle import KVPoll, RequestTable, Stepper, TorchCollective

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)


    class Poller:
        def __init__(self, n):
            self.status = np.full(n + 1, int(KVPoll.Transferring), dtype=np.int8)

        def poll_many(self, rooms, indices):
            return self.status[indices]


    n = 64
    table = RequestTable(rank=rank, capacity=n)
    table.extend(
        np.arange(1, n + 1, dtype=np.uint64),
        state=KVPoll.Transferring,
        handle_indices=np.arange(1, n + 1),
    )
    stepper = Stepper(table, rank, poller=Poller(n))
    coll = TorchCollective()
    for _ in range(90):
        stepper.step(coll)
    for _ in range(20):  # the reduce overlapping a forward pass (a callback chained on it)
        stepper.start(coll)
        stepper.finish()
    # the program ends right after its last reduce, as a serving process may
    """
)


def test_programs_that_step_and_exit_end_cleanly(tmp_path):
    """Three pairs of fresh interpreters step and end; before the lent tensors
    were held, one pair in eight to one in four had a rank abort as it exited
    (2 of 16, 5 of 20)."""
    script = tmp_path / "step_and_exit.py"
    script.write_text(_PROGRAM)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=os.pathsep.join(sys.path))
    for attempt in range(3):
        server = store_server(2)
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), str(rank), str(server.port)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        try:
            outs = [p.communicate(timeout=60) for p in procs]
        finally:
            for p in procs:
                p.kill()
        for rank, (p, (_, err)) in enumerate(zip(procs, outs)):
            assert "terminate called" not in err, (attempt, rank, err[-2000:])
            assert p.returncode == 0, (attempt, rank, p.returncode, err[-2000:])
        del server
