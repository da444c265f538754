"""A cached prefix through the field-shaped connector classes, the 0.5.23 way:
decode's ``send_metadata(..., decode_prefix_len=)`` with the pages after the
prefix, prefill's ``pop_decode_prefix_len()`` after its sender leaves
Bootstrapping. On the fake backend, and over the shared connector in one
process with a stub engine that copies memory (real bytes: only the pages
after the prefix move; tests/integration/test_field_prefix.py does the same
on Mooncake and NIXL)."""

import types

import numpy as np
import pytest
import torch

from buffers.errors import BadArgument, BadArgumentType
from field.conn.backends import get_kv_class
from field.conn.kv_args import KVArgs
from field.conn.mooncake import MooncakeKVManager, MooncakeKVReceiver, MooncakeKVSender
from field.data.metadata import MetadataBuffers
from lifecycle import KVPoll
from lifecycle.testing.spawn import store_server
from support.pages import pattern
from support.stub_engine import CopyConnector, handshaken
from support.wait import wait_for

pytestmark = pytest.mark.timeout(60)

PAGES, PAGE_BYTES, LAYERS, PS = 16, 64, 2, 4  # PS: tokens per page


def test_fake_receiver_takes_a_prefix_and_the_fake_sender_has_none(v0523):
    r = get_kv_class("fake", "receiver")(
        get_kv_class("fake", "manager")(KVArgs(), "decode", None), "fake:1", bootstrap_room=9
    )
    r.init(0)
    with pytest.raises(BadArgument, match=r"decode_prefix_len.*-4.*>= 0"):
        r.send_metadata(np.array([1, 2]), 0, None, decode_prefix_len=-4)
    with pytest.raises(BadArgumentType, match="decode_prefix_len"):
        r.send_metadata(np.array([1, 2]), 0, None, decode_prefix_len=2.5)
    assert r.poll() == KVPoll.WaitingForInput  # refused calls changed nothing
    r.send_metadata(np.array([1, 2]), 0, None, decode_prefix_len=8)
    assert r.poll() == KVPoll.Success
    s = get_kv_class("fake", "sender")(None, "fake:1", 9)
    assert s.pop_decode_prefix_len() == 0  # 0.5.23's fake: nothing is cached or moved
    s.init(2, 0)
    s.send(np.array([5, 6]))
    assert s.poll() == KVPoll.Success


class Side:
    """One rank's KV pages, metadata rows and field-shaped manager."""

    def __init__(self, mode, port):
        self.kv = [torch.zeros((PAGES, PAGE_BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
        self.meta = MetadataBuffers(8, 32, torch.float32, max_top_logprobs_num=16)
        a = KVArgs()
        a.kv_data_ptrs = [t.data_ptr() for t in self.kv]
        a.kv_data_lens = [t.nbytes for t in self.kv]
        a.kv_item_lens = [t[0].nbytes for t in self.kv]
        a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = self.meta.get_buf_infos()
        a.page_size = PS
        sa = types.SimpleNamespace(disaggregation_bootstrap_port=port, host="127.0.0.1")
        self.mgr = MooncakeKVManager(a, mode, sa)


@pytest.fixture
def pair(monkeypatch):
    for var in ("SGLANG_HOST_IP", "HOST_IP", "SGLANG_LOCAL_IP_NIC", "PDLIFE_HOST"):
        monkeypatch.delenv(var, raising=False)
    # the shared connector with an engine that copies in the write call
    monkeypatch.setattr(
        "field.conn.mooncake.get_backend", lambda name: types.SimpleNamespace(manager=CopyConnector)
    )
    store = store_server()
    pre, dec = Side("prefill", store.port), Side("decode", store.port)
    yield pre, dec
    for side in (pre, dec):
        side.mgr.core.close(wait=0)
    _ = store


def handshake(pre, dec, room):
    s = MooncakeKVSender(pre.mgr, "127.0.0.1", room)
    r = MooncakeKVReceiver(dec.mgr, "127.0.0.1", room)
    r.init(0)
    wait_for(lambda: r.poll() == KVPoll.WaitingForInput, "decode handshake")
    # prefill reports Bootstrapping until the page lists are in: wait for its phase
    wait_for(lambda: handshaken(s.core), "prefill handshake")
    return s, r


@pytest.mark.parametrize("pops", [True, False], ids=["pops-the-prefix", "sends-every-page"])
def test_only_the_pages_after_the_prefix_move(v0523, pair, pops):
    pre, dec = pair
    room, n, prefix = 41, 6, 2
    s, r = handshake(pre, dec, room)
    # as 0.5.23: prefill's sender is Bootstrapping until decode said where to write
    assert s.poll() == KVPoll.Bootstrapping
    assert s.pop_decode_prefix_len() == 0  # not known yet (and not used up)
    src = np.arange(3, 3 + n)
    for pos, page in enumerate(src):
        for layer in range(LAYERS):
            pre.kv[layer][page] = pattern(room, pos, layer, PAGE_BYTES)
    pre.meta.bootstrap_room[1, 0] = room
    pre.meta.output_ids[1, 0] = 77
    cached = np.array([12, 13])  # decode's own copy of the prefix: must stay as it is
    for layer in range(LAYERS):
        dec.kv[layer][cached] = 0xAB
    dst = np.array([10, 8, 9, 11])  # the pages after the prefix, in decode's order
    r.send_metadata(dst, 2, None, decode_prefix_len=prefix * PS)
    wait_for(lambda: s.poll() == KVPoll.WaitingForInput, "prefill told where to write")
    if pops:  # 0.5.23's prefill: init and send only what follows the prefix
        assert s.pop_decode_prefix_len() == prefix * PS
        assert s.pop_decode_prefix_len() == 0  # popped once
        s.init(n - prefix, 1)
        chunks = [src[2:4], src[4:6]]
    else:  # an engine that does not ask hands every page over
        s.init(n, 1)
        chunks = [src[0:3], src[3:6]]
    for chunk in chunks:
        assert s.should_send_kv_chunk(chunk.size, False)
        s.send(chunk)
    wait_for(lambda: r.poll() == KVPoll.Success, "decode success")
    wait_for(lambda: s.poll() == KVPoll.Success, "prefill success")
    for layer in range(LAYERS):
        for pos, page in zip(range(prefix, n), dst):
            want = pattern(room, pos, layer, PAGE_BYTES)
            assert torch.equal(dec.kv[layer][page], want), (layer, pos)
        assert bool((dec.kv[layer][cached] == 0xAB).all())  # the prefix pages untouched
        others = np.setdiff1d(np.arange(PAGES), np.concatenate([dst, cached]))
        assert int(dec.kv[layer][others].sum()) == 0  # nothing landed anywhere else
    assert int(dec.meta.bootstrap_room[2, 0]) == room and int(dec.meta.output_ids[2, 0]) == 77
    moved = (n - prefix) * LAYERS * PAGE_BYTES
    row = sum(pre.mgr.core.kv_args.aux_item_lens)
    assert pre.mgr.core.stats["bytes_written"] == moved + row
    metric = s.get_transfer_metric()
    assert metric.transfer_total_bytes == moved and metric.transfer_latency_s > 0
    assert metric.alloc_latency_s is None
    s.clear()
    assert s.get_transfer_metric().transfer_total_bytes == moved  # kept after clear
    assert r.is_abort_release_safe()  # ended: nothing more can land


def test_a_prefix_that_is_not_whole_pages_is_refused_before_anything_is_sent(v0523, pair):
    pre, dec = pair
    s, r = handshake(pre, dec, 42)
    with pytest.raises(BadArgument, match=r"decode_prefix_len.*6.*multiple of the page size 4"):
        r.send_metadata(np.array([8, 9]), 2, None, decode_prefix_len=6)
    with pytest.raises(BadArgument, match="destination"):
        r.send_metadata(np.array([8, 9]), 2, None, decode_prefix_len=4, destination="host")
    assert r.poll() == KVPoll.WaitingForInput
    assert s.poll() == KVPoll.Bootstrapping  # prefill heard nothing
    r.abort()
    wait_for(lambda: s.poll() == KVPoll.Failed, "prefill hears of the abort")
    wait_for(lambda: r.is_abort_release_safe(), "prefill said it stopped")
