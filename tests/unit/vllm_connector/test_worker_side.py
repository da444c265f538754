"""The vLLM connector's two sides end to end on the simulated network (no vLLM,
no socket): prefill's scheduler holds a finished request's blocks, decode's
loads them, the workers move the bytes, and each side reports the request to
vLLM once, only when its pages are drained."""

import numpy as np
import pytest
import torch

from lifecycle import FailureReason, SingleRank, StepConfig
from lifecycle.rules.recovery import DEFAULT_RECOVERY, FAIL_ALL
from support.simcases import pair
from transport.testing.simnet import Faults
from vllm_connector.agreement import WorkerAgreement
from vllm_connector.scheduler import Meta, Phase, SchedulerCore
from vllm_connector.worker import Report, WorkerSide

SRC, DST = [[3, 4, 5]], [[6, 1, 7]]


def setup(seed=0, recovery=FAIL_ALL, **net):
    n, sides = pair(seed, **net)
    (p, pkv, _), (d, dkv, _) = sides["prefill"], sides["decode"]
    pkv[0].copy_(torch.arange(pkv[0].numel()).view_as(pkv[0]) % 251)
    cfg = StepConfig(recovery=recovery)
    w = {
        "prefill": WorkerSide(p, WorkerAgreement(0, p.core, SingleRank(), cfg)),
        "decode": WorkerSide(d, WorkerAgreement(0, d.core, SingleRank(), cfg)),
    }
    s = {r: SchedulerCore(f"{r}-0", "127.0.0.1", 5600, 1) for r in w}
    return n, (p, pkv), (d, dkv), w, s


def hand_over(s, w, prefix_computed=0):
    """Prefill finishes the request and holds its blocks; the router copies the
    params into decode's request, which loads them."""
    held, params = s["prefill"].finished("req-p", {"do_remote_decode": True}, SRC, normal=True)
    assert held
    w["prefill"].start(s["prefill"].build_meta())
    n, load_async = s["decode"].matched("req-d", params, 3, prefix_computed)
    assert (n, load_async) == (3, True)
    s["decode"].allocated("req-d", DST, n)
    w["decode"].start(s["decode"].build_meta())


def run(n, w, s, until, limit=4000):
    """Step the network and both sides (each worker's get_finished, then the
    scheduler's update_connector_output) until ``until(reports)``."""
    got = {r: Report() for r in w}
    for _ in range(limit):
        n.step()
        for r in w:
            rep = w[r].finished()
            s[r].workers_report(set(rep.sending), set(rep.recving), set(rep.failed))
            got[r] = Report(
                got[r].sending | rep.sending,
                got[r].recving | rep.recving,
                got[r].load_errors | rep.load_errors,
                got[r].failed | rep.failed,
            )
        if until(got):
            return got
    raise AssertionError(f"not within {limit} steps: {got}")


def test_a_load_moves_every_byte_and_each_side_reports_once():
    n, (p, pkv), (d, dkv), w, s = setup()
    hand_over(s, w)
    got = run(n, w, s, lambda g: g["prefill"].sending and g["decode"].recving)
    assert got["decode"] == Report(recving=frozenset({"req-d"}))
    assert got["prefill"] == Report(sending=frozenset({"req-p"}))
    assert torch.equal(dkv[0][[6, 1, 7]], pkv[0][[3, 4, 5]])
    assert s["prefill"].reqs == {} == s["decode"].reqs
    # nothing is reported again
    more = run(n, w, s, lambda g: True)
    assert more == {"prefill": Report(), "decode": Report()}


def test_an_abort_in_flight_holds_the_blocks_until_drained():
    # writes take long: decode's scheduler gives up while they are in flight
    n, _, (d, dkv), w, s = setup(faults=Faults(write_delay=(0.5, 0.5)))
    hand_over(s, w)
    run(
        n,
        w,
        s,
        lambda g: (
            s["prefill"].phase("req-p") is Phase.SENDING
            and d.core.reqs
            and any(r.tokens for r in n.ranks["prefill", 0].core.reqs.values())
        ),
    )
    held, _ = s["decode"].finished("req-d", None, DST, normal=False)
    assert held and s["decode"].phase("req-d") is Phase.DRAINING
    w["decode"].start(s["decode"].build_meta())
    got = run(n, w, s, lambda g: g["decode"].sending and g["prefill"].sending)
    # reported as sent (its blocks may be freed) only when no write can land
    assert got["decode"].sending == {"req-d"} and not got["decode"].recving
    assert s["decode"].reqs == {}


def test_an_abort_that_crosses_the_loads_end_still_frees_the_blocks():
    """The workers finished the load, but the scheduler gave the request up before
    it heard: it holds the blocks until told they are freeable, and is told."""
    n, _, _, w, s = setup()
    hand_over(s, w)
    # the workers' report is not handed to the scheduler: it still thinks it loads
    for _ in range(4000):
        n.step()
        w["prefill"].finished()
        rep = w["decode"].finished()
        if rep.recving:
            break
    assert rep.recving == {"req-d"} and s["decode"].phase("req-d") is Phase.LOADING
    held, _ = s["decode"].finished("req-d", None, DST, normal=False)
    assert held and s["decode"].phase("req-d") is Phase.DRAINING
    w["decode"].start(s["decode"].build_meta())
    s["decode"].workers_report(set(), set(rep.recving))  # the crossed report arrives
    got = run(n, w, s, lambda g: g["decode"].sending)
    assert got["decode"].sending == {"req-d"} and s["decode"].reqs == {}


def test_a_failed_load_is_told_at_once_even_while_its_writer_is_silent():
    """Prefill pauses for ever after decode's page list went out: decode's load
    fails (peer dead) and stays fenced. vLLM is told at once, with the load's
    blocks as errors; the blocks are never reported freeable (sent) while the
    writer is silent."""
    n, (p, _), (d, _), w, s = setup()
    hand_over(s, w)
    n.pause(p, None)
    got = run(n, w, s, lambda g: g["decode"].failed)
    assert got["decode"].recving == {"req-d"} and got["decode"].load_errors == {6, 1, 7}
    assert s["decode"].phase("req-d") is Phase.QUARANTINED
    for _ in range(600):
        n.step()
        rep = w["decode"].finished()
        s["decode"].workers_report(set(rep.sending), set(rep.recving), set(rep.failed))
        assert "req-d" not in rep.sending  # fenced: a thawed writer could still land
    assert s["decode"].phase("req-d") is Phase.QUARANTINED


def test_a_failed_load_reports_its_blocks_as_load_errors():
    n, (p, _), _, w, s = setup()
    hand_over(s, w)
    p.core.fail(next(iter(p.core.reqs.values())), FailureReason.TRANSFER_ERROR)
    got = run(n, w, s, lambda g: g["decode"].recving and g["prefill"].sending)
    assert got["decode"].load_errors == {6, 1, 7} and got["decode"].failed == {"req-d"}


def test_a_retried_failure_starts_the_next_attempt_unseen_by_vllm():
    n, (p, pkv), (d, dkv), w, s = setup(recovery=DEFAULT_RECOVERY)
    epochs = {"sender": [], "receiver": []}
    for role, rank in (("sender", p), ("receiver", d)):
        make = getattr(rank, role)

        def record(room, epoch=0, make=make, seen=epochs[role]):
            seen.append(epoch)
            return make(room, epoch)

        setattr(rank, role, record)
    hand_over(s, w)
    first = next(iter(p.core.reqs.values()))
    p.core.fail(first, FailureReason.TRANSFER_ERROR)  # retryable: a second attempt
    got = run(n, w, s, lambda g: g["decode"].recving and g["prefill"].sending)
    assert got["decode"] == Report(recving=frozenset({"req-d"}))  # no load error
    assert torch.equal(dkv[0][[6, 1, 7]], pkv[0][[3, 4, 5]])
    assert epochs == {"sender": [0, 1], "receiver": [0, 1]}  # both sides moved on
    assert w["decode"].live == {} == w["prefill"].live and not w["decode"].ending


def test_blocks_of_several_kv_cache_groups_are_refused_by_name():
    _, _, _, w, _ = setup()
    from vllm_connector.params import ParamsError
    from vllm_connector.scheduler import Send

    meta = Meta(sends={"r": Send(5, 0, ((1,), (2,)))})
    with pytest.raises(ParamsError, match="one KV cache group"):
        w["prefill"].start(meta)
    assert w["prefill"].live == {}


def test_the_bytes_would_differ_without_the_transfer():
    """Negative control: the check above can fail (decode's pages start apart)."""
    _, (p, pkv), (d, dkv), _, _ = setup()
    assert not torch.equal(dkv[0][[6, 1, 7]], pkv[0][[3, 4, 5]])
    assert np.array_equal(np.asarray(SRC[0]), [3, 4, 5])


def _until_ready(n, w):
    """Step until decode's worker finds its load ready (its page list not sent)."""
    for _ in range(4000):
        n.step()
        for r in w:
            w[r].finished()
        if w["decode"].ready:
            return
    raise AssertionError("decode's load never became ready")


def _counting_page_lists(dec):
    (t,) = dec.live.values()
    sent, send = [], t.handle.send_metadata
    t.handle.send_metadata = lambda *a, **kw: (sent.append(a), send(*a, **kw))
    return sent


def test_the_page_list_leaves_from_start_load_kv_not_from_get_finished():
    # get_finished only steps and reports; the load it found ready is handed its
    # pages by the next start_load_kv, where vLLM's own connectors start reads
    n, (p, pkv), (d, dkv), w, s = setup()
    hand_over(s, w)
    sent = _counting_page_lists(w["decode"])
    _until_ready(n, w)
    assert sent == []
    w["decode"].start(Meta())
    assert len(sent) == 1 and w["decode"].ready == []
    got = run(n, w, s, lambda g: g["decode"].recving)
    assert got["decode"] == Report(recving=frozenset({"req-d"})) and len(sent) == 1
    assert torch.equal(dkv[0][[6, 1, 7]], pkv[0][[3, 4, 5]])


def test_a_load_given_up_before_its_hand_over_is_not_handed_its_pages():
    n, (p, pkv), (d, dkv), w, s = setup()
    hand_over(s, w)
    sent = _counting_page_lists(w["decode"])
    _until_ready(n, w)
    w["decode"].start(Meta(aborts={"req-d": 0}))
    assert sent == [] and w["decode"].ready == []
    got = run(n, w, s, lambda g: "req-d" in g["decode"].sending)  # freeable once drained
    assert "req-d" not in got["decode"].recving


def _agreement():
    _, sides = pair(0)
    d = sides["decode"][0]
    return WorkerAgreement(0, d.core, SingleRank())


def test_adding_a_batch_is_adding_each_in_turn():
    """add_many (one table extend per run of one role) leaves the table and the
    ids as one add at a time would."""
    from lifecycle import Role
    from vllm_connector.agreement import Begun

    begun = [
        Begun(f"r{i}", 40 + i, 7 + i, Role.SENDER if i in (2, 3) else Role.RECEIVER, i % 2)
        for i in range(6)
    ]
    batch, one = _agreement(), _agreement()
    batch.add_many(begun)
    for b in begun:
        one.add(*b)
    for a in (batch, one):
        assert a.table.rooms().tolist() == [40, 41, 42, 43, 44, 45]
    cols = ("role", "handle_index", "epoch", "state", "room_key")
    for c in cols:
        got = getattr(batch.table, c)[batch.table.order()].tolist()
        assert got == getattr(one.table, c)[one.table.order()].tolist(), c
    assert batch._ids == one._ids and batch._rooms == one._rooms


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("twice", "added twice"),
        ("present", "added twice"),
        ("not a str", "request id"),
        ("room taken", "room"),
        ("room taken by a later run", "room"),
    ],
)
def test_a_refused_batch_adds_none_of_it(bad, match):
    from lifecycle import Role
    from vllm_connector.agreement import Begun

    a = _agreement()
    a.add("old", 9, 1, Role.RECEIVER)
    begun = [Begun("x", 10, 2, Role.RECEIVER), Begun("y", 11, 3, Role.RECEIVER)]
    if bad == "twice":
        begun.append(Begun("x", 12, 4, Role.RECEIVER))
    elif bad == "present":
        begun.append(Begun("old", 12, 4, Role.RECEIVER))
    elif bad == "not a str":
        begun.append(Begun(5, 12, 4, Role.RECEIVER))  # type: ignore[arg-type]
    elif bad == "room taken":
        begun.append(Begun("z", 9, 4, Role.RECEIVER))  # room 9 is in flight
    else:  # the receivers' run is added, then the senders' is refused: neither stays
        begun.append(Begun("z", 9, 4, Role.SENDER))
    with pytest.raises(Exception, match=match):
        a.add_many(begun)
    assert a.table.rooms().tolist() == [9] and set(a._rooms) == {"old"} and len(a) == 1
