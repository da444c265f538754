"""KV pools cut in one region per head group (``KVArgs.head_group``) over the
byte-moving backends (Mooncake over TCP, NIXL over UCX) on 127.0.0.1: a
request moves every byte between such pools with the TP sizes either way
round and with replicated heads (each decode rank checks every byte in its
layout), and a peer whose pages are not cut alike is refused on a real
engine before anything is written."""

import pytest

from pdlife.bench.transfer import run_transfer_bench

pytestmark = [pytest.mark.multiprocess, pytest.mark.network, pytest.mark.timeout(180)]


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "kv_heads"),
    [(1, 2, 8), (1, 2, 1)],
    ids=["tp1-to-tp2", "tp1-to-tp2-replicated"],
)
def test_pools_cut_in_head_groups_move_every_byte(backend, prefill_tp, decode_tp, kv_heads):
    # (prefill TP 2 -> decode TP 1 is test_bench's head-sliced case, layout "group")
    res = run_transfer_bench(
        2, None, 2, backend, prefill_tp=prefill_tp, decode_tp=decode_tp, page_tokens=16,
        head_dim=128, kv_heads=kv_heads, layout="group",
    )  # fmt: skip
    assert res["bytes_verified"] and res["layout"] == "group"
    # one KV run per decode rank (a head group of every page, consecutive on both
    # sides), then each decode rank's metadata row (its fields and its room)
    assert decode_tp < res["lifecycle_runs"] <= decode_tp * 12


def _misfit_side(backend, role, port, q):
    import time

    import torch

    from buffers import MetadataBuffers, MetadataLayout
    from transport.connector.config import ConnectorConfig
    from transport.layout import kv_args_for
    from transport.registry import get_backend

    # 4 heads of 2 tokens of 8 bytes: prefill cut in head groups of 2, decode not
    grouped = role == "prefill"
    kv = [torch.zeros((2, 16, 2, 2, 8) if grouped else (16, 2, 4, 8), dtype=torch.uint8)]
    meta = MetadataBuffers(
        4, MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
    )
    args = kv_args_for(
        kv, meta.buf_infos(), 0, page_size=2, kv_head_num=4, head_group=2 if grouped else 0
    )
    cfg = ConnectorConfig(role=role, tp_rank=0, store_port=port, namespace="hg-misfit")
    m = get_backend(backend).manager(args, cfg)
    t0 = time.time()
    h = m.sender(9) if grouped else m.receiver(9)
    if not grouped:
        h.init()
    while h.poll() != 0 and time.time() - t0 < 30:
        time.sleep(0.01)
    q.put((role, h.poll(), type(m.last_error).__name__, str(m.last_error), m.stats["writes"]))
    time.sleep(0.5)
    m.close()


def test_a_peer_whose_pages_are_not_cut_alike_is_refused(backend):
    from test_transfer_backends import _pair

    from lifecycle import KVPoll

    got, codes = _pair(_misfit_side, backend)
    assert codes == [0, 0]
    status, kind, text, writes = got["decode"]
    assert (status, kind, writes) == (KVPoll.Failed, "TopologyError", 0)
    assert "cut in head groups of 2" in text and "(KVArgs.head_group)" in text
    assert got["prefill"][0] == KVPoll.Failed and got["prefill"][3] == 0
