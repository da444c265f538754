"""KV pools cut in head groups (``KVArgs.head_group``) move every head to the
right decode rank whatever the two TP sizes, the head count and the group
size (replicated heads included), and each leg's digest on decode matches
prefill's over the same bytes.

The writes are the connector's (:func:`transport.connector.core.legs.kv_writes`
over real tensors, performed with ``memmove``); decode's pages are compared
head by head with the model's, read back through the grouped layout.
"""

import ctypes
import math

import numpy as np
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from transport.connector.core.legs import kv_writes, leg_of
from transport.digest import Views, digest
from transport.layout import kv_args_for
from transport.topology import Topology, TopologyError

POOL = 6  # pages per rank's pool


def _model(pages, page_size, heads, hb):
    p, t, h, b = np.meshgrid(
        np.arange(pages), np.arange(page_size), np.arange(heads), np.arange(hb), indexing="ij"
    )
    return ((p * 37 + t * 11 + h * 5 + b * 3 + 1) % 251).astype(np.uint8)


def _pool(heads, k, page_size, hb):
    t = torch.zeros((len(heads) // k, POOL, page_size, k, hb), dtype=torch.uint8)
    args = kv_args_for(
        [t], ([], [], []), 0, page_size=page_size, kv_head_num=len(heads), head_group=k
    )
    return t, args


def _logical(t):
    """(regions, pages, tokens, k, bytes) as (pages, tokens, heads, bytes)."""
    g, pages, ps, k, hb = t.shape
    return t.numpy().transpose(1, 2, 0, 3, 4).reshape(pages, ps, g * k, hb)


SIZES = st.sampled_from([1, 2, 3, 4, 8])


@given(
    prefill_tp=SIZES,
    decode_tp=SIZES,
    kv_heads=st.sampled_from([1, 2, 4, 6, 8]),
    page_size=st.sampled_from([1, 2, 4]),
    hb=st.sampled_from([2, 8]),
    pages=st.integers(1, 4),
    seed=st.integers(0, 1000),
    smaller=st.booleans(),
)
def test_pools_cut_in_head_groups_land_every_head_and_digest_alike(
    prefill_tp, decode_tp, kv_heads, page_size, hb, pages, seed, smaller
):
    try:
        topo = Topology(prefill_tp, decode_tp, kv_heads)
    except TopologyError:
        assume(False)
    held = [len(topo.heads("prefill", r)) for r in range(prefill_tp)]
    held += [len(topo.heads("decode", d)) for d in range(decode_tp)]
    k = math.gcd(*held)
    if smaller:  # any group size every rank holds whole, the smallest too
        k = min(d for d in range(1, k + 1) if k % d == 0 and d < k) if k > 1 else 1
    rng = np.random.default_rng(seed)
    truth = _model(pages, page_size, kv_heads, hb)
    src = rng.choice(POOL, pages, replace=False).astype(np.int64)
    dst = rng.choice(POOL, pages, replace=False).astype(np.int64)
    pre, keep = [], []  # (the tensors live as long as the addresses in their KVArgs)
    for r in range(prefill_tp):
        heads = topo.heads("prefill", r)
        t, args = _pool(heads, k, page_size, hb)
        g = len(heads) // k
        want = truth[:, :, heads.start : heads.stop].reshape(pages, page_size, g, k, hb)
        t.numpy()[:, src] = want.transpose(2, 0, 1, 3, 4)
        pre.append(args)
        keep.append(t)
    dec = [_pool(topo.heads("decode", d), k, page_size, hb) for d in range(decode_tp)]
    for d, (t, args) in enumerate(dec):
        info = {"kv_ptrs": list(args.kv_data_ptrs), "kv_lens": list(args.kv_data_lens)}
        for s in topo.senders(d):
            leg = leg_of(d, s)
            leg.dst_heads = args.kv_head_num
            w = kv_writes(pre[s.prefill], info, leg, src, dst)
            for a, b, n in zip(*(x.tolist() for x in w)):
                ctypes.memmove(b, a, n)
            sent = Views(pre[s.prefill]).kv_parts(src, s.src_head, s.count)
            got = Views(args).kv_parts(dst, s.dst_head, s.count)
            assert digest(got) == digest(sent)
            assert digest(sent)[1] == int(w[2].sum())
        heads = topo.heads("decode", d)
        assert np.array_equal(_logical(t)[dst], truth[:, :, heads.start : heads.stop]), (
            f"decode rank {d} of TP {decode_tp} from prefill TP {prefill_tp}, "
            f"{kv_heads} heads, groups of {k}"
        )
