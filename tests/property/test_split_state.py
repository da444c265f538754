"""State that TP splits, resharded between TP groups of any sizes: whatever
the KV layout (split heads, replicated heads, MLA), every decode rank ends up
holding exactly its share of every split row and the whole of every whole
row, each byte written once, and nothing outside the rows it named."""

import ctypes

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from buffers.kv_args import StateComponent, StateType
from transport.layout import StateShare, kv_args_for, state_geometry, state_misfit, state_writes
from transport.topology import Topology

TPS = [1, 2, 3, 4, 6, 8]


@st.composite
def layouts(draw):
    pt, dt = draw(st.sampled_from(TPS)), draw(st.sampled_from(TPS))
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([h for h in range(1, 13) if _fits(h, pt, dt)]))
    lcm = np.lcm(pt, dt)
    # per tensor: global units (a multiple of both TP sizes) and bytes per unit, or whole
    tensors = draw(
        st.lists(
            st.one_of(
                st.tuples(st.integers(1, 3).map(lambda k: int(k * lcm)), st.integers(1, 4)),
                st.tuples(st.just(0), st.integers(1, 9)),
            ),
            min_size=1,
            max_size=3,
        )
    )
    rows = draw(st.integers(2, 6))
    n = draw(st.integers(1, rows))
    src_rows = draw(st.permutations(range(rows)).map(lambda p: list(p[:n])))
    dst_rows = draw(st.permutations(range(rows)).map(lambda p: list(p[:n])))
    return pt, dt, heads, mla, tensors, rows, src_rows, dst_rows


def _fits(h, pt, dt):
    return all(h % tp == 0 or tp % h == 0 for tp in (pt, dt))


def _rank_state(tensors, tp, r, rows, fill):
    """One rank's tensors (numpy rows) and its StateComponent; ``fill``: the
    global rows' bytes to take this rank's share from, or None (zeros)."""
    arrays, items, dims = [], [], []
    for i, (units, unit) in enumerate(tensors):
        if units:
            local = units // tp
            a = np.zeros((rows, local * unit), np.uint8)
            if fill is not None:
                a[:] = fill[i][:, r * local * unit : (r + 1) * local * unit]
            dims.append(local)
        else:
            a = np.zeros((rows, unit), np.uint8)
            if fill is not None:
                a[:] = fill[i]
            dims.append(0)
        arrays.append(a)
        items.append(a.shape[1])
    comp = StateComponent(
        StateType.MAMBA,
        [a.ctypes.data for a in arrays],
        [a.nbytes for a in arrays],
        items,
        split_dims=dims,
    )
    return arrays, kv_args_for([], ([], [], []), r, state=[comp])


@given(layouts())
def test_every_decode_rank_holds_its_share_of_every_row_written_once(layout):
    pt, dt, heads, mla, tensors, rows, src_rows, dst_rows = layout
    rng = np.random.default_rng(len(src_rows) * 7919 + rows)
    full = [
        rng.integers(1, 256, (rows, (units or 1) * unit), dtype=np.uint8) for units, unit in tensors
    ]
    prefill = [_rank_state(tensors, pt, p, rows, full) for p in range(pt)]
    decode = [_rank_state(tensors, dt, d, rows, None) for d in range(dt)]
    pgeom = state_geometry(prefill[0][1].state)
    dgeom = [state_geometry(args.state) for _, args in decode]
    assert state_misfit(pgeom, pt, dgeom[0], dt) is None
    topo = Topology(pt, dt, heads, mla, split_state=True)
    src = [np.array(src_rows, np.int64)]
    dst = [np.array(dst_rows, np.int64)]
    for d, (arrays, _) in enumerate(decode):
        count = [np.zeros_like(a, dtype=np.int64) for a in arrays]
        primary = topo.senders(d)[0].prefill
        writers = set(topo.state_sources(d)) | {primary}
        assert writers <= set(topo.contacts(d))  # a leg exists to every writer
        for p in writers:
            share = StateShare(p, pt, d, dt, p == primary, dgeom[d])
            w = state_writes(prefill[p][1], [[a.ctypes.data for a in arrays]], src, dst, share)
            for s, t, n in zip(*(x.tolist() for x in w)):
                for i, a in enumerate(arrays):
                    off = t - a.ctypes.data
                    if 0 <= off < a.nbytes:
                        assert off + n <= a.nbytes, "a write runs past the tensor"
                        count[i].reshape(-1)[off : off + n] += 1  # runs may span whole rows
                ctypes.memmove(t, s, n)
        for i, ((units, unit), a) in enumerate(zip(tensors, arrays)):
            if units:
                local = units // dt * unit
                want = full[i][src_rows, d * local : (d + 1) * local]
            else:
                want = full[i][src_rows]
            assert np.array_equal(a[dst_rows], want), (d, i)
            assert (count[i][dst_rows] == 1).all(), "each byte of each named row exactly once"
            others = [r for r in range(rows) if r not in dst_rows]
            assert not a[others].any() and not count[i][others].any()
