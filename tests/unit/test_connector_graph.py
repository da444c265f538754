"""The connector's declared per-request protocol: tables, reference machine, diagram."""

import numpy as np
import pytest
from transitions import MachineError

from pdlife.cli import main
from transport.connector.core.graph import (
    BOOTSTRAPPING,
    DEST,
    EDGES,
    IS_TERMINAL,
    POLL,
    READY,
    ROLE_ID,
    ROLES,
    TERMINAL,
    TRIGGER_ID,
    TRIGGERS,
    Phase,
    ProtocolError,
    build_machine,
    fire,
)

ALL = [(r, t, p) for r in ROLES for t in TRIGGERS for p in Phase]


class Model:
    pass


@pytest.mark.parametrize(("role", "trigger", "phase"), ALL)
def test_tables_and_machine_agree_on_every_pair(role, trigger, phase):
    edge = next((e for e in EDGES if e.trigger == trigger and role in e.roles), None)
    new, illegal = fire(np.array([phase]), trigger, role)
    m = Model()
    build_machine(m, role, initial=phase)
    if edge is None:  # a move this side never makes: refused by the table, absent from the machine
        assert illegal[0] and new[0] == phase
        assert not hasattr(m, trigger)
    elif phase in edge.sources:  # every declared edge moves, in both executors
        assert not illegal[0]
        assert new[0] == edge.dest
        getattr(m, trigger)()
        assert m.state == edge.dest
    else:  # every undeclared move is refused by both
        assert illegal[0]
        assert new[0] == phase
        with pytest.raises(MachineError):
            getattr(m, trigger)()


def test_terminal_phases_latch_and_are_the_reusable_ones():
    assert set(TERMINAL) == {Phase.Done, Phase.Drained}
    for p in TERMINAL:
        assert (DEST[:, :, p] == -1).all()
        assert IS_TERMINAL[p]
    assert not IS_TERMINAL[Phase.Aborted]  # quarantined: writes may still land
    assert not IS_TERMINAL[Phase.Fenced]  # its writer may resume: never reused


def test_fire_moves_a_batch_and_flags_only_illegal_rows():
    ph = np.array([Phase.Bootstrap, Phase.Writing, Phase.Done, Phase.Aborted], dtype=np.int8)
    new, illegal = fire(ph, "abort", "prefill")
    assert new.tolist() == [Phase.Aborted, Phase.Aborted, Phase.Done, Phase.Aborted]
    assert illegal.tolist() == [False, False, True, True]
    with pytest.raises(ValueError, match="unknown protocol trigger"):
        fire(ph, "teleport", "prefill")


def test_each_side_takes_only_its_own_moves():
    """One graph serves both sides, and each edge says which side takes it:
    prefill never completes from Metadata (it writes first), decode never
    writes, prefill is never fenced (it holds no memory a peer writes)."""
    meta, fenced, aborted = (
        np.array([p], np.int8) for p in (Phase.Metadata, Phase.Fenced, Phase.Aborted)
    )
    assert fire(meta, "complete", "prefill")[1][0]
    assert not fire(meta, "complete", "decode")[1][0]
    assert fire(meta, "write", "decode")[1][0]
    assert not fire(meta, "write", "prefill")[1][0]
    assert fire(aborted, "peer_dead", "prefill")[1][0]
    assert not fire(aborted, "peer_dead", "decode")[1][0]
    assert fire(fenced, "peer_back", "prefill")[1][0]
    err = ProtocolError(
        room=3, rank=0, phase=int(Phase.Metadata), trigger="metadata", role="decode"
    )
    assert "decode tp rank 0" in str(err) and "write" not in str(err).split("allowed there:")[1]


def test_edges_name_the_status_they_imply():
    from lifecycle import KVPoll

    pre, dec = ROLE_ID["prefill"], ROLE_ID["decode"]
    # decode is ready for pages and a row once registered; prefill only once every
    # decode leg's page list arrived (a metadata-row deadlock otherwise)
    assert POLL[dec, TRIGGER_ID["handshake"]] == KVPoll.WaitingForInput
    assert POLL[pre, TRIGGER_ID["handshake"]] == -1
    assert POLL[pre, TRIGGER_ID["metadata"]] == KVPoll.WaitingForInput
    assert POLL[dec, TRIGGER_ID["metadata"]] == -1
    for role in (pre, dec):
        assert POLL[role, TRIGGER_ID["complete"]] == KVPoll.Success
        for t in ("abort", "peer_failed"):
            assert POLL[role, TRIGGER_ID[t]] == KVPoll.Failed
        # releases: the status is Failed already, with its reason
        assert POLL[role, TRIGGER_ID["drain"]] == POLL[role, TRIGGER_ID["peer_dead"]] == -1
    # a fenced writer back (decode only): Failed again, so its drain timeout starts afresh
    assert POLL[dec, TRIGGER_ID["peer_back"]] == KVPoll.Failed
    assert {"prefill": Phase.Metadata, "decode": Phase.Handshaken} == READY


def test_the_bootstrap_deadline_covers_every_phase_a_side_is_bootstrapping_in():
    # prefill's covers the wait for decode's page lists; decode's ends at its register
    pre = [p for p in Phase if BOOTSTRAPPING[ROLE_ID["prefill"], p]]
    dec = [p for p in Phase if BOOTSTRAPPING[ROLE_ID["decode"], p]]
    assert pre == [Phase.Bootstrap, Phase.Handshaken]
    assert dec == [Phase.Bootstrap]


def _check_with(monkeypatch, edges):
    from transport.connector.core import graph as g

    monkeypatch.setattr(g, "EDGES", edges)
    monkeypatch.setattr(g, "TRIGGERS", tuple(e.trigger for e in edges))
    g._check_declaration()


def test_the_import_check_refuses_prefill_ready_at_the_handshake(monkeypatch):
    # the table that deadlocked: prefill WaitingForInput once decode registered
    import attrs

    from lifecycle import KVPoll
    from transport.connector.core.graph import ByRole

    both = ByRole(prefill=KVPoll.WaitingForInput, decode=KVPoll.WaitingForInput)
    old = tuple(
        attrs.evolve(e, poll=both)
        if e.trigger == "handshake"
        else attrs.evolve(e, poll=None)
        if e.trigger == "metadata"
        else e
        for e in EDGES
    )
    with pytest.raises(AssertionError, match="prefill may report WaitingForInput only on"):
        _check_with(monkeypatch, old)
    # and a status that skips ahead before the page lists arrived
    early = tuple(
        attrs.evolve(e, poll=ByRole(prefill=KVPoll.Transferring, decode=KVPoll.WaitingForInput))
        if e.trigger == "handshake"
        else e
        for e in EDGES
    )
    with pytest.raises(AssertionError, match="prefill"):
        _check_with(monkeypatch, early)
    _check_with(monkeypatch, EDGES)  # the declared table passes


def test_a_dead_peer_quarantines_then_fences_and_never_releases_on_silence():
    # a silent peer may only be paused: its requests are quarantined (Aborted),
    # then fenced at the drain timeout; only its word or its return leads on
    live = [Phase.Bootstrap, Phase.Handshaken, Phase.Metadata, Phase.Writing, Phase.RoomWritten]
    _, illegal = fire(np.array(live, dtype=np.int8), "peer_dead", "decode")
    assert illegal.all()
    new, illegal = fire(np.array([Phase.Aborted], dtype=np.int8), "peer_dead", "decode")
    assert (new.tolist(), illegal.tolist()) == ([Phase.Fenced], [False])
    # out of Fenced: drained on the writer's word, or back to Aborted when it speaks
    for trigger, dest in (("drain", Phase.Drained), ("peer_back", Phase.Aborted)):
        new, illegal = fire(np.array([Phase.Fenced], dtype=np.int8), trigger, "decode")
        assert (new.tolist(), illegal.tolist()) == ([dest], [False])
    others = [t for t in TRIGGERS if t not in ("drain", "peer_back")]
    for t in others:
        assert fire(np.array([Phase.Fenced], dtype=np.int8), t, "decode")[1].all(), t


def test_protocol_error_names_request_phase_and_what_is_allowed():
    e = ProtocolError(room=42, rank=1, phase=int(Phase.Bootstrap), trigger="metadata")
    msg = str(e)
    assert "room=42" in msg
    assert "rank 1" in msg
    assert "Bootstrap" in msg
    assert "handshake" in msg


@pytest.mark.parametrize("fmt", ["mermaid", "dot"])
def test_protocol_diagram_shows_every_state_and_edge(fmt, capsys):
    assert main(["diagram", "--protocol", "--format", fmt]) == 0
    out = capsys.readouterr().out
    from transport.connector.core.legs import DECODE_LEG_EDGES, PREFILL_LEG_EDGES

    for p in Phase:
        assert p.name in out
    for e in EDGES + PREFILL_LEG_EDGES + DECODE_LEG_EDGES:  # the request, then each leg
        for src in e.sources:
            edge = (
                f"{src.name} --> {e.dest.name}: {e.trigger}"
                if fmt == "mermaid"
                else f'{src.name} -> {e.dest.name} [label="{e.trigger}'
            )
            assert edge in out
    assert set(TRIGGERS) == {e.trigger for e in EDGES}


def test_each_word_is_said_by_one_side_and_heard_by_the_other():
    import json

    from transport.connector.core.messages import MESSAGES, Msg, check_words
    from transport.connector.core.sides import SIDES

    assert set(MESSAGES) == set(Msg)
    for role, side in SIDES.items():
        assert all(MESSAGES[m].by == role for m in side.SAYS)
        assert all(MESSAGES[m].by != role for m in side.HEARS)
    assert json.dumps({"kind": Msg.gave_up}) == '{"kind": "gave_up"}'  # the wire is unchanged
    words = {role: (side.SAYS, side.HEARS) for role, side in SIDES.items()}
    check_words(words)
    (pre_says, pre_hears), (dec_says, dec_hears) = words["prefill"], words["decode"]
    with pytest.raises(AssertionError, match="prefill says"):  # a word of decode's
        check_words({**words, "prefill": (pre_says | {Msg.abort}, pre_hears)})
    with pytest.raises(AssertionError, match="decode hears"):  # a word no one hears
        check_words({**words, "decode": (dec_says, dec_hears - {Msg.gave_up})})


def test_a_word_said_twice_moves_a_leg_nowhere():
    from transport.connector.core.legs import DecodeLeg, PrefillLeg, PrefillLegPhase

    leg = PrefillLeg(3, sends=True)
    assert leg.move("register") and not leg.move("register")  # a copy: nothing moves
    assert not leg.move("out")  # not told where to write yet
    assert leg.move("pages") and leg.told and leg.registered and not leg.fields_out
    assert leg.move("ask_stop") and leg.asked_stop and leg.phase == PrefillLegPhase.Stopping
    assert not leg.move("verified")
    d = DecodeLeg(0, sends=True)
    assert d.move("stop") and d.stopped and not d.done
    assert d.move("done") and d.done and d.stopped and not d.move("stop")
