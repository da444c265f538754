"""KV pools cut in one region per head group (``KVArgs.head_group``): the
writes between two such pools (one run per whole group of consecutive pages,
every head landing where the peer's layout puts it), the digest's views of
them (the same bytes in the same order on both sides) and the connector
refusing a peer laid out otherwise."""

import ctypes
import math

import numpy as np
import pytest
import torch

from buffers import MetadataBuffers, MetadataLayout
from buffers.errors import BadSetting
from lifecycle import KVPoll
from lifecycle.testing.spawn import store_server
from support.stub_engine import CopyConnector, handshaken, refused_for_layout
from support.wait import wait_for
from transport.connector.config import ConnectorConfig
from transport.connector.core.legs import kv_writes, leg_of
from transport.digest import Views, digest, flip, signature
from transport.layout import coalesce, kv_args_for, layout_misfit, sliced_page_writes
from transport.topology import Topology, head_range

PAGES, PS, HB = 12, 4, 8
META = MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)


def model(heads, pages=PAGES, salt=0):
    """The model's bytes of global heads ``heads``: (pages, tokens, heads, bytes)."""
    p = np.arange(pages)[:, None, None, None]
    t = np.arange(PS)[None, :, None, None]
    h = np.asarray(heads)[None, None, :, None]
    b = np.arange(HB)[None, None, None, :]
    return ((p * 37 + t * 11 + h * 5 + b * 3 + salt * 7 + 1) % 251).astype(np.uint8)


class Pool:
    """One rank's KV: ``layers`` buffers of its heads, cut in groups of ``k``
    heads (0: token-major pages, one block each)."""

    def __init__(self, heads, k, layers=2, pages=PAGES, meta=None):
        self.heads, self.k, self.pages = list(heads), k, pages
        n = len(self.heads)
        shape = (n // k, pages, PS, k, HB) if k else (pages, PS, n, HB)
        self.kv = [torch.zeros(shape, dtype=torch.uint8) for _ in range(layers)]
        infos = meta.buf_infos() if meta is not None else ([], [], [])
        self.args = kv_args_for(self.kv, infos, 0, page_size=PS, kv_head_num=n, head_group=k)

    def logical(self, layer):
        """Buffer ``layer`` as (pages, tokens, heads, bytes), whatever its layout."""
        t = self.kv[layer].numpy()
        if not self.k:
            return t
        return t.transpose(1, 2, 0, 3, 4).reshape(self.pages, PS, len(self.heads), HB)

    def fill(self):
        for layer, t in enumerate(self.kv):
            want = model(self.heads, self.pages, layer)
            if self.k:
                g = len(self.heads) // self.k
                want = want.reshape(self.pages, PS, g, self.k, HB).transpose(2, 0, 1, 3, 4)
            t.numpy()[...] = want

    def info(self):
        a = self.args
        return {"kv_ptrs": list(a.kv_data_ptrs), "kv_lens": list(a.kv_data_lens)}


def apply(writes):
    for s, d, n in zip(*(w.tolist() for w in writes)):
        ctypes.memmove(d, s, n)


def pools(pt, dt, heads, grouped=True):
    topo = Topology(pt, dt, heads)
    k = math.gcd(*(max(1, heads // tp) for tp in (pt, dt))) if grouped else 0
    pre = [Pool(topo.heads("prefill", r), k) for r in range(pt)]
    dec = [Pool(topo.heads("decode", r), k) for r in range(dt)]
    for p in pre:
        p.fill()
    return topo, pre, dec


def writes_of(topo, pre, dec, r, s, src, dst):
    leg = leg_of(s.decode, s)
    leg.dst_heads = len(dec[s.decode].heads)
    return kv_writes(pre[r].args, dec[s.decode].info(), leg, src, dst)


@pytest.mark.parametrize(
    ("pt", "dt", "heads"), [(2, 1, 8), (1, 2, 8), (2, 4, 8), (4, 2, 8), (2, 2, 4), (1, 4, 2)]
)
def test_writes_between_pools_cut_in_head_groups_land_every_head(pt, dt, heads):
    topo, pre, dec = pools(pt, dt, heads)
    src = np.arange(2, 9)
    dst = np.array([9, 3, 4, 5, 0, 1, 10])  # decode's pages in another order
    for r in range(pt):
        for s in topo.targets(r):
            apply(writes_of(topo, pre, dec, r, s, src, dst))
    for d in dec:
        for layer in range(2):
            got = d.logical(layer)
            assert np.array_equal(got[dst], model(d.heads, salt=layer)[src])
            others = np.setdiff1d(np.arange(PAGES), dst)
            assert not got[others].any()  # nothing outside the request's pages


@pytest.mark.parametrize("grouped", [True, False], ids=["head-groups", "token-major"])
def test_a_head_group_of_consecutive_pages_is_one_run(grouped):
    topo, pre, dec = pools(2, 1, 8, grouped)
    src = np.arange(PAGES)
    for r in range(2):
        (s,) = topo.targets(r)
        _, _, n = writes_of(topo, pre, dec, r, s, src, src)
        # a run per buffer (layer) in head groups; a run per token of a page without
        assert n.size == (2 if grouped else 2 * PAGES * PS)
        assert n.sum() == 2 * PAGES * PS * 4 * HB
        shuffled = np.random.default_rng(r).permutation(PAGES)
        _, _, n = writes_of(topo, pre, dec, r, s, src, shuffled)
        assert n.size <= (2 * PAGES if grouped else 2 * PAGES * PS)
        assert n.sum() == 2 * PAGES * PS * 4 * HB


@pytest.mark.parametrize(("src_head", "dst_head", "count"), [(1, 1, 2), (0, 1, 3), (1, 0, 3)])
def test_a_slice_across_head_groups_is_cut_where_either_side_breaks(src_head, dst_head, count):
    # slices not aligned to the groups (no TP split makes these, the writes still
    # place every head): each piece lies in one group on both sides
    here = Pool(range(4), 2)
    here.fill()
    there = Pool(range(4), 2, pages=PAGES + 3)
    src, dst = np.arange(1, 6), np.arange(8, 3, -1)
    w = sliced_page_writes(
        here.args, there.info()["kv_ptrs"], 4, src, dst, src_head, dst_head, count,
        dst_lens=there.info()["kv_lens"],
    )  # fmt: skip
    apply(w)
    for layer in range(2):
        got, want = there.logical(layer), here.logical(layer)
        sl_src, sl_dst = slice(src_head, src_head + count), slice(dst_head, dst_head + count)
        assert np.array_equal(got[dst][:, :, sl_dst], want[src][:, :, sl_src])
        got[dst, :, sl_dst] = 0
        assert not got.any()  # nothing else written


def test_coalesce_merges_runs_contiguous_on_both_sides_only():
    s, d, n = (np.array(x) for x in ([0, 10, 20, 50], [100, 110, 130, 140], [10, 10, 10, 5]))
    cs, cd, cn = coalesce(s, d, n)
    # 0-20 and 100-120 continue each other; 20 and 130 do not on decode's side
    assert cs.tolist() == [0, 20, 50] and cd.tolist() == [100, 130, 140]
    assert cn.tolist() == [20, 10, 5]


def test_head_group_must_cut_the_heads_evenly_and_token_major_only():
    with pytest.raises(BadSetting, match=r"KVArgs\.head_group"):
        kv_args_for([torch.zeros((1, 4, 16))], ([], [], []), 0, kv_head_num=4, head_group=3)
    with pytest.raises(BadSetting, match=r"head-major"):
        kv_args_for(
            [torch.zeros((2, 4, 8))], ([], [], []), 0, kv_head_num=4, head_group=2,
            heads_major=True,
        )  # fmt: skip
    assert Pool(range(4), 2).args.head_groups == 2
    assert Pool(range(4), 0).args.head_groups == 1


def test_layouts_must_match_to_fit():
    grouped, plain = Pool(range(4), 2).args, Pool(range(4), 0).args
    assert layout_misfit(grouped, {"heads_major": False, "head_group": 2}) is None
    assert "cut in head groups of 2" in (layout_misfit(grouped, plain) or "")
    assert "token-major" in (layout_misfit(grouped, {}) or "")  # a peer naming neither


@pytest.mark.parametrize(("pt", "dt", "heads"), [(2, 1, 8), (1, 2, 8), (1, 4, 2)])
def test_the_digest_reads_the_bytes_each_leg_moves_in_the_same_order(pt, dt, heads):
    topo, pre, dec = pools(pt, dt, heads)
    src, dst = np.arange(1, 7), np.array([7, 2, 3, 4, 11, 0])
    for r in range(pt):
        for s in topo.targets(r):
            w = writes_of(topo, pre, dec, r, s, src, dst)
            apply(w)
            sent = Views(pre[r].args).kv_parts(src, s.src_head, s.count)
            held = Views(dec[s.decode].args).kv_parts(dst, s.dst_head, s.count)
            assert signature(sent) == signature(held)
            value, nbytes = digest(sent)
            assert nbytes == int(w[2].sum())  # exactly the bytes the leg moved
            assert digest(held) == (value, nbytes)
            assert flip(held)  # a byte of the leg's own changed: the digest differs
            assert digest(held)[0] != value
            flip(held)
    if dt == 1:  # another leg's heads changed: this leg's digest does not see it
        held = Views(dec[0].args).kv_parts(dst, 0, 4)
        before = digest(held)
        other = Views(dec[0].args).kv_parts(dst, 4, 4)
        flip(other)
        assert digest(held) == before


# -- the connector: a request between pools cut in head groups, and a misfit -----------------
@pytest.fixture(scope="module")
def store():
    server = store_server()
    yield server.port
    _ = server


class Rank:
    def __init__(self, role, tp, rank, port, ns, heads, k, **cfg):
        self.meta = MetadataBuffers(4, META)
        self.pool = Pool(head_range(tp, rank, heads), k, meta=self.meta)
        c = ConnectorConfig(
            role=role, tp_rank=rank, tp_size=tp, kv_heads=heads, store_port=port,
            namespace=ns, idle_interval=0.005, **cfg,
        )  # fmt: skip
        self.m = CopyConnector(self.pool.args, c)


def test_a_request_between_pools_cut_in_head_groups_lands_every_byte(store):
    pre = [Rank("prefill", 2, r, store, "hg-ok", 8, 4, digest=True) for r in range(2)]
    dec = Rank("decode", 1, 0, store, "hg-ok", 8, 4, digest=True)
    try:
        for p in pre:
            p.pool.fill()
        senders = [p.m.sender(31) for p in pre]
        r = dec.m.receiver(31)
        r.init()
        wait_for(lambda: r.poll() == KVPoll.WaitingForInput, "handshake")
        wait_for(lambda: handshaken(*senders), "registered")
        dst = np.array([8, 9, 10, 11, 0, 1])
        r.send_metadata(dst, 2)
        wait_for(lambda: all(s.poll() == KVPoll.WaitingForInput for s in senders), "pages in")
        src = np.arange(6)
        for p, s in zip(pre, senders):
            p.meta.write(1, 31, {"output_ids": [31]})
            s.init(src.size, 1)
            s.send(src)
        wait_for(lambda: r.poll() == KVPoll.Success, "decode success")
        for layer in range(2):
            assert np.array_equal(dec.pool.logical(layer)[dst], model(range(8), salt=layer)[src])
        # two runs of KV per prefill rank: one per buffer, pages 0-3 and 4-5 apart
        # (the primary's metadata fields in the same write)
        row = len(pre[0].meta.buf_infos()[0]) - 1
        assert [len(p.m.engine.writes[0]) for p in pre] == [4 + row, 4]
        assert (dec.m.stats["digests_checked"], dec.m.stats["digest_mismatches"]) == (2, 0)
    finally:
        for x in (*pre, dec):
            x.m.close(wait=0)


@pytest.mark.parametrize("grouped_side", ["prefill", "decode"])
def test_a_peer_whose_pages_are_not_cut_alike_is_refused(store, grouped_side):
    ns = f"hg-misfit-{grouped_side}"
    k = {"prefill": (2, 0), "decode": (0, 2)}[grouped_side]
    p = Rank("prefill", 1, 0, store, ns, 4, k[0])
    d = Rank("decode", 1, 0, store, ns, 4, k[1])
    try:
        refused_for_layout(p.m, d.m, 4, "KVArgs.head_group")
        assert p.m.stats["bytes_written"] == 0
    finally:
        p.m.close()
        d.m.close()


def test_the_bench_cuts_every_rank_in_the_largest_group_both_sides_hold_whole():
    from pdlife.bench.transfer_shape import pattern, shape_of

    s = shape_of(2, None, prefill_tp=2, decode_tp=1, layout="group")
    assert (s.head_group, s.layout, s.tensor_shape(8)) == (4, "group", (2, 64, 16, 4, 256))
    assert shape_of(2, None, prefill_tp=1, decode_tp=2, kv_heads=1, layout="group").head_group == 1
    plain = shape_of(2, None, prefill_tp=2, decode_tp=1, layout="token")
    grouped = pattern(s, range(8), 0)  # (regions, pages, tokens, heads of the region, bytes)
    want = pattern(plain, range(8), 0).reshape(64, 16, 2, 4, 256).transpose(2, 0, 1, 3, 4)
    assert np.array_equal(grouped, want)


def test_decode_hashes_each_head_groups_pages_as_they_land():
    # a slice across two head groups is two KV parts per buffer: every piece of
    # both is hashed once its pages are in, none left for the end
    from types import SimpleNamespace

    from transport.digest.parts import decode_progress

    pool = Pool(range(4), 2)  # 2 buffers of 2 regions
    port = SimpleNamespace(
        views=Views(pool.args), split_state=False, config=SimpleNamespace(tp_rank=0),
        group=lambda dp: {},
    )  # fmt: skip
    req = SimpleNamespace(pages=np.arange(PAGES), slot=-1, rows=None, dp=0)
    leg = SimpleNamespace(sends=True, primary=False, state=False, dst_head=0, count=4, peer=0)
    progress = decode_progress(port, req, leg)
    assert len(progress.needs) and max(progress.needs) == PAGES  # all paged, none inf
