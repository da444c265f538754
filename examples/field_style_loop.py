"""A prefill and a decode loop written the way PD engines write them today.

Only the compat names are used, called as SGLang 0.5.23 calls them (the
loops pin that release with ``field.release.set_release``): ``KVArgs()``
filled in field by field, ``get_kv_class(TransferBackend.X, ...)`` for the
manager, sender, receiver and bootstrap server, sender ``init/send/poll``,
receiver ``init(prefill_dp_rank)/send_metadata/poll``,
``poll_and_all_reduce`` (with the metadata gate on decode),
``MetadataBuffers.set_buf/get_buf/clear_slot`` and
``ReqToMetadataIdxAllocator``. An engine that has loops like these changes its
imports and nothing else.

Prefill and decode are two processes on 127.0.0.1, each with its own gloo
group (a TP group of one). On Mooncake, decode checks every KV byte and every
metadata row it commits against what prefill wrote; on the fake backend
nothing moves, so prefill checks each row it wrote reads back whole and
decode checks every request completes. Run it:

    python examples/field_style_loop.py --backend fake
    python examples/field_style_loop.py --backend mooncake
    python examples/field_style_loop.py --backend nixl
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import types
from datetime import timedelta
from typing import Any

import torch

from field.conn.backends import KVClassType, TransferBackend, get_kv_class
from field.release import set_release
from field.utils import (
    DisaggregationMode,
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    poll_and_all_reduce,
)
from lifecycle import KVPoll
from lifecycle.testing.spawn import store_server

POOL_PAGES, PAGE_BYTES, LAYERS = 64, 256, 2
META_ROWS, HIDDEN = 8, 32
CHUNK = 2  # pages per send (chunked prefill)
DEADLINE = 60.0


# ---------------------------------------------------------------------------
# what both sides know about each request (as a router would tell them)
# ---------------------------------------------------------------------------


def make_req(room: int) -> Any:
    """The request object an engine would hold, with what set_buf reads."""
    spec = room % 2 == 0  # every other request carries speculative-decoding state
    return types.SimpleNamespace(
        bootstrap_room=room,
        bootstrap_host=None,
        num_pages=1 + room % 5,
        output_ids=[(room * 7) % 30_000],
        cached_tokens=room % 3,
        cached_tokens_device=1,
        cached_tokens_host=0,
        cached_tokens_storage=0,
        multimodal_inputs=None,
        return_logprob=room % 2 == 1,
        logprob=types.SimpleNamespace(
            output_token_logprobs_val=[-room / 1000.0],
            output_token_logprobs_idx=[room],
            output_top_logprobs_val=[[-0.5, -1.5, -room / 100.0]],
            output_top_logprobs_idx=[[room, 1, 2]],
        ),
        hidden_states_tensor=torch.full((HIDDEN,), room / 10.0) if spec else None,
        output_topk_p=torch.tensor([0.75, 0.25]),
        output_topk_index=torch.tensor([room, room + 1]),
        metadata_buffer_index=None,
    )


def page_bytes(room: int, position: int, layer: int) -> torch.Tensor:
    """What page ``position`` of ``room``'s KV holds on ``layer`` (a recognisable pattern)."""
    base = (room * 131 + position * 17 + layer * 7) % 251
    return (torch.arange(PAGE_BYTES, dtype=torch.int64) + base).remainder(256).to(torch.uint8)


def build(backend: TransferBackend, mode: DisaggregationMode, server_args: Any) -> Any:
    kv = [torch.zeros((POOL_PAGES, PAGE_BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    metadata_buffers = MetadataBuffers(META_ROWS, HIDDEN, torch.float32, max_top_logprobs_num=16)
    kv_args = get_kv_class(backend, KVClassType.KVARGS)()
    kv_args.engine_rank = 0
    kv_args.kv_data_ptrs = [t.data_ptr() for t in kv]
    kv_args.kv_data_lens = [t.nbytes for t in kv]
    kv_args.kv_item_lens = [t[0].nbytes for t in kv]
    (
        kv_args.aux_data_ptrs,
        kv_args.aux_data_lens,
        kv_args.aux_item_lens,
    ) = metadata_buffers.get_buf_infos()
    kv_args.page_size = 1
    kv_manager = get_kv_class(backend, KVClassType.MANAGER)(kv_args, mode, server_args)
    return kv, metadata_buffers, kv_manager


# ---------------------------------------------------------------------------
# prefill
# ---------------------------------------------------------------------------


def prefill(
    backend: TransferBackend, rooms: list[int], server_args: Any, port_out: Any = None
) -> dict[str, Any]:
    bootstrap_server_class = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)
    server = None
    if bootstrap_server_class is not None:  # the fake backend has none
        # port 0: the OS picks one as the server binds it, and decode is told
        server = bootstrap_server_class("127.0.0.1", server_args.disaggregation_bootstrap_port)
        server_args.disaggregation_bootstrap_port = server.port
    if port_out is not None:
        port_out.put(server_args.disaggregation_bootstrap_port)
    kv, metadata_buffers, kv_manager = build(backend, DisaggregationMode.PREFILL, server_args)
    sender_class = get_kv_class(backend, KVClassType.SENDER)
    allocator = ReqToMetadataIdxAllocator(META_ROWS)
    free_pages = list(range(POOL_PAGES))
    group = None  # the TP group's gloo group (a world of one here)

    bootstrap_queue = []
    for room in rooms:
        req = make_req(room)
        req.disagg_kv_sender = sender_class(
            mgr=kv_manager,
            bootstrap_addr="127.0.0.1",
            bootstrap_room=room,
            req_has_disagg_prefill_dp_rank=False,
        )
        bootstrap_queue.append(req)
    inflight: list[Any] = []
    done, failed, rows_checked = [], [], 0
    deadline = time.monotonic() + DEADLINE
    while (bootstrap_queue or inflight) and time.monotonic() < deadline:
        # bootstrap queue: handshake done -> take a metadata row, say how many pages follow
        polls = poll_and_all_reduce([r.disagg_kv_sender for r in bootstrap_queue], group)
        waiting = []
        for req, poll in zip(bootstrap_queue, polls):
            if poll == KVPoll.WaitingForInput and len(free_pages) >= req.num_pages:
                idx = allocator.alloc()
                if idx is None:
                    waiting.append(req)  # no free row: wait, not an error
                    continue
                req.metadata_buffer_index = idx
                req.pages = [free_pages.pop(0) for _ in range(req.num_pages)]
                req.disagg_kv_sender.init(req.num_pages, idx)
                # the forward pass: KV pages and the first token's row, then send in chunks
                for pos, page in enumerate(req.pages):
                    for layer in range(LAYERS):
                        kv[layer][page] = page_bytes(req.bootstrap_room, pos, layer)
                metadata_buffers.set_buf(req)
                row = metadata_buffers.get_buf(idx)
                rows_checked += int(
                    int(row[0][0]) == req.output_ids[0] and int(row[-1][0]) == req.bootstrap_room
                )
                for start in range(0, req.num_pages, CHUNK):
                    req.disagg_kv_sender.send(
                        torch.tensor(req.pages[start : start + CHUNK]).numpy()
                    )
                inflight.append(req)
            elif poll == KVPoll.Failed:
                failed.append(req.bootstrap_room)
            else:
                waiting.append(req)
        bootstrap_queue = waiting
        # in-flight queue: Success -> release the request's pages and row
        polls = poll_and_all_reduce([r.disagg_kv_sender for r in inflight], group)
        still = []
        for req, poll in zip(inflight, polls):
            if poll in (KVPoll.Success, KVPoll.Failed):
                (done if poll == KVPoll.Success else failed).append(req.bootstrap_room)
                free_pages.extend(req.pages)
                allocator.free(req.metadata_buffer_index)
            else:
                still.append(req)
        inflight = still
        time.sleep(0.002)
    time.sleep(0.5)  # let decode read its last rows before this side goes away
    close = getattr(kv_manager, "close", None)
    if close is not None:
        close()
    _ = server
    return {
        "side": "prefill",
        "done": sorted(done),
        "failed": sorted(failed),
        "rows_checked": rows_checked,
        "leaked_rows": META_ROWS - allocator.available_size(),
    }


# ---------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------


def decode(backend: TransferBackend, rooms: list[int], server_args: Any) -> dict[str, Any]:
    kv, metadata_buffers, kv_manager = build(backend, DisaggregationMode.DECODE, server_args)
    receiver_class = get_kv_class(backend, KVClassType.RECEIVER)
    allocator = ReqToMetadataIdxAllocator(META_ROWS)
    free_pages = list(range(POOL_PAGES))[::-1]  # decode's pages differ from prefill's
    expected_rows = MetadataBuffers(1, HIDDEN, torch.float32, max_top_logprobs_num=16)
    verify = backend != TransferBackend.FAKE  # the fake backend moves no bytes
    group = None

    prealloc_queue = []
    for room in rooms:
        decode_req = types.SimpleNamespace(req=make_req(room), metadata_buffer_index=None)
        decode_req.kv_receiver = receiver_class(
            mgr=kv_manager, bootstrap_addr="127.0.0.1", bootstrap_room=room
        )
        decode_req.kv_receiver.init(0)  # the prefill DP rank (one DP group here)
        prealloc_queue.append(decode_req)
    transfer_queue: list[Any] = []
    done, failed, bad = [], [], []
    kv_bytes = rows = 0
    deadline = time.monotonic() + DEADLINE
    while (prealloc_queue or transfer_queue) and time.monotonic() < deadline:
        # pre-allocation: handshake done -> pages and a metadata row, tell prefill where to write
        polls = poll_and_all_reduce([d.kv_receiver for d in prealloc_queue], group)
        waiting = []
        for d, poll in zip(prealloc_queue, polls):
            if poll == KVPoll.WaitingForInput and len(free_pages) >= d.req.num_pages:
                idx = allocator.alloc()
                if idx is None:
                    waiting.append(d)
                    continue
                d.metadata_buffer_index = idx
                d.pages = [free_pages.pop() for _ in range(d.req.num_pages)]
                d.kv_receiver.send_metadata(torch.tensor(d.pages).numpy(), idx)
                transfer_queue.append(d)
            elif poll == KVPoll.Failed:
                failed.append(d.req.bootstrap_room)
            else:
                waiting.append(d)
        prealloc_queue = waiting
        # transfer queue: a Success counts only once the metadata row has landed
        polls = poll_and_all_reduce(
            [d.kv_receiver for d in transfer_queue],
            group,
            transfer_queue,
            metadata_buffers,
            server_args,
        )
        still = []
        for d, poll in zip(transfer_queue, polls):
            if poll == KVPoll.Success:
                room = d.req.bootstrap_room
                if verify:
                    row = metadata_buffers.get_buf(d.metadata_buffer_index)
                    d.req.metadata_buffer_index = 0
                    expected_rows.set_buf(d.req)
                    want = expected_rows.get_buf(0)
                    rows += 1
                    if not all(same(a, b) for a, b in zip(row, want)):
                        bad.append((room, "metadata row"))
                    for pos, page in enumerate(d.pages):
                        for layer in range(LAYERS):
                            if not torch.equal(kv[layer][page], page_bytes(room, pos, layer)):
                                bad.append((room, f"page {pos} layer {layer}"))
                            kv_bytes += PAGE_BYTES
                done.append(room)
            elif poll == KVPoll.Failed:
                failed.append(d.req.bootstrap_room)
            else:
                still.append(d)
                continue
            metadata_buffers.clear_slot(d.metadata_buffer_index)  # "not written" for the next owner
            allocator.free(d.metadata_buffer_index)
            free_pages.extend(d.pages)
        transfer_queue = still
        time.sleep(0.002)
    close = getattr(kv_manager, "close", None)
    if close is not None:
        close()
    return {
        "side": "decode",
        "done": sorted(done),
        "failed": sorted(failed),
        "bad": bad,
        "rows_verified": rows,
        "kv_bytes_verified": kv_bytes,
        "unfinished": len(prealloc_queue) + len(transfer_queue),
        "leaked_rows": META_ROWS - allocator.available_size(),
    }


def same(a: Any, b: Any) -> bool:
    """Two get_buf values agree (None: a row these buffers do not have)."""
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


# ---------------------------------------------------------------------------


def side_main(side: str, backend_name: str, rooms: list[int], ports: Any, out: Any) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    set_release("0.5.23")  # the call shapes below are 0.5.23's
    dist.init_process_group(
        "gloo",
        store=store_server(),  # this side's own one-rank group, on a port the OS picks
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=30),
    )
    backend = TransferBackend(backend_name)
    server_args = types.SimpleNamespace(
        disaggregation_transfer_backend=backend_name,
        disaggregation_bootstrap_port=0,  # prefill's server binds one, and says which
        host="127.0.0.1",
    )
    try:
        if side == "prefill":
            out.put(prefill(backend, rooms, server_args, ports))
        else:
            server_args.disaggregation_bootstrap_port = ports.get(timeout=DEADLINE)
            out.put(decode(backend, rooms, server_args))
    except Exception as e:  # report, so the parent does not wait for nothing
        out.put({"side": side, "error": repr(e)})
        raise
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["fake", "mooncake", "nixl"], default="fake")
    ap.add_argument("--requests", type=int, default=24)
    a = ap.parse_args(argv)
    rooms = [1000 + i for i in range(1, a.requests + 1)]
    ctx = mp.get_context("spawn")
    out, ports = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=side_main, args=(side, a.backend, rooms, ports, out))
        for side in ("prefill", "decode")
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            r = out.get(timeout=DEADLINE + 30)
            results[r["side"]] = r
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    pre, dec = results.get("prefill", {}), results.get("decode", {})
    for r in (pre, dec):
        if "error" in r:
            print(f"{r['side']}: error: {r['error']}")
    print(
        f"prefill: {len(pre.get('done', []))} sent, {len(pre.get('failed', []))} failed, "
        f"{pre.get('rows_checked', 0)} rows read back, {pre.get('leaked_rows')} rows leaked"
    )
    print(
        f"decode: {len(dec.get('done', []))} committed, {len(dec.get('failed', []))} failed, "
        f"{dec.get('unfinished')} unfinished, {dec.get('leaked_rows')} rows leaked"
    )
    print(
        f"verified: {dec.get('kv_bytes_verified', 0)} KV bytes and "
        f"{dec.get('rows_verified', 0)} metadata rows, {len(dec.get('bad', []))} differ"
        + (f" (first: {dec['bad'][:3]})" if dec.get("bad") else "")
    )
    ok = (
        pre.get("done") == rooms
        and dec.get("done") == rooms
        and pre.get("rows_checked") == len(rooms)
        and not dec.get("bad")
        and pre.get("leaked_rows") == 0
        and dec.get("leaked_rows") == 0
    )
    if a.backend != "fake":
        ok = ok and dec.get("rows_verified") == len(rooms)
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
