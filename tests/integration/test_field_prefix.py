"""A cached prefix through the field-shaped classes on Mooncake and NIXL over
127.0.0.1: decode holds the first pages of each request and says so with
``send_metadata(..., decode_prefix_len=)``; only the pages after them move,
and decode's own prefix pages are left as they were. One request is sent the
0.5.23 way (prefill pops the prefix and sends only what follows it), one by a
prefill that hands every page over. A prefill and a decode process, one
rank each, meeting at a store the parent starts on a port the OS picks."""

import pytest

from support.pages import pattern
from support.wait import wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.network, pytest.mark.timeout(180)]

PAGES, PAGE_BYTES, LAYERS, PS = 32, 256, 2, 4
#: room -> (pages in the request, cached pages on decode, whether prefill pops the prefix)
REQUESTS = {51: (6, 2, True), 52: (5, 3, False), 53: (4, 0, True)}
CACHED = 0xAB  # what decode's own prefix pages hold


def _side(backend, side, port, q):
    try:
        q.put((side, _run(backend, side, port)))
    except BaseException as e:  # report, so the parent does not wait for nothing
        import traceback

        q.put((side, {"error": "".join(traceback.format_exception(e))[-3000:]}))


def _run(backend, side, port):
    import time
    import types

    import torch

    from field.conn.backends import KVClassType, get_kv_class
    from field.data.metadata import MetadataBuffers
    from field.engine import DisaggregationMode
    from field.release import set_release

    set_release("0.5.23")
    kv = [torch.zeros((PAGES, PAGE_BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    meta = MetadataBuffers(8, 32, torch.float32, max_top_logprobs_num=16)
    args = get_kv_class(backend, KVClassType.KVARGS)()
    args.kv_data_ptrs = [t.data_ptr() for t in kv]
    args.kv_data_lens = [t.nbytes for t in kv]
    args.kv_item_lens = [t[0].nbytes for t in kv]
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = meta.get_buf_infos()
    args.page_size = PS
    sa = types.SimpleNamespace(disaggregation_bootstrap_port=port, host="127.0.0.1")
    mode = DisaggregationMode.PREFILL if side == "prefill" else DisaggregationMode.DECODE
    mgr = get_kv_class(backend, KVClassType.MANAGER)(args, mode, sa)
    out = {"local_ip": mgr.local_ip}
    try:
        if side == "prefill":
            out.update(_prefill(backend, mgr, kv, meta))
        else:
            out.update(_decode(backend, mgr, kv, meta))
        time.sleep(0.5)  # the peer reads its last status before this side goes away
    finally:
        mgr.close()
    return out


def _prefill(backend, mgr, kv, meta):
    import numpy as np

    from field.conn.backends import KVClassType, get_kv_class
    from lifecycle import KVPoll

    sender_class = get_kv_class(backend, KVClassType.SENDER)
    out = {}
    for slot, (room, (n, _, pops)) in enumerate(REQUESTS.items()):
        s = sender_class(mgr, "127.0.0.1", room)
        src = np.arange(slot * 8, slot * 8 + n)
        for pos, page in enumerate(src):
            for layer in range(LAYERS):
                kv[layer][page] = pattern(room, pos, layer, PAGE_BYTES)
        meta.bootstrap_room[slot, 0] = room
        meta.output_ids[slot, 0] = room % 100
        wait_for(
            lambda s=s: s.poll() != KVPoll.Bootstrapping,
            f"room {room} bootstrapped",
            timeout=60.0,
            interval=0.005,
        )
        popped = s.pop_decode_prefix_len() if pops else None
        first = (popped or 0) // PS
        s.init(n - first, slot)
        for k in range(first, n, 2):
            s.send(src[k : k + 2])
        wait_for(
            lambda s=s: s.poll() in (KVPoll.Success, KVPoll.Failed),
            f"room {room} done",
            timeout=60.0,
            interval=0.005,
        )
        metric = s.get_transfer_metric()
        out[room] = (int(s.poll()), popped, metric.transfer_total_bytes)
    out["bytes_written"] = mgr.core.stats["bytes_written"]
    out["row_bytes"] = sum(mgr.core.kv_args.aux_item_lens)
    return out


def _decode(backend, mgr, kv, meta):
    import numpy as np
    import torch

    from field.conn.backends import KVClassType, get_kv_class
    from lifecycle import KVPoll

    receiver_class = get_kv_class(backend, KVClassType.RECEIVER)
    out = {}
    for slot, (room, (n, cached, _)) in enumerate(REQUESTS.items()):
        r = receiver_class(mgr, "127.0.0.1", bootstrap_room=room)
        r.init(0)
        prefix = np.arange(31 - slot * 8, 31 - slot * 8 - cached, -1)  # decode's cached pages
        dst = np.arange(31 - slot * 8 - cached, 31 - slot * 8 - n, -1)  # the pages after them
        for layer in range(LAYERS):
            kv[layer][prefix] = CACHED
        wait_for(
            lambda r=r: r.poll() == KVPoll.WaitingForInput,
            f"room {room} handshake",
            timeout=60.0,
            interval=0.005,
        )
        r.send_metadata(dst, slot, None, decode_prefix_len=cached * PS)
        wait_for(
            lambda r=r: r.poll() in (KVPoll.Success, KVPoll.Failed),
            f"room {room} done",
            timeout=60.0,
            interval=0.005,
        )
        bad = [
            (pos, layer)
            for pos, page in zip(range(cached, n), dst)
            for layer in range(LAYERS)
            if not torch.equal(kv[layer][page], pattern(room, pos, layer, PAGE_BYTES))
        ]
        untouched = all(bool((kv[layer][prefix] == CACHED).all()) for layer in range(LAYERS))
        row = (int(meta.bootstrap_room[slot, 0]), int(meta.output_ids[slot, 0]))
        out[room] = (int(r.poll()), bad, untouched, row)
    used = {
        int(p) for slot in range(len(REQUESTS)) for p in range(31 - slot * 8, 23 - slot * 8, -1)
    }
    free = sorted(set(range(PAGES)) - used)
    out["elsewhere"] = int(sum(int(kv[layer][free].sum()) for layer in range(LAYERS)))
    return out


def test_only_the_pages_after_decodes_prefix_move(backend):

    from lifecycle import KVPoll
    from lifecycle.testing.spawn import rank_context, store_server

    store = store_server(2)
    ctx = rank_context()
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_side, args=(backend, side, store.port, q))
        for side in ("prefill", "decode")
    ]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            side, result = q.get(timeout=120)
            got[side] = result
    finally:
        for p in procs:
            p.join(15)
            if p.is_alive():
                p.kill()
    pre, dec = got["prefill"], got["decode"]
    assert "error" not in pre and "error" not in dec, (pre.get("error"), dec.get("error"))
    assert pre["local_ip"] == dec["local_ip"] == "127.0.0.1"  # discovered: the store's route
    moved_pages = 0
    for room, (n, cached, pops) in REQUESTS.items():
        status, popped, metric_bytes = pre[room]
        assert status == KVPoll.Success, room
        assert popped == (cached * PS if pops else None), room
        assert metric_bytes == (n - cached) * LAYERS * PAGE_BYTES, room
        d_status, bad, untouched, row = dec[room]
        assert d_status == KVPoll.Success and bad == [], (room, bad)
        assert untouched, f"room {room}: a cached prefix page was written"
        assert row == (room, room % 100)
        moved_pages += n - cached
    assert dec["elsewhere"] == 0  # nothing landed outside the requests' pages
    # only the pages after each prefix, and each request's metadata row, were written
    assert pre["bytes_written"] == moved_pages * LAYERS * PAGE_BYTES + 3 * pre["row_bytes"]
    _ = store
