import pytest

from lifecycle import KVPoll, RequestTable, SingleRank, Stepper
from lifecycle.testing import StatusBoard

prometheus_client = pytest.importorskip("prometheus_client")


def test_metrics_follow_the_step():
    from pdlife.metrics import LifecycleMetrics

    reg = prometheus_client.CollectorRegistry()
    m = LifecycleMetrics(reg)
    clock = iter([0.0, 0.0, 2.5, 2.5])
    table, board = RequestTable(), StatusBoard()
    table.extend([1, 2, 3])
    st = Stepper(table, 0, poller=board, clock=lambda: next(clock))
    m.observe("decode", st.step(SingleRank()))
    board.set([1], KVPoll.Success)
    board.set([2], KVPoll.Failed)
    m.observe("decode", st.step(SingleRank()))

    def val(name, **labels):
        return reg.get_sample_value(name, labels)

    assert (
        val(
            "pdlife_transitions_total", queue="decode", **{"from": "Bootstrapping", "to": "Success"}
        )
        == 1
    )
    assert val("pdlife_failures_total", queue="decode", reason="unknown") == 1
    assert val("pdlife_time_in_state_seconds_count", queue="decode", state="Bootstrapping") == 2
    assert val("pdlife_time_in_state_seconds_sum", queue="decode", state="Bootstrapping") == 5.0
    assert val("pdlife_live_requests", queue="decode", state="Bootstrapping") == 1
    assert val("pdlife_stuck_requests", queue="decode") == 0


def test_failures_by_origin_gate_holds_and_their_exemplars():
    import numpy as np
    from prometheus_client.openmetrics.exposition import generate_latest

    from lifecycle.testing import SetGate, lockstep
    from pdlife.metrics import LifecycleMetrics

    reg = prometheus_client.CollectorRegistry()
    m = LifecycleMetrics(reg)
    gate = SetGate("hold")
    tables = [RequestTable(rank=r) for r in (0, 1)]
    boards = [StatusBoard(), StatusBoard()]
    steppers = []
    for r in (0, 1):
        tables[r].extend([1, 2, 3])
        steppers.append(Stepper(tables[r], r, poller=boards[r], gates=[gate] if r == 1 else []))
        steppers[r].record_holds = True
        boards[r].set([1, 2], KVPoll.Success)
    boards[1].set([3], KVPoll.Failed)  # rank 1 fails room 3: the origin on every rank
    gate.closed_rooms = {2}  # rank 1's gate holds room 2
    res = lockstep(steppers)
    m.observe("decode", res[0])  # rank 0's view: the failure came from rank 1
    m.observe_holds("decode", 1, steppers[1].last_holds(), now=10.0)
    m.observe_holds("decode", 1, steppers[1].last_holds(), now=11.0)  # still held: not again
    gate.closed_rooms = set()
    lockstep(steppers)
    m.observe_holds("decode", 1, steppers[1].last_holds(), now=12.5)

    def val(name, **labels):
        return reg.get_sample_value(name, labels)

    labels = {"queue": "decode", "reason": "unknown", "origin": "1"}
    assert val("pdlife_failures_by_origin_total", **labels) == 1
    assert val("pdlife_gate_holds_total", queue="decode", gate="user", rank="1") == 1
    assert val("pdlife_gate_hold_seconds_count", queue="decode", gate="user") == 1
    assert val("pdlife_gate_hold_seconds_sum", queue="decode", gate="user") == 2.5
    m.observe_step_time("decode", 0.002)
    assert val("pdlife_step_seconds_count", queue="decode") == 1
    text = generate_latest(reg).decode()
    assert '# {room="3"} 1.0' in text  # the failure's exemplar names its room
    assert '# {room="2"} 2.5' in text  # and the hold's
    assert np.array_equal(steppers[0].last_holds().get("user", []), [])  # rank 0 has no gate


def test_kv_pages_by_state_and_legs_by_peer_with_their_exemplars():
    from prometheus_client.openmetrics.exposition import generate_latest

    from lifecycle import FailureReason as R
    from pdlife.metrics import LifecycleMetrics
    from transport.connector.peer_legs import PeerLegs

    reg = prometheus_client.CollectorRegistry()
    m = LifecycleMetrics(reg)
    m.observe_pages("decode", {"held": 40, "quarantined": 8, "fenced": 2})
    m.observe_requests("prefill", {"Transferring": 5, "quarantined": 1, "fenced": 0})
    legs = PeerLegs()
    legs.asked(7, 0, [0, 1], now=0.0)
    legs.done(7, 0, 0, now=0.02)
    legs.failed(7, 0, R.WAITING_TIMEOUT, now=3.0)  # the leg to peer 1 was still open
    legs.asked(9, 0, [1], now=4.0)
    legs.failed(9, 0, R.ABORTED, now=4.5)  # a client's abort: nobody's fault
    m.observe_peer_legs("decode", legs.take())

    def val(name, **labels):
        return reg.get_sample_value(name, labels)

    assert val("pdlife_kv_pages", side="decode", state="quarantined") == 8
    assert val("pdlife_kv_pages", side="decode", state="fenced") == 2
    assert val("pdlife_requests", side="prefill", state="Transferring") == 5
    assert val("pdlife_requests", side="prefill", state="quarantined") == 1
    assert val("pdlife_peer_legs_total", side="decode", peer="0", outcome="done") == 1
    assert val("pdlife_peer_legs_total", side="decode", peer="1", outcome="waiting timeout") == 1
    assert val("pdlife_peer_legs_total", side="decode", peer="1", outcome="aborted") is None
    assert val("pdlife_peer_leg_seconds_count", side="decode", peer="1") == 1
    assert val("pdlife_peer_leg_seconds_sum", side="decode", peer="1") == 3.0
    assert '# {room="7"} 3.0' in generate_latest(reg).decode()  # the slow leg's room


def test_given_the_run_an_exemplar_names_its_rooms_trace():
    from prometheus_client.openmetrics.exposition import generate_latest

    from pdlife.metrics import LifecycleMetrics
    from pdlife.spans.select import trace_id
    from transport.connector.peer_legs import LegEnded

    reg = prometheus_client.CollectorRegistry()
    m = LifecycleMetrics(reg, run="1700000000.000001")
    m.observe_peer_legs("decode", [LegEnded(0, "done", 0.25, 77)])
    want = f'# {{room="77",trace_id="{trace_id("1700000000.000001", 77):032x}"}} 0.25'
    assert want in generate_latest(reg).decode()
