"""KV heads land on the right decode rank, whatever the two TP sizes and the
head count, replicated heads included (SGLang #23746 / PR #30997: decode TP
larger than the KV head count mapped every rank to head 0, and gsm8k accuracy
fell from 0.99 to 0.44).

The bytes are moved exactly as the connector moves them: the plan comes from
:class:`transport.topology.Topology` and each leg's writes from
:func:`transport.connector.core.legs.kv_writes` over real tensors; the test performs each
(source address, destination address, length) write with ``memmove`` and
checks every decode rank's pages head by head, token by token.
"""

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from buffers.kv_args import KVArgs
from transport.connector.core.legs import kv_writes, leg_of
from transport.topology import Topology, TopologyError

POOL = 8  # pages per rank's pool


def _value(page: int, token: int, head: int, byte: int) -> int:
    return (page * 37 + token * 11 + head * 5 + byte * 3 + 1) % 251


def _global_kv(pages: int, page_size: int, heads: int, hb: int) -> np.ndarray:
    p, t, h, b = np.meshgrid(
        np.arange(pages), np.arange(page_size), np.arange(heads), np.arange(hb), indexing="ij"
    )
    return _value(p, t, h, b).astype(np.uint8)


def _move(
    topo: Topology,
    page_size: int,
    hb: int,
    pages: int,
    seed: int,
    bug: bool = False,
    heads_major: bool = False,
):
    """Every decode rank's pages for one request after prefill's writes, and the
    global KV they must hold (both as (page, token, head, byte); with
    ``heads_major`` every rank's pages are (page, head, token, byte) in memory)."""
    rng = np.random.default_rng(seed)
    truth = _global_kv(pages, page_size, topo.kv_heads, hb)
    prefill_pages = rng.choice(POOL, pages, replace=False)
    decode_pages = rng.choice(POOL, pages, replace=False)
    pre = []
    for r in range(topo.prefill_tp):
        heads = topo.heads("prefill", r)
        t = torch.zeros((POOL, page_size, len(heads), hb), dtype=torch.uint8)
        if heads_major:
            t = t.transpose(1, 2).contiguous().transpose(1, 2)  # (page, head, token) in memory
        t.numpy()[prefill_pages] = truth[:, :, heads.start : heads.stop]
        pre.append(t)
    dec = []
    for d in range(topo.decode_tp):
        heads = topo.heads("decode", d)
        t = torch.zeros((POOL, page_size, len(heads), hb), dtype=torch.uint8)
        dec.append(t.transpose(1, 2).contiguous().transpose(1, 2) if heads_major else t)
    for d in range(topo.decode_tp):
        for s in topo.senders(d):
            if bug:  # what the field did: every decode rank mapped to global head 0
                s = type(s)(0, s.decode, 0, s.dst_head, s.count, s.primary)
            local = KVArgs(
                engine_rank=s.prefill,
                kv_data_ptrs=[pre[s.prefill].data_ptr()],
                kv_data_lens=[pre[s.prefill].nbytes],
                kv_item_lens=[pre[s.prefill][0].nbytes],
                page_size=page_size,
                kv_head_num=pre[s.prefill].shape[2],
                heads_major=heads_major,
            )
            leg = leg_of(d, s)
            leg.dst_heads = dec[d].shape[2]
            info = {"kv_ptrs": [dec[d].data_ptr()]}
            src = np.asarray(prefill_pages, dtype=np.int64)
            dst = np.asarray(decode_pages, dtype=np.int64)
            for a, b, n in zip(*kv_writes(local, info, leg, src, dst)):
                ctypes.memmove(int(b), int(a), int(n))
    return truth, decode_pages, dec


SIZES = st.sampled_from([1, 2, 3, 4, 6, 8, 16])


@given(
    prefill_tp=SIZES,
    decode_tp=SIZES,
    kv_heads=st.sampled_from([1, 2, 3, 4, 8]),
    page_size=st.sampled_from([1, 2, 16]),
    hb=st.sampled_from([2, 8]),
    pages=st.integers(1, 3),
    seed=st.integers(0, 1000),
    heads_major=st.booleans(),
)
def test_sglang_23746_every_decode_rank_gets_its_own_heads(
    prefill_tp, decode_tp, kv_heads, page_size, hb, pages, seed, heads_major
):
    try:
        topo = Topology(prefill_tp, decode_tp, kv_heads)
    except TopologyError:
        assume(False)
    truth, decode_pages, dec = _move(topo, page_size, hb, pages, seed, heads_major=heads_major)
    for d in range(decode_tp):
        heads = topo.heads("decode", d)
        got = dec[d].numpy()[decode_pages]
        assert np.array_equal(got, truth[:, :, heads.start : heads.stop]), (
            f"decode rank {d} of TP {decode_tp} (heads {list(heads)}) from prefill TP "
            f"{prefill_tp}, {kv_heads} KV heads"
        )
        # every head it holds is written by exactly one slice
        covered = sorted(
            h for s in topo.senders(d) for h in range(s.dst_head, s.dst_head + s.count)
        )
        assert covered == list(range(len(heads)))


@pytest.mark.parametrize("heads_major", [False, True])
def test_negative_control_head_zero_everywhere_is_caught(heads_major):
    """Decode TP 4 over 2 KV heads (each head replicated twice) from prefill TP 2."""
    topo = Topology(2, 4, 2)
    truth, decode_pages, dec = _move(topo, 4, 8, 2, 0, bug=True, heads_major=heads_major)
    wrong = [
        d
        for d in range(4)
        if not np.array_equal(
            dec[d].numpy()[decode_pages],
            truth[:, :, topo.heads("decode", d).start : topo.heads("decode", d).stop],
        )
    ]
    assert wrong, "a plan that sends head 0 to every rank went unnoticed"
