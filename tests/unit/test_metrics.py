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
