"""The vLLM connector's scheduler side as a declared machine: vLLM's calls in
order move each request along EDGES; any other order is refused, naming the
request, its phase and the call, and changes nothing."""

import pytest

from vllm_connector import ParamsError, TransferParams
from vllm_connector.scheduler import EDGES, Load, Meta, Phase, SchedulerCore, SchedulerProtocolError

REMOTE = TransferParams.answer(
    room=91,
    epoch=0,
    engine_id="p0",
    request_id="cmpl-7-p",
    host="127.0.0.1",
    port=5600,
    tp_size=2,
    block_ids=[[3, 4]],
)


def core():
    return SchedulerCore("d0", "127.0.0.1", 5601, 1)


def test_decode_loads_the_prompt_once_and_forgets_it_when_received():
    s = core()
    assert s.matched("r", dict(REMOTE), prompt_tokens=32, computed=0) == (32, True)
    assert s.matched("r", dict(REMOTE), prompt_tokens=32, computed=0) == (32, True)  # asked again
    assert s.phase("r") is Phase.ASKED
    s.allocated("r", [[10, 11]], external_tokens=32)
    meta = s.build_meta()
    load = meta.loads["r"]
    assert load == Load(91, 0, ((10, 11),), TransferParams.from_params("r", dict(REMOTE)))
    assert s.phase("r") is Phase.LOADING
    assert s.build_meta() == Meta()  # the load goes out once
    s.workers_report(set(), {"r"})
    assert s.phase("r") is None and s.reqs == {}
    # then it finishes as any request does: nothing held for it
    assert s.finished("r", {"do_remote_prefill": False}, [[10, 11]], normal=True) == (False, None)


def test_a_request_without_remote_prefill_loads_nothing():
    s = core()
    assert s.matched("r", None, 32, 0) == (0, False)
    assert s.matched("r", {"do_remote_decode": True}, 32, 0) == (0, False)
    assert s.matched("r", dict(REMOTE), 32, 32) == (0, False)  # every token computed here
    s.allocated("r", [[1]], 0)
    assert s.reqs == {} and s.build_meta() == Meta()


def test_prefill_holds_its_blocks_for_decode_and_frees_them_when_sent():
    s = core()
    held, params = s.finished("cmpl-7", {"do_remote_decode": True}, [[3, 4]], normal=True)
    assert held is True
    back = TransferParams.from_params("cmpl-7-d", params)
    assert back.block_ids == ((3, 4),) and back.request_id == "cmpl-7"
    assert (back.engine_id, back.host, back.port) == ("d0", "127.0.0.1", 5601)
    meta = s.build_meta()
    assert meta.sends["cmpl-7"].room == back.room and meta.sends["cmpl-7"].block_ids == ((3, 4),)
    assert s.phase("cmpl-7") is Phase.SENDING
    s.workers_report({"cmpl-7"}, set())
    assert s.reqs == {}


def test_prefill_aborted_or_without_blocks_frees_at_once():
    s = core()
    assert s.finished("a", {"do_remote_decode": True}, [[3]], normal=False) == (False, None)
    assert s.finished("b", {"do_remote_decode": True}, [[]], normal=True) == (False, None)
    assert s.finished("c", None, [[3]], normal=True) == (False, None)
    assert s.reqs == {}


@pytest.mark.parametrize(
    ("steps", "held", "aborts"),
    [
        (["match"], False, {}),
        (["match", "alloc"], False, {}),  # planned, never sent to the workers
        (["match", "alloc", "meta"], True, {"r": 91}),  # in flight: held until drained
    ],
)
def test_decode_finished_early_holds_blocks_only_while_a_load_is_in_flight(steps, held, aborts):
    s = core()
    for step in steps:
        if step == "match":
            s.matched("r", dict(REMOTE), 32, 0)
        elif step == "alloc":
            s.allocated("r", [[10, 11]], 32)
        else:
            s.build_meta()
    assert s.finished("r", dict(REMOTE), [[10, 11]], normal=False) == (held, None)
    meta = s.build_meta()
    assert dict(meta.aborts) == aborts and not meta.loads
    if held:
        assert s.phase("r") is Phase.DRAINING
        s.workers_report(set(), {"r"})  # the load ended at the workers: still draining
        assert s.phase("r") is Phase.DRAINING
        s.workers_report({"r"}, set())  # drained: vLLM frees the blocks now
    assert s.reqs == {}


def test_a_call_out_of_order_is_refused_naming_request_phase_and_call():
    s = core()
    s.matched("r", dict(REMOTE), 32, 0)
    s.allocated("r", [[10]], 32)
    s.build_meta()
    s.finished("r", dict(REMOTE), [[10]], normal=False)
    before = dict(s.reqs)
    with pytest.raises(
        SchedulerProtocolError, match=r"request r: 'finish' while in phase draining"
    ):
        s.finished("r", dict(REMOTE), [[10]], normal=False)  # vLLM calls it once
    assert s.reqs == before


def test_malformed_params_change_nothing():
    s = core()
    with pytest.raises(ParamsError, match=r'request r: kv_transfer_params\["remote_port"\]'):
        s.matched("r", {**REMOTE, "remote_port": "x"}, 32, 0)
    assert s.reqs == {} and s.build_meta() == Meta()


def test_stale_worker_reports_are_ignored():
    s = core()
    s.workers_report({"gone"}, {"gone"})
    assert s.reqs == {}


def test_the_table_enters_and_leaves_every_phase():
    entered = {n for n in EDGES.values() if n is not None}
    assert entered == set(Phase) == {p for p, _ in EDGES if p is not None}


@pytest.mark.parametrize("finished_by_vllm", [True, False])
def test_a_failed_load_is_quarantined_until_its_blocks_drain(finished_by_vllm):
    """vLLM is told at once (it fails or recomputes the request); the blocks stay
    held by this side until the workers report no write can land."""
    s = core()
    s.matched("r", dict(REMOTE), 32, 0)
    s.allocated("r", [[10, 11]], 32)
    s.build_meta()
    s.workers_report(set(), {"r"}, {"r"})
    assert s.phase("r") is Phase.QUARANTINED
    assert s.take_holds() == ([(10, 11)], [])
    if finished_by_vllm:  # policy fail: vLLM ends the request and frees its own hold
        assert s.finished("r", dict(REMOTE), [[10, 11]], normal=False) == (False, None)
        assert s.phase("r") is Phase.QUARANTINED
    assert s.take_holds() == ([], [])
    s.workers_report({"r"}, set(), set())  # drained
    assert s.take_holds() == ([], [(10, 11)]) and s.reqs == {}


def test_a_load_that_fails_after_an_abort_is_held_by_vllm_not_here():
    s = core()
    s.matched("r", dict(REMOTE), 32, 0)
    s.allocated("r", [[10]], 32)
    s.build_meta()
    s.finished("r", dict(REMOTE), [[10]], normal=False)  # draining: vLLM holds the blocks
    s.workers_report(set(), {"r"}, {"r"})
    assert s.phase("r") is Phase.DRAINING and s.take_holds() == ([], [])
    s.workers_report({"r"}, set(), set())
    assert s.reqs == {}
