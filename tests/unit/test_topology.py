"""Who sends which heads to whom (transport.topology), and the head-sliced,
state and staged layouts the connector writes with (transport.layout,
transport.staging)."""

import numpy as np
import pytest
import torch

from buffers.errors import LayoutError
from buffers.kv_args import KVArgs, StateComponent, StateType
from transport.layout import (
    StateShare,
    coalesce,
    kv_args_for,
    layout_misfit,
    sliced_page_writes,
    state_geometry,
    state_misfit,
    state_writes,
)
from transport.staging import Scatter, Staging
from transport.topology import Slice, Topology, TopologyError, head_range


def test_head_ranges_split_and_replicate():
    assert [head_range(2, r, 8) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [head_range(4, r, 2) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    with pytest.raises(TopologyError, match="do not split"):
        head_range(3, 0, 8)
    with pytest.raises(TopologyError, match="not a multiple"):
        head_range(6, 0, 4)
    with pytest.raises(TopologyError, match="outside"):
        head_range(2, 2, 8)


@pytest.mark.parametrize(
    ("pt", "dt", "h"), [(1, 1, 4), (2, 1, 4), (1, 2, 4), (2, 4, 4), (4, 2, 8), (4, 2, 2), (2, 8, 4)]
)
def test_every_decode_head_comes_from_exactly_one_holder(pt, dt, h):
    topo = Topology(pt, dt, h)
    for d in range(dt):
        got = []
        for s in topo.senders(d):
            theirs = topo.heads("prefill", s.prefill)
            got += [theirs[s.src_head + i] for i in range(s.count)]
            assert list(range(s.dst_head, s.dst_head + s.count)) == [
                topo.heads("decode", d).index(theirs[s.src_head + i]) for i in range(s.count)
            ]
        assert got == list(topo.heads("decode", d))
        senders = topo.senders(d)
        assert [s.primary for s in senders] == [True] + [False] * (len(senders) - 1)
    # every prefill rank is either a sender or informed by exactly one decode rank
    for p in range(pt):
        informers = [d for d in range(dt) if p in topo.contacts(d)]
        assert informers, f"prefill rank {p} hears from no decode rank"
        assert set(topo.peers(p)) == set(informers)


def test_mla_one_sender_per_decode_rank_the_rest_idle():
    topo = Topology(4, 2, mla=True)
    assert topo.senders(0) == (Slice(0, 0, 0, 0, 1, True),)
    assert topo.senders(1) == (Slice(1, 1, 0, 0, 1, True),)
    assert topo.targets(2) == () and topo.peers(2) == (0,)
    assert topo.contacts(0) == (0, 2) and topo.contacts(1) == (1, 3)
    assert Topology(1, 2, mla=True).targets(0) == (
        Slice(0, 0, 0, 0, 1, True),
        Slice(0, 1, 0, 0, 1, True),
    )


def test_a_bad_topology_is_refused_up_front():
    with pytest.raises(TopologyError, match="split over TP size 3"):
        Topology(3, 1, 4)
    with pytest.raises(TopologyError, match=">= 1"):
        Topology(0, 1, 4)


def _kv(pages, ps, heads, hb, fill):
    t = torch.zeros((pages, ps, heads, hb), dtype=torch.uint8)
    if fill:
        t.copy_(torch.arange(t.numel(), dtype=torch.int64).view_as(t) % 251)
    return t


def _apply(w):
    import ctypes

    for s, d, n in zip(*(a.tolist() for a in w)):
        ctypes.memmove(d, s, n)


def test_sliced_writes_move_exactly_the_heads_and_coalesce():
    src, dst = _kv(6, 2, 4, 8, True), _kv(6, 2, 2, 8, False)
    args = kv_args_for([src], ([], [], []), 0, page_size=2, kv_head_num=4)
    w = sliced_page_writes(args, [dst.data_ptr()], 2, np.array([1, 2]), np.array([4, 5]), 2, 0, 2)
    assert w[0].size == 4  # one run per token: the source is strided
    _apply(w)
    assert torch.equal(dst[4:6], src[1:3, :, 2:4])
    assert dst[:4].sum() == 0
    # whole pages on both sides: one run for two contiguous pages
    full = _kv(6, 2, 2, 8, False)
    args2 = kv_args_for([dst], ([], [], []), 0, page_size=2, kv_head_num=2)
    w2 = sliced_page_writes(
        args2, [full.data_ptr()], 2, np.array([4, 5]), np.array([0, 1]), 0, 0, 2
    )
    assert w2[0].size == 1 and int(w2[2][0]) == 2 * 2 * 2 * 8


def test_head_major_pages_move_a_slice_as_one_run_per_page():
    # (page, head, token, byte): a rank's heads of a page are one run of all its tokens
    src = torch.arange(6 * 4 * 2 * 8, dtype=torch.int64).view(6, 4, 2, 8).remainder(251)
    src = src.to(torch.uint8)
    dst = torch.zeros((6, 8, 2, 8), dtype=torch.uint8)
    args = kv_args_for([src], ([], [], []), 0, page_size=2, kv_head_num=4, heads_major=True)
    pages, to = np.array([1, 2, 4]), np.array([5, 0, 3])
    w = sliced_page_writes(args, [dst.data_ptr()], 8, pages, to, 0, 4, 4)
    assert w[0].size == 3 and set(w[2].tolist()) == {4 * 2 * 8}  # one run per page
    _apply(w)
    assert torch.equal(dst[to][:, 4:8], src[pages])
    assert dst[to][:, :4].sum() == 0 and dst[[1, 2, 4]].sum() == 0
    # the same slice of token-major pages: one run per token
    tm = kv_args_for([src], ([], [], []), 0, page_size=2, kv_head_num=4)
    assert sliced_page_writes(tm, [dst.data_ptr()], 8, pages, to, 0, 4, 4)[0].size == 6
    # head-major pages whose slice is the whole page on both sides coalesce across pages
    whole = sliced_page_writes(
        args, [dst.data_ptr()], 4, np.array([0, 1]), np.array([2, 3]), 0, 0, 4
    )
    assert whole[0].size == 1 and int(whole[2][0]) == 2 * src[0].nbytes


def test_the_two_sides_must_lay_out_a_page_alike():
    assert layout_misfit(True, True) is None and layout_misfit(False, False) is None
    why = layout_misfit(False, True)
    assert why is not None and "prefill's KV pages are token-major, decode's head-major" in why


def test_coalesce_merges_only_runs_contiguous_on_both_sides():
    s, d, n = (np.array(v, dtype=np.int64) for v in ([0, 4, 8, 20], [100, 104, 200, 204], [4] * 4))
    got = coalesce(s, d, n)
    assert [a.tolist() for a in got] == [[0, 8, 20], [100, 200, 204], [8, 4, 4]]


def test_state_rows_move_by_component():
    a = torch.arange(40, dtype=torch.uint8).view(10, 4)
    b = torch.zeros((10, 4), dtype=torch.uint8)
    comp = StateComponent(StateType.MAMBA, [a.data_ptr()], [a.nbytes], [4])
    args = kv_args_for([], ([], [], []), 0, state=[comp])
    _apply(state_writes(args, [[b.data_ptr()]], [np.array([2, 3])], [np.array([7, 8])]))
    assert torch.equal(b[7:9], a[2:4]) and b[:7].sum() == 0


@pytest.mark.parametrize(("pt", "dt"), [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2), (2, 8)])
def test_split_state_shares_tile_every_decode_row_exactly_once(pt, dt):
    # 8 units of 3 bytes split by TP, plus a 5-byte tensor held whole: every
    # prefill rank writes its overlap with every decode rank it is a source of
    units, unit, rows = 8, 3, 4
    full = np.arange(rows * units * unit, dtype=np.uint8).reshape(rows, units * unit)
    whole = (np.arange(rows * 5, dtype=np.uint8) + 100).reshape(rows, 5)

    def comps(tp, r, split, wh):
        n = units // tp
        split[:] = torch.from_numpy(full[:, r * n * unit : (r + 1) * n * unit].copy())
        wh[:] = torch.from_numpy(whole)
        return [
            StateComponent(
                StateType.MAMBA,
                [split.data_ptr(), wh.data_ptr()],
                [split.nbytes, wh.nbytes],
                [split[0].nbytes, 5],
                split_dims=[n, 0],
            )
        ]

    src = [
        (
            torch.zeros(rows, units // pt * unit, dtype=torch.uint8),
            torch.zeros(rows, 5, dtype=torch.uint8),
        )
        for _ in range(pt)
    ]
    dst = [
        (
            torch.zeros(rows, units // dt * unit, dtype=torch.uint8),
            torch.zeros(rows, 5, dtype=torch.uint8),
        )
        for _ in range(dt)
    ]
    pargs = [kv_args_for([], ([], [], []), p, state=comps(pt, p, *src[p])) for p in range(pt)]
    dgeom = state_geometry(
        kv_args_for(
            [], ([], [], []), 0, state=comps(dt, 0, *[torch.zeros_like(x) for x in dst[0]])
        ).state
    )
    assert state_misfit(state_geometry(pargs[0].state), pt, dgeom, dt) is None
    topo = Topology(pt, dt, 8, split_state=True)
    written = np.zeros((dt, rows, units * unit // dt), dtype=np.int64)
    for d in range(dt):
        primary = topo.senders(d)[0].prefill
        for p in topo.state_sources(d) + (
            (primary,) if primary not in topo.state_sources(d) else ()
        ):
            share = StateShare(p, pt, d, dt, p == primary, dgeom)
            w = state_writes(
                pargs[p],
                [[dst[d][0].data_ptr(), dst[d][1].data_ptr()]],
                [np.array([1, 3])],
                [np.array([2, 0])],
                share,
            )
            _apply(w)
            for _, d0, n in zip(*w):
                off = d0 - dst[d][0].data_ptr()
                if 0 <= off < dst[d][0].nbytes:
                    r, c = divmod(int(off), dst[d][0].shape[1])
                    written[d, r, c : c + int(n)] += 1
        n = units // dt * unit
        assert np.array_equal(dst[d][0][2].numpy(), full[1, d * n : (d + 1) * n])
        assert np.array_equal(dst[d][0][0].numpy(), full[3, d * n : (d + 1) * n])
        assert np.array_equal(dst[d][1][2].numpy(), whole[1])
        assert dst[d][0][1].sum() == 0 and dst[d][0][3].sum() == 0
    assert set(np.unique(written[:, [0, 2]])) == {1}  # each byte of each share once


def test_state_misfits_are_named():
    g = lambda items, dims: [[items, dims]]  # noqa: E731
    assert state_misfit(g([24], [8]), 2, g([48], [16]), 1) is None
    assert "2 state components" in state_misfit(g([24], [8]) * 2, 1, g([24], [8]), 1)
    assert "1 tensors, decode 2" in state_misfit(g([24], None), 1, g([24, 8], None), 1)
    assert "split on one side only" in state_misfit(g([24], [8]), 1, g([24], None), 1)
    # which side splits is named, whichever it is
    why = state_misfit(g([24], None), 1, g([24], [8]), 1)
    assert "split on one side only (prefill split dims None, decode [8])" in why
    assert "rows of 24 bytes on prefill, 12" in state_misfit(g([24], None), 2, g([12], None), 1)
    assert "a unit must have the same bytes" in state_misfit(g([24], [8]), 2, g([96], [16]), 1)
    assert "the two sides split different rows" in state_misfit(g([24], [8]), 2, g([24], [8]), 1)
    with pytest.raises(LayoutError, match="tensor 0 splits its 24-byte rows into 5 units"):
        StateComponent(StateType.MAMBA, [1], [48], [24], split_dims=[5])


def test_split_state_sources_and_legs_agree_on_both_sides():
    for pt, dt, h, mla in [(2, 4, 1, False), (4, 2, 4, False), (2, 1, 1, True), (4, 2, 1, True)]:
        topo = Topology(pt, dt, h, mla, split_state=True)
        for d in range(dt):
            assert set(topo.state_sources(d)) <= set(topo.contacts(d))
        for p in range(pt):
            assert set(topo.peers(p)) == {d for d in range(dt) if p in topo.contacts(d)}
    # MLA 4 -> 2: prefill 1 sends decode 1 its KV, and decode 0 half its state
    topo = Topology(4, 2, mla=True, split_state=True)
    assert topo.state_sources(0) == (0, 1) and topo.contacts(0) == (0, 1)
    assert topo.peers(1) == (0, 1)
    assert Topology(4, 2, mla=True).contacts(0) == (0, 2)  # without split state: as before


def test_kv_args_refuse_pages_that_are_not_tokens_by_heads():
    with pytest.raises(LayoutError, match="KV buffer 0 has 30-byte pages"):
        KVArgs(0, [1], [60], [30], page_size=2, kv_head_num=4)


def test_staging_scatter_places_blocks_a_bounded_amount_at_a_time():
    kv = _kv(8, 2, 4, 4, False)
    args = kv_args_for([kv], ([], [], []), 0, page_size=2, kv_head_num=4)
    st = Staging(args, slots=2, pages=3)
    # two senders' blocks for slot 1: heads 0-1 and heads 2-3, three pages each
    for head in (0, 2):
        at = st.block(1, head)[0] - st.bufs[0].ctypes.data
        blk = np.arange(3 * 2 * 2 * 4, dtype=np.uint8).reshape(3, 2, 2, 4) + head * 50
        st.bufs[0][at : at + blk.size] = blk.reshape(-1)
    job = Scatter(1, np.array([5, 1, 6]), [(0, 2), (2, 2)])
    st.scatter(job, 2)
    assert job.left == 1 and kv[6].sum() == 0
    st.scatter(job, 2)
    assert job.left == 0
    want = np.arange(48, dtype=np.uint8).reshape(3, 2, 2, 4)
    for j, page in enumerate([5, 1, 6]):
        assert np.array_equal(kv[page, :, 0:2].numpy(), want[j])
        assert np.array_equal(kv[page, :, 2:4].numpy(), want[j] + 100)


def test_runs_never_span_two_buffers_even_back_to_back_in_memory():
    # two KV buffers adjacent on both sides: a merged run would cross from one
    # registered region into the next (Mooncake: "segment descriptor not found")
    src = torch.zeros((2, 2, 2, 2, 4), dtype=torch.uint8)  # layer, page, token, head, byte
    dst = torch.zeros((2, 2, 2, 2, 4), dtype=torch.uint8)
    args = kv_args_for([src[0], src[1]], ([], [], []), 0, page_size=2, kv_head_num=2)
    w = sliced_page_writes(
        args, [dst[0].data_ptr(), dst[1].data_ptr()], 2, np.array([0, 1]), np.array([0, 1]), 0, 0, 2
    )
    assert w[0].size == 2  # one run per buffer, not one across both
    comp = StateComponent(
        StateType.MAMBA,
        [src[0].data_ptr(), src[1].data_ptr()],
        [src[0].nbytes] * 2,
        [src[0].nbytes] * 2,
    )
    sa = kv_args_for([], ([], [], []), 0, state=[comp])
    w2 = state_writes(
        sa, [[dst[0].data_ptr(), dst[1].data_ptr()]], [np.array([0])], [np.array([0])]
    )
    assert w2[0].size == 2


#: a conv state row [q|k|v]: blocks of 4, 4 and 8 units of 3 bytes in the whole
#: row, each split by TP on its own (rank r holds its share of q, of k, of v)
QKV = (4, 4, 8)


def _qkv_share(full, tp, r):
    """Rank ``r``'s row of a TP group of ``tp``: its share of each block, in order."""
    out, at = [], 0
    for b in QKV:
        n = b // tp
        out.append(full[:, (at + r * n) * 3 : (at + (r + 1) * n) * 3])
        at += b
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("blocks", [True, False], ids=["blocks", "negative-control"])
@pytest.mark.parametrize(("pt", "dt"), [(2, 1), (1, 2), (2, 4), (4, 2), (1, 4)])
def test_sglang_30997_a_state_split_block_by_block_is_resharded_block_by_block(pt, dt, blocks):
    # SGLang PR #30997: a conv state [q|k|v] whose blocks TP splits one by one
    # was sliced as one block. Declared by its blocks (split_dims=[(q, k, v)]),
    # each decode rank's row holds its own share of q, of k and of v, byte for
    # byte, whatever the two TP sizes. Negative control: the same memory declared
    # as one block of 16 units is moved as one range, and the rows come out wrong
    rows, total = 4, sum(QKV)
    full = np.arange(rows * total * 3, dtype=np.int64).astype(np.uint8).reshape(rows, total * 3)

    def comp(tp, t):
        dims = [tuple(b // tp for b in QKV)] if blocks else [total // tp]
        return [StateComponent(StateType.MAMBA, [t.data_ptr()], [t.nbytes], [t[0].nbytes], split_dims=dims)]  # fmt: skip

    src = [torch.from_numpy(_qkv_share(full, pt, p).copy()) for p in range(pt)]
    dst = [torch.zeros(rows, total // dt * 3, dtype=torch.uint8) for _ in range(dt)]
    pargs = [kv_args_for([], ([], [], []), p, state=comp(pt, src[p])) for p in range(pt)]
    dgeom = state_geometry(comp(dt, dst[0]))
    assert state_misfit(state_geometry(pargs[0].state), pt, dgeom, dt) is None
    topo = Topology(pt, dt, 8, split_state=True)
    rows_src, rows_dst = np.arange(rows), np.arange(rows)[::-1].copy()
    for d in range(dt):
        for p in topo.state_sources(d):
            share = StateShare(p, pt, d, dt, False, dgeom)
            _apply(state_writes(pargs[p], [[dst[d].data_ptr()]], [rows_src], [rows_dst], share))
    exact = all(np.array_equal(dst[d].numpy()[::-1], _qkv_share(full, dt, d)) for d in range(dt))
    assert exact is blocks
