"""The byte-moving backends (Mooncake over TCP, NIXL over UCX) on 127.0.0.1.

2 prefill + 2 decode ranks (4 processes, TP=2 on each side, gloo groups),
driven by the reference scheduler loops of `pdlife simulate`; decode checks
every KV page and metadata row it commits against what prefill wrote. Both
backends run the same tests: they share one connector.
"""

import json

import pytest

from support.wait import wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.network, pytest.mark.timeout(300)]


def decode_outcomes(out):
    ranks = [json.loads((out / "ranks" / f"rank{r}.json").read_text()) for r in (2, 3)]
    return [r["outcome"] for r in ranks], ranks


def test_200_requests_move_byte_for_byte(tmp_path, run_sim, backend):
    proc, s, out = run_sim(backend, "ok", "--requests", "200", "--abort-prob", "0", "--seed", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert s["succeeded"] == 200
    assert s["invariant_violations"] == []  # a differing page or row would be listed here
    assert s["kv_bytes_verified"] >= 200 * 2 * 256 * 2  # both decode ranks, 2 layers, >= 1 page
    assert (s["leaked_slots"], s["leaked_kv_pages"], s["disagreements"]) == (0, 0, 0)
    (o2, o3), _ = decode_outcomes(out)
    assert o2 == o3
    assert {v[0] for v in o2.values()} == {"Success"}


def test_aborts_and_a_killed_prefill_rank(tmp_path, run_sim, backend):
    """Prefill rank 1 is killed at step 6 of a run with client aborts.

    Decode's failures are aborted (a client's abort, or the surviving prefill
    rank's close) or peer dead, and never a transfer error, on either backend.
    Both engines tell a dead peer from a failed write only when the write is
    issued: a submit to a peer that is gone reads as peer dead (Mooncake's
    batch id 0; NIXL's initialize_xfer or transfer raising), while a write
    already in flight whose target dies reads as a transfer error (Mooncake's
    negative batch status, NIXL's ERR state; Connector._reap). That is the
    writer's view of its own writes. Here the writer dies and its targets
    live: its writes die with it, and decode asks no engine about any write
    (it waits for prefill's "done", or on NIXL also the room's notification,
    whose absence is no error), so it hears of rank 1 only from its silent
    heartbeat: peer dead. A decode rank that first reads rank 1's endpoint
    record after rank 1 died cannot connect to it (NIXL's add_remote_agent
    raises): that fails no request, the connect is tried again a heartbeat
    later (it once failed every live request of that rank as a transfer
    error, in 1 of 2 loaded runs). The surviving prefill rank 0 writes only
    to decode rank 2, which lives.

    Rank 0 stops on its group's broken collective, holding the buffers of the
    requests it had not finished; it must hold nothing else.
    """
    proc, s, out = run_sim(
        backend,
        "kill",
        "--requests",
        "200",
        "--abort-prob",
        "0.1",
        "--kill-rank",
        "1",
        "--kill-step",
        "6",
        "--pg-timeout",
        "10",
        "--seed",
        "5",
    )
    assert proc.returncode != 0  # the prefill group lost a rank: the run says so
    assert s["dead_ranks"] == [1]
    assert any("dead rank(s) [1]" in e for e in s["rank_errors"])
    (o2, o3), ranks = decode_outcomes(out)
    assert o2 == o3  # every decode rank agrees on every request, reason and origin
    reasons = {v[1] for v in o2.values() if v[0] == "Failed"}
    assert reasons <= {0, 1}  # aborted, peer dead (see the docstring)
    assert 1 in reasons
    assert s["aborted"] > 0
    assert s["succeeded"] + s["aborted"] + sum(s["failed"].values()) == 200
    for r in ranks:  # the decode side finished cleanly: nothing leaked, nothing hung
        assert r["error"] is None
        assert r["leaked_slots"] == 0
        assert r["leaked_kv_pages"] == 0
        assert r["unfinished"] == 0
        assert r["backend_error"] is None  # (the connector's loop failed nothing wholesale)
    r0 = json.loads((out / "ranks" / "rank0.json").read_text())
    assert "dead rank(s) [1]" in r0["error"]  # it stopped where its group broke
    assert r0["backend_error"] is None
    # what it still holds is its unfinished requests' slots and pages, nothing more
    held = (r0["held_slots"], r0["held_kv_pages"])
    assert (r0["leaked_slots"], r0["leaked_kv_pages"]) == held
    assert r0["held_slots"] <= r0["unfinished"]
    assert s["hung_ranks"] == []
    assert s["invariant_violations"] == []


def _manager(backend, role, port, namespace, **kw):
    import torch

    from buffers import MetadataBuffers, MetadataLayout
    from transport.connector.config import ConnectorConfig
    from transport.layout import kv_args_for
    from transport.registry import get_backend

    kv = [torch.zeros((16, 256), dtype=torch.uint8)]
    meta = MetadataBuffers(
        4, MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
    )
    cfg = ConnectorConfig(role=role, tp_rank=0, store_port=port, namespace=namespace, **kw)
    # (the metadata buffers are registered with the engine: they live as long as the manager)
    return get_backend(backend).manager(kv_args_for(kv, meta.buf_infos(), 0), cfg), kv, meta


def _abort_pair(backend, role, port, q):
    import time

    m, _, _ = _manager(backend, role, port, "abort")
    t0 = time.time()
    if role == "prefill":
        s = m.sender(77)
        while s.poll() == 1 and time.time() - t0 < 20:
            time.sleep(0.01)
        while s.poll() != 0 and time.time() - t0 < 20:
            time.sleep(0.01)
        q.put(("prefill", s.poll(), int(s.failure_reason())))
    else:
        r = m.receiver(77)
        r.init()
        while r.poll() == 1 and time.time() - t0 < 20:
            time.sleep(0.01)
        r.abort()  # the client went away after the handshake
        while not r.drained and time.time() - t0 < 20:
            time.sleep(0.01)
        q.put(("decode", r.poll(), int(r.failure_reason()), r.drained))
    time.sleep(0.5)
    m.close()


RAISED = "raised"  # what a side that raised puts on the queue after its role


class _Reported:
    """A side's target whose exception reaches the parent as ``(role, RAISED, traceback)``:
    a side that raised (a wait that timed out, say) fails the test at once, with
    what it said, instead of leaving the parent waiting on the queue."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, backend, role, port, q):
        try:
            self.fn(backend, role, port, q)
        except BaseException:
            import traceback

            q.put((role, RAISED, traceback.format_exc()[-3000:]))
            raise


def _pair(target, backend, timeout=60):

    from lifecycle.testing.spawn import rank_context, store_server

    store = store_server(3)
    port = store.port
    ctx = rank_context()
    q = ctx.Queue()
    side = _Reported(target)
    procs = [ctx.Process(target=side, args=(backend, r, port, q)) for r in ("prefill", "decode")]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        item = q.get(timeout=timeout)
        got[item[0]] = item[1:]
    for p in procs:
        p.join(10)
    _ = store
    raised = {role: item[1] for role, item in got.items() if item[:1] == (RAISED,)}
    assert not raised, "\n".join(f"{role} raised:\n{tb}" for role, tb in raised.items())
    return got, [p.exitcode for p in procs]


def test_decode_abort_reaches_prefill(backend):
    from lifecycle import FailureReason

    got, codes = _pair(_abort_pair, backend)
    assert codes == [0, 0]  # both processes ended cleanly
    assert got["prefill"] == (0, FailureReason.ABORTED)
    assert got["decode"] == (0, FailureReason.ABORTED, True)  # prefill said it stopped


def _dead_peer_pair(backend, role, port, q):
    import os
    import time

    # 2 s of silence is death: tight enough to see, loose enough for a loaded machine
    m, _, _ = _manager(backend, role, port, "dead", heartbeat_interval=0.25, heartbeat_misses=8)
    t0 = time.time()
    if role == "prefill":
        from transport.connector.core.graph import Phase

        s = m.sender(5)
        while m.phase_of(s._req) == Phase.Bootstrap and time.time() - t0 < 20:
            time.sleep(0.01)
        q.put(("prefill", s.poll(), m.phase_of(s._req)))
        q.close()
        q.join_thread()  # the message is out before the process vanishes
        os._exit(0)  # gone without a word: no abort, no close, heartbeats stop
    r = m.receiver(5)
    r.init()
    while r.poll() != 0 and time.time() - t0 < 20:
        time.sleep(0.01)
    # Failed shows first; the request drains right after, on the connector's own
    # thread, once its stop words are out (no page list was sent: nothing can land).
    # Reading it in the same instant raced that (seen on NIXL under load).
    wait_for(lambda: r.drained, "decode's request drained", timeout=5.0, interval=0.01)
    q.put(("decode", r.poll(), int(r.failure_reason()), r.drained, time.time() - t0))
    m.close()


def test_a_dead_peer_becomes_peer_dead(backend):
    from lifecycle import FailureReason, KVPoll
    from transport.connector.core.graph import Phase

    got, _ = _pair(_dead_peer_pair, backend)
    # the handshake was done; prefill waits for decode's page list (Bootstrapping)
    assert got["prefill"] == (KVPoll.Bootstrapping, Phase.Handshaken), got
    status, reason, drained, took = got["decode"]
    assert (status, reason, drained) == (KVPoll.Failed, FailureReason.PEER_DEAD, True)
    assert took < 10  # heartbeats found it, not a timeout


def _duplicate_room_side(backend, role, port, q):
    """One side of SGLang #40125: register room 40125, then a second request
    with the same room; the first must still complete, and so must the next."""
    import torch

    from transport.errors import DuplicateRoom, TransportError

    m, kv, meta = _manager(backend, role, port, "dup")
    if role == "prefill":
        kv[0].copy_(torch.arange(kv[0].numel()).view_as(kv[0]) % 251)
    make = m.sender if role == "prefill" else m.receiver
    out = {}
    first = make(40125)
    live = dict(m.core.reqs)
    try:
        make(40125)
        out["second"] = "accepted"
    except Exception as e:  # what a scheduler would catch
        out["second"] = (
            type(e).__name__,
            isinstance(e, DuplicateRoom),
            isinstance(e, TransportError),
            isinstance(e, ValueError),
            str(e),
        )
    out["unchanged"] = m.core.reqs == live and all(m.core.reqs[k] is live[k] for k in live)

    def transfer(h, src, dst, slot):
        if role == "prefill":
            meta.write(slot, h.bootstrap_room, {"output_ids": [slot]})  # the first token's row
            wait_for(
                lambda: h.poll() == 2, f"room {h.bootstrap_room}: decode registered", 20.0, 0.01
            )
            h.init(len(src), slot)
            h.send(src)
        else:
            h.init()
            wait_for(lambda: h.poll() == 2, f"room {h.bootstrap_room}: WaitingForInput", 20.0, 0.01)
            h.send_metadata(dst, slot)
        wait_for(lambda: h.poll() == 4, f"room {h.bootstrap_room}: Success", 20.0, 0.01)
        return h.poll(), int(h.failure_reason())

    # the first request with the room, then a later one
    out["first"] = transfer(first, [2, 3], [5, 6], 1)
    first.clear()
    out["later"] = transfer(make(40126), [7], [9], 2)
    if role == "decode":
        src = torch.arange(kv[0].numel()).view_as(kv[0]) % 251
        out["bytes"] = all(torch.equal(kv[0][d], src[s]) for s, d in ((2, 5), (3, 6), (7, 9)))
        out["rows"] = [meta.room_of(slot) for slot in (1, 2)]
    import time

    time.sleep(0.5)  # the peer's last status may still be on its way
    q.put((role, out))
    m.close()


def test_sglang_40125_duplicate_room_is_refused_and_both_sides_survive(backend):
    """SGLang #40125: a client-supplied bootstrap_room used twice crashed both
    schedulers. On Mooncake and NIXL the connector refuses a second live request
    with a room, on prefill and on decode, with a DuplicateRoom (a TransportError,
    and a ValueError as the untyped error was), changing nothing: the first
    request with the room moves its bytes to Success, and a later request does
    too. The negative control (the check taken out, the first request orphaned)
    is in tests/unit/test_connector.py; the fake backend keeps no state per
    room, and the scheduler's RequestTable refuses the room there (see
    tests/unit/test_transport.py)."""
    got, codes = _pair(_duplicate_room_side, backend)
    assert codes == [0, 0], got  # both sides ended cleanly
    for role in ("prefill", "decode"):
        out = got[role][0]
        name, typed, transport, value, msg = out["second"]
        assert (name, typed, transport, value) == ("DuplicateRoom", True, True, True), out
        assert "room=40125" in msg and f"{role} rank 0" in msg and "Nothing was changed" in msg
        assert out["unchanged"], role
        for what in ("first", "later"):
            assert out[what] == (4, 15), (role, what, got)  # Success, no reason
    assert got["decode"][0]["bytes"] is True
    assert got["decode"][0]["rows"] == [40125, 40126]
