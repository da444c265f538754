"""One decode rank of the simulator, in process (fake backend, a group of one):
the run's own bookkeeping -- buffers released, limits and faults reported."""

import numpy as np
import pytest

from lifecycle import SingleRank
from lifecycle.status import T
from pdlife.cluster.config import SimConfig, Workload
from pdlife.cluster.plan_doc import parse_plan
from pdlife.sim.hooks import DrainPoller
from pdlife.sim.rank import RankRun
from support.store_stub import Store


def decode_rank(tmp_path, plan=None, **kw):
    kw.setdefault("requests", 20)
    kw.setdefault("abort_prob", 0.0)
    cfg = SimConfig(
        prefill=1, decode=1, backend="fake", plan=parse_plan(plan or {}), fault_mode="step", **kw
    )
    return RankRun(cfg, 1, tmp_path, SingleRank(), Store())


FAIL_FIRST = {"faults": [{"kind": "fail", "rank": 1, "request": 0}]}
# fails request 0 once it holds a metadata slot and pages (held in transfer first)
FAIL_IN_FLIGHT = {
    "faults": [
        {"kind": "hold_gate", "rank": 1, "request": 0, "steps": 5},
        {"kind": "fail", "rank": 1, "request": 0, "step": 2},
    ]
}


def test_a_clean_run_finishes_everything(tmp_path):
    res = decode_rank(tmp_path).run()
    assert res["problems"] == [] and res["violations"] == []
    assert res["unfinished"] == 0 and len(res["outcome"]) == 20
    assert (res["leaked_slots"], res["leaked_kv_pages"]) == (0, 0)


def test_the_fake_backend_hears_the_other_sides_failures_and_tells_its_own(tmp_path):
    """A failure the other side reports fails the request here with its reason,
    whether it was live here already or not yet admitted; what fails here is
    told to every rank of the other side, but not what the other side told."""
    from lifecycle.reasons import FailureReason
    from pdlife.cluster.config import Workload

    run = decode_rank(tmp_path, FAIL_FIRST)
    rooms = Workload(run.cfg).all_rooms(20)
    late = rooms[15]  # not admitted yet when the word comes
    for room in (rooms[3], late):
        run.store.queue_push("fakepeer/1", f"{room} {int(FailureReason.TRANSFER_ERROR)}".encode())
    res = run.run()
    assert res["unfinished"] == 0 and res["problems"] == []
    for room in (rooms[3], late):
        assert res["outcome"][str(room)][:2] == ["Failed", int(FailureReason.TRANSFER_ERROR)]
    # its own failure (request 0, injected here) went to prefill rank 0, once
    told = [bytes(w).split() for w in run.store.d.get("fakepeer/0", [])]
    assert told == [[str(rooms[0]).encode(), str(int(FailureReason.INJECTED_FAULT)).encode(), b"0"]]


def test_a_drain_entry_agreed_failed_gives_its_buffers_back(tmp_path, monkeypatch):
    def broken(self, rooms, indices):
        raise RuntimeError("drain poll broke")

    monkeypatch.setattr(DrainPoller, "poll_many", broken)
    res = decode_rank(tmp_path, FAIL_IN_FLIGHT, max_steps=60).run()
    assert res["drain_failed"] == 1
    assert (res["leaked_slots"], res["leaked_kv_pages"]) == (0, 0)
    assert res["problems"] == []
    failed = [o for o in res["outcome"].values() if o[0] == "Failed"]
    assert len(failed) == 1


def test_pinned_buffers_and_max_steps_fail_the_run_and_say_why(tmp_path, monkeypatch):
    def never(self, rooms, indices):
        return np.full(rooms.size, T, dtype=np.int8)  # the peer never stops writing

    monkeypatch.setattr(DrainPoller, "poll_many", never)
    res = decode_rank(tmp_path, FAIL_IN_FLIGHT, max_steps=40, stuck_after=10_000).run()
    text = " ".join(res["problems"])
    assert "--max-steps 40" in text
    assert "still pinned" in text and "1 failed request" in text
    assert res["leaked_slots"] == 1 and res["leaked_kv_pages"] > 0
    # all of it pinned by the failed request still draining: nothing else leaked
    assert (res["held_slots"], res["held_kv_pages"]) == (1, res["leaked_kv_pages"])


def test_hitting_max_steps_names_the_unfinished(tmp_path):
    res = decode_rank(tmp_path, requests=100, max_steps=2).run()
    assert len(res["problems"]) == 1
    assert "stopped at --max-steps 2 with" in res["problems"][0]
    assert res["unfinished"] > 0


def test_a_targeted_fault_that_never_fired_is_reported(tmp_path):
    plan = {
        "faults": [
            {"kind": "fail", "rank": 1, "request": 3, "step": 900},
            {"kind": "delay", "rank": 1, "request": 4, "steps": 2},
        ]
    }
    res = decode_rank(tmp_path, plan).run()
    assert res["unfired_faults"] == ["fail on rank 1, request 3, step 900"]


def test_workload_rooms_are_distinct_reproducible_and_in_range():
    cfg = SimConfig(requests=50_000, seed=3)
    rooms = Workload(cfg).all_rooms(50_000)
    assert len(set(rooms)) == 50_000
    assert min(rooms) >= 1 and max(rooms) <= 2**62
    assert Workload(cfg).all_rooms(10) == rooms[:10]
    assert Workload(SimConfig(seed=4)).all_rooms(10) != rooms[:10]
    w = Workload(cfg)
    assert [w[i] for i in (0, 4095, 4096, 49_999)] == [rooms[i] for i in (0, 4095, 4096, 49_999)]


@pytest.mark.parametrize(
    ("step", "start", "room", "upto", "want"),
    [
        (1, 0, 100, None, range(0, 16)),  # 16 arrive per step
        (3, 16, 100, None, range(16, 48)),  # behind schedule: catch up
        (3, 16, 5, None, range(16, 21)),  # admission control
        (3, 16, 100, 20, range(16, 20)),  # the soak's agreed limit
        (3, 48, 100, None, range(48, 48)),
    ],
)
def test_arrivals_respect_schedule_room_and_limit(step, start, room, upto, want):
    assert Workload(SimConfig(requests=1000)).arriving(step, start, room, upto) == want


def test_a_plan_in_step_mode_keeps_step_aborts_whatever_the_default(tmp_path):
    cfg = SimConfig(
        prefill=1,
        decode=1,
        backend="fake",
        requests=200,
        abort_prob=0.2,
        plan=parse_plan({"mode": "step"}),
        fault_mode="phase",
    )
    assert cfg.mode == "step"
    res = RankRun(cfg, 1, tmp_path, SingleRank(), Store()).run()
    aborted = [o for o in res["outcome"].values() if o[:2] == ["Failed", 0]]
    assert res["fault_mode"] == "step" and res["decisions"] == []
    assert 10 < len(aborted) < 80


def test_a_prefill_dp_group_serves_its_share_and_decode_names_the_group(tmp_path, monkeypatch):
    cfg = SimConfig(prefill=1, prefill_dp=3, decode=1, backend="fake", requests=20, abort_prob=0.0)
    res = RankRun(cfg, 1, tmp_path / "p", SingleRank(), Store()).run()  # group 1 of 3
    rooms = Workload(cfg).all_rooms(20)
    assert sorted(res["outcome"]) == sorted(str(rooms[i]) for i in range(1, 20, 3))
    assert res["unfinished"] == 0 and res["group"] == "prefill/1"

    named = {}
    from transport.backends.fake import FakeReceiver

    real_init = FakeReceiver.init

    def init(self, prefill_dp_rank=None):
        named[self.bootstrap_room] = prefill_dp_rank
        real_init(self, prefill_dp_rank)

    monkeypatch.setattr(FakeReceiver, "init", init)
    res = RankRun(cfg, 3, tmp_path / "d", SingleRank(), Store()).run()
    assert len(res["outcome"]) == 20 and res["group"] == "decode"
    assert named == {rooms[i]: i % 3 for i in range(20)}


def test_a_decode_rank_with_state_and_a_cached_prefix_sends_the_rest(tmp_path, monkeypatch):
    sent = {}
    from transport.backends.fake import FakeReceiver

    real = FakeReceiver.send_metadata

    def send_metadata(self, pages, slot, state_indices=None, decode_prefix_len=0):
        sent[self.bootstrap_room] = (len(pages), state_indices, decode_prefix_len, slot)
        real(self, pages, slot, state_indices, decode_prefix_len)

    monkeypatch.setattr(FakeReceiver, "send_metadata", send_metadata)
    run = decode_rank(tmp_path, state=True, prefix_pages=3, page_size=4, metadata_slots=16)
    res = run.run()
    assert res["violations"] == [] and res["unfinished"] == 0
    assert res["bytes_checked"] > 0  # every committed metadata row, byte for byte
    w = run.work
    uncached = 0
    for i in range(20):
        room, pages, _ = w.request(i)
        n, state, prefix, slot = sent[room]
        cached = 3 if pages > 3 else 0
        assert (n, prefix) == (pages - cached, cached * 4)
        assert [s.tolist() for s in state] == [[16 - 1 - slot]]
        uncached += n
    # what prefill must send this rank: uncached pages, 2 layers, both of the 2 KV heads
    page = 4 * 2 * 128  # tokens x heads x head bytes
    rows = sum(run.meta.buf_infos()[2]) + 64 + 192  # metadata row, state row
    assert res["bytes_asked"] == res["bytes_due"] == uncached * 2 * page + 20 * rows


def test_decodes_transfer_queue_is_transferring_for_its_faults():
    """A receiver reports WaitingForInput until every byte landed: in decode's
    transfer queue a fault at Transferring fires all the same (the floor), at
    once rather than once the data has all landed; elsewhere it waits."""
    from types import SimpleNamespace

    from lifecycle.protocols import StepContext
    from pdlife.cluster.plan import RankFaults
    from pdlife.sim.hooks import QueueFaults

    plan = parse_plan({"faults": [{"kind": "fail", "rank": 2, "room": 7, "at": "Transferring"}]})
    rooms = np.array([7], np.uint64)
    w, f = np.array([2], np.int8), 0
    for floor, want in ((None, False), (3, True)):
        faults = RankFaults(plan, 2, [], mode="phase")
        poller = SimpleNamespace(observed=(rooms, w.astype(np.int64)))
        hook = QueueFaults(faults, poller, None, lambda _room: None, floor)
        ctx = StepContext(0, 1, 0.0, rooms, w.copy(), np.zeros(1, np.int64))
        assert hook.inject(ctx).tolist() == [want]
    # a row already Failed stays so: no floor lifts it
    faults = RankFaults(plan, 2, [], mode="phase")
    hook = QueueFaults(faults, SimpleNamespace(observed=None), None, lambda _room: None, 3)
    failed = np.array([f], np.int8)
    assert hook.inject(StepContext(0, 1, 0.0, rooms, failed, np.zeros(1, np.int64))).tolist() == [
        False
    ]
