"""`pdlife simulate` end to end: real gloo ranks on 127.0.0.1, fake backend."""

import json
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def strip_timings(s):
    timings = ("step_latency_us", "elapsed_s", "rss_mb", "rss_growth_after_warmup")
    return {k: v for k, v in s.items() if k not in timings}


def timeless(path):
    """The trace's lines without its time base: the clock record dropped and
    every observation's ``ts`` cut out of its line (the rest stays bytes)."""
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["t"] == "clock" and all('"ts":' in x for x in lines if '"obs"' in x)
    return [re.sub(r'"ts":[0-9.]+,', "", x) for x in lines[1:]]


def test_default_run_is_clean_and_reproducible(tmp_path, run_sim):
    p1, s1, out1 = run_sim("fake", "a", "--timeline")
    # the second run in a fresh interpreter: another string-hash seed, nothing
    # imported before it starts
    p2, s2, out2 = run_sim("fake", "b", "--timeline", fresh=True)
    assert p1.returncode == 0, p1.stdout + p1.stderr
    assert s1["ok"]
    assert s1["disagreements"] == 0
    assert s1["leaked_slots"] == 0
    assert s1["stuck"] == 0
    assert s1["succeeded"] + s1["aborted"] + sum(s1["failed"].values()) == s1["requests"]
    assert strip_timings(s1) == strip_timings(s2)
    # the same records, byte for byte, once the time base is set aside (the
    # clock record and each observation's timestamp are the run's own)
    first, second = (timeless(o / "trace" / "rank2.jsonl") for o in (out1, out2))
    assert first == second and len(first) > 100
    # the counts are those of the per-request outcomes, and they match the plan:
    # no faults, so exactly the requests whose abort was drawn failed, as aborted
    outcomes = s1["outcomes"]
    assert len(outcomes) == 200
    assert s1["succeeded"] == sum(o == ["Success", "none", 1] for o in outcomes.values())
    drawn = {str(d["room"]) for d in s1["fault_decisions"] if d["wins"]}
    assert {d["kind"] for d in s1["fault_decisions"]} == {"abort"}
    assert {r for r, o in outcomes.items() if o[0] == "Failed"} == drawn
    assert s1["aborted"] == len(drawn) > 0
    assert s1["failed"] == {} and s1["faults_fired"] == 0
    assert (s1["unfired_faults"], s1["problems"]) == ([], [])
    assert (out1 / "timeline.png").stat().st_size > 1000
    assert "stateDiagram-v2" in (out1 / "lifecycle.mmd").read_text()
    for key in (
        "requests",
        "succeeded",
        "failed",
        "aborted",
        "disagreements",
        "leaked_slots",
        "stuck",
        "steps",
        "step_latency_us",
        "backend",
        "seed",
    ):
        assert key in s1


def test_failure_probability_under_load(tmp_path, run_sim):
    proc, s, out = run_sim("fake", "p", "--fail-prob", "0.05", "--requests", "2000")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # each drawn winner fired once and ended its request, for its reason
    fired = [d for d in s["fault_decisions"] if d["wins"]]
    want = {str(d["room"]): "aborted" if d["kind"] == "abort" else "injected fault" for d in fired}
    got = {r: o[1] for r, o in s["outcomes"].items() if o[0] == "Failed"}
    assert got == want
    injected = sum(v == "injected fault" for v in want.values())
    assert s["failed"] == {"injected fault": injected}
    assert s["faults_fired"] == injected
    assert 4 * 2000 * 0.05 * 0.7 < injected < 4 * 2000 * 0.05 * 1.1  # ~5% per rank, 4 ranks
    assert s["succeeded"] == 2000 - len(want)
    assert (s["disagreements"], s["leaked_slots"], s["stuck"]) == (0, 0, 0)
    rp = subprocess.run(
        [sys.executable, "-m", "pdlife", "replay", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rp.returncode == 0, rp.stdout
    assert "no difference" in rp.stdout


def test_targeted_plan(tmp_path, run_sim):
    plan = {
        "faults": [
            {"kind": "fail", "rank": 0, "request": 3},
            {"kind": "raise_in_poll", "rank": 1, "request": 5},
            {"kind": "corrupt_metadata", "rank": 3, "request": 7},
            {"kind": "drop_metadata", "rank": 2, "request": 9},
            {"kind": "delay", "rank": 2, "request": 11, "steps": 5},
            {"kind": "hold_gate", "rank": 3, "request": 13, "steps": 5},
            {"kind": "fail", "rank": 2, "request": 15, "at": "WaitingForInput"},
        ]
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    proc, s, out = run_sim("fake", "t", "--plan", str(tmp_path / "plan.json"), "--abort-prob", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert s["failed"] == {
        "injected fault": 2,
        "local exception": 1,
        "metadata corrupt": 1,
        "waiting timeout": 1,
    }
    assert s["succeeded"] == s["requests"] - 5  # delay and hold only slow a request down
    from pdlife.cluster.config import SimConfig, Workload

    rooms = [str(r) for r in Workload(SimConfig(seed=0)).all_rooms(200)]
    # (status, reason) of each; every one at its first and only attempt (no recovery)
    by_request = {i: s["outcomes"][rooms[i]][:2] for i in (3, 5, 7, 9, 11, 13, 15)}
    assert {s["outcomes"][rooms[i]][2] for i in by_request} == {1}
    assert by_request == {
        3: ["Failed", "injected fault"],
        5: ["Failed", "local exception"],
        7: ["Failed", "metadata corrupt"],
        9: ["Failed", "waiting timeout"],
        11: ["Success", "none"],
        13: ["Success", "none"],
        15: ["Failed", "injected fault"],  # on decode rank 2, once it reached WaitingForInput
    }
    assert s["faults_fired"] == 7 and s["unfired_faults"] == []
    assert (s["disagreements"], s["leaked_slots"], s["stuck"]) == (0, 0, 0)
    fails = [
        json.loads(line)
        for line in (out / "trace" / "rank0.jsonl").read_text().splitlines()
        if '"tr"' in line and '"to":0' in line
    ]
    got = {(f["reason"], f["origin"]) for f in fails}
    # prefill's own group agreed these two, each from the rank that failed it
    assert {(8, 0), (7, 1)} <= got, got
    # requests 7 (corrupt row) and 15 (injected at WaitingForInput) fail on
    # decode: prefill hears of each over the peer link, and fails it too (with
    # decode's reason, from the prefill rank that heard) only if the word comes
    # before its own writes finished; which comes first is timing
    assert got - {(8, 0), (7, 1)} <= {(4, 0), (4, 1), (8, 0), (8, 1)}, got


def test_killed_rank_is_named_by_the_survivors(tmp_path, run_sim):
    proc, s, _ = run_sim("fake", "k", "--kill-rank", "3", "--kill-step", "4", "--pg-timeout", "10")
    assert proc.returncode != 0
    assert s["dead_ranks"] == [3]
    assert any("dead rank(s) [3]" in e for e in s["rank_errors"])
    assert "dead rank(s) [3]" in proc.stdout


def test_a_fault_that_never_fired_and_max_steps_fail_the_run(tmp_path, run_sim):
    # request 199 arrives at step 13 (16 a step): the run stops at step 4 without it
    # (a kill or pause after the last step is refused up front: it cannot fire)
    plan = tmp_path / "late.json"
    plan.write_text(json.dumps({"faults": [{"kind": "fail", "rank": 0, "request": 199}]}))
    proc, s, _ = run_sim("fake", "nf", "--plan", str(plan), "--max-steps", "4")
    assert proc.returncode == 1
    assert not s["ok"]
    assert s["unfired_faults"] == ["fail on rank 0, request 199, its first step"]
    text = "\n".join(s["problems"])
    assert "1 targeted fault(s) never fired, e.g. fail on rank 0, request 199" in text
    assert "stopped at --max-steps 4" in text
    assert "never fired" in proc.stdout and "--max-steps 4" in proc.stdout
    assert "result: FAILED" in proc.stdout


def test_replay_finds_a_hand_edit(tmp_path, run_sim):
    proc, _, out = run_sim("fake", "r", "--requests", "64")
    assert proc.returncode == 0
    path = out / "trace" / "rank1.jsonl"
    lines = path.read_text().splitlines()
    edited_step = None
    for i, line in enumerate(lines):
        rec = json.loads(line)
        if rec["t"] == "obs" and rec["step"] >= 3 and rec["rooms"] and rec["local"][0] != 0:
            rec["local"][0] = 0
            rec["reason"][0] = 8
            lines[i] = json.dumps(rec)
            edited_step = rec["step"]
            break
    path.write_text("\n".join(lines) + "\n")
    rp = subprocess.run(
        [sys.executable, "-m", "pdlife", "replay", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rp.returncode == 1
    assert f"first difference at step {edited_step}" in rp.stdout
    # a rank's trace gone: what is left would replay clean, so replay refuses it
    path.unlink()
    rp = subprocess.run(
        [sys.executable, "-m", "pdlife", "replay", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rp.returncode == 2, rp.stdout
    (line,) = rp.stderr.strip().splitlines()
    assert f"{path} is missing: the run had 4 ranks" in line


def test_same_command_runs_under_torchrun_prefill_dp_groups_included(tmp_path):
    """The command a user runs on one host, as a torchrun job of 4 ranks (one
    job, so two prefill DP groups of one rank and 2 decode ranks): every rank
    builds every group, each prefill rank serves its group's share, and only
    global rank 0 prints the summary."""
    out = tmp_path / "dp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4"]
    # --standalone: the rendezvous binds a port the OS picks
    cmd += ["--standalone", "-m", "pdlife", "simulate", "--backend", "fake"]
    cmd += ["--quiet", "--no-timeline", "--requests", "40", "--prefill", "1", "--prefill-dp", "2"]
    cmd += ["--decode", "2", "--abort-prob", "0", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    # a rank's own last words come before torchrun's summary: keep both
    said = [ln for ln in proc.stderr.splitlines() if not ln.startswith(("  ", "[", "=", "-"))]
    assert proc.returncode == 0, proc.stdout + "\n".join(said[-60:]) + proc.stderr[-1500:]
    assert proc.stdout.count("pdlife simulate:") == 1
    s = json.loads((out / "summary.json").read_text())
    assert s["ok"] and s["succeeded"] == 40
    assert s["topology"]["prefill_dp"] == 2
    ranks = [json.loads((out / "ranks" / f"rank{r}.json").read_text()) for r in range(4)]
    assert [len(r["outcome"]) for r in ranks] == [20, 20, 40, 40]  # each group half, decode all
    assert set(ranks[0]["outcome"]).isdisjoint(ranks[1]["outcome"])
    assert ranks[2]["outcome"] == ranks[3]["outcome"]
