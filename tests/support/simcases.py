"""The connector's tests on the simulated network (transport.testing.simnet):
waiting in virtual time; a prefill/decode pair of one small buffer each; the
few things those tests steer on the wire (sends watched or held back, a raw
body put on a rank's queue, a message handed to a core at once, a paused rank
thawed); and ranks over a topology's real buffers (head slices, head-major
pages, MLA, state rows, staging) that either network (simulated, or a store
with a copy engine) can host, with the steps of one request across them."""

import json

import numpy as np
import torch

from buffers import MetadataBuffers, MetadataLayout
from buffers.kv_args import StateComponent, StateType
from lifecycle import KVPoll
from transport.connector.config import ConnectorConfig
from transport.connector.core.events import Arrived, Send
from transport.connector.core.graph import Phase
from transport.connector.core.messages import parse
from transport.layout import kv_args_for
from transport.testing.simnet import SimNet
from transport.topology import TopologyError

LAYOUT = MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
#: virtual seconds a step of a test may take: far more than any message or write needs
LIMIT = 5.0


def settle(net, cond, what, limit=LIMIT):
    """Step ``net`` until ``cond()`` holds; fail naming ``what`` if it never does
    within ``limit`` virtual seconds."""
    if not net.run(cond, limit):
        raise AssertionError(f"{what}: not within {limit} virtual seconds (t={net.now:.3f})")


def handshaken(*senders):
    """Every decode leg registered each of these prefill requests (the handshake)."""
    return all(s.manager.phase_of(s._req) == Phase.Handshaken for s in senders)


def pair(seed=0, prefill=None, decode=None, **net_kw):
    """A network of one prefill and one decode rank over 8 pages of 64 bytes and 4
    metadata rows: ``(net, {role: (rank, kv, meta)})``; per-role config extras."""
    net = SimNet(seed, **net_kw)
    sides = {}
    for role, extra in (("prefill", prefill), ("decode", decode)):
        kv = [torch.zeros((8, 64), dtype=torch.uint8)]
        meta = MetadataBuffers(4, LAYOUT)
        cfg = ConnectorConfig(role=role, tp_rank=0, store_port=1, **(extra or {}))
        sides[role] = (net.add(kv_args_for(kv, meta.buf_infos(), 0), cfg), kv, meta)
    return net, sides


def watch_sends(net, rank, see):
    """Call ``see(msg)`` for each message ``rank`` sends, as it leaves."""
    perform = net._perform

    def spy(r, e):
        if r is rank and isinstance(e, Send):
            see(e.msg)
        perform(r, e)

    net._perform = spy


def hold_sends(net, rank, kind):
    """Hold back the messages of ``kind`` that ``rank`` sends; returns a function
    that lets them go (and every later one)."""
    perform = net._perform
    held = []

    def hold(r, e):
        if r is rank and isinstance(e, Send) and str(e.msg.KIND) == kind:
            held.append((r, e))
        else:
            perform(r, e)

    def release():
        net._perform = perform
        for r, e in held:
            perform(r, e)
        return len(held)

    net._perform = hold
    return release


def post(rank, body):
    """Put ``body`` (bytes, as a store queue holds it) on ``rank``'s queue, read as
    the mailbox reads it: JSON when it is, the raw body when not."""
    try:
        rank.inbox.append(json.loads(body))
    except ValueError:
        rank.inbox.append(body)


def deliver(net, rank, raw):
    """``raw`` reaches ``rank`` as its mailbox read it, and is handled at once,
    nothing else in between; what it causes goes out on the rank's next pass."""
    rank.core.handle(Arrived(parse(raw)), net.now)


def thaw(rank):
    """A rank paused for ever (``net.pause(rank, None)``) resumes."""
    rank.paused = False


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


# -- ranks over real topologies --------------------------------------------------------------
PAGES, PS, HB, SLOTS = 32, 2, 8, 4
SPLIT_UNITS, UNIT, WHOLE = 8, 3, 5  # split state: 8 global units of 3 bytes; a 5-byte whole row


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
    its connector, ``m`` (``SimNet.add``, or a driver over a store at ``port``)."""

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

    @property
    def stats(self):
        return self.m.core.stats

    def advance(self, room, index, now):
        """The staging gate's step for one request (decode's scheduler, each step)."""
        self.m.core.advance(np.array([room], np.uint64), np.array([index]), now)

    def pending(self, room, index):
        return bool(self.m.core.pending(np.array([room], np.uint64), np.array([index]))[0])

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


def hello(net, pre, dec, room, dp=0):
    """Request ``room``'s senders (on prefill DP group ``dp``) and receivers (on
    every decode rank), past the handshake: (senders, receivers)."""
    senders = [p.m.sender(room) for p in pre if p.dp == dp]
    receivers = [d.m.receiver(room) for d in dec]
    for r in receivers:
        r.init(prefill_dp_rank=dp)
    settle(net, lambda: all(r.poll() == KVPoll.WaitingForInput for r in receivers), "handshake")
    settle(net, lambda: handshaken(*senders), "every decode rank registered")
    return senders, receivers


def run_request(net, pre, dec, room, n=5, prefix=0, dp=0, chunks=2):
    """Request ``room`` of ``n`` pages from prefill DP group ``dp`` to every decode
    rank (``prefix`` pages cached there), handed over ``chunks`` pages a send;
    (senders, receivers, decode's pages)."""
    group = [p for p in pre if p.dp == dp]
    senders, receivers = hello(net, pre, dec, room, dp=dp)
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


def run_split_state(net, pre, dec, room):
    """One request whose state is split by TP: prefill row 2, decode row 5."""
    senders, receivers = hello(net, pre, dec, room)
    src = np.arange(3, 5)
    for p, s in zip(pre, senders):
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


def finish(net, senders, receivers, dec, staged=False):
    """Run until decode (with every staged page placed) and then prefill succeed."""

    def done():
        for d, r in zip(dec, receivers):
            if staged:
                d.advance(r.bootstrap_room, r.index, net.now)
        return all(r.poll() == KVPoll.Success for r in receivers) and (
            not staged or not any(d.pending(0, r.index) for d, r in zip(dec, receivers))
        )

    settle(net, done, "decode success")
    settle(net, lambda: all(s.poll() == KVPoll.Success for s in senders), "prefill success")
