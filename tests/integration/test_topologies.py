"""Real topologies on the byte-moving backends (Mooncake over TCP, NIXL over
UCX) on 127.0.0.1: prefill and decode TP sizes that differ (direct head-sliced
writes and a staging buffer), MLA, a hybrid model's state rows (held whole,
or split by TP and resharded), a cached
prefix on decode, and two prefill DP groups -- each under injected failures
and client aborts.

Decode checks every page it commits (its own KV heads, every token), every
state row and every metadata row byte for byte against what prefill wrote;
a difference is an invariant violation. Every decode rank must end every
request the same way, nothing may leak and nothing may hang.
"""

import json
from collections import Counter

import pytest
from engines import require

from buffers import MetadataBuffers
from lifecycle.reasons import FailureReason
from pdlife.cluster.config import KV_LAYERS, SIM_LAYOUT, SimConfig, Workload
from pdlife.cluster.topology import HEAD_BYTES
from pdlife.sim.kv_bytes import STATE_ROW_BYTES

pytestmark = [pytest.mark.multiprocess, pytest.mark.network]


REQUESTS = 48
# per rank and request (phase-keyed), and per request: a few percent of requests
# fail somewhere, about 5% are aborted by the client
FAULTS = ("--fail-prob", "0.02", "--abort-prob", "0.05", "--pg-timeout", "20")

CASES = {
    "tp2-to-tp1": "--prefill-tp 2 --decode-tp 1",
    "tp1-to-tp2": "--prefill-tp 1 --decode-tp 2",
    "tp2-to-tp4-direct": "--prefill-tp 2 --decode-tp 4",
    "tp2-to-tp4-staging": "--prefill-tp 2 --decode-tp 4 --staging --page-size 2",
    "mla-tp2-to-tp1": "--prefill-tp 2 --decode-tp 1 --mla",
    "state-tp2-to-tp2": "--prefill-tp 2 --decode-tp 2 --state",
    "mla-state-tp2-to-tp1": "--prefill-tp 2 --decode-tp 1 --mla --state",
    # state split by TP: each decode rank assembles its share from every prefill
    # rank holding part of it, KV senders or not (one replicated KV head; MLA)
    "split-state-tp2-to-tp4": "--prefill-tp 2 --decode-tp 4 --kv-heads 1 --state --state-split",
    "mla-split-state-tp2-to-tp1": "--prefill-tp 2 --decode-tp 1 --mla --state --state-split",
    "prefix-tp2-to-tp1": "--prefill-tp 2 --decode-tp 1 --prefix-pages 4 --page-size 2",
    "dp2-tp1-to-tp2": "--prefill-tp 1 --prefill-dp 2 --decode-tp 2",
}


def _ranks(out, s):
    n = s["ranks"]["prefill"] + s["ranks"]["decode"]
    return [json.loads((out / "ranks" / f"rank{r}.json").read_text()) for r in range(n)]


def check_run(proc, s, out):
    """What every topology run must hold."""
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert s["invariant_violations"] == []  # a differing byte would be listed here
    assert s["problems"] == [] and s["rank_errors"] == [] and s["backend_errors"] == {}
    assert (s["hung_ranks"], s["crashed_ranks"], s["stuck"]) == ([], [], 0)
    assert (s["leaked_slots"], s["leaked_kv_pages"], s["disagreements"]) == (0, 0, 0)
    ranks = _ranks(out, s)
    # every rank ends a failed request for a drawn reason: injected or aborted. A
    # peer-dead, timeout or transfer error would mean a rank was never told, or
    # gave up on a peer that was there all along (the summary's end-to-end
    # outcome takes decode's reason first, so each rank's is checked here)
    for r in ranks:
        other = Counter(
            FailureReason(o[1]).label
            for o in r["outcome"].values()
            if o[0] == "Failed"
            and o[1] not in (FailureReason.ABORTED, FailureReason.INJECTED_FAULT)
        )
        assert not other, f"{r['side']} rank {r['rank']}: {dict(other)}"
    decode = [r for r in ranks if r["side"] == "decode"]
    assert all(r["outcome"] == decode[0]["outcome"] for r in decode)  # every decode rank agrees
    assert len(decode[0]["outcome"]) == REQUESTS
    assert s["succeeded"] > REQUESTS // 2
    assert s["aborted"] + sum(s["failed"].values()) > 0  # the faults did fire
    assert s["succeeded"] + s["aborted"] + sum(s["failed"].values()) == REQUESTS
    # at least one page per succeeded request on every decode rank, both layers
    t = s["topology"]
    heads = 1 if t["mla"] else max(t["kv_heads"] // t["decode_tp"], 1)
    per_page = KV_LAYERS * t["page_size"] * heads * HEAD_BYTES
    assert s["kv_bytes_verified"] >= s["succeeded"] * len(decode) * per_page
    # prefill wrote everything the succeeded requests needed and nothing decode
    # did not ask for (a cached prefix page, a page twice, another rank's heads)
    assert s["decode_bytes_due"] <= s["prefill_bytes_written"] <= s["decode_bytes_asked"]
    # head slices land via the staging buffer exactly when it was asked for
    assert (s["staged_requests"] > 0) == t["staging"]
    return ranks


#: each topology on one byte-moving backend, the two taking turns: they share
#: the connector that does what differs between topologies, and every other
#: test here runs on both
PAIRS = [(("mooncake", "nixl")[i % 2], case) for i, case in enumerate(CASES)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("backend", "case"), PAIRS, ids=[f"{b}-{c}" for b, c in PAIRS])
def test_topology_moves_every_byte_under_faults(run_sim, backend, case):
    require(backend)
    proc, s, out = run_sim(
        backend, case, "--requests", str(REQUESTS), "--seed", "7", *FAULTS, *CASES[case].split()
    )
    check_run(proc, s, out)


def _kv_bytes(requests, seed, prefix_pages, page_size, kv_heads):
    """The KV bytes the decode group needs in all, and those of its cached
    prefixes: every page of every request, each head once (no replication)."""
    w = Workload(SimConfig(requests=requests, seed=seed))
    page = KV_LAYERS * page_size * kv_heads * HEAD_BYTES
    uncached = cached = 0
    for i in range(requests):
        pages = w.request(i)[1]
        k = prefix_pages if pages > prefix_pages else 0
        uncached += (pages - k) * page
        cached += k * page
    return uncached, cached


@pytest.mark.timeout(150)
def test_a_cached_prefix_is_not_sent(run_sim, backend):
    """Without faults every byte prefill writes is counted: exactly the
    uncached pages of every request, plus one state and metadata row each."""
    args = ["--prefill-tp", "2", "--decode-tp", "1", "--prefix-pages", "3", "--state"]
    args += ["--page-size", "2"]
    proc, s, out = run_sim(
        backend, "prefix", "--requests", str(REQUESTS), "--seed", "9", "--abort-prob", "0", *args
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert s["invariant_violations"] == [] and s["succeeded"] == REQUESTS
    uncached, cached = _kv_bytes(REQUESTS, 9, 3, 2, s["topology"]["kv_heads"])
    meta = MetadataBuffers(1, SIM_LAYOUT)
    rows = REQUESTS * (sum(meta.buf_infos()[2]) + sum(STATE_ROW_BYTES))
    assert cached > REQUESTS  # the prefix is worth checking for
    assert s["prefill_bytes_written"] == s["decode_bytes_asked"] == uncached + rows
    assert s["kv_bytes_verified"] >= uncached + cached  # the prefix was checked too


@pytest.mark.timeout(120)
def test_prefill_dp_groups_fail_exactly_the_requests_drawn_for_them(run_sim):
    """Phase-keyed faults under prefill DP (fake backend: no bytes, the same
    statuses): a prefill rank draws faults only for its own group's requests,
    so every request ends as its winning draw says."""
    args = ["--prefill-tp", "1", "--prefill-dp", "2", "--decode-tp", "2", "--seed", "4"]
    proc, s, out = run_sim(
        "fake", "dp", "--requests", "300", "--fail-prob", "0.1", "--abort-prob", "0.1", *args
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    winners = {str(d["room"]): d for d in s["fault_decisions"] if d["wins"]}
    # every request drawn for has its winner among the draws of the ranks that
    # see it (a draw of a rank that never sees the request must not win it)
    assert {str(d["room"]) for d in s["fault_decisions"]} == set(winners)
    want = {
        room: ["Success", "none", 1]  # (one attempt: no recovery)
        if room not in winners
        else ["Failed", "aborted" if winners[room]["kind"] == "abort" else "injected fault", 1]
        for room in s["outcomes"]
    }
    assert len(s["outcomes"]) == 300 and s["outcomes"] == want
    assert any(d["rank"] in (0, 1) for d in winners.values())  # prefill groups did fail some
    ranks = _ranks(out, s)
    for g in (0, 1):  # each group saw its own requests only
        rooms = Workload(SimConfig(requests=300, seed=4)).all_rooms(300)[g::2]
        assert sorted(ranks[g]["outcome"]) == sorted(map(str, rooms))


@pytest.mark.timeout(120)
def test_a_metadata_fault_is_carried_by_the_decode_ranks_primary(run_sim, backend, tmp_path):
    """Prefill TP 1, decode TP 2: decode rank 1 (global rank 2) has prefill rank 0
    as its primary, not a TP peer of its own number. A corrupted metadata row
    targeted at it is written by prefill rank 0, fires, and fails the request
    on every rank as metadata corrupt (prefill's one row reaches both decode
    ranks it is the primary of)."""
    plan = {"faults": [{"kind": "corrupt_metadata", "rank": 2, "request": 7}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    args = ["--prefill-tp", "1", "--decode-tp", "2", "--requests", "24", "--abort-prob", "0"]
    proc, s, _ = run_sim(backend, "meta", *args, "--plan", str(tmp_path / "plan.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert s["unfired_faults"] == [] and s["faults_fired"] == 1
    room = str(Workload(SimConfig(seed=0)).all_rooms(24)[7])
    assert s["outcomes"][room] == ["Failed", "metadata corrupt", 1]
    assert s["failed"] == {"metadata corrupt": 1} and s["succeeded"] == 23
    assert s["invariant_violations"] == [] and s["disagreements"] == 0


@pytest.mark.timeout(120)
def test_under_prefill_dp_a_metadata_fault_is_reported_by_the_group_serving_it(
    run_sim, backend, tmp_path
):
    """Two prefill DP groups: request 7 is group 1's, so group 0's rank, primary
    of the same decode rank, never writes its row and must not call the fault
    unfired."""
    plan = {"faults": [{"kind": "corrupt_metadata", "rank": 3, "request": 7}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    args = ["--prefill-tp", "1", "--prefill-dp", "2", "--decode-tp", "2", "--requests", "24"]
    args += ["--abort-prob", "0", "--plan", str(tmp_path / "plan.json")]
    proc, s, _ = run_sim(backend, "meta-dp", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert s["unfired_faults"] == [] and s["faults_fired"] == 1 and s["problems"] == []
    room = str(Workload(SimConfig(seed=0)).all_rooms(24)[7])
    assert s["outcomes"][room] == ["Failed", "metadata corrupt", 1]
    assert s["failed"] == {"metadata corrupt": 1} and s["succeeded"] == 23


#: a paused prefill rank on one backend, a paused decode rank on the other
PAUSES = [("mooncake", "prefill"), ("nixl", "decode")]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("backend", "who"), PAUSES, ids=[f"{b}-{w}" for b, w in PAUSES])
def test_a_paused_rank_costs_only_requests_in_flight(run_sim, backend, who):
    require(backend)
    # the whole process of one rank stops for 3 s (its heartbeat too: longer than
    # the 2 s its peers allow), as a long GC pause or a starved host would: the
    # requests in flight then may fail (peer dead), on every rank alike; nothing
    # hangs, nothing leaks, and no page is reused while a write may still land
    rank, step = (1, 5) if who == "prefill" else (2, 5)  # early: a fast run ends in ~20 steps
    n = 150  # enough that many are in flight when the pause comes
    proc, s, out = run_sim(
        backend,
        f"pause-{who}",
        *("--requests", str(n), "--seed", "7", *FAULTS),
        *CASES["mla-state-tp2-to-tp1"].split(),
        *("--pause-rank", str(rank), "--pause-step", str(step), "--pause-seconds", "3"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert s["unfired_faults"] == []  # the pause happened
    assert s["invariant_violations"] == [] and s["problems"] == [] and s["rank_errors"] == []
    assert (s["hung_ranks"], s["crashed_ranks"], s["stuck"]) == ([], [], 0)
    assert (s["leaked_slots"], s["leaked_kv_pages"], s["disagreements"]) == (0, 0, 0)
    allowed = (FailureReason.ABORTED, FailureReason.INJECTED_FAULT, FailureReason.PEER_DEAD)
    ranks = _ranks(out, s)
    for r in ranks:
        bad = {o[1] for o in r["outcome"].values() if o[0] == "Failed" and o[1] not in allowed}
        assert not bad, f"{r['side']} rank {r['rank']}: {bad}"
    decode = [r for r in ranks if r["side"] == "decode"]
    assert len(decode[0]["outcome"]) == n
    assert s["succeeded"] + s["aborted"] + sum(s["failed"].values()) == n


#: past decode's heartbeat deadline (2 s) and its drain timeout after that (3 s)
LONG_PAUSE_S = 8


@pytest.mark.timeout(150)
def test_sglang_24527_a_prefill_paused_past_the_drain_timeout_never_writes_into_reused_pages(
    run_sim, backend
):
    # SGLang #24527's silent corruption, by way of a pause: a prefill process
    # stops for 8 s with writes queued, then resumes. Decode fails its requests
    # in flight (peer dead) and, once its drain timeout passes with prefill
    # still silent, fences their pages and rows instead of releasing them (the
    # connector's unit test shows the late write landing, with its negative
    # control). When prefill speaks again the fenced requests are asked again
    # to stop and released on its word. A 10 s soak, paced by prefill: requests
    # keep arriving after the resume (about 500 of them here, in the 2 s left;
    # more than the 64 metadata rows even at a fifth of that pace), so the rows
    # and pages the fence held are reused, and every committed page and row is
    # checked byte for byte. Every request admitted after the resume succeeds
    seed, abort = 11, 0.02
    proc, s, out = run_sim(
        backend,
        "long-pause",
        *("--soak", "10", "--seed", str(seed), "--abort-prob", str(abort), "--fail-prob", "0"),
        *("--pg-timeout", "20", "--prefill-tp", "1", "--decode-tp", "1"),
        *("--pause-rank", "0", "--pause-step", "5", "--pause-seconds", str(LONG_PAUSE_S)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert s["unfired_faults"] == []  # the pause happened
    assert s["invariant_violations"] == [] and s["problems"] == [] and s["rank_errors"] == []
    assert (s["hung_ranks"], s["crashed_ranks"], s["stuck"]) == ([], [], 0)
    assert (s["leaked_slots"], s["leaked_kv_pages"], s["disagreements"]) == (0, 0, 0)
    assert s["fenced_kv_pages"] == 0  # prefill came back: nothing stays fenced
    _, decode = _ranks(out, s)
    stats = decode["transport_stats"]
    assert stats["fenced"] > 0, stats  # the drain timeout passed while prefill was silent
    assert stats["unfenced"] == stats["fenced"]  # every fence lifted once it spoke again
    # admission order: every request after the last one the pause failed succeeds
    # (or was aborted by its client), and there are enough of them to reuse rows
    work = Workload(SimConfig(requests=2**31 - 1, seed=seed, abort_prob=abort))
    outcome = decode["outcome"]
    order = [str(work[i]) for i in range(len(outcome))]
    assert set(order) == set(outcome)
    dead = [
        i
        for i, room in enumerate(order)
        if outcome[room][0] == "Failed" and outcome[room][1] == FailureReason.PEER_DEAD
    ]
    assert dead, "the pause failed no request: it did not test anything"
    after = [outcome[room][:2] for room in order[dead[-1] + 1 :]]
    assert len(after) > 64, (len(after), dead)  # more than the metadata rows
    ok = [["Success", FailureReason.NONE], ["Failed", FailureReason.ABORTED]]
    assert all(o in ok for o in after), after
    assert s["kv_bytes_verified"] > 0
