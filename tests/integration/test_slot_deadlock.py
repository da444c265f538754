"""Prefill's and decode's schedulers, each with one metadata row, taking two
requests in opposite orders, must not deadlock.

Written the way the field writes them: prefill takes a row for the first
request, in its order, that reports WaitingForInput; decode gives its row to
the request at the head of its queue once that one is ready. Prefill's order
is A, B; decode's is B, A. Had prefill reported WaitingForInput at the
handshake, it would give its row to A while decode gave its own to B: each
then waits for the other for ever (the field saw this with 8 rows a side, on
Mooncake and on NIXL). Prefill reports WaitingForInput only once decode said
where to write (every decode leg's page list is in), so it takes B first,
and both requests end Success, every KV byte and metadata byte checked.

The negative control swaps in the old table (prefill ready at the handshake)
and shows the same scenario reaching the crossed holding -- prefill's row on
A, decode's on B, which nothing but a timeout undoes -- and not finishing.
The connectors' timeouts are 300 s and the scenario's budget 60 s: a
deadlock fails a test, it does not hang one, and no verdict rests on a
clock (the crossed holding is itself the proof of the deadlock).

On the stub engine of tests/support/stub_engine.py (both sides in one
process, stepped in turn; the fake backend's two sides never wait for each
other, so it cannot deadlock) and on Mooncake and NIXL (a process a side, on
127.0.0.1).
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import pytest
import torch
from engines import require

from buffers import MetadataBuffers, MetadataLayout
from lifecycle import KVPoll
from lifecycle.testing.spawn import rank_context, store_server
from support.pages import pattern
from support.status import F, S, W
from support.stub_engine import CopyConnector
from transport.connector.config import ConnectorConfig
from transport.layout import kv_args_for

pytestmark = pytest.mark.timeout(240)

A, B = 501, 502
PAGES, POOL, PAGE_BYTES, LAYERS = 3, 8, 256, 2
LAYOUT = MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
BUDGET = 60.0  # seconds for the scenario: far above its run (about a second), far below
TIMEOUTS = 300.0  # the connectors' bootstrap and waiting timeouts
GRACE = 5.0  # a crossed holding is watched this long more: nothing moves


def row_values(room: int) -> dict[str, Any]:
    """The first-token metadata row prefill writes for ``room``."""
    return {
        "output_ids": [room % 30_000, room % 7],
        "cached_tokens": [room % 3],
        "output_token_logprobs_val": [-room / 1000.0],
        "output_topk_p": [0.75, 0.25],
        "output_hidden_states": [room / 10.0] * 32,
    }


class Board:
    """Which room holds each side's row (0: none), seen by both sides."""

    def __init__(self) -> None:
        self.held = {"prefill": 0, "decode": 0}

    def hold(self, role: str, room: int) -> None:
        self.held[role] = room

    def holder(self, role: str) -> int:
        return self.held[role]


class StoreBoard(Board):
    """The same, through the TCPStore, for sides in two processes. A store
    answers in order: a side that heard of a page list reads the row taken
    before it was sent."""

    def __init__(self, store: Any, ns: str) -> None:
        self.store, self.ns = store, ns

    def hold(self, role: str, room: int) -> None:
        self.store.set(f"{self.ns}/row/{role}", str(room))

    def holder(self, role: str) -> int:
        key = f"{self.ns}/row/{role}"
        return int(self.store.get(key)) if self.store.check([key]) else 0


@attrs.define
class Side:
    """One side's scheduler: one metadata row (row 0), a queue in its own order."""

    role: str
    m: Any
    kv: list[torch.Tensor]
    meta: MetadataBuffers
    board: Board
    order: tuple[int, ...]
    handles: dict[int, Any] = attrs.field(factory=dict)
    queue: list[int] = attrs.field(factory=list)
    row: int = 0  # the room holding the row, 0 if free
    pages: dict[int, list[int]] = attrs.field(factory=dict)
    outcome: dict[int, str] = attrs.field(factory=dict)
    problems: list[str] = attrs.field(factory=list)
    kv_bytes: int = 0
    row_bytes: int = 0
    steps: int = 0

    def finished(self) -> bool:
        return len(self.outcome) == len(self.order)

    def crossed(self) -> bool:
        """Each side's only row held for a request the other holds none for:
        neither can finish without the other's row (a deadlock)."""
        p, d = self.board.holder("prefill"), self.board.holder("decode")
        return p != 0 and d != 0 and p != d

    def _take(self, room: int) -> None:
        self.row = room
        self.board.hold(self.role, room)
        self.queue.remove(room)

    def _release(self, room: int, status: int) -> None:
        self.outcome[room] = KVPoll(status).name
        self.handles[room].clear()
        self.row = 0
        self.board.hold(self.role, 0)

    def step(self) -> None:
        self.steps += 1
        if self.role == "prefill":
            self._prefill()
        else:
            self._decode()

    def _prefill(self) -> None:
        # the bootstrap queue: the first ready request, in this side's order, takes the row
        for room in list(self.queue):
            st = self.handles[room].poll()
            if st == W and self.row == 0:
                self._take(room)
                pages = self.pages[room] = list(range(PAGES))
                for pos, page in enumerate(pages):  # the forward pass
                    for layer in range(LAYERS):
                        self.kv[layer][page] = pattern(room, pos, layer, PAGE_BYTES)
                self.meta.write(0, room, row_values(room))
                s = self.handles[room]
                s.init(PAGES, 0)
                s.send(pages[:2])
                s.send(pages[2:])
            elif st in (S, F):  # a Success before init would be a bug
                if st == S:
                    self.problems.append(f"room {room} Success in the bootstrap queue")
                self.queue.remove(room)
                self.outcome[room] = KVPoll(st).name
        if self.row:
            st = self.handles[self.row].poll()
            if st in (S, F):
                self._release(self.row, st)

    def _decode(self) -> None:
        # head of line: the request first in this side's order gets the row once ready
        if self.row == 0 and self.queue:
            room = self.queue[0]
            st = self.handles[room].poll()
            if st == W:
                self._take(room)
                pages = self.pages[room] = [POOL - 1 - k for k in range(PAGES)]
                self.handles[room].send_metadata(pages, 0)
            elif st == F:
                self.queue.pop(0)
                self.outcome[room] = "Failed"
        if self.row:
            room = self.row
            st = self.handles[room].poll()
            if st == S:
                self._verify(room)
                self.meta.clear_room(0)
            if st in (S, F):
                self._release(room, st)

    def _verify(self, room: int) -> None:
        for pos, page in enumerate(self.pages[room]):
            for layer in range(LAYERS):
                if not torch.equal(self.kv[layer][page], pattern(room, pos, layer, PAGE_BYTES)):
                    self.problems.append(f"room {room}: page {pos} layer {layer} differs")
                self.kv_bytes += PAGE_BYTES
        want = MetadataBuffers(1, LAYOUT)
        want.write(0, room, row_values(room))
        for name, t in self.meta.tensors.items():
            if not torch.equal(t[0], want.tensors[name][0]):
                self.problems.append(f"room {room}: metadata field {name} differs")
            self.row_bytes += t[0].nbytes

    def report(self, crossed: bool) -> dict[str, Any]:
        return {
            "side": self.role,
            "outcome": dict(self.outcome),
            "row": self.row,
            "crossed": crossed,
            "problems": list(self.problems),
            "kv_bytes": self.kv_bytes,
            "row_bytes": self.row_bytes,
            "steps": self.steps,
        }


def side(role: str, make: Any, ns: str, port: int, board: Board) -> Side:
    """A side's connector (``make(kv_args, config)``), buffers and scheduler.
    Decode registers A before B: were prefill ready at the handshake, it would
    see A ready first (its order's first), so the old table always crosses."""
    kv = [torch.zeros((POOL, PAGE_BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    meta = MetadataBuffers(1, LAYOUT)
    cfg = ConnectorConfig(
        role=role,
        tp_rank=0,
        store_port=port,
        namespace=ns,
        bootstrap_timeout=TIMEOUTS,
        waiting_timeout=TIMEOUTS,
        idle_interval=0.005,
    )
    m = make(kv_args_for(kv, meta.buf_infos(), 0), cfg)
    order = (A, B) if role == "prefill" else (B, A)
    s = Side(role, m, kv, meta, board, order)
    s.queue = list(order)
    for room in (A, B):
        s.handles[room] = m.sender(room) if role == "prefill" else m.receiver(room)
    return s


def register_in_order(d: Side, deadline: float) -> None:
    """Decode: A's register goes out, then B's (a loop pass could otherwise send
    B's first, were the prefill group's record to appear between the two)."""
    for room in (A, B):
        d.handles[room].init()
        while d.handles[room].poll() != W and time.monotonic() < deadline:
            time.sleep(0.002)


def drive(sides: list[Side], deadline: float) -> bool:
    """Step until every side finished, or the rows stay crossed for GRACE (nothing
    moves: the deadlock), or the budget ends; whether they were still crossed,
    unfinished, at the end. A crossing that passes is no deadlock: a side that
    finished its request may be a moment from releasing its row while the other
    side has given its own to the next request."""
    budget, crossed_at = deadline, None
    while time.monotonic() < deadline and not all(s.finished() for s in sides):
        for s in sides:
            s.step()
        if sides[0].crossed():
            if crossed_at is None:
                crossed_at = time.monotonic()
                deadline = min(budget, crossed_at + GRACE)
        elif crossed_at is not None:  # it passed: the budget again
            crossed_at, deadline = None, budget
        time.sleep(0.002)
    return crossed_at is not None and not all(s.finished() for s in sides)


def old_table() -> Any:
    """The table as it was: prefill reports WaitingForInput at the handshake."""
    from transport.connector.core.graph import EDGES, ByRole, compile_polls

    ready = ByRole(prefill=W, decode=W)
    return compile_polls(
        tuple(
            attrs.evolve(e, poll=ready)
            if e.trigger == "handshake"
            else attrs.evolve(e, poll=None)
            if e.trigger == "metadata"
            else e
            for e in EDGES
        )
    )


def check_success(reports: list[dict[str, Any]]) -> None:
    for r in reports:
        assert r["outcome"] == {A: "Success", B: "Success"}, r
        assert r["problems"] == [], r
        assert not r["crossed"], r
    d = next(r for r in reports if r["side"] == "decode")
    assert d["kv_bytes"] == 2 * PAGES * LAYERS * PAGE_BYTES  # every page of both, checked
    assert d["row_bytes"] == 2 * sum(MetadataBuffers(1, LAYOUT).buf_infos()[2])


def check_deadlocked(reports: list[dict[str, Any]]) -> None:
    with pytest.raises(AssertionError):  # the test above fails on it
        check_success(reports)
    held = {r["side"]: r["row"] for r in reports}
    assert held == {"prefill": A, "decode": B}, reports  # each side's row on its first
    for r in reports:
        assert r["crossed"], r
        assert r["outcome"] == {}, r  # nothing finished, on either side


# -- one process: the stub engine --------------------------------------------------------


def run_in_process(ns: str) -> list[dict[str, Any]]:
    server = store_server()
    board = Board()
    pre = side("prefill", CopyConnector, ns, server.port, board)
    dec = side("decode", CopyConnector, ns, server.port, board)
    try:
        deadline = time.monotonic() + BUDGET
        register_in_order(dec, deadline)
        crossed = drive([pre, dec], deadline)
        return [pre.report(crossed), dec.report(crossed)]
    finally:
        for s in (pre, dec):
            s.m.close(wait=0)


def test_one_row_a_side_opposite_orders_both_succeed_stub_engine():
    check_success(run_in_process("slots-ok"))


def test_negative_control_ready_at_the_handshake_deadlocks_stub_engine(monkeypatch):
    from transport.connector.core import machine

    monkeypatch.setattr(machine, "POLL", old_table())
    check_deadlocked(run_in_process("slots-old"))


# -- a process a side: Mooncake, NIXL --------------------------------------------------------


def _side_main(backend: str, role: str, port: int, ns: str, old: bool, q: Any) -> None:
    from transport.registry import get_backend

    if old:
        from transport.connector.core import machine

        machine.POLL = old_table()
    s = None
    try:
        from datetime import timedelta

        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        s = side(role, get_backend(backend).manager, ns, port, StoreBoard(store, ns))
        deadline = time.monotonic() + BUDGET
        if role == "decode":
            register_in_order(s, deadline)
        crossed = drive([s], deadline)
        q.put(s.report(crossed))
        # both sides stay up until both are done: the last word must reach the other
        store.set(f"{ns}/end/{role}", "1")
        other = "decode" if role == "prefill" else "prefill"
        while not store.check([f"{ns}/end/{other}"]) and time.monotonic() < deadline + 30:
            time.sleep(0.01)
    except Exception as e:  # report, so the parent does not wait for nothing
        q.put({"side": role, "error": repr(e)})
        raise
    finally:
        if s is not None:
            s.m.close(wait=1)


def run_pair(backend: str, ns: str, old: bool) -> list[dict[str, Any]]:
    server = store_server(3)
    ctx = rank_context()
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_side_main, args=(backend, role, server.port, ns, old, q))
        for role in ("prefill", "decode")
    ]
    for p in procs:
        p.start()
    try:
        reports = [q.get(timeout=BUDGET + 60) for _ in procs]
    finally:
        for p in procs:
            p.join(45)
            if p.is_alive():
                p.kill()
    errors = [r for r in reports if "error" in r]
    assert not errors, errors
    assert [p.exitcode for p in procs] == [0, 0]
    return sorted(reports, key=lambda r: r["side"] != "prefill")


@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_one_row_a_side_opposite_orders_both_succeed(backend):
    check_success(run_pair(require(backend), f"slots-ok-{backend}", old=False))


@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_negative_control_ready_at_the_handshake_deadlocks(backend):
    check_deadlocked(run_pair(require(backend), f"slots-old-{backend}", old=True))
