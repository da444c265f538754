"""SGLang 0.5.23's own KV connector moving scattered KV pages between a prefill
and a decode process on 127.0.0.1, timed per request.

The case is ``pdlife bench-transfer --buffers 8 --page-kib 32 --shuffle``'s:
8 KV buffers (uint8 CPU tensors), each of 256 pages of 32 KiB (64 MiB in all),
plus one metadata (aux) buffer whose one row travels with each request.
Prefill's page ``i`` of every buffer lands in decode's page
``np.random.default_rng(0).permutation(256)[i]``, so no two pages are adjacent
on both sides and every page is a transfer of its own.

Three processes: this one runs SGLang's bootstrap server (``KVClassType.
BOOTSTRAP_SERVER`` of the backend, bound to port 0: the OS picks it), and
spawns a prefill and a decode process. Each publishes a dummy ServerArgs
through ``get_context().override_server_args`` (its disaggregation mode, the
backend, the bootstrap port, host 127.0.0.1), builds a ``KVArgs`` over its
tensors, and makes the backend's own KV manager (``KVClassType.MANAGER``).
For Mooncake the shared engine comes from
``maybe_init_shared_mooncake_transfer_engine`` with ``MOONCAKE_PROTOCOL=tcp``;
for NIXL the manager makes its own agent (UCX by default) over DRAM buffers.

Each repetition is one request with a new bootstrap room, driven as SGLang's
scheduler drives it:

- prefill makes the sender, polls it until ``WaitingForInput`` (decode's page
  list has arrived), then ``init(256, aux_row)`` and ``send(arange(256))``,
  and polls until Success;
- decode makes the receiver, ``init(prefill_dp_rank=0)``, then
  ``send_metadata(destination pages, aux_row)``, and polls until Success.

The time of a request is from just before decode's ``send_metadata`` (its page
list) to the moment its ``poll`` returns Success, in ``time.monotonic`` (one
clock for every process of the machine); both sides poll every 0.2 ms, as
``pdlife bench-transfer`` does. GB/s is 64 MiB over that time (the metadata
row is not counted). One untimed warm-up request comes first (``--warmup``),
so the engine's first connection to its peer is not in a timed one. After each
request, outside the timed window, decode checks every byte of its 256 x 8
pages and the metadata row against what prefill holds (the same seeded
pattern, regenerated), then zeroes them, so only the next request can put the
bytes back.

Nothing of SGLang is patched or monkeypatched: its configuration comes from
the published dummy ServerArgs and the environment (``MOONCAKE_PROTOCOL=tcp``,
``SGLANG_HOST_IP=127.0.0.1`` for the address the managers advertise), and only
its public classes are called. No process groups are built, so each process
states its ranks (all 0, ``pp_group`` None: one prefill rank, one decode rank)
with ``get_parallel().override_permanently``. NIXL's manager calls
``torch.get_device_module(device).set_device(gpu_id)``; with ``device="cpu"``
in the dummy ServerArgs that is torch's own CPU no-op. SGLang imports
``nixl._api``, which the ``nixl`` meta-package provides by re-exporting the
``nixl_cu12`` wheel; that meta-package (it pulls a CUDA torch) is not installed
here, so the NIXL run makes the same alias in ``sys.modules`` (and sets
``UCX_MODULES=^ib,rdmacm``: UCX's InfiniBand modules are unused on loopback
and crash the process at exit). The engines' own loggers are set to errors
only unless ``--verbose`` (Mooncake still prints one benign glog line,
"Local segment descriptor not found", at start).

Prints one line (median GB/s over the timed requests, quartiles, bytes
verified); ``--json PATH`` also writes the per-request seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import sys
import time
import warnings
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

BUFFERS = 8
PAGES = 256
PAGE_BYTES = 32 * 1024
TOTAL_BYTES = BUFFERS * PAGES * PAGE_BYTES  # 64 MiB
META_ROWS = 4
META_ROW_BYTES = 64
SRC_META_ROW = 2  # prefill's metadata row of a request
DST_META_ROW = 1  # decode's
POLL_S = 0.0002
PATTERN_SEED = 1234
HOST = "127.0.0.1"
STEP_TIMEOUT_S = 60.0

log = logging.getLogger("sglang_transfer")


def dst_pages() -> np.ndarray:
    """Decode's page for each prefill page (the bench's ``--shuffle``)."""
    return np.random.default_rng(0).permutation(PAGES)


def pattern() -> np.ndarray:
    """Prefill's KV bytes: (buffers, pages, page bytes), seeded."""
    rng = np.random.default_rng(PATTERN_SEED)
    return rng.integers(0, 256, size=(BUFFERS, PAGES, PAGE_BYTES), dtype=np.uint8)


def meta_row(room: int) -> np.ndarray:
    """The metadata row a request carries: its room, then a filler."""
    row = np.full(META_ROW_BYTES, 0xA5, dtype=np.uint8)
    row[:8] = np.frombuffer(int(room).to_bytes(8, "little"), dtype=np.uint8)
    return row


def _quiet(verbose: bool) -> None:
    level = logging.DEBUG if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(processName)s %(name)s: %(message)s")
    if not verbose:
        logging.getLogger().setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")  # SGLang's import-time CUDA-only notices


def _environment(verbose: bool = False) -> None:
    os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
    # the engines' own loggers (glog, NIXL's, UCX's): errors only unless --verbose
    # (a value the user has set is kept)
    loud = {"MC_LOG_LEVEL": "INFO", "NIXL_LOG_LEVEL": "INFO", "UCX_LOG_LEVEL": "warn"}
    quiet = {"MC_LOG_LEVEL": "ERROR", "NIXL_LOG_LEVEL": "ERROR", "UCX_LOG_LEVEL": "error"}
    for var, level in (loud if verbose else quiet).items():
        os.environ.setdefault(var, level)
    if not verbose:
        os.environ.setdefault("GLOG_minloglevel", "2")
    os.environ["SGLANG_HOST_IP"] = HOST  # the address each manager advertises


def _nixl_module() -> None:
    """Make ``import nixl`` name the installed ``nixl_cu12`` wheel.

    SGLang imports ``nixl._api``; the ``nixl`` meta-package, which only
    re-exports the wheel for the machine's CUDA, pulls a CUDA torch and is not
    installed here (see pyproject), so the same alias is made in this process.
    """
    if "nixl" in sys.modules:
        return
    try:
        import nixl  # noqa: F401
    except ImportError:
        import nixl_cu12
        import nixl_cu12._api

        sys.modules["nixl"] = nixl_cu12
        sys.modules["nixl._api"] = nixl_cu12._api
    # the wheel's UCX InfiniBand modules are not used on loopback, and their
    # libnl crashes the process at exit
    os.environ.setdefault("UCX_MODULES", "^ib,rdmacm")


def _publish(role: str, backend: str, bootstrap_port: int) -> Any:
    """Publish the dummy ServerArgs this process's SGLang reads."""
    from sglang.srt.runtime_context import get_context, get_parallel

    server_args = (
        get_context()
        .override_server_args(
            disaggregation_mode=role,
            disaggregation_transfer_backend=backend,
            disaggregation_bootstrap_port=bootstrap_port,
            host=HOST,
            device="cpu",
        )
        .install()
    )
    # one rank of everything: no process groups are built, so state the ranks
    ranks = ("tp", "pp", "attn_tp", "attn_cp", "attn_dcp", "dcp", "attn_dp", "dp")
    get_parallel().override_permanently(**{f"{r}_rank": 0 for r in ranks}, pp_group=None)
    return server_args


def _kv_args(backend: str, kv: list[Any], meta: Any) -> Any:
    """SGLang's own KVArgs over ``kv`` and ``meta``: every field it declares starts
    at the empty value of the field-facing ``field.conn.kv_args.KVArgs`` (no
    state, no host copies, one head, one page size), then this case's own."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    from field.conn.kv_args import KVArgs as EmptyKVArgs

    args = get_kv_class(TransferBackend(backend), KVClassType.KVARGS)()
    declared = {n for c in type(args).__mro__ for n in getattr(c, "__annotations__", {})}
    for name, value in vars(EmptyKVArgs()).items():
        if name in declared:
            setattr(args, name, value)
    args.kv_data_ptrs = [t.data_ptr() for t in kv]
    args.kv_data_lens = [t.numel() for t in kv]
    args.kv_item_lens = [PAGE_BYTES] * len(kv)  # pages are opaque: one "token" per page
    args.kv_cache_dtype_str = "auto"
    args.aux_data_ptrs = [meta.data_ptr()]
    args.aux_data_lens = [meta.numel()]
    args.aux_item_lens = [META_ROW_BYTES]
    # plain MHA: K buffers then V buffers, paired by position
    args.prefill_end_layer = args.hidden_kv_layers = len(kv) // 2
    if backend == "nixl":
        args.kv_data_mem_kinds = ["DRAM"] * len(kv)
    return args


def _wait(poll: Any, want: int, what: str) -> int:
    """Poll every POLL_S until ``want`` or a terminal status; returns the status."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    deadline = time.monotonic() + STEP_TIMEOUT_S
    while True:
        status = int(poll())
        if status >= want or status == KVPoll.Failed:
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: still at status {status} after {STEP_TIMEOUT_S:.0f} s")
        time.sleep(POLL_S)


def _role_main(
    role: str, backend: str, bootstrap_port: int, conn: Connection, verbose: bool
) -> None:
    """One process: prefill or decode, serving requests the launcher names."""
    _quiet(verbose)
    _environment(verbose)
    try:
        _serve(role, backend, bootstrap_port, conn)
    except BaseException as exc:  # report, then let the launcher stop everything
        conn.send(("error", f"{role}: {type(exc).__name__}: {exc}"))
        raise


def _serve(role: str, backend: str, bootstrap_port: int, conn: Connection) -> None:
    import torch

    server_args = _publish(role, backend, bootstrap_port)
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        TransferBackend,
        get_kv_class,
    )

    tb = TransferBackend(backend)
    kv = [torch.zeros(PAGES * PAGE_BYTES, dtype=torch.uint8) for _ in range(BUFFERS)]
    meta = torch.zeros(META_ROWS * META_ROW_BYTES, dtype=torch.uint8)
    want = pattern()
    if role == "prefill":
        for t, w in zip(kv, want):
            t.numpy()[:] = w.reshape(-1)
    if backend == "nixl":
        _nixl_module()
    if backend == "mooncake":
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            maybe_init_shared_mooncake_transfer_engine,
        )

        maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    mgr = get_kv_class(tb, KVClassType.MANAGER)(
        _kv_args(backend, kv, meta), mode, server_args, False
    )
    addr = f"{HOST}:{bootstrap_port}"
    if role == "decode":
        conn.send(("built", None))
        conn.recv()  # the launcher's word that prefill has registered
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while not mgr.try_ensure_parallel_info(addr):  # prefill registered yet?
            if time.monotonic() > deadline:
                raise TimeoutError(f"no prefill registered at the bootstrap server {addr}")
            time.sleep(0.05)
    conn.send(("up", None))

    pages = dst_pages().astype(np.int32)
    src_pages = np.arange(PAGES, dtype=np.int32)
    kv_np = [t.numpy().reshape(PAGES, PAGE_BYTES) for t in kv]
    meta_np = meta.numpy().reshape(META_ROWS, META_ROW_BYTES)
    while True:
        cmd, room = conn.recv()
        if cmd == "stop":
            break
        if role == "prefill":
            meta_np[SRC_META_ROW] = meta_row(room)  # before the request, untimed
            sender = get_kv_class(tb, KVClassType.SENDER)(mgr, addr, room)
            conn.send(("ready", None))
            status = _wait(sender.poll, KVPoll.WaitingForInput, f"prefill room {room}")
            if status != KVPoll.WaitingForInput:
                raise RuntimeError(f"prefill room {room}: status {status} before sending")
            t_in = time.monotonic()
            sender.init(PAGES, SRC_META_ROW)
            sender.send(src_pages)
            t_sent = time.monotonic()
            status = _wait(sender.poll, KVPoll.Success, f"prefill room {room}")
            t_done = time.monotonic()
            sender.clear()
            conn.send(
                (
                    "done",
                    {"status": status, "inputs_at": t_in, "sent_at": t_sent, "done_at": t_done},
                )
            )
        else:
            receiver = get_kv_class(tb, KVClassType.RECEIVER)(mgr, addr, room)
            receiver.init(0)  # prefill_dp_rank: one prefill rank
            status = _wait(receiver.poll, KVPoll.WaitingForInput, f"decode room {room}")
            if status != KVPoll.WaitingForInput:
                raise RuntimeError(f"decode room {room}: status {status} before its page list")
            t0 = time.monotonic()
            receiver.send_metadata(pages, DST_META_ROW)
            status = _wait(receiver.poll, KVPoll.Success, f"decode room {room}")
            t1 = time.monotonic()
            receiver.clear()
            verified = 0
            if status == KVPoll.Success:  # outside the timed window
                for held, w in zip(kv_np, want):
                    ok = np.array_equal(held[pages], w)
                    verified += held.nbytes if ok else 0
                if np.array_equal(meta_np[DST_META_ROW], meta_row(room)):
                    verified += META_ROW_BYTES
            for held in kv_np:
                held.fill(0)
            meta_np.fill(0)
            conn.send(("done", {"status": status, "start": t0, "end": t1, "verified": verified}))
    conn.send(("stopped", None))


def _bootstrap_server(backend: str) -> tuple[Any, int]:
    """SGLang's bootstrap server on 127.0.0.1, on a port the OS picks."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    server = get_kv_class(TransferBackend(backend), KVClassType.BOOTSTRAP_SERVER)(HOST, 0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        runner = getattr(server, "_runner", None)
        addresses = getattr(runner, "addresses", None) if runner is not None else None
        if addresses:
            return server, int(addresses[0][1])
        time.sleep(0.02)
    raise RuntimeError("the bootstrap server did not start in 30 s")


def _recv(conn: Connection, expect: str, who: str, timeout: float = STEP_TIMEOUT_S) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"{who}: no {expect!r} in {timeout:.0f} s")
    kind, payload = conn.recv()
    if kind == "error":
        raise RuntimeError(payload)
    if kind != expect:
        raise RuntimeError(f"{who}: got {kind!r}, expected {expect!r}")
    return payload


def run(backend: str, reps: int, warmup: int, verbose: bool) -> dict[str, Any]:
    """Start the three processes, drive ``warmup + reps`` requests, stop them."""
    _environment(verbose)
    server, port = _bootstrap_server(backend)
    ctx = mp.get_context("spawn")
    conns: dict[str, Connection] = {}
    procs: dict[str, Any] = {}
    try:
        for role in ("prefill", "decode"):
            ours, theirs = ctx.Pipe()
            conns[role] = ours
            procs[role] = ctx.Process(
                target=_role_main,
                args=(role, backend, port, theirs, verbose),
                name=role,
                daemon=True,
            )
            procs[role].start()
        # decode asks the bootstrap server for prefill only once prefill has registered
        _recv(conns["prefill"], "up", "prefill", timeout=180)
        _recv(conns["decode"], "built", "decode", timeout=180)
        conns["decode"].send(("connect", 0))
        _recv(conns["decode"], "up", "decode")
        base = int.from_bytes(os.urandom(4), "little") << 16  # new rooms every run
        seconds: list[float] = []
        breakdown: list[dict[str, float]] = []
        warm_s: list[float] = []
        verified = 0
        for i in range(warmup + reps):
            room = base + i
            conns["prefill"].send(("go", room))
            _recv(conns["prefill"], "ready", "prefill")
            conns["decode"].send(("go", room))
            d = _recv(conns["decode"], "done", "decode")
            p = _recv(conns["prefill"], "done", "prefill")
            if d["status"] != 4 or p["status"] != 4:
                raise RuntimeError(
                    f"room {room}: decode status {d['status']}, prefill status {p['status']}"
                )
            if d["verified"] != TOTAL_BYTES + META_ROW_BYTES:
                raise RuntimeError(
                    f"room {room}: only {d['verified']} of {TOTAL_BYTES + META_ROW_BYTES} bytes verified"
                )
            took = d["end"] - d["start"]
            if i < warmup:
                warm_s.append(took)
                continue
            verified += d["verified"]
            seconds.append(took)
            breakdown.append(
                {
                    "to_prefill_send_s": p["inputs_at"] - d["start"],
                    "send_call_s": p["sent_at"] - p["inputs_at"],
                    "send_to_decode_success_s": d["end"] - p["sent_at"],
                }
            )
        for role in ("prefill", "decode"):
            conns[role].send(("stop", 0))
            _recv(conns[role], "stopped", role)
    finally:
        for proc in procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        server.close()
    return {
        "backend": backend,
        "bytes_per_request": TOTAL_BYTES,
        "buffers": BUFFERS,
        "pages": PAGES,
        "page_bytes": PAGE_BYTES,
        "shuffle": True,
        "seconds": seconds,
        "warmup_seconds": warm_s,
        "breakdown": breakdown,
        "bytes_verified": verified,
        "expected_bytes": reps * (TOTAL_BYTES + META_ROW_BYTES),
    }


def summary(result: dict[str, Any]) -> str:
    gbps = sorted(TOTAL_BYTES / s / 1e9 for s in result["seconds"])
    q1, med, q3 = (float(q) for q in np.percentile(gbps, [25, 50, 75]))
    names = {
        "mooncake": "SGLang 0.5.23 Mooncake connector (TCP)",
        "nixl": "SGLang 0.5.23 NIXL connector",
    }
    ok = result["bytes_verified"] == result["expected_bytes"]
    return (
        f"64 MiB ({BUFFERS} buffer(s) of 32 KiB pages, destination pages shuffled) over "
        f"{names[result['backend']]} on 127.0.0.1: {med:.2f} GB/s median of {len(gbps)} request(s) "
        f"(quartiles {q1:.2f}-{q3:.2f}, extremes {gbps[0]:.2f}-{gbps[-1]:.2f}), timed from decode's "
        f"send_metadata to its Success; {result['bytes_verified']} bytes verified"
        + ("" if ok else f" of {result['expected_bytes']} (MISMATCH)")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("mooncake", "nixl"), default="mooncake")
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=1, help="untimed requests first")
    parser.add_argument("--json", type=str, default=None, help="write per-request seconds here")
    parser.add_argument("--verbose", action="store_true", help="SGLang's and the connector's logs")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        parser.error("--reps must be >= 1 and --warmup >= 0")
    _quiet(args.verbose)
    result = run(args.backend, args.reps, args.warmup, args.verbose)
    print(summary(result), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    return 0 if result["bytes_verified"] == result["expected_bytes"] else 1


if __name__ == "__main__":
    sys.exit(main())
