"""The Mooncake backend moving real bytes over TCP on 127.0.0.1.

2 prefill + 2 decode ranks (4 processes, TP=2 on each side, gloo groups),
driven by the reference scheduler loops of `pdlife simulate`; decode checks
every KV page and metadata row it commits against what prefill wrote.
"""

import json

import pytest

mooncake = pytest.importorskip("mooncake.engine", reason="pd-lifecycle[mooncake] not installed")

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
