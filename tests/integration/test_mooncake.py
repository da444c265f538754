"""The Mooncake backend moving real bytes over TCP on 127.0.0.1.

2 prefill + 2 decode ranks (4 processes, TP=2 on each side, gloo groups),
driven by the reference scheduler loops of `pdlife simulate`; decode checks
every KV page and metadata row it commits against what prefill wrote.
"""

import json

import pytest

try:  # a missing system library (libibverbs.so.1) raises ImportError or OSError
    import mooncake.engine  # noqa: F401
except (ImportError, OSError) as e:
    pytest.skip(
        f"Mooncake engine not usable here ({e}); install Debian's libibverbs1 "
        "(`apt-get install libibverbs1`, or `make install` as root) and pd-lifecycle[mooncake]",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.multiprocess, pytest.mark.network, pytest.mark.timeout(300)]


def decode_outcomes(out):
    ranks = [json.loads((out / "ranks" / f"rank{r}.json").read_text()) for r in (2, 3)]
    return [r["outcome"] for r in ranks], ranks


def test_200_requests_move_byte_for_byte(tmp_path, run_sim):
    proc, s, out = run_sim(
        "mooncake", "ok", "--requests", "200", "--abort-prob", "0", "--seed", "3"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert s["succeeded"] == 200
    assert s["invariant_violations"] == []  # a differing page or row would be listed here
    assert s["kv_bytes_verified"] >= 200 * 2 * 256 * 2  # both decode ranks, 2 layers, >= 1 page
    assert (s["leaked_slots"], s["leaked_kv_pages"], s["disagreements"]) == (0, 0, 0)
    (o2, o3), _ = decode_outcomes(out)
    assert o2 == o3
    assert {v[0] for v in o2.values()} == {"Success"}


def test_aborts_and_a_killed_prefill_rank(tmp_path, run_sim):
    proc, s, out = run_sim(
        "mooncake",
        "kill",
        "--requests",
        "200",
        "--abort-prob",
        "0.1",
        "--kill-rank",
        "1",
        "--kill-step",
        "6",
        "--pg-timeout",
        "10",
        "--seed",
        "5",
    )
    assert proc.returncode != 0  # the prefill group lost a rank: the run says so
    assert s["dead_ranks"] == [1]
    assert any("dead rank(s) [1]" in e for e in s["rank_errors"])
    (o2, o3), ranks = decode_outcomes(out)
    assert o2 == o3  # every decode rank agrees on every request, reason and origin
    reasons = {v[1] for v in o2.values() if v[0] == "Failed"}
    assert reasons <= {0, 1}  # aborted, peer dead
    assert 1 in reasons
    assert s["aborted"] > 0
    assert s["succeeded"] + s["aborted"] + sum(s["failed"].values()) == 200
    for r in ranks:  # the decode side finished cleanly: nothing leaked, nothing hung
        assert r["error"] is None
        assert r["leaked_slots"] == 0
        assert r["leaked_kv_pages"] == 0
        assert r["unfinished"] == 0
    assert s["hung_ranks"] == []
    assert s["invariant_violations"] == []


def _abort_pair(role, port, q):
    import time

    import torch

    from buffers import MetadataBuffers, MetadataLayout
    from transport.mooncake import MooncakeConfig, MooncakeManager, kv_args_for

    kv = [torch.zeros((16, 256), dtype=torch.uint8)]
    meta = MetadataBuffers(
        4, MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
    )
    m = MooncakeManager(
        kv_args_for(kv, meta.buf_infos(), 0),
        MooncakeConfig(role=role, tp_rank=0, store_port=port, namespace="abort"),
    )
    t0 = time.time()
    if role == "prefill":
        s = m.sender(77)
        while s.poll() == 1 and time.time() - t0 < 20:
            time.sleep(0.01)
        while s.poll() != 0 and time.time() - t0 < 20:
            time.sleep(0.01)
        q.put(("prefill", s.poll(), int(s.failure_reason())))
    else:
        r = m.receiver(77)
        r.init()
        while r.poll() == 1 and time.time() - t0 < 20:
            time.sleep(0.01)
        r.abort()  # the client went away after the handshake
        while not r.drained and time.time() - t0 < 20:
            time.sleep(0.01)
        q.put(("decode", r.poll(), int(r.failure_reason()), r.drained))
    time.sleep(0.5)
    m.close()


def test_decode_abort_reaches_prefill():
    import multiprocessing as mp

    from torch.distributed import TCPStore

    from lifecycle import FailureReason
    from lifecycle.testing.spawn import free_port

    port = free_port()
    store = TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_abort_pair, args=(r, port, q)) for r in ("prefill", "decode")]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        item = q.get(timeout=60)
        got[item[0]] = item[1:]
    for p in procs:
        p.join(10)
    _ = store
    assert got["prefill"] == (0, FailureReason.ABORTED)
    assert got["decode"] == (0, FailureReason.ABORTED, True)  # prefill said it stopped
