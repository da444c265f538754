"""What the connector's liveness and topology tests need on top of the simulated
network (transport.testing.simnet): waiting in virtual time, a message handed
in as a mailbox would, a paused rank thawed, and a rank over a topology's
real buffers that either network (simulated, or a store with a copy engine)
can host."""

import numpy as np
import torch

from buffers import MetadataBuffers, MetadataLayout
from buffers.kv_args import StateComponent, StateType
from lifecycle import KVPoll
from transport.connector.config import ConnectorConfig
from transport.connector.core.events import Arrived
from transport.connector.core.graph import Phase
from transport.connector.core.messages import parse
from transport.layout import kv_args_for
from transport.topology import TopologyError

PAGES, PS, HB, SLOTS = 32, 2, 8, 4
SPLIT_UNITS, UNIT, WHOLE = 8, 3, 5  # split state: 8 global units of 3 bytes; a 5-byte whole row
LAYOUT = MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)


def settle(net, cond, what, limit=10.0):
    """Run ``net`` until ``cond()`` holds; fail naming ``what`` after ``limit`` virtual seconds."""
    if not net.run(cond, limit):
        raise AssertionError(f"not within {limit} virtual s: {what}")


def deliver(net, rank, raw):
    """``raw`` reaches ``rank`` as its mailbox read it, and is handled at once;
    what it causes goes out on the rank's next pass."""
    rank.core.handle(Arrived(parse(raw)), net.now)


def thaw(rank):
    """A rank paused for ever (``net.pause(rank, None)``) resumes."""
    rank.paused = False


def handshaken(*senders):
    """Every decode leg registered each of these prefill requests."""
    return all(s.manager.phase_of(s._req) == Phase.Handshaken for s in senders)


def refused_for_layout(net, prefill, decode, room, says):
    """Decode refuses ``room`` for a layout misfit (a TopologyError saying ``says``)
    and prefill is told: (the prefill sender, the decode receiver), both Failed."""
    s = prefill.sender(room)
    r = decode.receiver(room)
    r.init()
    settle(net, lambda: r.poll() == KVPoll.Failed, "refused")
    assert isinstance(decode.core.last_error, TopologyError)
    assert says in str(decode.core.last_error)
    settle(net, lambda: s.poll() == KVPoll.Failed, "prefill told")
    return s, r


def split_row(room, tp, rank):
    """Rank ``rank`` of a TP group of ``tp``'s share of ``room``'s split state row."""
    full = (room * 17 + np.arange(SPLIT_UNITS * UNIT) * 3 + 1) % 251
    n = SPLIT_UNITS // tp * UNIT
    return full[rank * n : (rank + 1) * n].astype(np.uint8)


def whole_row(room):
    return ((room * 5 + np.arange(WHOLE) * 7 + 2) % 251).astype(np.uint8)


def pattern(room, layer, tokens, heads):
    """What global heads ``heads`` of tokens ``tokens`` of ``room`` hold: (tokens, heads, HB)."""
    t = np.asarray(tokens)[:, None, None]
    h = np.asarray(heads)[None, :, None]
    b = np.arange(HB)[None, None, :]
    return ((room * 31 + layer * 7 + t * 13 + h * 29 + b) % 251).astype(np.uint8)


class Rank:
    """One rank of a topology over real buffers; ``host(kv_args, config)`` builds
    its connector (``SimNet.add``, or a driver over a store at ``port``)."""

    def __init__(
        self, role, tp, rank, topo, host, port=1, dp=0, state=False, heads_major=False, **cfg
    ):
        cfg = {"kv_heads": topo.kv_heads, **cfg}
        self.role, self.tp_rank, self.dp = role, rank, dp
        self.heads = list(topo.heads(role, rank))
        shape = (
            (PAGES, len(self.heads), PS, HB) if heads_major else (PAGES, PS, len(self.heads), HB)
        )
        # indexed (page, token, head, byte) either way; head-major pages are
        # (page, head, token, byte) in memory
        self.kv = [torch.zeros(shape, dtype=torch.uint8) for _ in range(2)]
        if heads_major:
            self.kv = [t.transpose(1, 2) for t in self.kv]
        self.meta = MetadataBuffers(SLOTS, LAYOUT)
        self.state = torch.zeros((8, 24), dtype=torch.uint8) if state is True else None
        comps = (
            [StateComponent(StateType.MAMBA, [self.state.data_ptr()], [self.state.nbytes], [24])]
            if state is True
            else []
        )
        if state == "split":  # a mamba-like state: one tensor split by TP, one held whole
            units = SPLIT_UNITS // tp
            self.split = [
                torch.zeros((8, units * UNIT), dtype=torch.uint8),
                torch.zeros((8, WHOLE), dtype=torch.uint8),
            ]
            comps = [
                StateComponent(
                    StateType.MAMBA,
                    [t.data_ptr() for t in self.split],
                    [t.nbytes for t in self.split],
                    [t[0].nbytes for t in self.split],
                    split_dims=[units, 0],
                )
            ]
        args = kv_args_for(
            self.kv,
            self.meta.buf_infos(),
            rank,
            page_size=PS,
            kv_head_num=len(self.heads),
            state=comps,
            heads_major=heads_major,
        )
        c = ConnectorConfig(
            role=role,
            tp_rank=rank,
            tp_size=tp,
            dp_rank=dp,
            store_port=port,
            idle_interval=0.005,
            mla=topo.mla,
            **cfg,
        )
        self.m = host(args, c)

    def fill(self, room, pages):
        for layer, t in enumerate(self.kv):
            tokens = np.arange(pages.size * PS)
            t.numpy()[pages] = pattern(room, layer, tokens, self.heads).reshape(
                pages.size, PS, len(self.heads), HB
            )

    def check(self, room, pages, first_page=0):
        for layer, t in enumerate(self.kv):
            tokens = np.arange(first_page * PS, (first_page + pages.size) * PS)
            want = pattern(room, layer, tokens, self.heads).reshape(
                pages.size, PS, len(self.heads), HB
            )
            assert np.array_equal(t.numpy()[pages], want), (
                f"decode rank {self.tp_rank} layer {layer}"
            )


def run_request(net, pre, dec, room, n=5, prefix=0, dp=0, chunks=2):
    """Request ``room`` of ``n`` pages from prefill DP group ``dp`` to every decode
    rank (``prefix`` pages cached there), handed over ``chunks`` pages a send;
    (senders, receivers, decode's pages)."""
    group = [p for p in pre if p.dp == dp]
    senders = [p.m.sender(room) for p in group]
    receivers = [d.m.receiver(room) for d in dec]
    for r in receivers:
        r.init(prefill_dp_rank=dp)
    settle(net, lambda: all(r.poll() == KVPoll.WaitingForInput for r in receivers), "handshake")
    settle(net, lambda: handshaken(*senders), "every decode rank registered")
    # prefill waits for every decode rank's page list before it reports ready
    assert {s.poll() for s in senders} == {KVPoll.Bootstrapping}
    dst = np.arange(10, 10 + n - prefix)[::-1].copy()  # decode pages in another order
    for d, r in zip(dec, receivers):
        r.send_metadata(
            dst,
            2,
            state_indices=[np.array([5])] if d.state is not None else None,
            decode_prefix_len=prefix * PS,
        )
    settle(net, lambda: all(s.poll() == KVPoll.WaitingForInput for s in senders), "page lists in")
    src = np.arange(3, 3 + n)
    for p, s in zip(group, senders):
        p.fill(room, src)
        p.meta.write(1, room, {"output_ids": [room % 1000]})
        if p.state is not None:
            p.state[2] = torch.tensor(pattern(room, 9, [0], range(3)).reshape(-1))
        s.init(n, 1)
    for k in range(0, n, chunks):
        for p, s in zip(group, senders):
            s.send(
                src[k : k + chunks], state_indices=[np.array([2])] if p.state is not None else None
            )
    return senders, receivers, dst


def finish(net, senders, receivers, dec, staged=False):
    """Run until every side succeeded (staged: and every page was scattered)."""

    def done():
        for d, r in zip(dec, receivers):
            if staged:
                d.m.core.advance(
                    np.array([r.bootstrap_room], np.uint64), np.array([r.index]), net.now
                )
        return all(r.poll() == KVPoll.Success for r in receivers) and (
            not staged
            or not any(
                d.m.core.pending(np.array([0], np.uint64), np.array([r.index]))[0]
                for d, r in zip(dec, receivers)
            )
        )

    settle(net, done, "decode success")
    settle(net, lambda: all(s.poll() == KVPoll.Success for s in senders), "prefill success")


def hello(net, pre, dec, room):
    """One request's senders and receivers, past the handshake."""
    senders = [p.m.sender(room) for p in pre]
    receivers = [d.m.receiver(room) for d in dec]
    for r in receivers:
        r.init()
    settle(net, lambda: all(r.poll() == KVPoll.WaitingForInput for r in receivers), "hello")
    settle(net, lambda: handshaken(*senders), "every decode rank registered")
    return senders, receivers


def run_split_state(net, pre, dec, room):
    """One request whose state is split by TP: prefill row 2, decode row 5."""
    group = pre
    senders, receivers = hello(net, pre, dec, room)
    src = np.arange(3, 5)
    for p, s in zip(group, senders):
        p.fill(room, src)
        p.split[0][2] = torch.tensor(split_row(room, len(pre), p.tp_rank))
        p.split[1][2] = torch.tensor(whole_row(room))
        s.init(2, 1)
    dst = np.array([11, 10])
    for r in receivers:
        r.send_metadata(dst, 2, state_indices=[np.array([5])])
    for s in senders:
        s.send(src, state_indices=[np.array([2])])
    return senders, receivers, dst
