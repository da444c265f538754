"""Staged head slices land in their own heads, whatever the two TP sizes.

With staging, each sender's slice lands in a block of decode's staging region
that holds that slice alone, and the scatter places the block into heads
``[dst_head, dst_head + count)`` of decode's pages. The writes are the
connector's own (:func:`transport.connector.core.legs.kv_writes`, told a block as
decode's page list tells it), performed with ``memmove``; the scatter is
:class:`transport.staging.Staging`'s. A decode rank that hears from several
prefill ranks (prefill TP larger than decode's) once had every slice but the
first written ``dst_head`` heads into its block: shifted by tokens, and past
the block's end.
"""

import ctypes

import numpy as np
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from buffers.kv_args import KVArgs
from transport.connector.core.legs import kv_writes, leg_of
from transport.staging import Scatter, Staging
from transport.topology import Topology, TopologyError

SLOTS = 3


def _args(t: torch.Tensor, rank: int, page_size: int, aux: torch.Tensor | None = None) -> KVArgs:
    extra = {}
    if aux is not None:
        extra = dict(
            aux_data_ptrs=[aux.data_ptr()],
            aux_data_lens=[aux.nbytes],
            aux_item_lens=[aux[0].nbytes],
        )
    return KVArgs(
        engine_rank=rank,
        kv_data_ptrs=[t.data_ptr()],
        kv_data_lens=[t.nbytes],
        kv_item_lens=[t[0].nbytes],
        page_size=page_size,
        kv_head_num=t.shape[2],
        **extra,
    )


def _staged(topo: Topology, page_size: int, hb: int, pages: int, slot: int):
    rng = np.random.default_rng(slot)
    truth = rng.integers(0, 256, (pages, page_size, topo.kv_heads, hb), dtype=np.uint8)
    pre = []
    for r in range(topo.prefill_tp):
        h = topo.heads("prefill", r)
        pre.append(torch.from_numpy(truth[:, :, h.start : h.stop].copy()))
    out = []
    for d in range(topo.decode_tp):
        h = topo.heads("decode", d)
        dec = torch.zeros((pages + 2, page_size, len(h), hb), dtype=torch.uint8)
        aux = torch.zeros((SLOTS, 8), dtype=torch.uint8)
        staging = Staging(_args(dec, d, page_size, aux), SLOTS, pages)
        dst = rng.permutation(pages + 2)[:pages].astype(np.int64)
        blocks = []
        for s in topo.senders(d):
            leg = leg_of(d, s)  # as decode's page list tells it: its block, count heads
            leg.dst_heads, leg.dst_ptrs = s.count, staging.block(slot, s.dst_head)
            local = _args(pre[s.prefill], s.prefill, page_size)
            src = np.arange(pages, dtype=np.int64)
            at = np.arange(pages, dtype=np.int64)  # the block's own pages
            ((lo, size),) = staging.regions()
            block_end = staging.block(slot, s.dst_head + s.count)[0]
            for a, b, n in zip(*kv_writes(local, {"kv_ptrs": [dec.data_ptr()]}, leg, src, at)):
                # inside this sender's block: never past it, into a neighbour or the region's end
                assert leg.dst_ptrs[0] <= b and b + n <= min(block_end, lo + size), (s, b, n)
                ctypes.memmove(int(b), int(a), int(n))
            blocks.append((s.dst_head, s.count))
        staging.scatter(Scatter(slot, dst, sorted(blocks)), pages)
        out.append((h, dec.numpy()[dst]))
    return truth, out


@given(
    prefill_tp=st.sampled_from([1, 2, 4, 8]),
    decode_tp=st.sampled_from([1, 2, 4, 8]),
    kv_heads=st.sampled_from([1, 2, 4, 8]),
    page_size=st.sampled_from([1, 2, 4]),
    hb=st.sampled_from([2, 4]),
    pages=st.integers(1, 4),
    slot=st.integers(0, SLOTS - 1),
)
def test_every_staged_slice_lands_in_its_heads(
    prefill_tp, decode_tp, kv_heads, page_size, hb, pages, slot
):
    try:
        topo = Topology(prefill_tp, decode_tp, kv_heads)
    except TopologyError:
        assume(False)
    truth, got = _staged(topo, page_size, hb, pages, slot)
    for d, (heads, held) in enumerate(got):
        assert np.array_equal(held, truth[:, :, heads.start : heads.stop]), (
            f"decode rank {d} of TP {decode_tp} from prefill TP {prefill_tp}, {kv_heads} heads"
        )


def test_two_senders_into_one_staged_rank():
    """The case that was wrong: two prefill ranks, one decode rank, 8 heads."""
    truth, got = _staged(Topology(2, 1, 8), 2, 4, 3, 1)
    assert np.array_equal(got[0][1], truth)
