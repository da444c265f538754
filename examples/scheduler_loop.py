"""A prefill and a decode scheduler stepping their queues with pd-lifecycle.

Two gloo ranks on 127.0.0.1 form one TP group. Each rank runs the same
scheduler code (here: a prefill queue pair and a decode queue pair side by
side, on the fake backend) and every queue is advanced by one consensus step
per iteration. Run it:

    python examples/scheduler_loop.py
"""

from __future__ import annotations

import numpy as np
import torch

from buffers import MetadataBuffers, MetadataLayout, SlotAllocator
from lifecycle import KVPoll, RequestTable, StepConfig, Stepper, TorchCollective
from lifecycle.testing.spawn import run_ranks
from transport.backends.fake import FakeManager

ROOMS = [101, 102, 103, 104, 105]
PAGES = {101: 3, 102: 0, 103: 8, 104: 2, 105: 5}


class NotBefore:
    """A user gate: hold a local Success until the scheduler says so."""

    name = "not-before"

    def __init__(self) -> None:
        self.held: set[int] = set()

    def closed(self, rooms: np.ndarray, indices: np.ndarray) -> np.ndarray:
        return np.array([r in self.held for r in rooms.tolist()], dtype=bool)


def rank_main(rank: int, world: int) -> dict[str, list[tuple[int, str]]]:
    tp = TorchCollective()  # the attention TP group (default group here)
    layout = MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
    backend = FakeManager()

    # ---- prefill: bootstrap queue -> in-flight queue -----------------------
    p_meta = MetadataBuffers(4, layout)
    p_slots = SlotAllocator(4, p_meta)
    bootstrap, inflight = RequestTable(), RequestTable()
    cfg = StepConfig(bootstrap_timeout=30.0, invalid_status="fail")
    p_boot = Stepper(bootstrap, rank, poller=backend, config=cfg)
    p_fly = Stepper(inflight, rank, poller=backend, config=cfg)

    # ---- decode: handshake queue -> transfer queue -------------------------
    d_meta = MetadataBuffers(4, layout)
    d_slots = SlotAllocator(4, d_meta)
    handshake, transfer = RequestTable(), RequestTable()
    gate = NotBefore()
    d_hand = Stepper(handshake, rank, poller=backend, config=cfg)
    d_xfer = Stepper(
        transfer,
        rank,
        poller=backend,
        metadata=d_meta,  # a Success waits for the first-token row to land
        gates=[gate],
        config=StepConfig(waiting_timeout=30.0),
    )

    senders, receivers = {}, {}
    for room in ROOMS:  # every rank admits the same requests in the same order
        s = senders[room] = backend.sender(room)
        bootstrap.add(room, handle_index=s.index)
        r = receivers[room] = backend.receiver(room)
        r.init()
        handshake.add(room, handle_index=r.index)
    gate.held.add(105)
    done: dict[str, list[tuple[int, str]]] = {"prefill": [], "decode": []}

    for it in range(1, 20):
        if it == 1:  # a client aborts 104: every rank hears of it, the step spreads it
            for table in (bootstrap, inflight, handshake, transfer):
                if 104 in table:
                    table.request_abort(104)
        if it == 4:
            gate.held.clear()

        # prefill bootstrap queue: WaitingForInput -> take a slot, move in flight
        res = p_boot.step(tp)
        for room, st in zip(res.rooms.tolist(), res.statuses.tolist()):
            if st == KVPoll.WaitingForInput:
                slot = p_slots.alloc(room)
                if slot is None:
                    continue  # no metadata row free: wait, not an error
                senders[room].init(PAGES[room], slot)
                bootstrap.remove(room)
                inflight.add(
                    room,
                    state=KVPoll.WaitingForInput,
                    handle_index=senders[room].index,
                    metadata_slot=slot,
                )
            elif st == KVPoll.Failed:
                bootstrap.remove(room)
                (f,) = [f for f in res.failures() if f.room == room]
                done["prefill"].append((room, f"failed: {f.reason.label} on rank {f.origin}"))
        for room in inflight.rooms().tolist():  # the forward pass sent a chunk
            senders[room].send(np.arange(4))
        res = p_fly.step(tp)
        for f in res.failures():
            done["prefill"].append((f.room, f"failed: {f.reason.label} on rank {f.origin}"))
        for room in res.rooms[(res.statuses == KVPoll.Success) | (res.statuses == KVPoll.Failed)]:
            slot = int(inflight.info(int(room)).metadata_slot)
            inflight.remove(int(room))
            p_slots.free(slot, int(room))
            if int(room) in res.succeeded:
                done["prefill"].append((int(room), "sent"))

        # decode handshake queue: WaitingForInput -> allocate and say where to write
        res = d_hand.step(tp)
        for room, st in zip(res.rooms.tolist(), res.statuses.tolist()):
            if st == KVPoll.Failed:
                handshake.remove(room)
                (f,) = [f for f in res.failures() if f.room == room]
                done["decode"].append((room, f"failed: {f.reason.label} on rank {f.origin}"))
            elif st == KVPoll.WaitingForInput:
                slot = d_slots.alloc(room)
                if slot is None:
                    break  # head-of-line: later requests wait too
                receivers[room].send_metadata(np.arange(PAGES[room]), slot)
                # the fake backend moves no bytes: write what prefill would have
                d_meta.write(slot, room, {"output_ids": [room % 1000]})
                handshake.remove(room)
                transfer.add(
                    room,
                    state=KVPoll.WaitingForInput,
                    metadata_slot=slot,
                    handle_index=receivers[room].index,
                )
                transfer.mark_metadata_sent(room, now=d_xfer.clock())
        res = d_xfer.step(tp)
        for room, st in zip(res.rooms.tolist(), res.statuses.tolist()):
            if st in (KVPoll.Success, KVPoll.Failed):
                slot = int(transfer.info(room).metadata_slot)
                if st == KVPoll.Success:
                    token = d_meta.read(slot).first_token
                    done["decode"].append((room, f"first token {token} (step {res.step})"))
                transfer.remove(room)
                d_slots.free(slot, room)  # zeroes the room: the next owner sees 'not written'
        if not (len(bootstrap) + len(inflight) + len(handshake) + len(transfer)):
            break
    assert d_slots.in_use == 0 and p_slots.in_use == 0, "a slot leaked"
    return done


if __name__ == "__main__":
    results = run_ranks(rank_main, 2, timeout=60)
    assert results[0] == results[1], "ranks disagree"
    for side, events in results[0].items():
        print(f"{side}:")
        for room, what in events:
            print(f"  room {room}: {what}")
