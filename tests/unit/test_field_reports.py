"""Field reports, each a test named after it (with a negative control): every
failure ends in one agreed outcome with a reason, on every rank, with no
slot, page or row leaked and no byte written to the wrong request or outside
the buffers. Driven through the shared connector with an in-process engine
that copies memory (the bytes are real) and can hold, fail or refuse writes."""

import ctypes
from typing import ClassVar

import numpy as np
import pytest
import torch

from buffers import MetadataBuffers, MetadataLayout
from lifecycle import FailureReason, KVPoll
from lifecycle.testing.spawn import store_server
from support.stub_engine import CopyConnector, CopyEngine, handshaken, timeouts
from support.wait import wait_for
from transport.connector.config import ConnectorConfig
from transport.connector.core import prefill as pre
from transport.connector.core.graph import Phase
from transport.layout import kv_args_for

pytestmark = pytest.mark.timeout(60)


class EngineError(RuntimeError):
    """The engine's submit refused a write (a sender-side exception)."""


class HoldEngine(CopyEngine):
    """Copies each write at once but reports it in flight while ``hold`` is set;
    ``raise_next`` makes the next submit raise; a write outside the peer's
    registered regions is not copied and is recorded in ``outside``."""

    regions_of: ClassVar[dict[int, list[tuple[int, int]]]] = {}  # first KV address -> regions

    def __init__(self):
        super().__init__()
        self.hold = False
        self.raise_next = False
        self.outside: list[tuple[int, int]] = []
        self.events: list[str] = []

    def start(self, regions, host):
        self.regions = regions  # the first is the first KV buffer's
        HoldEngine.regions_of[regions[0][0]] = regions
        return super().start(regions, host)

    def write(self, info, src, dst, lens, note):
        if self.raise_next:
            self.raise_next = False
            raise EngineError("submit failed")
        far = HoldEngine.regions_of[info["kv_ptrs"][0]]
        near = self.regions
        inside = lambda at, n, regs: any(b <= at and at + n <= b + ln for b, ln in regs)  # noqa: E731
        for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist()):
            if not (inside(d, n, far) and inside(s, n, near)):
                self.outside.append((d, n))
            else:
                ctypes.memmove(d, s, n)
        self.writes.append(lens.tolist())
        return ["write", len(self.writes)]

    def check(self, token):
        if self.hold:
            return 0
        if token[0] == "write":
            self.events.append(f"landed {token[1]}")
            token[0] = "landed"
        return 1


def _side(role, port, **cfg):
    kv = [torch.zeros((8, 64), dtype=torch.uint8)]
    layout = MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
    meta = MetadataBuffers(4, layout)
    config = ConnectorConfig(role=role, tp_rank=0, store_port=port, idle_interval=0.005, **cfg)
    return CopyConnector(kv_args_for(kv, meta.buf_infos(), 0), config, HoldEngine()), kv, meta


@pytest.fixture
def make_pair():
    made = []

    def make(**decode_cfg):
        store = store_server()
        p = _side("prefill", store.port)
        d = _side("decode", store.port, **decode_cfg)
        made.append((store, p[0], d[0]))
        p[1][0].copy_(torch.arange(p[1][0].numel()).view_as(p[1][0]) % 251)
        return p, d

    yield make
    for _, p, d in made:
        p.close(wait=0)
        d.close(wait=0)


def _log_decode_moves(d, log):
    """Record every protocol move of decode's requests, in order with prefill's landings."""
    fire_many, fire = d.core.fire_many, d.core.fire

    def logged_many(reqs, trigger, reason=FailureReason.NONE):
        moved = fire_many(reqs, trigger, reason)
        if moved.any():
            log.append(f"decode {trigger}")
        return moved

    def logged(req, trigger, reason=FailureReason.NONE):
        moved = fire(req, trigger, reason)
        if moved:
            log.append(f"decode {trigger}")
        return moved

    d.core.fire_many, d.core.fire = logged_many, logged


def _ready(s, r, pages, slot):
    r.init()
    wait_for(lambda: handshaken(s), "prefill handshake")
    wait_for(lambda: r.poll() == KVPoll.WaitingForInput, "decode handshake")
    r.send_metadata(pages, slot)
    wait_for(lambda: s.poll() == KVPoll.WaitingForInput, "prefill has the page list")


# -- SGLang #34208 ------------------------------------------------------------------------


def _abort_after_metadata_landed(make_pair, room):
    (p, pkv, pmeta), (d, dkv, dmeta) = make_pair()
    log = p.engine.events  # prefill's landings and decode's moves, in the order they happen
    _log_decode_moves(d, log)
    pmeta.write(1, room, {"output_ids": [42]})
    s, r = p.sender(room), d.receiver(room)
    _ready(s, r, [5, 6], 2)
    p.engine.hold = True  # the writes are copied, but the engine has not reported them yet
    s.init(2, 1)
    s.send([2, 3])
    # (the row's fields go in one write with the last pages)
    wait_for(
        lambda: p.phase_of(s._req) == Phase.Writing and len(p.engine.writes) == 1,
        "pages and row out",
    )
    assert torch.equal(dkv[0][5:7], pkv[0][2:4])  # the pages landed ...
    assert dmeta.room_of(2) != room  # ... the row's fields too, but not its room column
    s.abort()
    assert s.poll() == KVPoll.Failed
    return p, d, s, r, log


def _check_decode_failed_after_the_drain(p, d, s, r, log):
    wait_for(lambda: r.poll() == KVPoll.Failed and r.drained, "decode failed and drained")
    assert r.failure_reason() == FailureReason.ABORTED
    assert s.failure_reason() == FailureReason.ABORTED
    assert "decode complete" not in log  # never Success
    assert not p.engine.outside and not d.engine.outside
    wait_for(lambda: s.drained, "prefill drained")  # its writes all reported
    landed = max(i for i, e in enumerate(log) if e.startswith("landed"))
    released = min(i for i, e in enumerate(log) if e in ("decode peer_failed", "decode drain"))
    assert landed < released, log  # decode's pages were freed only after prefill's writes
    s.clear()
    r.clear()
    wait_for(lambda: not p.core.reqs and not d.core.reqs, "both released their slots")


def test_sglang_34208_prefill_abort_after_metadata_landed_fails_on_decode(make_pair):
    """SGLang #34208: prefill aborted a request after its metadata row had landed
    on decode, and decode took it for a finished transfer. Here decode ends
    Failed (aborted), never Success, and releases its pages only once
    prefill's writes in flight have drained."""
    p, d, s, r, log = _abort_after_metadata_landed(make_pair, 34208)
    # prefill's loop passes over the aborted request with writes in flight
    seen = len(p.engine.writes), p.phase_of(s._req)
    assert seen == (1, Phase.Aborted)
    for _ in range(3):
        p.wake()
        wait_for(lambda: not p._wake.is_set(), "a prefill loop pass")
    assert r.poll() not in (KVPoll.Success, KVPoll.Failed) and not r.drained
    p.engine.hold = False
    _check_decode_failed_after_the_drain(p, d, s, r, log)


def test_sglang_34208_negative_control_told_before_the_drain(make_pair, monkeypatch):
    """Negative control: prefill tells decode at once (not after its writes
    drained): decode releases its pages while prefill's writes may still land,
    which the check above catches."""
    real = pre.PrefillSide.steps

    def eager(side, req):
        if side.core.phase_of(req) == Phase.Aborted:
            side.tell_legs(req)
        return real(side, req)

    monkeypatch.setattr(pre.PrefillSide, "steps", eager)
    p, d, s, r, log = _abort_after_metadata_landed(make_pair, 34209)
    wait_for(lambda: r.drained, "decode drained while the writes are held")
    p.engine.hold = False
    with pytest.raises(AssertionError):
        _check_decode_failed_after_the_drain(p, d, s, r, log)


# -- TensorRT-LLM #12542 -------------------------------------------------------------------

WAITING = 60.0  # decode's configured deadline: the failure must come well before it


def _sender_raises(make_pair, room):
    (p, _, pmeta), (d, _, _) = make_pair(waiting_timeout=WAITING)
    pmeta.write(1, room, {"output_ids": [7]})
    s, r = p.sender(room), d.receiver(room)
    _ready(s, r, [4, 5], 3)
    p.engine.raise_next = True  # the engine's transfer submit raises
    s.init(2, 1)
    s.send([0, 1])  # returns: the submit runs on the connector's loop
    wait_for(lambda: p.last_error is not None, "the submit raised")
    assert isinstance(p.last_error, EngineError)
    return p, d, s, r


def test_trtllm_12542_sender_exception_fails_the_request(make_pair):
    """TensorRT-LLM #12542: an exception in the sender's transfer left the
    receiver waiting. Here prefill fails the request (transfer error) and
    tells decode, which ends Failed with that reason (not its waiting
    timeout, which has not come) on every rank; both release their slots."""
    p, d, s, r = _sender_raises(make_pair, 12542)
    assert (s.poll(), s.failure_reason()) == (KVPoll.Failed, FailureReason.TRANSFER_ERROR)
    wait_for(lambda: r.poll() == KVPoll.Failed, "decode hears of it", timeout=WAITING / 2)
    assert r.failure_reason() == FailureReason.TRANSFER_ERROR
    wait_for(lambda: s.drained and r.drained, "both drained")
    assert not p.engine.outside and not d.engine.outside
    s.clear()
    r.clear()
    wait_for(lambda: not p.core.reqs and not d.core.reqs, "both released their slots")


def test_trtllm_12542_negative_control_an_exception_left_unhandled(make_pair, monkeypatch):
    """Negative control: with prefill's failure path switched off, decode hears
    nothing and is only freed by its waiting deadline (a WAITING_TIMEOUT, not
    the sender's transfer error the test above asks for)."""

    (p, _, _), (d, _, _) = make_pair(waiting_timeout=WAITING)
    monkeypatch.setattr(p.core, "fail", lambda *a, **k: None)
    p.engine.raise_next = True
    s, r = p.sender(12543), d.receiver(12543)
    _ready(s, r, [4], 3)
    s.init(1, 1)
    s.send([0])
    wait_for(lambda: p.last_error is not None, "the submit raised")
    assert s.poll() != KVPoll.Failed and r.poll() != KVPoll.Failed
    timeouts(d, d.core.waited[r.index] + WAITING + 1)  # the deadline, by hand
    assert (r.poll(), r.failure_reason()) == (KVPoll.Failed, FailureReason.WAITING_TIMEOUT)


# -- vLLM #49250 --------------------------------------------------------------------------


def _stale_table_columns(t, room):
    """The columns of ``room``'s RequestTable row that are not those of a new request."""
    slot = t.slot_of(room)
    fresh = {name: fill for name, _, fill in t._COLUMNS}
    fresh.update(room=room, alive=True, entered_time=t.now)
    if "room_key" in fresh:  # derived from the room alone: a new request with it has it too
        from lifecycle.core.fingerprint import room_keys

        fresh["room_key"] = room_keys(np.array([room], dtype=np.uint64))[0]
    stale = [
        name
        for name, value in fresh.items()
        if not np.array_equal(getattr(t, name)[slot], value, equal_nan=True)
    ]
    if t.handles[slot] is not None:
        stale.append("handles")
    if (t.abort_count, t.terminal_count) != (0, 0):
        stale.append("counts")
    return stale


def _readmit_in_table():
    from lifecycle.table import RequestTable

    t = RequestTable(capacity=1)  # one row: the re-admitted request gets the same one
    room = 49250
    first = t.add(room, state=KVPoll.Failed, handle=object(), metadata_slot=3, handle_index=5)
    t.request_abort(room)
    t.reason[first], t.origin[first] = FailureReason.TRANSFER_ERROR, 2
    t.entered_step[first] = t.added_step[first] = 7
    t.entered_time[first] = t.metadata_sent_at[first] = 12.5
    t.remove(room)
    again = t.add(room)
    assert again == first
    return t, room


def _stale_connector_state(m, h, old):
    """What of the re-admitted request's connector state is not that of a new one."""
    i, req = h.index, h._req
    stale = [
        name
        for name, (dtype, fill) in m.core._cols.items()
        if name not in ("status", "phase", "born")
        and not np.array_equal(
            getattr(m.core, name)[i], fill, equal_nan=np.dtype(dtype).kind == "f"
        )
    ]
    if h.poll() != KVPoll.Bootstrapping or m.phase_of(req) != Phase.Bootstrap:
        stale.append("status/phase")
    if not m.core.born[i] > old:
        stale.append("born")
    kept = vars(req)  # (held, src, local_slot, abandoned and sent: a prefill request's)
    used = {
        "legs": req.legs,
        "tokens": req.tokens,
        "held": kept.get("held"),
        "src": kept.get("src", np.empty(0)).size,
        "reason": req.reason != FailureReason.NONE,
        "num_pages": req.num_pages + 1,
        "local_slot": kept.get("local_slot", -1) + 1,
        "flags": kept.get("abandoned") or req.cleared or req.released or kept.get("sent"),
    }
    stale += [f"request.{name}" for name, v in used.items() if v]
    if req.room in m.core.attempts.cleared or m.core.live(req.room) is not req:
        stale.append("room")
    return stale


def _readmit_in_connector(make_pair, room):
    (p, pkv, pmeta), (d, dkv, dmeta) = make_pair()
    s, r = p.sender(room), d.receiver(room)
    _ready(s, r, [1, 2], 0)
    p.engine.raise_next = True  # the first try fails in transfer
    s.init(2, 0)
    s.send([0, 1])
    wait_for(lambda: s.drained and r.drained, "the first try failed and drained")
    assert r.failure_reason() == FailureReason.TRANSFER_ERROR
    old = [(s.index, p.core.born[s.index]), (r.index, d.core.born[r.index])]
    s.clear()
    r.clear()
    wait_for(lambda: not p.core.reqs and not d.core.reqs, "the first try released")
    s2, r2 = p.sender(room), d.receiver(room)
    assert [s2.index, r2.index] == [i for i, _ in old]  # the same slots, re-used
    return (p, pkv, pmeta, s2, old[0][1]), (d, dkv, dmeta, r2, old[1][1])


def test_vllm_49250_readmitted_room_starts_from_a_clean_row(make_pair):
    """vLLM #49250: a request re-admitted with the room of one that had failed
    inherited its stale state. Here the lifecycle's row and the connector's
    per-request state and slot of the new request are those of a new one,
    and it moves its own bytes to Success."""
    t, room = _readmit_in_table()
    assert _stale_table_columns(t, room) == []
    (p, pkv, pmeta, s, sb), (d, dkv, dmeta, r, rb) = _readmit_in_connector(make_pair, 49250)
    assert _stale_connector_state(p, s, sb) == [] and _stale_connector_state(d, r, rb) == []
    pmeta.write(2, 49250, {"output_ids": [3]})
    _ready(s, r, [6, 7], 1)
    s.init(2, 2)
    s.send([4, 5])
    wait_for(lambda: r.poll() == KVPoll.Success, "the new try succeeds")
    assert torch.equal(dkv[0][6:8], pkv[0][4:6]) and dmeta.room_of(1) == 49250
    assert not p.engine.outside and not d.engine.outside


def test_vllm_49250_negative_control_rows_not_reset(make_pair, monkeypatch):
    """Negative control: a table that hands back the old row, and a connector
    whose slot keeps its old columns, are both caught."""
    from lifecycle.table import RequestTable

    real = RequestTable.extend

    def keeps_the_row(self, rooms, **kw):
        before = {name: getattr(self, name).copy() for name, _, _ in self._COLUMNS}
        slots = real(self, rooms, **kw)
        for name, col in before.items():
            if name not in ("room", "alive"):
                getattr(self, name)[slots] = col[slots]
        return slots

    monkeypatch.setattr(RequestTable, "extend", keeps_the_row)
    t, room = _readmit_in_table()
    assert "reason" in _stale_table_columns(t, room)

    def keeps_the_slot(m):
        def take(initial):
            idx = m._free.pop()
            m.status[idx] = initial
            return idx

        return take

    (p, _, _), (d, _, _) = make_pair()
    monkeypatch.setattr(d.core, "take", keeps_the_slot(d.core))
    r = d.receiver(49251)
    r.abort()
    r.clear()
    r2 = d.receiver(49251)
    assert "reason" in _stale_connector_state(d, r2, 0.0)


# -- SGLang #28652 ------------------------------------------------------------------------


def _stuck_fake_sender(monkeypatch, switched_off=False):
    """A fake sender given its page count but never a send(), polled on a clock
    the test moves: it must fail at the waiting timeout and free its slot."""
    import types

    from field.conn.fake import WAITING_TIMEOUT_VAR, FakeKVManager, FakeKVSender

    clock = [1000.0]
    monkeypatch.setattr("field.conn.fake.time.monotonic", lambda: clock[0])
    monkeypatch.setenv(WAITING_TIMEOUT_VAR, "30")
    m = FakeKVManager(types.SimpleNamespace(), "prefill", types.SimpleNamespace())
    s = FakeKVSender(m, "fake_addr:1", 28652)
    if switched_off:
        s.waiting_timeout = float("inf")
    index, free = s.core.index, len(m.core._free)
    s.init(4, 0)
    assert s.poll() == KVPoll.WaitingForInput  # the clock starts at the first poll
    clock[0] += 29.9
    assert s.poll() == KVPoll.WaitingForInput
    clock[0] += 0.1
    return m, s, index, free


def _check_timed_out_and_released(m, s, index, free):
    assert s.poll() == KVPoll.Failed
    assert m.core.failure_reasons(np.array([0], np.uint64), np.array([index]))[0] == int(
        FailureReason.WAITING_TIMEOUT
    )
    assert s.poll() == KVPoll.Failed  # latched
    with pytest.raises(Exception, match="waiting"):
        s.failure_exception()
    s.clear()
    assert len(m.core._free) == free + 1 and m.core._free[-1] == index  # the slot is back


def test_sglang_28652_fake_sender_waiting_forever_times_out(monkeypatch):
    """SGLang #28652: a fake (warm-up) sender whose send never came waited in
    WaitingForInput for ever, holding its place. Here the waiting timeout
    applies to it: it is Failed (waiting timeout) once the timeout has passed
    and its slot is freed."""
    _check_timed_out_and_released(*_stuck_fake_sender(monkeypatch))


def test_sglang_28652_negative_control_no_timeout_waits_for_ever(monkeypatch):
    """Negative control: with the waiting timeout switched off, the sender is
    still WaitingForInput at the same clock, which the test above catches."""
    with pytest.raises(AssertionError):
        _check_timed_out_and_released(*_stuck_fake_sender(monkeypatch, switched_off=True))


# -- vLLM #52234 --------------------------------------------------------------------------

BAD_REFS = {
    "decode page past its pool": ([6, 8], 2, [0, 1], 1),
    "decode page negative": ([-1, 6], 2, [0, 1], 1),
    "decode metadata slot past its rows": ([6, 7], 4, [0, 1], 1),
    "prefill page past its pool": ([6, 7], 2, [0, 99], 1),
    "prefill metadata slot past its rows": ([6, 7], 2, [0, 1], 7),
}


def _bad_refs(make_pair, room, case):
    dst, dslot, src, pslot = BAD_REFS[case]
    (p, _, _), (d, dkv, dmeta) = make_pair()
    before = (dkv[0].clone(), dmeta.buf_infos())
    s, r = p.sender(room), d.receiver(room)
    _ready(s, r, dst, dslot)
    s.init(len(src), pslot)
    s.send(src)
    wait_for(lambda: s.drained and r.drained, f"{case}: both ended")
    return p, d, s, r, before


@pytest.mark.parametrize("case", sorted(BAD_REFS))
def test_vllm_52234_stale_or_out_of_range_page_refs_fail_never_succeed(make_pair, case):
    """vLLM #52234: a page reference outside the pool (stale, consumed or
    unknown) was written through, or reported Success. Here a page or metadata
    row that either side does not have fails the request on both ranks (a
    transfer error, with why), nothing is written outside the buffers, and
    no page of decode's is touched."""
    p, d, s, r, (kv, _) = _bad_refs(make_pair, 52234, case)
    assert (s.poll(), r.poll()) == (KVPoll.Failed, KVPoll.Failed)
    assert s.failure_reason() == r.failure_reason() == FailureReason.TRANSFER_ERROR
    assert p.engine.outside == [] and d.engine.outside == []
    assert "outside" in str(p.last_error) or "has no" in str(p.last_error)
    s.clear()
    r.clear()
    wait_for(lambda: not p.core.reqs and not d.core.reqs, "both released their slots")


def test_vllm_52234_negative_control_unchecked_refs_write_outside(make_pair, monkeypatch):
    """Negative control: with prefill's reference check switched off, the page
    past decode's pool is written (outside its buffers; the test's engine
    refuses to copy it and records it) and the request reports Success."""
    monkeypatch.setattr(pre, "refs_misfit", lambda *a: None)
    (p, _, _), (d, _, _) = make_pair()
    s, r = p.sender(52235), d.receiver(52235)
    _ready(s, r, [6, 8], 2)
    s.init(2, 1)
    s.send([0, 1])
    wait_for(lambda: r.poll() in (KVPoll.Success, KVPoll.Failed), "decode ended")
    assert r.poll() == KVPoll.Success and p.engine.outside != []
