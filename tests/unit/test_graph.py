import numpy as np
import pytest

from lifecycle import FailureReason, KVPoll
from lifecycle.errors import IllegalTransition, UnknownTrigger
from lifecycle.rules import batch
from lifecycle.rules.graph import EDGES, GATES, TRIGGERS, EdgeKind
from lifecycle.rules.reference import RequestMachine
from support.status import B, F, S, T, W

DECLARED = [(e.trigger, s, e.dest, e.guard) for e in EDGES for s in e.sources]


def test_kvpoll_values_are_the_fields():
    assert [(p.name, int(p)) for p in KVPoll] == [
        ("Failed", 0),
        ("Bootstrapping", 1),
        ("WaitingForInput", 2),
        ("Transferring", 3),
        ("Success", 4),
    ]
    assert S.terminal and F.terminal and not T.terminal


@pytest.mark.parametrize(("trigger", "src", "dst", "guard"), DECLARED)
def test_every_declared_edge_in_both_executors(trigger, src, dst, guard):
    m = RequestMachine(room=7, initial=src)
    assert m.fire(trigger) is True
    assert m.state == dst
    new, illegal = batch.fire(np.array([src]), batch.trigger_ids([trigger]))
    assert not illegal[0] and new[0] == dst
    m.close()


@pytest.mark.parametrize(("trigger", "src", "dst", "guard"), [d for d in DECLARED if d[3]])
def test_closed_guard_keeps_state(trigger, src, dst, guard):
    m = RequestMachine(room=7, initial=src)
    assert m.fire(trigger, **{guard: False}) is False
    assert m.state == src
    new, illegal = batch.fire(
        np.array([src]), batch.trigger_ids([trigger]), guard=np.array([False])
    )
    assert not illegal[0] and new[0] == src


def _undeclared():
    declared = {(t, s) for t, s, _, _ in DECLARED}
    return [(t, s) for t in TRIGGERS for s in KVPoll if (t, s) not in declared]


@pytest.mark.parametrize(("trigger", "src"), _undeclared())
def test_undeclared_edges_are_illegal_in_both(trigger, src):
    m = RequestMachine(room=9, rank=3, initial=src)
    with pytest.raises(IllegalTransition) as ei:
        m.fire(trigger)
    assert ei.value.room == 9 and ei.value.rank == 3 and ei.value.src == src
    assert "room=9" in str(ei.value) and "rank 3" in str(ei.value)
    new, illegal = batch.fire(np.array([src]), batch.trigger_ids([trigger]))
    assert illegal[0] and new[0] == src


@pytest.mark.parametrize(
    ("src", "dst"), [(S, B), (S, T), (S, F), (F, B), (F, S), (T, W), (W, B), (T, B)]
)
def test_regressions_and_leaving_terminal_are_illegal(src, dst):
    m = RequestMachine(room=1, initial=src)
    with pytest.raises(IllegalTransition, match=f"{src.name} -> {dst.name}"):
        m.advance(dst)
    new, trig, illegal = batch.advance(np.array([src]), np.array([dst]))
    assert illegal[0] and new[0] == src and trig[0] == -1


@pytest.mark.parametrize(
    ("src", "dst", "trigger"),
    [
        (B, W, "handshake"),
        (B, T, "start_transfer"),
        (B, S, "complete"),
        (W, T, "start_transfer"),
        (W, S, "complete"),
        (T, S, "complete"),
        (B, F, "fail"),
        (T, F, "fail"),
    ],
)
def test_advance_takes_the_declared_trigger(src, dst, trigger):
    m = RequestMachine(room=1, initial=src)
    assert m.advance(dst) == trigger
    new, trig, illegal = batch.advance(np.array([src]), np.array([dst]))
    assert not illegal[0] and new[0] == dst and TRIGGERS[trig[0]] == trigger


def test_abort_reason_takes_abort_trigger():
    from lifecycle import FailureReason

    m = RequestMachine(room=1, initial=W)
    assert m.advance(F, FailureReason.ABORTED, origin=2) == "abort"
    assert m.reason == FailureReason.ABORTED and m.origin == 2
    _, trig, _ = batch.advance(np.array([W]), np.array([F]), np.array([FailureReason.ABORTED]))
    assert TRIGGERS[trig[0]] == "abort"


def test_unknown_trigger():
    m = RequestMachine(room=1)
    with pytest.raises(UnknownTrigger, match="declares"):
        m.fire("teleport")
    with pytest.raises(UnknownTrigger):
        batch.trigger_ids(["teleport"])
    with pytest.raises(UnknownTrigger):
        batch.fire(np.array([1]), np.array([99]))


def test_gates_only_demote_success():
    vals = np.array([F, B, W, T, S], dtype=np.int8)
    out = batch.demote(vals, "hold_metadata", np.ones(5, dtype=bool))
    assert out.tolist() == [F, B, W, T, T]
    assert all(e.sources == (S,) and e.dest == T for e in EDGES if e.kind is EdgeKind.DEMOTE)


def test_terminal_states_have_no_progress_or_fail_edges():
    for e in EDGES:
        if e.kind is not EdgeKind.DEMOTE:
            assert not any(s.terminal for s in e.sources)


def test_a_misspelt_gate_source_is_named_by_the_import_time_check():
    """A copy of the tables with one gate's source misspelt: the check that
    runs at import names it (the step would otherwise never ask that gate)."""
    import attrs

    from lifecycle.core.sources import GATE_SOURCES, SOURCES, check_sources
    from lifecycle.rules.graph import GATES, VERDICTS

    check_sources(VERDICTS, GATES, SOURCES, GATE_SOURCES)  # the real tables agree
    gates = tuple(
        attrs.evolve(g, source="metadata_pendng") if g.source == "metadata_pending" else g
        for g in GATES
    )
    with pytest.raises(AssertionError, match=r"GATES name source\(s\) \['metadata_pendng'\]"):
        check_sources(VERDICTS, gates, SOURCES, GATE_SOURCES)


def test_a_misspelt_verdict_source_is_named_too():
    import attrs

    from lifecycle.core.sources import GATE_SOURCES, SOURCES, check_sources
    from lifecycle.rules.graph import GATES, VERDICTS

    verdicts = tuple(
        attrs.evolve(v, sources=("abort_flg", "backend")) if "abort_flag" in v.sources else v
        for v in VERDICTS
    )
    with pytest.raises(AssertionError) as e:
        check_sources(verdicts, GATES, SOURCES, GATE_SOURCES)
    assert "['abort_flg']" in str(e.value) and "['abort_flag']" in str(e.value)


def test_gates_are_asked_in_table_order(monkeypatch):
    """The step asks each gate's source in GATES order, through the registry."""
    import numpy as np

    from lifecycle import RequestTable, SingleRank, Stepper
    from lifecycle.core import sources as src
    from lifecycle.testing import StatusBoard

    asked = []
    for name, fn in list(src.GATE_SOURCES.items()):
        monkeypatch.setitem(
            src.GATE_SOURCES,
            name,
            lambda x, closed, _n=name, _f=fn: asked.append(_n) or _f(x, closed),
        )

    class Closed:
        name = "never"

        def closed(self, rooms, hidx):
            return np.ones(rooms.size, dtype=bool)

    table, board = RequestTable(), StatusBoard()
    table.add(1)
    board.set([1], 4)
    stepper = Stepper(table, 0, poller=board, gates=[Closed()])
    res = stepper.step(SingleRank())
    assert asked == [g.source for g in GATES]
    assert int(res.statuses[0]) == 3  # held at Transferring by the user gate


def test_the_abort_reason_is_declared_on_its_edge_and_both_executors_read_it():
    """Which failure edge a reason takes is the edges' declaration, not code:
    ABORTED takes ``abort``, every other reason ``fail``, in the batch and
    the reference executors alike."""
    from lifecycle.rules.batch import advance
    from lifecycle.rules.graph import FAIL_TRIGGER, edges_for

    assert edges_for("abort")[0].reasons == (FailureReason.ABORTED,)
    assert FAIL_TRIGGER[FailureReason.ABORTED] == "abort"
    assert {FAIL_TRIGGER[r] for r in FailureReason if r is not FailureReason.ABORTED} == {"fail"}
    for reason in FailureReason:
        _, trig, _ = advance(np.array([1]), np.array([0]), np.array([int(reason)]))
        ref = RequestMachine(room=1, initial=KVPoll.WaitingForInput)
        assert TRIGGERS[int(trig[0])] == ref.advance(KVPoll.Failed, reason) == FAIL_TRIGGER[reason]


def test_a_reason_code_outside_the_table_takes_the_unclaimed_reasons_edge():
    from lifecycle.rules.batch import advance

    _, trig, _ = advance(np.array([1, 1, 1]), np.array([0, 0, 0]), np.array([-1, 0, 99]))
    assert [TRIGGERS[int(t)] for t in trig] == ["fail", "abort", "fail"]
