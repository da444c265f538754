"""A scheduler on each rank of a simulated network (transport.testing.simnet):
requests admitted, pages handed out and taken back as the real schedulers do,
and what the protocol's invariants are checked against."""

import attrs
import numpy as np
import torch

from buffers import MetadataBuffers, MetadataLayout
from lifecycle import FailureReason, KVPoll
from transport.connector.config import ConnectorConfig
from transport.layout import kv_args_for
from transport.testing.simnet import Faults, SimNet

HEADS, HEAD_BYTES, PAGES, SLOTS = 6, 16, 16, 4  # 6 heads: TP 1, 2 and 3 slice them
#: the drain timeout outlasts any write and message delay the plans draw (0.5 s and 0.2 s):
#: past it a request is released even if a write could still land, by design
TIMEOUTS = {"bootstrap_timeout": 0.5, "waiting_timeout": 0.5, "drain_timeout": 1.5}
LAYOUT = MetadataLayout(hidden_size=16, hidden_dtype=torch.float32, max_top_logprobs=16)


@attrs.define
class Plan:
    """One simulated run: its shape, its faults, and what the schedulers do."""

    seed: int
    prefill_tp: int = 1
    decode_tp: int = 1
    requests: int = 2
    pages: int = 2  # per request
    digest: bool = False
    staging: bool = False
    notifies: bool = False
    faults: Faults = attrs.Factory(Faults)
    pause: tuple[str, int, float, float | None] | None = None  # (role, rank, at, seconds)
    abort: tuple[str, int, float] | None = None  # (role, request, at): its scheduler gives up
    limit: float = 8.0  # virtual seconds


def buffers(role, tp, rank, digest, staging):
    heads = HEADS // tp
    kv = [torch.zeros((PAGES, 1, heads, HEAD_BYTES), dtype=torch.uint8)]
    if role == "prefill":
        kv[0].copy_(
            torch.randint(0, 256, kv[0].shape, generator=torch.Generator().manual_seed(rank))
        )
    meta = MetadataBuffers(SLOTS, LAYOUT)
    cfg = ConnectorConfig(
        role=role, tp_rank=rank, tp_size=tp, store_port=1, digest=digest,
        staging=staging and role == "decode", staging_pages=8, heartbeat_interval=0.02,
        heartbeat_misses=3, **TIMEOUTS,
    )  # fmt: skip
    return kv_args_for(kv, meta.buf_infos(), rank, kv_head_num=heads), cfg, kv, meta


@attrs.define
class Outcome:
    status: int
    reason: int


class Run:
    """The network, its ranks, their schedulers, and what was seen."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.net = SimNet(plan.seed, plan.faults, dt=0.001, heartbeat=(0.02, 3))
        self.kv = {}
        self.prefill, self.decode = [], []
        for role, tp, out in (
            ("prefill", plan.prefill_tp, self.prefill),
            ("decode", plan.decode_tp, self.decode),
        ):
            for rank in range(tp):
                args, cfg, kv, meta = buffers(role, tp, rank, plan.digest, plan.staging)
                r = self.net.add(args, cfg, notifies=plan.notifies and role == "decode")
                self.kv[role, rank] = (kv, meta)
                out.append(r)
        self.free_pages = {r.rank: list(range(PAGES)) for r in self.decode}
        self.free_slots = {(r.role, r.rank): list(range(SLOTS)) for r in self.decode + self.prefill}
        self.handles = {}  # (role, rank, room) -> handle
        self.held = {}  # (role, rank, room) -> (pages, slot)
        self.outcome = {}  # (role, rank, room) -> Outcome
        self.drained_early = []  # (rank, room): drained while a write of it could land
        self.told = set()
        self.succeeded = {}  # (role, rank, room) -> when its Success was first seen
        self.paused_forever = False
        for i in range(plan.requests):
            room = 100 + i
            for r in self.decode:
                h = self.handles["decode", r.rank, room] = r.receiver(room)
                h.init()
            for r in self.prefill:
                self.handles["prefill", r.rank, room] = r.sender(room)

    def rooms(self):
        return [100 + i for i in range(self.plan.requests)]

    def schedule(self):
        """What every rank's scheduler does this tick."""
        plan, net = self.plan, self.net
        if plan.pause and abs(net.now - plan.pause[2]) < net.dt / 2:
            role, rank, _, seconds = plan.pause
            net.pause(net.ranks[role, rank], seconds)
            self.paused_forever = seconds is None
        for r in self.decode:  # the staging gate: each step scatters what landed
            if r.staging is not None:
                live = [(room, h.index) for (ro, k, room), h in self.handles.items()
                        if ro == "decode" and k == r.rank and not h.detached]  # fmt: skip
                rooms = np.array([x for x, _ in live], dtype=np.uint64)
                r.core.advance(rooms, np.array([i for _, i in live], dtype=np.int64), net.now)
        for (role, rank, room), h in list(self.handles.items()):
            if h.detached:
                continue
            st = h.poll()
            if st == KVPoll.Success and role == "decode" and self._scattering(rank, room, h):
                continue  # (the gate holds its Success until every page is placed)
            if st == KVPoll.Success:
                self.succeeded.setdefault((role, rank, room), net.now)
            aborts = plan.abort and plan.abort[0] == role and 100 + plan.abort[1] == room
            due = aborts and abs(net.now - plan.abort[2]) < net.dt / 2
            if due and st not in (KVPoll.Success, KVPoll.Failed):
                h.abort()
                continue
            key = (role, rank, room)
            if role == "decode" and st == KVPoll.WaitingForInput and key not in self.told:
                pages = [self.free_pages[rank].pop(0) for _ in range(plan.pages)]
                slot = self.free_slots[role, rank].pop(0)
                net.fence.assign(net.ranks[role, rank], pages, room, h.epoch)
                self.held[key] = (pages, slot)
                self.told.add(key)
                h.send_metadata(pages, slot)
            elif role == "prefill" and st == KVPoll.WaitingForInput and key not in self.told:
                slot = self.free_slots[role, rank].pop(0)
                self.held[key] = ([], slot)
                self.told.add(key)
                h.init(plan.pages, slot)
                h.send(list(range(plan.pages * (room - 100), plan.pages * (room - 99))))
            elif st in (KVPoll.Success, KVPoll.Failed) and h.drained:
                self._finish(key, h, st)

    def _scattering(self, rank, room, h):
        core = self.net.ranks["decode", rank].core
        return bool(core.pending(np.array([room], dtype=np.uint64), np.array([h.index]))[0])

    def _finish(self, key, h, st):
        role, rank, room = key
        net = self.net
        if role == "decode" and net.in_flight(net.ranks[role, rank], room, h.epoch):
            self.drained_early.append((rank, room))
        self.outcome[key] = Outcome(int(st), int(h.failure_reason()) if st == KVPoll.Failed else -1)
        h.clear()
        pages, slot = self.held.pop(key, ([], None))
        if role == "decode":
            net.fence.free(net.ranks[role, rank], pages)
            self.free_pages[rank] += pages
        if slot is not None:
            self.free_slots[role, rank].append(slot)

    def go(self):
        """Run until every handle is cleared or the plan's time is up; True if all were."""

        def done():
            self.schedule()
            return all(h.detached for h in self.handles.values())

        return self.net.run(done, self.plan.limit)

    # -- invariants -------------------------------------------------------------------------
    def leaks(self):
        """Slots or pages still held once every handle was cleared."""
        out = []
        for r in self.prefill + self.decode:
            if r.core.reqs:
                out.append(f"{r.role} rank {r.rank} still holds {sorted(r.core.reqs)}")
            if len(r.core._free) != r.core.status.size:
                out.append(
                    f"{r.role} rank {r.rank}: {r.core.status.size - len(r.core._free)} slots taken"
                )
        for rank, free in self.free_pages.items():
            if sorted(free) != list(range(PAGES)):
                out.append(
                    f"decode rank {rank}: pages {sorted(set(range(PAGES)) - set(free))} not back"
                )
        return out

    def disagreements(self):
        """Requests whose sides did not agree (checked where no message was lost).

        Each side's ranks agree as the step makes them (a MIN over the TP group:
        Failed on one rank is Failed on all); the two sides are separate groups,
        and must end alike through the protocol alone, unless a deadline ended
        one of them (a timeout races the other side's completion by design), or
        a scheduler gave up on it after the other side had succeeded (:meth:`_raced`)."""
        out = []
        deadlines = {int(FailureReason.BOOTSTRAP_TIMEOUT), int(FailureReason.WAITING_TIMEOUT)}
        for room in self.rooms():
            if any(o.reason in deadlines for k, o in self.outcome.items() if k[2] == room):
                continue
            if self._raced(room):
                continue
            agreed = {}
            for (role, _, r), o in self.outcome.items():
                if r == room:
                    agreed[role] = min(agreed.get(role, o.status), o.status)
            if len(agreed) == 2 and len(set(agreed.values())) > 1:
                ends = {k: o.status for k, o in self.outcome.items() if k[2] == room}
                out.append(f"room={room}: agreed {agreed}, by rank {ends}")
        return out

    def _raced(self, room):
        """A scheduler's abort of ``room`` that came too late for the other side:
        each of its ranks that ended Success had succeeded before it handled any
        word of the failure (the abort crossed its "done", or its "verified")."""
        if not self.plan.abort or 100 + self.plan.abort[1] != room:
            return False
        other = "decode" if self.plan.abort[0] == "prefill" else "prefill"
        words = {"abort", "failed", "gave_up"}
        heard = {}  # (role, rank) -> when it first handled a word of the failure
        for t, role, rank, kind, r in self.net.handled:
            if r == room and kind in words:
                heard.setdefault((role, rank), t)
        ok = [(k, t) for k, t in self.succeeded.items() if k[0] == other and k[2] == room]
        return bool(ok) and all(t <= heard.get(k[:2], float("inf")) for k, t in ok)

    def corrupted_successes(self):
        """Requests that ended Success on a decode rank holding bytes flipped in flight."""
        hit = {
            (f.target.rank, f.effect.room)
            for f in self.net.flights
            if f.corrupt and f.done and f.lands
        }
        return [
            (rank, room)
            for (role, rank, room), o in self.outcome.items()
            if role == "decode" and (rank, room) in hit and o.status == KVPoll.Success
        ]
