"""One rank process of ``pdlife bench-transfer``: a prefill or a decode TP rank
with its connector on 127.0.0.1, timing each repetition's raw 1:1 write and
its lifecycle-driven request.

Every rank meets the others at a store barrier before each timed part. In
``raw`` each prefill rank writes its share of the bytes as whole pages (see
:func:`pdlife.bench.transfer_shape.raw_runs`) through the engine's own calls
and polls them to completion; in ``sliced`` it writes, the same way, the very
runs the connector issues for its head slices of the request (where the time
goes: the engine's cost of those runs, apart from the protocol's; staged, those
runs are the raw ones, into decode's staging region). In ``life`` one request
is driven end to end:
each decode rank ``init`` + ``send_metadata``, each prefill rank ``init`` +
``send``, every rank stepping a :class:`~lifecycle.Stepper` until the agreed
Success. Times are ``time.monotonic`` instants (one clock for every process
of the machine), so the launcher takes each part from its first start to its
last end across the ranks. After each lifecycle request, outside the timed
window, every decode rank checks every byte of its pages and the metadata
row.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np

from pdlife.bench.transfer_shape import Shape, pattern, raw_runs
from pdlife.engine_output import divert

if TYPE_CHECKING:
    from transport.connector.timeline import Timeline

__all__ = ["rank_main"]

logger = logging.getLogger(__name__)

#: the pause between a rank's steps (by default) and between polls of a raw write
POLL = 0.0002
NS = "bench"
#: what each repetition times: the raw 1:1 write, the raw engine write of the
#: connector's own runs for the request (``sliced``), the lifecycle-driven request
PARTS = ("raw", "sliced", "life")


def _barrier(store: Any, key: str, world: int, leader: bool) -> None:
    store.add(f"sync/{key}", 1)
    if leader:
        while int(store.add(f"sync/{key}", 0)) < world:
            time.sleep(POLL)
        store.set(f"go/{key}", "1")
    else:
        store.wait([f"go/{key}"])


def _connected(mgr: Any, peer: int, store: Any) -> dict[str, Any]:
    """The peer's record once the connector's thread connected its engine to it,
    asked for a heartbeat apart (a peer that never answers fails the bench by
    the connector's error, or its timeout)."""
    while (info := mgr.peer_record(peer)) is None:
        if mgr.last_error is not None:
            raise mgr.last_error
        time.sleep(mgr.config.heartbeat_interval)
    return info  # type: ignore[no-any-return]


def rank_main(
    backend: str,
    role: str,
    rank: int,
    shape: Shape,
    reps: int,
    port: int,
    q: Any,
    quiet: bool,
    step_s: float = POLL,
    digest: bool = False,
    timeline: bool = False,
) -> None:
    """Run one rank; put ``(role, rank, {part: [(start, end), ...]}, verified, stats)``
    on ``q``, or ``(role, rank, None, why, None)`` if it failed. ``timeline``: the
    connector's :class:`~transport.connector.timeline.Timeline` on, with this
    bench's marks, its records in ``stats["timeline"]``."""
    try:
        _run(backend, role, rank, shape, reps, port, q, quiet, step_s, digest, timeline)
    except Exception as e:
        q.put((role, rank, None, f"{type(e).__name__}: {e}", None))
        raise


def _run(
    backend: str,
    role: str,
    rank: int,
    shape: Shape,
    reps: int,
    port: int,
    q: Any,
    quiet: bool,
    step_s: float,
    digest: bool = False,
    timeline: bool = False,
) -> None:
    if quiet:
        divert(None)  # the engine's own lines; --verbose keeps them
    import torch
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from buffers import MetadataBuffers, MetadataLayout
    from transport.connector.config import ConnectorConfig
    from transport.connector.timeline import Timeline
    from transport.layout import kv_args_for
    from transport.registry import get_backend

    heads = shape.heads(role, rank)
    tp = shape.prefill_tp if role == "prefill" else shape.decode_tp
    kv = [
        torch.zeros(shape.tensor_shape(len(heads)), dtype=torch.uint8) for _ in range(shape.buffers)
    ]
    meta = MetadataBuffers(
        3, MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
    )
    args = kv_args_for(
        kv,
        meta.buf_infos(),
        rank,
        page_size=shape.page_tokens,
        kv_head_num=len(heads),
        heads_major=shape.heads_major,
        head_group=shape.head_group,
    )
    staged: dict[str, Any] = {}
    if role == "decode" and shape.staging:  # a staging region of the request's pages per slot
        staged = {"staging": True, "staging_pages": shape.pages, "scatter_pages": shape.pages}
    config = ConnectorConfig(
        role=role,
        tp_rank=rank,
        tp_size=tp,
        kv_heads=shape.kv_heads,
        store_port=port,
        namespace=NS,
        digest=digest,
        **staged,
    )
    mgr = get_backend(backend).manager(args, config)
    tl = mgr.timeline = Timeline() if timeline else None
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    want = [torch.from_numpy(pattern(shape, heads, b)) for b in range(shape.buffers)]
    if role == "prefill":
        for t, w in zip(kv, want):
            t.copy_(w)
        want = []
        peers = shape.topology.peers(rank)
    else:
        peers = shape.topology.contacts(rank)
    peer_role = "decode" if role == "prefill" else "prefill"
    store.wait([f"{NS}/{peer_role}/{p}/endpoint" for p in peers])
    infos = {p: _connected(mgr, p, store) for p in peers}  # as the connector writes
    dst = shape.dst_pages()
    writes = {}
    if role == "prefill":
        raw = raw_runs(shape, rank, kv, infos)
        # staged, the connector's runs are the raw ones, into decode's staging instead
        writes = {"raw": raw, "sliced": raw if shape.staging else _sliced(args, shape, infos)}
    world, leader = shape.prefill_tp + shape.decode_tp, role == "prefill" and rank == 0
    times: dict[str, list[tuple[float, float]]] = {p: [] for p in (*PARTS, "handshake")}
    verified = True
    from transport.digest import bare_cpu, hash_cpu

    hashed: list[tuple[float, int]] = []  # per lifecycle request: (CPU seconds, bytes) hashed
    for rep in range(reps):
        for what in PARTS[rep % 3 :] + PARTS[: rep % 3]:  # each part first in turn
            if role == "decode" and what == "life":
                for t in kv:
                    t.zero_()  # so only this request can put the bytes back
            _barrier(store, f"{rep}/{what}", world, leader)
            room = 1000 + rep * 2 + (what == "life")
            before = hash_cpu()
            if what != "life":
                if role == "prefill":
                    times[what].append(_raw(mgr, infos, writes[what]))
                    if tl is not None:
                        tl.mark(f"{what} write", -1, times[what][-1][0])
                        tl.mark(f"{what} landed", -1, times[what][-1][1])
            elif role == "decode":
                hand, life = _decode(mgr, meta, room, dst, shape.staging, step_s, tl)
                times["handshake"].append(hand)
                times["life"].append(life)
                rows = torch.from_numpy(dst)
                verified &= all(torch.equal(shape.held(t, rows), w) for t, w in zip(kv, want))
                verified &= meta.room_of(1) == room
                meta.clear_room(1)
            else:
                _prefill(mgr, meta, room, shape.pages, step_s, tl)
            if what == "life":
                after = hash_cpu()
                hashed.append((after[0] - before[0], after[1] - before[1]))
    stats: dict[str, Any] = dict(mgr.stats)
    if tl is not None:
        stats["timeline"] = tl.take()
    if digest:
        per = int(np.median([b for _, b in hashed]))
        stats["digest_cpu_s"] = [c for c, _ in hashed]
        stats["digest_bytes_per_request"] = per
        stats["bare_hash_cpu_s"] = bare_cpu(per) if per else 0.0
    q.put((role, rank, times, bool(verified), stats))
    _barrier(store, "end", world, leader)  # nobody closes while a peer still writes
    time.sleep(0.2)
    mgr.close()


def _sliced(args: Any, shape: Shape, infos: dict[int, Any]) -> dict[int, Any]:
    """The KV writes the connector issues for this prefill rank's slices of the
    request, by decode rank (the same legs and pages as the lifecycle-driven one)."""
    from transport.connector.core.legs import kv_writes, leg_of

    out = {}
    src = np.arange(shape.pages, dtype=np.int64)
    for s in shape.topology.targets(args.engine_rank):
        leg = leg_of(s.decode, s)
        leg.dst_heads = int(infos[s.decode]["kv_head_num"])
        out[s.decode] = kv_writes(args, infos[s.decode], leg, src, shape.dst_pages())
    return out


def _raw(mgr: Any, infos: dict[int, Any], raw: dict[int, Any]) -> tuple[float, float]:
    """Every write of ``raw`` (by decode rank), through the engine's own calls and
    polled to completion: (start, end)."""
    t0 = time.monotonic()
    tokens = [mgr.engine.write(infos[d], *w, b"") for d, w in raw.items()]  # the engine's own write
    while any(mgr.engine.check(tok) == 0 for tok in tokens):
        time.sleep(POLL)
    t1 = time.monotonic()
    for tok in tokens:
        mgr.engine.forget(tok)
    return t0, t1


def _decode(
    mgr: Any, meta: Any, room: int, dst: Any, staged: bool, step_s: float, tl: Timeline | None
) -> tuple[tuple[float, float], ...]:
    """One request on a decode rank: (handshake (start, end), transfer (start, end)),
    the transfer timed from ``send_metadata`` to the agreed Success (staged: once
    the stepper's staging gate saw every page scattered)."""
    from lifecycle import RequestTable, SingleRank, Stepper

    table = RequestTable()
    r = mgr.receiver(room)
    r.init()
    table.add(room, handle_index=r.index, metadata_slot=1)
    stepper = Stepper(table, 0, poller=mgr, metadata=meta, staging=mgr if staged else None)
    t0 = t1 = time.monotonic()
    sent = False
    while True:
        res = stepper.step(SingleRank())
        if not sent and res.statuses[0] == 2:
            t1 = time.monotonic()  # handshake done: decode says where to write
            if tl is not None:
                tl.mark("page list", room, t1)
            r.send_metadata(dst, 1)
            sent = True
        if res.statuses[0] in (0, 4):
            break
        time.sleep(step_s)
    t2 = time.monotonic()
    if tl is not None:
        tl.mark("success", room, t2)
    if res.statuses[0] != 4:
        raise RuntimeError(f"lifecycle transfer of room {room} failed: {res.failures()}")
    r.clear()
    return (t0, t1), (t1, t2)


def _prefill(
    mgr: Any, meta: Any, room: int, pages: int, step_s: float, tl: Timeline | None
) -> None:
    """One request on a prefill rank: ``init`` + ``send`` once decode's page list is in."""
    from lifecycle import RequestTable, SingleRank, Stepper

    meta.write(2, room, {"output_ids": [room]})
    h = mgr.sender(room)
    table = RequestTable()
    table.add(room, handle_index=h.index)
    stepper = Stepper(table, 0, poller=mgr)
    inited = False
    while True:
        res = stepper.step(SingleRank())
        if not inited and res.statuses[0] == 2:
            if tl is not None:
                tl.mark("pages in", room)
            h.init(pages, 2)
            h.send(np.arange(pages, dtype=np.int64))
            inited = True
            if tl is not None:
                tl.mark("handed over", room)
        if res.statuses[0] in (0, 4):
            break
        time.sleep(step_s)
    if res.statuses[0] != 4:
        raise RuntimeError(f"lifecycle transfer of room {room} failed: {res.failures()}")
    h.clear()
