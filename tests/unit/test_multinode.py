"""Placement by role, results through the store, and naming what died."""

import json

import pytest

from pdlife.run import multinode
from support.store_stub import Store


class FakeDist:
    def __init__(self, said):
        self.said = said

    def all_gather_object(self, out, _mine):
        out[:] = self.said


def test_sides_come_from_the_roles_not_the_rank_order():
    # rendezvous put the decode node first
    said = [("decode", "192.0.2.2")] * 2 + [("prefill", "192.0.2.1")] * 2
    where = multinode.place(2, 4, 2, "prefill", "192.0.2.1", FakeDist(said))
    assert (where.logical, where.prefill, where.decode) == (0, (2, 3), (0, 1))
    assert where.hosts == ("192.0.2.1", "192.0.2.1", "192.0.2.2", "192.0.2.2")
    assert multinode.place(1, 4, 2, "decode", "192.0.2.2", FakeDist(said)).logical == 3


def test_without_roles_prefill_is_the_first_ranks():
    said = [("prefill", "a"), ("prefill", "a"), ("decode", "b"), ("decode", "b")]
    where = multinode.place(3, 4, 2, None, "b", FakeDist(said))
    assert (where.logical, where.prefill, where.decode) == (3, (0, 1), (2, 3))


def test_a_wrong_count_of_roles_is_named():
    said = [("prefill", "a")] * 3 + [("decode", "b")]
    with pytest.raises(
        ValueError,
        match=r"3 ranks said --role prefill but the prefill side has 2 \(--prefill x --prefill-dp\)",
    ):
        multinode.place(0, 4, 2, "prefill", "a", FakeDist(said))


def test_results_travel_through_the_store_and_the_silent_are_named(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "ranks").mkdir(parents=True)
    (src / "ranks" / "rank0.json").write_text(json.dumps({"rank": 0}))
    store = Store()
    multinode.publish(store, 0, src)  # rank 0 reported, no trace
    store.set("hb/1", "41")  # rank 1 started step 41, then went quiet
    where = multinode.Placement(0, (0,), (1,), ("192.0.2.1", "192.0.2.2"))
    dead, msgs = multinode.collect(store, 2, dst, patience=0.3, placement=where)
    assert json.loads((dst / "ranks" / "rank0.json").read_text()) == {"rank": 0}
    assert not (dst / "trace" / "rank0.jsonl").exists()
    assert dead == [1]
    assert msgs == [
        "rank 1 (decode, on 192.0.2.2) stopped: no result, last heartbeat at step 41, "
        "still for 0.3 s; its host or process died"
    ]


def test_a_lost_store_names_the_ranks_on_its_host():
    where = multinode.Placement(2, (0, 1), (2, 3), ("192.0.2.1",) * 2 + ("192.0.2.2",) * 2)
    msg = multinode.store_lost(where, ("192.0.2.1", 4242), RuntimeError("Connection reset\nmore"))
    assert msg == (
        "rank 2 (decode, on 192.0.2.2): the job's store at 192.0.2.1:4242 stopped answering "
        "(Connection reset); the node hosting it died with rank(s) [0, 1]; exiting"
    )


WATCHER = r"""
import sys, time
from pdlife.run import multinode
where = multinode.Placement(1, (0,), (1,), ("10.0.0.1", "10.0.0.2"))
watch = multinode.StoreWatch(where, ("127.0.0.1", int(sys.argv[1])))
watch.start()
if sys.argv[2] == "done":
    watch.done()
assert watch.watching.wait(30)
time.sleep(0.2)  # its wait is with the store
print("watching", flush=True)
time.sleep(30)
"""

NODE0 = r"""
import sys, time
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
print(store.port, flush=True)  # the OS picked it as the store bound it
time.sleep(60)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("finished", [False, True])
def test_a_lost_store_is_said_at_once_unless_the_job_ended(finished):
    import subprocess
    import sys

    run = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    node0 = subprocess.Popen([sys.executable, "-c", NODE0], **run)
    try:
        port = int(node0.stdout.readline().strip())
        child = subprocess.Popen(
            [sys.executable, "-c", WATCHER, str(port), "done" if finished else "run"], **run
        )
        assert child.stdout.readline().strip() == "watching"
    finally:
        node0.kill()  # node 0 dies, and its store with it
        node0.wait()
    if finished:  # the job's normal end: nothing to say, it runs on
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=3)
        child.kill()
        assert "stopped answering" not in child.communicate()[1]
        return
    # the watcher's wait fails as the connection drops; what it would otherwise
    # wait for is its store wait's own timeout (an hour): 30 s is margin enough
    _, err = child.communicate(timeout=30)
    assert child.returncode == 4, err
    lines = [x for x in err.splitlines() if "stopped answering" in x]
    assert len(lines) == 1 and lines[0].startswith(
        "rank 1 (decode, on 10.0.0.2): the job's store at 127.0.0.1:"
    ), err
